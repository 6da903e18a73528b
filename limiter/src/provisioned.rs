//! A provisioned container: the pod file the node daemon mounted read-only
//! beside this library ([`gpushare_utils::pod_file`]) says which pod this
//! process is in, where the daemon is, the token, who owns the pod's limits
//! and whether CUDA must run as an MPS client. The environment cannot
//! change any of these: its variables for them are ignored (said once in
//! the log); it can only tighten, with a lower local memory limit.

use std::ffi::CStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use gpushare_utils::pod::PodId;
use gpushare_utils::pod_file::PodFile;
use gpushare_utils::quote::Clipped;

use crate::config::{LimiterConfig, MpsMode};

/// What the daemon stated for this container, read from its pod file.
pub(crate) struct Provisioned {
    pub file: PodFile,
    pub pod: PodId,
}

/// The pod file beside this library, when there is one: `Ok(None)` is
/// local mode (no file); an error (a file that is not the daemon's, or
/// not one this limiter reads) refuses CUDA.
pub(crate) fn find() -> Result<Option<Provisioned>, String> {
    let Some(library) = own_path() else {
        return Ok(None);
    };
    let path = PodFile::beside(&library);
    let Some(file) = PodFile::read(&path).map_err(|error| error.to_string())? else {
        return Ok(None);
    };
    let pod = PodId::new(file.pod.trim()).map_err(|error| {
        format!(
            "{}: the pod {} is not a pod id ({error})",
            path.display(),
            Clipped(&file.pod)
        )
    })?;
    Ok(Some(Provisioned { file, pod }))
}

impl Provisioned {
    /// Puts the daemon's statements in `config`, over whatever the
    /// environment said; `overridden`: the variables of the environment
    /// that say the same things, said once in the log to be ignored.
    pub(crate) fn apply(&self, config: &mut LimiterConfig, overridden: &[&str]) {
        let ignored: Vec<&str> = overridden
            .iter()
            .copied()
            .filter(|name| std::env::var_os(name).is_some())
            .collect();
        if !ignored.is_empty() {
            tracing::warn!(
                pod = %self.pod,
                "provisioned container: {} ignored; the node daemon's pod file decides",
                ignored.join(", ")
            );
        }
        config.pod = self.pod.clone();
        config.hypervisor = Some(self.file.hypervisor.clone());
        if self.file.mps_required {
            config.mps = MpsMode::Required;
        }
    }
}

/// This library's path as the dynamic loader loaded it (a link is not
/// resolved: the pod file sits beside the name the container was given).
fn own_path() -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::uninit();
    let address = find as *const ();
    // SAFETY: dladdr only reads the loader's tables and writes `info`.
    if unsafe { libc::dladdr(address.cast(), info.as_mut_ptr()) } == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so it filled `info`.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string owned by the loader, alive while the
    // library is loaded (this code is running from it).
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Some(PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes())))
}

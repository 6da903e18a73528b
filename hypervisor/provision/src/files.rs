//! Files of provisioning: random UIDs and tokens, whole-file writes and
//! removals that tolerate what is already gone.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use super::ProvisionError;
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::PodLimits;
use hypervisor_core::file_error::FileError;
use hypervisor_corun::CorunOptions;

/// A random (version 4) UID, for claims that have none in the API: those
/// the device plugin makes for a container.
pub fn new_uid() -> Result<String, ProvisionError> {
    let mut b = [0u8; 16];
    let mut file = std::fs::File::open("/dev/urandom").map_err(ProvisionError::Random)?;
    std::io::Read::read_exact(&mut file, &mut b).map_err(ProvisionError::Random)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    ))
}

pub(super) fn random_token() -> Result<String, ProvisionError> {
    let mut bytes = [0u8; 32];
    let mut file = std::fs::File::open("/dev/urandom").map_err(ProvisionError::Random)?;
    std::io::Read::read_exact(&mut file, &mut bytes).map_err(ProvisionError::Random)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

pub(crate) fn io<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> ProvisionError + 'a {
    move |source| {
        ProvisionError::Io(FileError {
            what,
            path: path.to_owned(),
            source,
        })
    }
}

/// Writes `bytes` to `path` through a temporary file and a rename, so
/// readers see the old or the new content, never a part.
pub(crate) fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), ProvisionError> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let result = (|| {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io("cannot write", path))
}

pub(super) fn remove_if_there(path: &Path) -> Result<(), ProvisionError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(io("cannot remove", path)(source)),
    }
}

/// The mount points a container runtime left for pod `pod`'s region and
/// limits in the co-run GPUs' shared-memory folders: a co-run container's
/// `/dev/shm` is its GPU's folder, and the runtime makes an empty file there
/// for each file mounted under it, which outlives the container. Only
/// regular files of those two names are removed.
pub(super) fn remove_mount_points(corun: &CorunOptions, pod: &str) -> Result<(), ProvisionError> {
    let names = [PodLedger::name_of(pod), PodLimits::name_of(pod)];
    for uuid in &corun.gpus {
        let folder = hypervisor_corun::shm_dir(&corun.dir, uuid);
        for name in &names {
            let path = folder.join(name);
            if std::fs::symlink_metadata(&path).is_ok_and(|meta| meta.is_file()) {
                remove_if_there(&path)?;
            }
        }
    }
    Ok(())
}

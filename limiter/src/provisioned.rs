//! A provisioned container: the pod file the node daemon mounted read-only
//! beside the container's limiter ([`gpushare_utils::pod_file`]) says which
//! pod this process is in, where the daemon is, the token, who owns the
//! pod's limits and whether CUDA must run as an MPS client. The environment
//! cannot change any of these: its variables for them are ignored (said
//! once in the log); it can only tighten, with a lower local memory limit.
//!
//! The container is known by what it is, not by the name this library was
//! loaded under, which the tenant chooses (a link to the library, a
//! `/proc/self/fd` alias of it, a copy). The pod file is looked for beside
//! 1. the name the loader gave this library;
//! 2. the file the kernel mapped for it (`/proc/self/maps`, where links and
//!    descriptor aliases are resolved to the file itself), where a preload
//!    file names libraries and this one was loaded under another name;
//! 3. each library `/etc/ld.so.preload` names: in a provisioned container
//!    the node's file, mounted read-only, naming the container's limiter.
//!
//! Every pod file found must be the daemon's and say the same; any other
//! refuses CUDA. Where the pod file is the preloaded limiter's and that
//! library is loaded in this process, another copy of the limiter (a
//! different file, loaded under any name) stays off: the preloaded one
//! enforces the pod's limits, once.

use std::ffi::CStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use gpushare_utils::pod::PodId;
use gpushare_utils::pod_file::PodFile;
use gpushare_utils::quote::Clipped;

use crate::config::{LimiterConfig, MpsMode};

/// The file that names the libraries every dynamically linked program loads.
const PRELOAD_FILE: &str = "/etc/ld.so.preload";
/// The most of [`PRELOAD_FILE`] read: it names a few libraries.
const PRELOAD_MAX_BYTES: u64 = 64 * 1024;

/// What the daemon stated for this container, read from its pod file.
pub(crate) struct Provisioned {
    pub file: PodFile,
    pub pod: PodId,
}

/// What this library is in this process.
pub(crate) enum Found {
    /// No pod file: local mode, the environment decides.
    Local,
    /// A provisioned container, whose limits this library enforces.
    Provisioned(Provisioned),
    /// A provisioned container whose preloaded limiter, another file than
    /// this one, is loaded in this process and enforces its limits.
    Standby {
        /// The preloaded limiter.
        preloaded: PathBuf,
    },
}

/// Looks for the container's pod file; an error (a file that is not the
/// daemon's, not one this limiter reads, or two that disagree) refuses CUDA.
pub(crate) fn find() -> Result<Found, String> {
    let loaded = loaded_name();
    let preloaded = preloaded_libraries();
    let mut files = PodFiles::default();
    if let Some(loaded) = &loaded {
        files.look_beside(loaded, false)?;
    }
    for library in &preloaded {
        files.look_beside(library, true)?;
    }
    // Loaded by the name the preload file gives, this library is the
    // preloaded one; under another name, the kernel says which file it is.
    // Without a preload file the environment loaded it, and could as well
    // not have: local mode stays as cheap as reading its variables.
    let by_preloaded_name = loaded.as_ref().is_some_and(|name| preloaded.contains(name));
    let maps = if by_preloaded_name || preloaded.is_empty() {
        Maps::default()
    } else {
        Maps::read()
    };
    if let Some(mapped) = &maps.own {
        files.look_beside(mapped, false)?;
    }
    let Some((path, file)) = files.found else {
        return Ok(Found::Local);
    };
    if let Some(preloaded) = files.preloaded_limiter
        && !by_preloaded_name
        && another_file(maps.own.as_ref().or(loaded.as_ref()), &preloaded)
        && maps.holds(&preloaded)
    {
        return Ok(Found::Standby { preloaded });
    }
    let pod = PodId::new(file.pod.trim()).map_err(|error| {
        format!(
            "{}: the pod {} is not a pod id ({error})",
            path.display(),
            Clipped(&file.pod)
        )
    })?;
    Ok(Found::Provisioned(Provisioned { file, pod }))
}

/// The pod files found so far, which must all say the same.
#[derive(Default)]
struct PodFiles {
    /// The first one: its path and what it says.
    found: Option<(PathBuf, PodFile)>,
    /// The first preloaded library the pod file was found beside.
    preloaded_limiter: Option<PathBuf>,
}

impl PodFiles {
    /// Reads the pod file beside `library`, if there is one.
    fn look_beside(&mut self, library: &Path, preloaded: bool) -> Result<(), String> {
        let path = PodFile::beside(library);
        let first = self.found.as_ref().map(|(first, _)| first);
        if first != Some(&path) {
            let Some(file) = PodFile::read(&path).map_err(|error| error.to_string())? else {
                return Ok(());
            };
            match &self.found {
                Some((first, said)) if *said != file => {
                    return Err(format!(
                        "{} and {} are pod files that disagree",
                        first.display(),
                        path.display()
                    ));
                }
                Some(_) => {}
                None => self.found = Some((path, file)),
            }
        }
        if preloaded && self.preloaded_limiter.is_none() {
            self.preloaded_limiter = Some(library.to_owned());
        }
        Ok(())
    }
}

/// The absolute paths of the libraries the preload file names.
fn preloaded_libraries() -> Vec<PathBuf> {
    let Ok(file) = std::fs::File::open(PRELOAD_FILE) else {
        return Vec::new();
    };
    let mut text = Vec::new();
    match file.take(PRELOAD_MAX_BYTES).read_to_end(&mut text) {
        Ok(_) => preload_names(&text),
        Err(_) => Vec::new(),
    }
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

/// A file's identity as `stat` gives it: its device and inode (links
/// followed); both sides of a comparison are taken the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StatId(u64, u64);

impl StatId {
    fn of(path: &Path) -> Option<Self> {
        let meta = std::fs::metadata(path).ok()?;
        Some(Self(meta.dev(), meta.ino()))
    }
}

/// Whether `own` is known to be another file than `library` (unknown is
/// not another: a copy that cannot tell enforces the limits too).
fn another_file(own: Option<&PathBuf>, library: &Path) -> bool {
    match (own.and_then(|own| StatId::of(own)), StatId::of(library)) {
        (Some(own), Some(other)) => own != other,
        _ => false,
    }
}

/// The files mapped in this process, as the kernel names them.
#[derive(Default)]
struct Maps {
    /// This library's file.
    own: Option<PathBuf>,
    /// Every mapped file, once.
    files: Vec<PathBuf>,
}

impl Maps {
    fn read() -> Self {
        let address = find as *const () as usize;
        let text = std::fs::read("/proc/self/maps").unwrap_or_default();
        let mut maps = Self::default();
        for (range, path) in text.split(|byte| *byte == b'\n').filter_map(mapping) {
            if range.contains(&address) {
                maps.own = Some(path.clone());
            }
            if !maps.files.contains(&path) {
                maps.files.push(path);
            }
        }
        maps
    }

    /// Whether the file `library` is mapped in this process, under any name.
    fn holds(&self, library: &Path) -> bool {
        let Some(wanted) = StatId::of(library) else {
            return false;
        };
        self.files
            .iter()
            .any(|file| StatId::of(file) == Some(wanted))
    }
}

/// The address range and file of one line of `/proc/self/maps`
/// (`start-end perms offset dev inode path`); `None` for anonymous memory
/// and for a file deleted since it was mapped.
fn mapping(line: &[u8]) -> Option<(std::ops::Range<usize>, PathBuf)> {
    let text = std::str::from_utf8(line).ok()?;
    let mut fields = text.splitn(6, ' ');
    let (start, end) = fields.next()?.split_once('-')?;
    let range = usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?;
    let path = fields.nth(4)?.trim_start();
    if !path.starts_with('/') || path.ends_with(" (deleted)") {
        return None;
    }
    Some((range, PathBuf::from(path)))
}

/// The absolute paths `/etc/ld.so.preload` names, as the loader reads it:
/// names separated by white space or colons, `#` starting a comment to the
/// end of its line. A bare name (searched for by the loader) has no folder
/// to look in, and is left out.
fn preload_names(text: &[u8]) -> Vec<PathBuf> {
    text.split(|byte| *byte == b'\n')
        .map(|line| line.split(|byte| *byte == b'#').next().unwrap_or_default())
        .flat_map(|line| line.split(|byte| matches!(byte, b' ' | b'\t' | b'\r' | b':')))
        .filter(|name| name.first() == Some(&b'/'))
        .map(|name| PathBuf::from(std::ffi::OsStr::from_bytes(name)))
        .collect()
}

/// This library's path as the dynamic loader loaded it.
fn loaded_name() -> Option<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preload_file_is_read_as_the_loader_reads_it() {
        let text = b"/usr/local/gpushare/lib/libcuda_limiter.so\n\
            # a comment /not/this.so\n\
            /a/b.so:/c/d.so\t/e/f.so # /g/h.so\n\
            libbare.so  \n";
        assert_eq!(
            preload_names(text),
            [
                "/usr/local/gpushare/lib/libcuda_limiter.so",
                "/a/b.so",
                "/c/d.so",
                "/e/f.so"
            ]
            .map(PathBuf::from)
        );
        assert!(preload_names(b"").is_empty());
    }

    #[test]
    fn a_maps_line_gives_its_range_and_file() {
        let line = b"7f12a0000000-7f12a0200000 r-xp 00001000 fd:01 1234  /usr/local/gpushare/lib/libcuda_limiter.so";
        assert_eq!(
            mapping(line),
            Some((
                0x7f12_a000_0000..0x7f12_a020_0000,
                PathBuf::from("/usr/local/gpushare/lib/libcuda_limiter.so")
            ))
        );
        let cases: [&[u8]; 4] = [
            b"7f12a0000000-7f12a0200000 rw-p 00000000 00:00 0 ",
            b"7ffd0000-7ffd1000 rw-p 00000000 00:00 0                          [stack]",
            b"7f12a0000000-7f12a0200000 r-xp 00000000 fd:01 99 /tmp/l.so (deleted)",
            b"not a mapping",
        ];
        for line in cases {
            assert_eq!(mapping(line), None, "{}", String::from_utf8_lossy(line));
        }
    }
}

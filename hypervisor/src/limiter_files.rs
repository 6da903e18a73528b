//! The limiter library on the host, installed so that no running process
//! ever sees the file it mapped change.
//!
//! 1. **Install** ([`install`]): the library is written as a new file named by
//!    its version and content hash (`libcuda_limiter-0.1.0-<hash>.so`) beside
//!    the stable name, through a temporary file renamed into place; an
//!    identical file already there is kept as it is.
//! 2. **Switch**: the stable name (`libcuda_limiter.so`, the path CDI specs and
//!    preload files name) becomes a relative symlink to that file, through a
//!    new symlink renamed over it: one atomic step, which also retires the
//!    regular file older releases copied there (its inode lives on for the
//!    processes that map it). A container started later resolves the link
//!    when its runtime bind-mounts it, and keeps that version for its life.
//! 3. **Collect** ([`collect`]): a versioned file other than the current one
//!    is removed once no process on the node maps it. "Maps" is read from
//!    every `/proc/<pid>/maps` of the host PID namespace, by inode number:
//!    inside a container the path differs (the bind mount's target), the
//!    inode does not. A maps file that cannot be read (other than a process
//!    that ended meanwhile) stops the collection: a file that may be in use
//!    is kept. The daemon collects periodically; the install collects too.
//!
//! Removing a file is safe even for a container that mounted it and has no
//! process mapping it at the moment: its bind mount holds the inode. The
//! one window left is a container whose runtime has resolved the link but
//! not yet mounted it while two installs and a collection happen: the
//! current version is never collected, so only a second switch within that
//! instant could race.

use std::collections::BTreeSet;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hypervisor_core::file_error::FileError;

/// Why an install or a collection failed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// A file system step failed; the error names the step and the path
    /// (reading the library, writing the versioned file, switching the
    /// link, listing the folder).
    #[error(transparent)]
    Io(#[from] FileError),
    /// The stable path given has no folder (a bare file name), no file name
    /// (`/`, `..`) or a name that is not UTF-8, so no versioned file can be
    /// named beside it.
    #[error("{} has no file name and folder", .0.display())]
    BadLink(PathBuf),
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.to_owned();
    move |source| InstallError::Io(FileError { what, path, source })
}

/// What an install did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Installed {
    /// The versioned file the link now names.
    pub file: PathBuf,
    /// Whether the file was written now (else it was there already).
    pub written: bool,
    /// Whether the link changed (else it named the file already).
    pub switched: bool,
    /// The collection of older versions that followed the switch.
    pub collected: Collected,
}

/// What a collection did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Collected {
    /// Old versions removed.
    pub removed: Vec<PathBuf>,
    /// Old versions kept: a process maps them.
    pub in_use: Vec<PathBuf>,
    /// Why nothing was removed, when a process's maps could not be read.
    pub unknown: Option<String>,
}

/// The folder and the stem (`libcuda_limiter`) of `link`.
fn parts(link: &Path) -> Result<(&Path, String), InstallError> {
    let dir = link
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .ok_or_else(|| InstallError::BadLink(link.to_owned()))?;
    let name = link
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| InstallError::BadLink(link.to_owned()))?;
    let stem = name.strip_suffix(".so").unwrap_or(name).to_owned();
    Ok((dir, stem))
}

/// FNV-1a: names versions apart, not a security measure (an existing file
/// of the same name is compared byte for byte).
fn content_hash(bytes: &[u8]) -> u64 {
    gpushare_utils::fnv::fnv1a(bytes.iter().copied())
}

/// The versioned file name of `bytes` for the link's `stem`.
pub fn versioned_name(stem: &str, version: &str, bytes: &[u8]) -> String {
    format!("{stem}-{version}-{:016x}.so", content_hash(bytes))
}

/// Installs `source` as version `version` behind `link`, switches `link` to
/// it and collects the versions no process on the node maps (`proc_root`:
/// the host's `/proc`).
pub fn install(
    source: &Path,
    link: &Path,
    version: &str,
    proc_root: &Path,
) -> Result<Installed, InstallError> {
    let (dir, stem) = parts(link)?;
    std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
    let bytes = std::fs::read(source).map_err(io("cannot read", source))?;
    let name = versioned_name(&stem, version, &bytes);
    let file = dir.join(&name);
    let written = match std::fs::read(&file) {
        Ok(existing) if existing == bytes => false,
        _ => {
            write_new(dir, &name, &bytes)?;
            true
        }
    };
    let switched = std::fs::read_link(link).ok().as_deref() != Some(Path::new(&name));
    if switched {
        let temporary = dir.join(format!(".{name}.link-{}", std::process::id()));
        let _ = std::fs::remove_file(&temporary);
        std::os::unix::fs::symlink(&name, &temporary)
            .map_err(io("cannot make the symlink", &temporary))?;
        std::fs::rename(&temporary, link).map_err(io("cannot switch", link))?;
        sync_dir(dir)?;
    }
    let collected = collect(link, proc_root)?;
    Ok(Installed {
        file,
        written,
        switched,
        collected,
    })
}

/// Writes `bytes` as `dir/name` through a temporary file: a reader never
/// sees a partial file, and no existing inode is written to.
fn write_new(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), InstallError> {
    let temporary = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&temporary);
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o755)
        .open(&temporary)
        .map_err(io("cannot create", &temporary))?;
    out.write_all(bytes)
        .and_then(|()| out.sync_all())
        .map_err(io("cannot write", &temporary))?;
    drop(out);
    let target = dir.join(name);
    std::fs::rename(&temporary, &target).map_err(io("cannot rename into", &target))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), InstallError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("cannot sync", dir))
}

/// Removes the versioned files behind `link` that it does not name and
/// that no process under `proc_root` maps.
pub fn collect(link: &Path, proc_root: &Path) -> Result<Collected, InstallError> {
    let (dir, stem) = parts(link)?;
    let current = std::fs::read_link(link)
        .ok()
        .and_then(|target| target.file_name().map(std::borrow::ToOwned::to_owned));
    let prefix = format!("{stem}-");
    let mut old = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io("cannot list", dir))? {
        let entry = entry.map_err(io("cannot list", dir))?;
        let name = entry.file_name();
        let Some(text) = name.to_str() else { continue };
        if !(text.starts_with(&prefix) && text.ends_with(".so")) {
            continue;
        }
        if current.as_deref() == Some(name.as_os_str()) {
            continue;
        }
        let meta = entry.metadata().map_err(io("cannot stat", &entry.path()))?;
        if meta.is_file() {
            old.push((entry.path(), meta.ino()));
        }
    }
    let mut collected = Collected::default();
    if old.is_empty() {
        return Ok(collected);
    }
    let mapped = match mapped_inodes(proc_root) {
        Ok(mapped) => mapped,
        Err(reason) => {
            collected.unknown = Some(reason);
            collected.in_use = old.into_iter().map(|(path, _)| path).collect();
            return Ok(collected);
        }
    };
    for (path, inode) in old {
        if mapped.contains(&inode) {
            collected.in_use.push(path);
        } else {
            std::fs::remove_file(&path).map_err(io("cannot remove", &path))?;
            collected.removed.push(path);
        }
    }
    Ok(collected)
}

/// The inode numbers of every file some process under `proc_root` maps.
/// By inode alone: the device number `maps` shows is not always the one
/// `stat` gives (btrfs subvolumes, overlay); a coincidence keeps a file.
fn mapped_inodes(proc_root: &Path) -> Result<BTreeSet<u64>, String> {
    let entries =
        std::fs::read_dir(proc_root).map_err(|e| format!("{}: {e}", proc_root.display()))?;
    let mut inodes = BTreeSet::new();
    for entry in entries.flatten() {
        let is_pid = entry
            .file_name()
            .to_str()
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if !is_pid {
            continue;
        }
        let maps = entry.path().join("maps");
        let text = match std::fs::read_to_string(&maps) {
            Ok(text) => text,
            // The process ended meanwhile.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => continue,
            Err(e) => return Err(format!("cannot read {}: {e}", maps.display())),
        };
        for line in text.lines() {
            // address perms offset dev inode [path]
            if let Some(inode) = line.split_whitespace().nth(4).and_then(|i| i.parse().ok())
                && inode != 0
            {
                inodes.insert(inode);
            }
        }
    }
    Ok(inodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_version_and_the_content() {
        let a = versioned_name("libcuda_limiter", "0.1.0", b"one");
        let b = versioned_name("libcuda_limiter", "0.1.0", b"two");
        assert!(a.starts_with("libcuda_limiter-0.1.0-") && a.ends_with(".so"));
        assert_ne!(a, b);
        assert_eq!(a, versioned_name("libcuda_limiter", "0.1.0", b"one"));
    }

    #[test]
    fn a_process_whose_maps_cannot_be_read_keeps_every_old_version() {
        let dir = std::env::temp_dir().join(format!("gpushare-collect-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (lib, proc) = (dir.join("lib"), dir.join("proc"));
        // A maps that is a folder: unreadable, as a hidden process's is.
        std::fs::create_dir_all(proc.join("42/maps")).unwrap();
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libcuda_limiter-1-00.so"), b"old").unwrap();
        std::fs::write(lib.join("libcuda_limiter-2-00.so"), b"new").unwrap();
        std::os::unix::fs::symlink("libcuda_limiter-2-00.so", lib.join("libcuda_limiter.so"))
            .unwrap();
        let link = lib.join("libcuda_limiter.so");
        let kept = collect(&link, &proc).unwrap();
        assert!(kept.removed.is_empty());
        assert_eq!(kept.in_use, [lib.join("libcuda_limiter-1-00.so")]);
        assert!(kept.unknown.is_some_and(|r| r.contains("42")));
        // Gone (a process that ended): nothing maps the old version.
        std::fs::remove_dir_all(proc.join("42")).unwrap();
        let collected = collect(&link, &proc).unwrap();
        assert_eq!(collected.removed, [lib.join("libcuda_limiter-1-00.so")]);
        assert!(lib.join("libcuda_limiter-2-00.so").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_link_needs_a_folder_and_a_name() {
        assert!(parts(Path::new("/")).is_err());
        assert!(parts(Path::new("libcuda_limiter.so")).is_err());
        let (dir, stem) = parts(Path::new("/var/lib/gpushare/lib/libcuda_limiter.so")).unwrap();
        assert_eq!(
            (dir, stem.as_str()),
            (Path::new("/var/lib/gpushare/lib"), "libcuda_limiter")
        );
    }
}

//! What stands at a `/dev/shm` name where the daemon made an object (a pod's
//! ledger, a node table), against what it made there: the same inode, a
//! regular file, of its size, owner and mode. The pods' uid may write (and
//! so truncate, remove, replace or `chmod`) the objects it owns, so the
//! daemon checks them periodically. Nothing here follows a link.

use std::io;
use std::os::unix::fs::MetadataExt;

use super::SHM_DIR;

/// An object as the daemon made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Made {
    /// Its inode: another one at the name is another object.
    pub(crate) inode: u64,
    /// Its size in bytes.
    pub(crate) size: u64,
    /// Its owner.
    pub(crate) uid: u32,
    /// Its permission bits.
    pub(crate) mode: u32,
}

/// What stands at the name, against what was made there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Entry {
    /// The object, as made.
    Intact,
    /// The object, its mode changed (to the bits here): processes of the
    /// pods' uid may no longer be able to open it.
    Mode(u32),
    /// Removed, replaced by something else (another file, a link, a
    /// directory, a FIFO), resized or given another owner.
    Damaged(&'static str),
}

/// What stands at `/dev/shm/<name>` now, against `made`.
pub(crate) fn inspect(name: &str, made: &Made) -> Entry {
    let Ok(meta) = std::fs::symlink_metadata(path(name)) else {
        return Entry::Damaged("removed");
    };
    let mode = meta.mode() & 0o7777;
    if meta.ino() != made.inode || !meta.file_type().is_file() {
        Entry::Damaged("replaced")
    } else if meta.len() != made.size {
        Entry::Damaged("resized")
    } else if meta.uid() != made.uid {
        Entry::Damaged("given another owner")
    } else if mode != made.mode {
        Entry::Mode(mode)
    } else {
        Entry::Intact
    }
}

/// Sets the mode of the object `made` at `/dev/shm/<name>` back, in place:
/// processes that mapped it and those that open it next share it still.
/// The name is opened `O_PATH|O_NOFOLLOW` and changed only when that is the
/// object made (a regular file of its inode), through the descriptor's
/// `/proc/self/fd` link, which names that inode whatever the name holds by
/// then.
pub(crate) fn restore_mode(name: &str, made: &Made) -> io::Result<()> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let path = std::ffi::CString::new(path(name)).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: a valid NUL-terminated path; the flags open no file for I/O.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just opened, owned here alone.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let by_fd = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let meta = std::fs::metadata(&by_fd)?;
    if !meta.file_type().is_file() || meta.ino() != made.inode {
        return Err(io::ErrorKind::NotFound.into());
    }
    std::fs::set_permissions(
        &by_fd,
        std::os::unix::fs::PermissionsExt::from_mode(made.mode),
    )
}

fn path(name: &str) -> String {
    format!("{SHM_DIR}/{name}")
}

//! The `/dev/shm` a co-run GPU's MPS daemon shares with its clients, where
//! the clients are containers ([`super::CorunOptions::private_shm`]).
//!
//! MPS servers and clients exchange memory through files in `/dev/shm`, and
//! a container has a `/dev/shm` of its own. So the daemon runs in a mount
//! namespace of its own where the GPU's [`super::shm_dir`] is bind-mounted
//! on `/dev/shm` (its servers, its children, inherit it), and the GPU's pods
//! get the same folder at `/dev/shm`. The hypervisor's own `/dev/shm`, with
//! every pod's region and limits, stays out of both. The folder should be
//! on a tmpfs, as `/dev/shm` is: [`is_tmpfs`] tells.

use std::ffi::{CStr, CString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// Makes `command` start in a mount namespace of its own whose `/dev/shm`
/// is `folder`. Needs `CAP_SYS_ADMIN`: without it the spawn fails with the
/// error of `unshare` (`EPERM`).
pub fn run_with_shm(command: &mut Command, folder: &Path) -> io::Result<()> {
    let source = c_path(folder)?;
    // SAFETY: the closure runs in the child between fork and exec; it only
    // makes system calls, allocates nothing (the path was made above) and
    // takes no lock.
    unsafe {
        command.pre_exec(move || private_shm(&source));
    }
    Ok(())
}

/// In the child: a new mount namespace, nothing in it propagated back to
/// the parent's, and `source` bound on `/dev/shm`.
fn private_shm(source: &CStr) -> io::Result<()> {
    // SAFETY: unshare takes flags only.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: NUL-terminated static strings; no file system type or data.
    let private = unsafe {
        libc::mount(
            c"none".as_ptr(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if private != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `source` and the target are NUL-terminated; a bind mount takes
    // no file system type or data.
    let bound = unsafe {
        libc::mount(
            source.as_ptr(),
            c"/dev/shm".as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        )
    };
    if bound != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `path` as the C string system calls take.
fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL byte in the path"))
}

/// Whether `folder` is on a tmpfs (memory, as `/dev/shm` is).
pub fn is_tmpfs(folder: &Path) -> io::Result<bool> {
    let path = c_path(folder)?;
    let mut stat = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: `path` is NUL-terminated; `stat` is written by the call, read
    // only when it succeeded.
    if unsafe { libc::statfs(path.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: statfs returned 0, so it filled `stat`.
    let stat = unsafe { stat.assume_init() };
    Ok(stat.f_type == libc::TMPFS_MAGIC)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_shm_is_a_tmpfs_and_a_missing_folder_an_error() {
        assert!(is_tmpfs(Path::new("/dev/shm")).unwrap());
        assert!(is_tmpfs(Path::new("/no/such/folder")).is_err());
    }
}

//! A provisioned container's view of the limiter, emulated on the host.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpushare_utils::pod_file::PodFile;

use crate::artifacts::limiter;

/// A provisioned container's library folder, emulated: the limiter under
/// the name the CDI spec mounts it at (a link: the limiter looks beside the
/// name it was loaded by), and the pod file beside it as the read-only bind
/// mount shows it (root's file, mode 0444). Removed when dropped.
pub struct ContainerLib {
    dir: PathBuf,
}

impl ContainerLib {
    /// The folder with the pod file whose text is `pod_file`.
    pub fn with_text(pod_file: &str) -> Self {
        let dir = std::env::temp_dir().join(crate::unique::name("limiter-container"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the container's library folder");
        let lib = Self { dir };
        std::os::unix::fs::symlink(limiter(), lib.library()).expect("the limiter's link");
        let file = lib.pod_file();
        std::fs::write(&file, pod_file).expect("the pod file");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444))
            .expect("the pod file's mode");
        lib
    }

    /// The folder with a copy of the pod file the daemon wrote at `host_path`.
    pub fn mounting(host_path: &Path) -> Self {
        Self::with_text(&std::fs::read_to_string(host_path).expect("the daemon's pod file"))
    }

    /// What `/etc/ld.so.preload` names in the container.
    pub fn library(&self) -> PathBuf {
        self.dir.join("libcuda_limiter.so")
    }

    /// The pod file beside it.
    pub fn pod_file(&self) -> PathBuf {
        PodFile::beside(&self.library())
    }

    /// Makes `command` start as a process of the container does: in a
    /// mount namespace of its own whose `/etc/ld.so.preload` names
    /// [`Self::library`] (an overlay on `/etc`, its upper layer on a tmpfs
    /// that goes with the namespace), as `uid` (and its group). With
    /// `alias`, the library is also open at that descriptor number, for
    /// `/proc/self/fd/<alias>`. Needs root ([`mount_namespaces`]).
    pub fn preloaded(&self, command: &mut Command, uid: u32, alias: Option<i32>) {
        let layer = self.dir.join("etc-layer");
        std::fs::create_dir_all(&layer).expect("the overlay's folder");
        let text =
            |path: &Path| CString::new(path.as_os_str().as_bytes()).expect("a path without NUL");
        let (upper, work) = (layer.join("upper"), layer.join("work"));
        let options = format!(
            "lowerdir=/etc,upperdir={},workdir={}",
            upper.display(),
            work.display()
        );
        let preload = text(&upper.join("ld.so.preload"));
        let names = format!("{}\n", self.library().display());
        let (layer, upper, work, library) = (
            text(&layer),
            text(&upper),
            text(&work),
            text(&self.library()),
        );
        let options = CString::new(options).expect("mount options without NUL");
        let check = |result: libc::c_int| {
            if result < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(result)
            }
        };
        // SAFETY: only system calls on strings made before the fork.
        unsafe {
            command.pre_exec(move || {
                check(libc::unshare(libc::CLONE_NEWNS))?;
                let none = std::ptr::null();
                check(libc::mount(
                    none,
                    c"/".as_ptr(),
                    none,
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ))?;
                check(libc::mount(
                    c"tmpfs".as_ptr(),
                    layer.as_ptr(),
                    c"tmpfs".as_ptr(),
                    0,
                    c"size=1m,mode=755".as_ptr().cast(),
                ))?;
                check(libc::mkdir(upper.as_ptr(), 0o755))?;
                check(libc::mkdir(work.as_ptr(), 0o755))?;
                let fd = check(libc::open(
                    preload.as_ptr(),
                    libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_CLOEXEC,
                    0o644,
                ))?;
                let written = libc::write(fd, names.as_ptr().cast(), names.len());
                libc::close(fd);
                if written != names.len() as isize {
                    return Err(std::io::Error::other("ld.so.preload not written"));
                }
                check(libc::mount(
                    c"overlay".as_ptr(),
                    c"/etc".as_ptr(),
                    c"overlay".as_ptr(),
                    0,
                    options.as_ptr().cast(),
                ))?;
                if let Some(alias) = alias {
                    let fd = check(libc::open(library.as_ptr(), libc::O_RDONLY))?;
                    if fd != alias {
                        check(libc::dup2(fd, alias))?;
                        libc::close(fd);
                    }
                }
                check(libc::setgroups(0, std::ptr::null()))?;
                check(libc::setgid(uid))?;
                check(libc::setuid(uid))?;
                Ok(())
            });
        }
    }
}

/// Whether this process may make mount namespaces (root, with
/// `CAP_SYS_ADMIN`), as [`ContainerLib::preloaded`] does.
pub fn mount_namespaces() -> bool {
    Command::new("unshare")
        .args(["--mount", "true"])
        .status()
        .is_ok_and(|status| status.success())
}

impl Drop for ContainerLib {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

//! A provisioned container's view of the limiter, emulated on the host.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

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
        std::fs::create_dir_all(&dir).unwrap();
        let lib = Self { dir };
        std::os::unix::fs::symlink(limiter(), lib.library()).unwrap();
        let file = lib.pod_file();
        std::fs::write(&file, pod_file).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o444)).unwrap();
        lib
    }

    /// The folder with a copy of the pod file the daemon wrote at `host_path`.
    pub fn mounting(host_path: &Path) -> Self {
        Self::with_text(&std::fs::read_to_string(host_path).unwrap())
    }

    /// What `/etc/ld.so.preload` names in the container.
    pub fn library(&self) -> PathBuf {
        self.dir.join("libcuda_limiter.so")
    }

    /// The pod file beside it.
    pub fn pod_file(&self) -> PathBuf {
        PodFile::beside(&self.library())
    }
}

impl Drop for ContainerLib {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

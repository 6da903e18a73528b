//! A cluster test's scratch: a folder under the temp dir, and the regions
//! in `/dev/shm` of the pods the cluster named (their UIDs, not a
//! [`crate::pod::Pod`] of the test's own), removed when the test ends,
//! however it ends.

use std::path::PathBuf;
use std::sync::Mutex;

/// The folder and the tracked pods' regions, removed on drop.
pub struct Scratch {
    /// The test's folder, made empty.
    pub dir: PathBuf,
    shm: Mutex<Vec<PathBuf>>,
}

impl Scratch {
    /// An empty `<temp>/<tag>-<pid>`.
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the scratch folder");
        Self {
            dir,
            shm: Mutex::new(Vec::new()),
        }
    }

    /// A pod's region and limits, as the node daemon names them in
    /// `/dev/shm`.
    pub fn pod_files(pod: &str) -> [PathBuf; 2] {
        [
            PathBuf::from(format!("/dev/shm/gpushare-pod-{pod}")),
            PathBuf::from(format!("/dev/shm/gpushare-limits-{pod}")),
        ]
    }

    /// Removes pod `pod`'s region and limits when the test ends.
    pub fn track(&self, pod: &str) {
        self.shm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(Self::pod_files(pod));
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        let files = self
            .shm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for file in files.iter() {
            let _ = std::fs::remove_file(file);
        }
    }
}

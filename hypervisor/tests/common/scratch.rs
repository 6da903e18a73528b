//! A test's folder under the temp dir, and the `/dev/shm` objects its node
//! made for the pods it names: all removed when dropped, also when the test
//! fails.

use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use gpushare_utils::shm;

use super::{region_names, unique};

/// The folder is `<temp dir>/hvt-<tag>-<pid>-<n>` ([`unique`]): tests in
/// the same process, even of one tag, never share one.
pub(crate) struct Scratch {
    pub dir: PathBuf,
    /// Names under `/dev/shm` to unlink at the end.
    shm: Mutex<Vec<String>>,
}

impl Scratch {
    /// An empty folder.
    pub(crate) fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(unique(tag));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Self {
            dir,
            shm: Mutex::new(Vec::new()),
        }
    }

    /// A folder with an empty limiter, [`Scratch::limiter`]: what the
    /// agent mounts into containers, which no test process loads.
    pub(crate) fn with_limiter(tag: &str) -> Self {
        let scratch = Self::new(tag);
        std::fs::write(scratch.limiter(), b"").expect("limiter file");
        scratch
    }

    /// `libcuda_limiter.so` in the folder.
    pub(crate) fn limiter(&self) -> PathBuf {
        self.dir.join("libcuda_limiter.so")
    }

    /// Removes the region and the limits of `pod` (a pod's UID, or a quota
    /// identity) at the end.
    pub(crate) fn track_pod(&self, pod: &str) {
        self.names().extend(region_names(pod));
    }

    /// Removes `/dev/shm/<name>` at the end.
    pub(crate) fn track_shm(&self, name: &str) {
        self.names().push(name.to_owned());
    }

    fn names(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.shm.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        for name in self.names().iter() {
            let _ = shm::unlink(name);
        }
    }
}

//! A test's scratch: a folder under the temp dir, and the `/dev/shm` objects
//! its node made for the pods it names (a pod's UID from a cluster, or a
//! quota identity: not a [`crate::pod::Pod`] of the test's own), all removed
//! when dropped, also when the test fails.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::PodLimits;
use gpushare_utils::shm;

/// The folder is `<temp dir>/<tag>-<pid>-<n>`: tests in the same process,
/// even of one tag, never share one.
pub struct Scratch {
    /// The test's folder, made empty.
    pub dir: PathBuf,
    /// Names under `/dev/shm` to unlink at the end.
    shm: Mutex<Vec<String>>,
}

impl Scratch {
    /// An empty folder.
    pub fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(crate::unique::name(tag));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("the scratch folder");
        Self {
            dir,
            shm: Mutex::new(Vec::new()),
        }
    }

    /// A folder with an empty limiter, [`Scratch::limiter`]: what the
    /// agent mounts into containers, which no test process loads.
    pub fn with_limiter(tag: &str) -> Self {
        let scratch = Self::new(tag);
        std::fs::write(scratch.limiter(), b"").expect("limiter file");
        scratch
    }

    /// `libcuda_limiter.so` in the folder.
    pub fn limiter(&self) -> PathBuf {
        self.dir.join("libcuda_limiter.so")
    }

    /// The names under `/dev/shm` of `pod`'s region (its ledger) and limits.
    pub fn region_names(pod: &str) -> [String; 2] {
        [PodLedger::name_of(pod), PodLimits::name_of(pod)]
    }

    /// The paths of `pod`'s region and limits.
    pub fn pod_files(pod: &str) -> [PathBuf; 2] {
        Self::region_names(pod).map(|name| PathBuf::from("/dev/shm").join(name))
    }

    /// Removes the region and the limits of `pod` at the end.
    pub fn track_pod(&self, pod: &str) {
        self.names().extend(Self::region_names(pod));
    }

    /// Removes `/dev/shm/<name>` at the end.
    pub fn track_shm(&self, name: &str) {
        self.names().push(name.to_owned());
    }

    fn names(&self) -> MutexGuard<'_, Vec<String>> {
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

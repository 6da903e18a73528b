//! A folder of a test's own, for the unit tests of files a user names.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// An empty folder under the temporary folder, named after the test's
/// `tag`, this process and a count (tests of different modules run at
/// once, and may share a tag); removed when dropped.
pub(crate) struct Dir(pub(crate) PathBuf);

impl Dir {
    pub(crate) fn new(tag: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "gpushare-utils-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

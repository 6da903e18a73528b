//! Removing a squat: whatever stands at a name the daemon owns in
//! `/dev/shm` in place of its object (a link, a directory, a FIFO, a file
//! it may not adopt). Only the entry goes, never what it points at:
//!
//! 1. `unlink` removes anything but a directory: a link itself, not its
//!    target.
//! 2. A directory is renamed aside (`.<name>.squat-<pid>-<n>`, never over
//!    an existing entry), which frees the name at once and, like `unlink`,
//!    never follows a link.
//! 3. Its tree is then removed on a thread of its own: the squatter sized
//!    it, so the daemon's lock is not held while it goes. The removal
//!    opens every level `O_NOFOLLOW` (`std::fs::remove_dir_all`): a link
//!    inside is removed, never entered.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use super::SHM_DIR;

/// Names tried for the aside entry before giving up (another entry at one
/// is someone else's).
const ASIDE_TRIES: u32 = 8;

/// Removes what stands at `/dev/shm/<name>` without following it; `Ok`
/// also when nothing is there any more.
pub(crate) fn remove(name: &str) -> io::Result<()> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    let path = Path::new(SHM_DIR).join(name);
    match std::fs::remove_file(&path) {
        Ok(()) => return Ok(()),
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(error) if error.raw_os_error() == Some(libc::EISDIR) => {}
        Err(error) => return Err(error),
    }
    let aside = move_aside(&path, name)?;
    let removal = aside.clone();
    let spawned = std::thread::Builder::new()
        .name("squat-removal".into())
        .spawn(move || remove_tree(&removal));
    if spawned.is_err() {
        remove_tree(&aside);
    }
    Ok(())
}

/// Renames the directory at `path` to a fresh name beside it; returns that.
fn move_aside(path: &Path, name: &str) -> io::Result<PathBuf> {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let from = c_path(path)?;
    let mut last = io::Error::from(io::ErrorKind::AlreadyExists);
    for _ in 0..ASIDE_TRIES {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let aside = Path::new(SHM_DIR).join(format!(".{name}.squat-{}-{n}", std::process::id()));
        let to = c_path(&aside)?;
        // SAFETY: two valid NUL-terminated paths; AT_FDCWD with absolute paths.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if rc == 0 {
            return Ok(aside);
        }
        last = io::Error::last_os_error();
        if last.raw_os_error() != Some(libc::EEXIST) {
            return Err(last);
        }
    }
    Err(last)
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Removes the tree at `aside`; the squatter may still be writing into it,
/// so a few tries.
fn remove_tree(aside: &Path) {
    let mut result = Ok(());
    for _ in 0..3 {
        result = std::fs::remove_dir_all(aside);
        match &result {
            Ok(()) => return,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return,
            Err(_) => {}
        }
    }
    if let Err(error) = result {
        tracing::warn!(%error, path = %aside.display(), "a squatted directory moved aside is left");
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    /// A name of this test's own in /dev/shm, and a folder outside it;
    /// both removed when dropped.
    struct Scene {
        name: String,
        outside: PathBuf,
    }

    impl Scene {
        fn new(test: &str) -> Self {
            let name = format!("gpushare-squat-test-{}-{test}", std::process::id());
            let outside = std::env::temp_dir().join(&name);
            std::fs::create_dir_all(outside.join("dir")).expect("outside");
            std::fs::write(outside.join("file"), "kept").expect("outside file");
            std::fs::write(outside.join("dir/inner"), "kept").expect("inner file");
            Self { name, outside }
        }

        fn at(&self) -> PathBuf {
            Path::new(SHM_DIR).join(&self.name)
        }

        fn assert_outside_untouched(&self) {
            assert_eq!(
                std::fs::read_to_string(self.outside.join("file"))
                    .ok()
                    .as_deref(),
                Some("kept")
            );
            assert_eq!(
                std::fs::read_to_string(self.outside.join("dir/inner"))
                    .ok()
                    .as_deref(),
                Some("kept")
            );
        }

        /// Entries of /dev/shm that hold the name (the squat, or it aside).
        fn left(&self) -> Vec<String> {
            std::fs::read_dir(SHM_DIR)
                .expect("/dev/shm")
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.contains(&self.name))
                .collect()
        }

        fn assert_gone(&self) {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while !self.left().is_empty() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            assert_eq!(self.left(), Vec::<String>::new());
        }
    }

    impl Drop for Scene {
        fn drop(&mut self) {
            for left in self.left() {
                let path = Path::new(SHM_DIR).join(left);
                let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir_all(&path));
            }
            let _ = std::fs::remove_dir_all(&self.outside);
        }
    }

    #[test]
    fn links_are_removed_not_their_targets() {
        let scene = Scene::new("links");
        for target in [scene.outside.join("file"), scene.outside.join("dir")] {
            symlink(&target, scene.at()).expect("symlink");
            remove(&scene.name).expect("removed");
            assert!(std::fs::symlink_metadata(scene.at()).is_err());
            scene.assert_outside_untouched();
        }
        symlink("/nowhere/at/all", scene.at()).expect("dangling symlink");
        remove(&scene.name).expect("removed");
        scene.assert_gone();
    }

    #[test]
    fn a_directory_goes_with_its_tree_and_nothing_it_links_to() {
        let scene = Scene::new("dirs");
        std::fs::create_dir(scene.at()).expect("empty dir");
        remove(&scene.name).expect("removed");
        assert!(
            std::fs::symlink_metadata(scene.at()).is_err(),
            "the name is free at once"
        );
        scene.assert_gone();
        std::fs::create_dir_all(scene.at().join("a/b")).expect("full dir");
        std::fs::write(scene.at().join("a/f"), "x").expect("file in it");
        symlink(scene.outside.join("dir"), scene.at().join("a/to-dir")).expect("link in it");
        symlink(scene.outside.join("file"), scene.at().join("to-file")).expect("link in it");
        remove(&scene.name).expect("removed");
        assert!(
            std::fs::symlink_metadata(scene.at()).is_err(),
            "the name is free at once"
        );
        scene.assert_gone();
        scene.assert_outside_untouched();
    }

    #[test]
    fn nothing_there_is_fine_and_odd_names_are_refused() {
        let scene = Scene::new("none");
        remove(&scene.name).expect("nothing to remove");
        for name in ["", "a/b", "..", ".hidden"] {
            assert_eq!(
                remove(name).map_err(|e| e.kind()),
                Err(io::ErrorKind::InvalidInput),
                "{name:?}"
            );
        }
    }
}

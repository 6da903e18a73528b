//! The pod file: what the node daemon tells the limiter in a container it
//! provisioned (device plugin or DRA), mounted read-only beside the library.
//!
//! In such a container the limiter comes from `/etc/ld.so.preload`, which
//! the tenant cannot unset; its environment it can. So the pod, the
//! daemon's address, the token, the uid that owns the pod's limits and
//! whether CUDA must run as an MPS client and which node tables to use come
//! from this file, never from
//! variables: the container's library is `<dir>/libcuda_limiter.so` and the
//! file `<dir>/gpushare-pod.json`, both bind-mounted read-only by the
//! container runtime from the daemon's CDI edits. A file that is there but
//! not root's regular file, writable by nobody else, of a bounded size and
//! of this version, refuses CUDA (fail closed); no file at all is local mode.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::node_table::NodeTableNames;
use crate::small_file::{self, Links, SmallFileError};

/// The file's name, in the folder of the limiter library.
pub const FILE_NAME: &str = "gpushare-pod.json";
/// The layout written and read here; another is refused.
pub const VERSION: u32 = 1;
/// The most bytes a pod file may hold: it holds a few short strings.
pub const MAX_BYTES: u64 = 16 * 1024;

/// What the daemon states about a provisioned container's pod.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodFile {
    /// [`VERSION`].
    pub version: u32,
    /// The pod's id ([`crate::pod::PodId`]): whose ledger and limits.
    pub pod: String,
    /// The daemon's address as the container reaches it (`http://…` or
    /// `http+unix://…`).
    pub hypervisor: String,
    /// The pod's token.
    pub token: String,
    /// The uid, besides root, that may own the pod's limits object: the
    /// daemon's own where it does not run as root; `None`: root only. Never
    /// the pods' uid (`region_uid`): a pod could then forge its limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits_owner: Option<u32>,
    /// CUDA runs only as a client of an MPS server (a co-run GPU's pod).
    #[serde(default)]
    pub mps_required: bool,
    /// The node tables the daemon made (their default names when absent).
    #[serde(default)]
    pub node_tables: NodeTableNames,
}

/// Why a pod file that is there cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PodFileError {
    /// Open or read failed (other than "not there").
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        #[source]
        source: std::io::Error,
    },
    /// Not a file the daemon can have mounted.
    #[error("refusing {}: {reason}", path.display())]
    Untrusted {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Not a pod file of this version.
    #[error("{} is not a pod file of version {VERSION}: {reason}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

impl PodFile {
    /// The pod file beside the library at `library`.
    pub fn beside(library: &Path) -> PathBuf {
        library.with_file_name(FILE_NAME)
    }

    /// Reads the pod file at `path`: `Ok(None)` when there is nothing
    /// there. It must be a regular file (a link is not followed; a FIFO or
    /// a device is refused without waiting on it), owned by root, writable
    /// by nobody else, at most [`MAX_BYTES`], and of [`VERSION`].
    pub fn read(path: &Path) -> Result<Option<Self>, PodFileError> {
        let untrusted = |reason: String| PodFileError::Untrusted {
            path: path.to_owned(),
            reason,
        };
        let refused = |error: SmallFileError| match error {
            SmallFileError::Io(source) => PodFileError::Io {
                path: path.to_owned(),
                source,
            },
            other => untrusted(other.to_string()),
        };
        let (file, meta) = match small_file::open(path, Links::Refuse) {
            Ok(opened) => opened,
            Err(SmallFileError::Io(error)) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(None);
            }
            Err(error) => return Err(refused(error)),
        };
        if meta.uid() != 0 {
            return Err(untrusted(format!("owned by uid {}, not root", meta.uid())));
        }
        if meta.mode() & 0o022 != 0 {
            return Err(untrusted(format!(
                "writable by group or others (mode {:o})",
                meta.mode() & 0o7777
            )));
        }
        let text = small_file::read_open(file, &meta, MAX_BYTES).map_err(refused)?;
        let invalid = |reason: String| PodFileError::Invalid {
            path: path.to_owned(),
            reason,
        };
        let file: Self = serde_json::from_slice(&text).map_err(|e| invalid(e.to_string()))?;
        if file.version != VERSION {
            return Err(invalid(format!("version {}", file.version)));
        }
        Ok(Some(file))
    }

    /// The file's text, as the daemon writes it.
    pub fn to_json(&self) -> String {
        // A struct of strings, numbers and booleans always serialises.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_dir::Dir;
    use std::os::unix::fs::PermissionsExt;

    fn example() -> PodFile {
        PodFile {
            version: VERSION,
            pod: "1c8d9b63-4f2e-4b8f-8d5f-3a7e2e3d4c5b".into(),
            hypervisor: "http://127.0.0.1:7070".into(),
            token: "0123abcd".into(),
            limits_owner: Some(1000),
            mps_required: true,
            node_tables: NodeTableNames {
                activity: "gpushare-node-test".into(),
                priority: "gpushare-priority-test".into(),
            },
        }
    }

    fn write(path: &Path, text: &str, mode: u32) {
        std::fs::write(path, text).unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    #[test]
    fn what_the_daemon_writes_the_limiter_reads() {
        let dir = Dir::new("round");
        let path = PodFile::beside(&dir.0.join("libcuda_limiter.so"));
        assert_eq!(path, dir.0.join(FILE_NAME));
        assert!(
            PodFile::read(&path).unwrap().is_none(),
            "absent: local mode"
        );
        write(&path, &example().to_json(), 0o444);
        if crate::shm::effective_uid() == 0 {
            assert_eq!(PodFile::read(&path).unwrap(), Some(example()));
        } else {
            let error = PodFile::read(&path).unwrap_err().to_string();
            assert!(error.contains("not root"), "{error}");
        }
    }

    #[test]
    fn anything_but_roots_small_regular_file_of_this_version_is_refused() {
        let dir = Dir::new("refused");
        let path = dir.0.join(FILE_NAME);
        let root = crate::shm::effective_uid() == 0;
        let text = example().to_json();
        type Case<'a> = (&'a str, Box<dyn Fn() + 'a>, &'a str);
        let cases: Vec<Case<'_>> = vec![
            (
                "writable by others",
                Box::new(|| write(&path, &text, 0o666)),
                if root {
                    "writable by group or others"
                } else {
                    "not root"
                },
            ),
            (
                "a directory",
                Box::new(|| std::fs::create_dir(&path).unwrap()),
                "not a regular file",
            ),
            (
                "a FIFO",
                Box::new(|| {
                    let name = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
                    // SAFETY: a valid path string.
                    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o444) }, 0);
                }),
                "not a regular file",
            ),
            (
                "a link to a good file",
                Box::new(|| {
                    let target = dir.0.join("elsewhere.json");
                    write(&target, &text, 0o444);
                    std::os::unix::fs::symlink(&target, &path).unwrap();
                }),
                "a symbolic link",
            ),
            (
                "too large",
                Box::new(|| write(&path, &" ".repeat(MAX_BYTES as usize + 1), 0o444)),
                if root { "more than" } else { "not root" },
            ),
            (
                "another version",
                Box::new(|| {
                    write(
                        &path,
                        &text.replace("\"version\": 1", "\"version\": 2"),
                        0o444,
                    );
                }),
                if root { "version 2" } else { "not root" },
            ),
            (
                "an unknown field",
                Box::new(|| {
                    write(
                        &path,
                        &text.replace("\"pod\"", "\"allow_unlimited\": true, \"pod\""),
                        0o444,
                    );
                }),
                if root { "unknown field" } else { "not root" },
            ),
            (
                "no token",
                Box::new(|| {
                    write(
                        &path,
                        "{\"version\": 1, \"pod\": \"p\", \"hypervisor\": \"http://x\"}",
                        0o444,
                    );
                }),
                if root {
                    "missing field `token`"
                } else {
                    "not root"
                },
            ),
        ];
        for (what, make, want) in cases {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_dir(&path);
            make();
            let error = PodFile::read(&path).expect_err(what).to_string();
            assert!(error.contains(want), "{what}: {error}");
        }
    }
}

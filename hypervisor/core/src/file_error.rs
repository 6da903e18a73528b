//! A file operation that failed: what was being done, on which path, and the
//! system's error; shown as one line ("cannot write /var/lib/…: …").

use std::path::PathBuf;

/// A failed file operation.
#[derive(Debug, thiserror::Error)]
#[error("{what} {}: {source}", path.display())]
pub struct FileError {
    /// What was being done ("cannot write").
    pub what: &'static str,
    /// The file or folder.
    pub path: PathBuf,
    /// Why it failed.
    #[source]
    pub source: std::io::Error,
}

//! Reading a small file that a user names (a token file, a config file):
//! whatever the name points at, the read neither waits nor grows past a
//! bound.
//!
//! A FIFO with no writer would block an ordinary `open` forever, and
//! `/dev/zero` or a huge file would fill memory; opening a device at all can
//! have effects (a tape rewinds, a watchdog arms). So the path is looked at
//! first and anything but a regular file is refused unopened; the open is
//! non-blocking and takes no controlling terminal, and the descriptor is
//! checked again (the name may have changed in between); at most `max + 1`
//! bytes are read, so a file that grew meanwhile is refused too.
//!
//! A file system that does not answer (a hung network mount) can still hold
//! a read; callers that must not wait bound the whole read in time.

use std::fs::{File, FileType, Metadata, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The most a token file may hold: a token is at most 4,096 bytes, and
/// usually tens.
pub const TOKEN_FILE_MAX: u64 = 4096;

/// Why a small file was not read.
#[derive(Debug, thiserror::Error)]
pub enum SmallFileError {
    /// The system refused: not there, no permission, a broken mount.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A FIFO, a device, a socket or a folder: never opened, never read.
    #[error("{0}, not a regular file")]
    NotRegular(&'static str),
    /// Larger than the bound, by its size or by what could be read.
    #[error("more than {max} bytes")]
    TooLarge {
        /// The bound.
        max: u64,
    },
    /// Not text.
    #[error("not UTF-8 text")]
    NotUtf8,
}

/// What to do with a symbolic link at the path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Links {
    /// Follow it (Kubernetes mounts secrets as links).
    Follow,
    /// Refuse it: the file must be at the name itself.
    Refuse,
}

/// The bytes of the regular file at `path`, at most `max` of them.
pub fn read(path: &Path, max: u64) -> Result<Vec<u8>, SmallFileError> {
    let (file, meta) = open(path, Links::Follow)?;
    read_open(file, &meta, max)
}

/// The regular file at `path`, opened for reading, and what `fstat` says of
/// it: for a caller that checks its owner or mode before reading it with
/// [`read_open`].
pub fn open(path: &Path, links: Links) -> Result<(File, Metadata), SmallFileError> {
    // Refused before any open: a device's open can do something.
    let kind = match links {
        Links::Follow => std::fs::metadata(path)?.file_type(),
        Links::Refuse => std::fs::symlink_metadata(path)?.file_type(),
    };
    if kind.is_symlink() {
        return Err(SmallFileError::NotRegular("a symbolic link"));
    }
    regular(kind)?;
    let nofollow = if links == Links::Refuse {
        libc::O_NOFOLLOW
    } else {
        0
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | nofollow)
        .open(path)
        .map_err(|error| match error.raw_os_error() {
            Some(libc::ELOOP) => SmallFileError::NotRegular("a symbolic link"),
            _ => SmallFileError::Io(error),
        })?;
    let meta = file.metadata()?;
    regular(meta.file_type())?;
    Ok((file, meta))
}

/// At most `max` bytes of `file`, opened by [`open`] (`meta`: its metadata).
pub fn read_open(file: File, meta: &Metadata, max: u64) -> Result<Vec<u8>, SmallFileError> {
    if meta.len() > max {
        return Err(SmallFileError::TooLarge { max });
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(SmallFileError::TooLarge { max });
    }
    Ok(bytes)
}

/// The text of the regular file at `path`, at most `max` bytes of it.
pub fn read_text(path: &Path, max: u64) -> Result<String, SmallFileError> {
    String::from_utf8(read(path, max)?).map_err(|_| SmallFileError::NotUtf8)
}

fn regular(kind: FileType) -> Result<(), SmallFileError> {
    let what = if kind.is_file() {
        return Ok(());
    } else if kind.is_dir() {
        "a folder"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "something else"
    };
    Err(SmallFileError::NotRegular(what))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::test_dir::Dir;

    #[test]
    fn a_small_regular_file_is_read_whole() {
        let dir = Dir::new("ok");
        let path = dir.0.join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        assert_eq!(read_text(&path, TOKEN_FILE_MAX).unwrap(), "s3cret\n");
        std::fs::write(&path, "x".repeat(16)).unwrap();
        assert_eq!(read(&path, 16).unwrap().len(), 16);
    }

    #[test]
    fn fifos_devices_folders_and_large_files_are_refused_at_once() {
        let dir = Dir::new("refused");
        let fifo = dir.0.join("fifo");
        let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid path string.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let large = dir.0.join("large");
        std::fs::write(&large, "x".repeat(TOKEN_FILE_MAX as usize + 1)).unwrap();
        let cases = [
            (fifo.as_path(), "a FIFO, not a regular file"),
            (
                Path::new("/dev/zero"),
                "a character device, not a regular file",
            ),
            (dir.0.as_path(), "a folder, not a regular file"),
            (large.as_path(), "more than 4096 bytes"),
        ];
        for (path, want) in cases {
            let started = Instant::now();
            let error = read(path, TOKEN_FILE_MAX).unwrap_err().to_string();
            assert_eq!(error, want, "{}", path.display());
            assert!(started.elapsed() < Duration::from_secs(1), "{error}");
        }
        let missing = read(&dir.0.join("missing"), 1).unwrap_err();
        assert!(
            matches!(missing, SmallFileError::Io(ref e) if e.kind() == std::io::ErrorKind::NotFound)
        );
        std::fs::write(&large, [0xff, 0xfe]).unwrap();
        assert!(matches!(
            read_text(&large, 16),
            Err(SmallFileError::NotUtf8)
        ));
    }
}

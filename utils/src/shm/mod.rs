//! POSIX shared-memory objects (`/dev/shm/<name>`), created and opened so that
//! another user cannot plant one for us to adopt.
//!
//! - **Create** with `O_CREAT|O_EXCL|O_NOFOLLOW`: never an object someone else
//!   made, never through a symbolic link. Owner and mode are then set on the
//!   file descriptor (`fchown`, `fchmod`), never by path, before the object
//!   is sized: until then it has length 0, which openers treat as "not ready".
//! - **Open** an existing object with `O_NOFOLLOW`, then `fstat` the
//!   descriptor: it must be a regular file owned by one of the trusted uids
//!   ([`Trust`]), writable by nobody but its owner (no `g+w`, no `o+w`),
//!   and of exactly the expected length. Anything else is refused with an
//!   error that says which check failed.
//! - **Read-only** opens map the object `PROT_READ` from an `O_RDONLY`
//!   descriptor: the process cannot write it even by mistake, and the kernel
//!   refuses `mprotect` to writable on such a mapping.
//! - **Squats**: an open never waits on what it finds (a FIFO), and an
//!   error that means something else stands at the name says what
//!   ([`ShmError::squat`]: a link, a directory, a file it may not adopt),
//!   for the object's creator to remove.
//! - **Shrinking** an object is harmless to those who map it: see [`guard`].

mod guard;

use std::ffi::CString;
use std::io;
use std::ptr::NonNull;

/// Which uids may own an object we open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trust {
    owners: Vec<u32>,
}

impl Trust {
    /// This process's effective uid and root, plus `extra` (a configured uid).
    pub fn own_or_root(extra: Option<u32>) -> Self {
        let mut owners = vec![effective_uid(), 0];
        owners.extend(extra);
        owners.dedup();
        Self { owners }
    }

    /// Root, plus `extra` (a configured uid): for objects only the node's
    /// daemon may create, which a process must not trust merely because its
    /// own uid made them.
    pub fn root_or(extra: Option<u32>) -> Self {
        let mut owners = vec![0];
        owners.extend(extra);
        owners.dedup();
        Self { owners }
    }

    /// Exactly these uids.
    pub fn only(owners: &[u32]) -> Self {
        Self {
            owners: owners.to_vec(),
        }
    }

    /// Whether `uid` may own an object we open.
    pub fn allows(&self, uid: u32) -> bool {
        self.owners.contains(&uid)
    }
}

/// Owner and permission bits of an object we create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Creation {
    /// `None` keeps our own uid / gid.
    pub uid: Option<u32>,
    /// Group of the object; `None` keeps our own gid.
    pub gid: Option<u32>,
    /// Permission bits; group and other write bits are always cleared.
    pub mode: u32,
}

impl Default for Creation {
    fn default() -> Self {
        Self {
            uid: None,
            gid: None,
            mode: 0o600,
        }
    }
}

/// Errors of shared-memory objects.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// Creating, owning or sizing the object failed.
    #[error("cannot create /dev/shm/{name}: {source}")]
    Create {
        /// Object name, without the leading `/`.
        name: String,
        /// The failed system call's error.
        #[source]
        source: io::Error,
    },
    /// Opening, inspecting or mapping the object failed.
    #[error("cannot open /dev/shm/{name}: {source}")]
    Open {
        /// Object name, without the leading `/`.
        name: String,
        /// The failed system call's error.
        #[source]
        source: io::Error,
    },
    /// The object's owner is not one of the trusted uids.
    #[error(
        "refusing /dev/shm/{name}: owned by uid {uid}, which is not trusted (allowed: {allowed:?})"
    )]
    UntrustedOwner {
        /// Object name, without the leading `/`.
        name: String,
        /// Uid that owns the object.
        uid: u32,
        /// The uids that were trusted.
        allowed: Vec<u32>,
    },
    /// Group or others may write the object.
    #[error("refusing /dev/shm/{name}: mode {mode:04o} lets group or others write it")]
    Writable {
        /// Object name, without the leading `/`.
        name: String,
        /// The object's permission bits.
        mode: u32,
    },
    /// The object is not a regular file.
    #[error("refusing /dev/shm/{name}: not a regular file")]
    NotRegular {
        /// Object name, without the leading `/`.
        name: String,
    },
    /// The object is neither empty (not ready) nor of the expected length.
    #[error("/dev/shm/{name} is {found} bytes, expected {expected}")]
    Size {
        /// Object name, without the leading `/`.
        name: String,
        /// The object's length in bytes.
        found: u64,
        /// The length the caller expected, in bytes.
        expected: u64,
    },
}

/// What stands at an object's name in place of an object that may be
/// adopted, as an opener found it ([`ShmError::squat`]): only the object's
/// creator (the hypervisor, for a pod's objects) removes it, never
/// following it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Squat {
    /// A symbolic link (`O_NOFOLLOW` refused it).
    Link,
    /// A directory.
    Directory,
    /// Something else that is not a regular file: a FIFO, a socket, a
    /// device (or a directory opened read-only).
    Special,
    /// A regular file owned by this uid, which is not trusted.
    Owner(u32),
    /// A regular file with these permission bits: group or others may write it.
    Writable(u32),
    /// A regular file of this many bytes, not the object's size.
    Size(u64),
    /// A regular file that stayed empty, or whose header was never made ready.
    Unready,
    /// An entry this process may not open.
    Unopenable,
}

impl std::fmt::Display for Squat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Squat::Link => f.write_str("a symbolic link"),
            Squat::Directory => f.write_str("a directory"),
            Squat::Special => f.write_str("not a regular file"),
            Squat::Owner(uid) => write!(f, "a file of the untrusted uid {uid}"),
            Squat::Writable(mode) => write!(f, "a file of mode {mode:04o}"),
            Squat::Size(bytes) => write!(f, "a file of {bytes} bytes"),
            Squat::Unready => f.write_str("a file never made ready"),
            Squat::Unopenable => f.write_str("an entry the opener may not open"),
        }
    }
}

impl ShmError {
    /// What stands at the name, when this error says it is not an object
    /// of ours (nor a failure to create one): a link, a directory, a file
    /// that may not be adopted.
    pub fn squat(&self) -> Option<Squat> {
        match self {
            ShmError::Open { source, .. } => match source.raw_os_error()? {
                libc::ELOOP => Some(Squat::Link),
                libc::EISDIR => Some(Squat::Directory),
                // A socket.
                libc::ENXIO => Some(Squat::Special),
                libc::EACCES | libc::EPERM => Some(Squat::Unopenable),
                _ => None,
            },
            ShmError::NotRegular { .. } => Some(Squat::Special),
            ShmError::UntrustedOwner { uid, .. } => Some(Squat::Owner(*uid)),
            ShmError::Writable { mode, .. } => Some(Squat::Writable(*mode)),
            ShmError::Size { found, .. } => Some(Squat::Size(*found)),
            ShmError::Create { .. } => None,
        }
    }
}

/// How an object was obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// We created it (and sized it).
    Created,
    /// Someone else had created it; we opened it.
    Opened,
}

/// A mapping of a shared-memory object; unmapped (never unlinked) on drop.
#[derive(Debug)]
pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
    /// Released before the pages are unmapped.
    guard: Option<guard::Guarded>,
}

// SAFETY: the mapping is process-wide memory; the owner only unmaps it on drop.
unsafe impl Send for Mapping {}
// SAFETY: as above; callers access it through atomics only.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// First byte of the mapping (page-aligned).
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }

    /// Length of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping has length 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The object mapped, as the kernel lists it in this process's
    /// `/proc/self/maps`, and so in the maps of every process that maps the
    /// same file; `None` where `/proc` cannot tell.
    pub fn file(&self) -> Option<crate::process::FileId> {
        crate::process::mapped_at(self.base.as_ptr() as usize)
    }

    /// Whether the object was shrunk under this mapping: a touched page past
    /// its new end now reads zeros of this process's own, so nothing read
    /// from the mapping can be trusted any more.
    pub fn is_broken(&self) -> bool {
        self.guard.as_ref().is_some_and(guard::Guarded::is_broken)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        drop(self.guard.take());
        // SAFETY: `base`/`len` are exactly what mmap returned; nothing borrows
        // the mapping past its owner.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// An open descriptor, closed on drop.
struct Fd(libc::c_int);

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

fn c_name(name: &str) -> io::Result<CString> {
    CString::new(format!("/{name}")).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Creates `name` (`len` bytes, owner and mode from `creation`) if it does not
/// exist; `Ok(None)` if it does.
pub fn create(name: &str, len: usize, creation: &Creation) -> Result<Option<Mapping>, ShmError> {
    let fail = |source| ShmError::Create {
        name: name.to_owned(),
        source,
    };
    let path = c_name(name).map_err(fail)?;
    // SAFETY: a valid NUL-terminated name.
    let fd = unsafe {
        libc::shm_open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            0o600 as libc::mode_t,
        )
    };
    if fd < 0 {
        let error = io::Error::last_os_error();
        if error.raw_os_error() == Some(libc::EEXIST) {
            return Ok(None);
        }
        return Err(fail(error));
    }
    let fd = Fd(fd);
    let check = |rc: libc::c_int| {
        if rc == 0 {
            Ok(())
        } else {
            Err(fail(io::Error::last_os_error()))
        }
    };
    if creation.uid.is_some() || creation.gid.is_some() {
        let uid = creation.uid.unwrap_or(u32::MAX);
        let gid = creation.gid.unwrap_or(u32::MAX);
        // SAFETY: our descriptor; -1 (u32::MAX) leaves that id unchanged.
        check(unsafe { libc::fchown(fd.0, uid, gid) })?;
    }
    // SAFETY: our descriptor.
    check(unsafe { libc::fchmod(fd.0, (creation.mode & 0o755) as libc::mode_t) })?;
    // SAFETY: our descriptor; sizing last tells openers it is ready to map.
    check(unsafe { libc::ftruncate(fd.0, len as libc::off_t) })?;
    map(&fd, len, true).map(Some).map_err(fail)
}

/// Opens the existing object `name` after checking it against `trust`;
/// `Ok(None)` if it does not exist or its creator has not sized it yet.
pub fn open(
    name: &str,
    len: usize,
    writable: bool,
    trust: &Trust,
) -> Result<Option<Mapping>, ShmError> {
    let fail = |source| ShmError::Open {
        name: name.to_owned(),
        source,
    };
    let path = c_name(name).map_err(fail)?;
    let access = if writable {
        libc::O_RDWR
    } else {
        libc::O_RDONLY
    };
    // O_NONBLOCK: a FIFO planted at the name is opened (and refused below)
    // at once, never waited on; it changes nothing for a regular file.
    // SAFETY: a valid NUL-terminated name.
    let fd = unsafe {
        libc::shm_open(
            path.as_ptr(),
            access | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::ENOENT) => return Ok(None),
            // glibc's shm_open reports a directory as EINVAL: say what it is.
            Some(libc::EINVAL) if is_directory(name) => {
                return Err(fail(io::Error::from_raw_os_error(libc::EISDIR)));
            }
            _ => return Err(fail(error)),
        }
    }
    let fd = Fd(fd);
    // SAFETY: an all-zero stat is a valid out-buffer.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: our descriptor and a valid out-pointer.
    if unsafe { libc::fstat(fd.0, &mut stat) } != 0 {
        return Err(fail(io::Error::last_os_error()));
    }
    if stat.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(ShmError::NotRegular {
            name: name.to_owned(),
        });
    }
    if !trust.allows(stat.st_uid) {
        return Err(ShmError::UntrustedOwner {
            name: name.to_owned(),
            uid: stat.st_uid,
            allowed: trust.owners.clone(),
        });
    }
    let mode = stat.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Err(ShmError::Writable {
            name: name.to_owned(),
            mode,
        });
    }
    match u64::try_from(stat.st_size).unwrap_or(0) {
        0 => Ok(None),
        size if size == len as u64 => map(&fd, len, writable).map(Some).map_err(fail),
        found => Err(ShmError::Size {
            name: name.to_owned(),
            found,
            expected: len as u64,
        }),
    }
}

/// Whether `/dev/shm/<name>` is a directory (not a link to one).
fn is_directory(name: &str) -> bool {
    !name.contains('/')
        && std::fs::symlink_metadata(format!("/dev/shm/{name}")).is_ok_and(|m| m.is_dir())
}

/// Removes `name` (tests, and pods the hypervisor forgets).
pub fn unlink(name: &str) -> io::Result<()> {
    let path = c_name(name)?;
    // SAFETY: a valid NUL-terminated name.
    if unsafe { libc::shm_unlink(path.as_ptr()) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn map(fd: &Fd, len: usize, writable: bool) -> io::Result<Mapping> {
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    // SAFETY: a fresh shared mapping of our descriptor; the kernel picks the address.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd.0, 0) };
    if base == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let Some(base) = NonNull::new(base.cast::<u8>()) else {
        return Err(io::Error::from(io::ErrorKind::InvalidData));
    };
    match guard::register(base.as_ptr() as usize, len) {
        Some(guard) => Ok(Mapping {
            base,
            len,
            guard: Some(guard),
        }),
        None => {
            // SAFETY: the mapping we just made, not yet shared with anyone.
            unsafe { libc::munmap(base.as_ptr().cast(), len) };
            Err(io::Error::other("too many shared-memory mappings to guard"))
        }
    }
}

/// This process's effective uid.
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;
    use std::path::PathBuf;
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// A name of this test's own; whatever is there is removed when dropped.
    struct Name(String);

    impl Name {
        fn path(&self) -> PathBuf {
            PathBuf::from(format!("/dev/shm/{}", self.0))
        }

        fn clear(&self) {
            let _ = std::fs::remove_file(self.path());
            let _ = std::fs::remove_dir(self.path());
        }

        /// What opening it (`writable` or not) says stands there, within
        /// 5 s: an open never waits on what it finds.
        fn squat(&self, writable: bool) -> Option<Squat> {
            let (name, (tx, rx)) = (self.0.clone(), mpsc::channel());
            std::thread::spawn(move || {
                let trust = Trust::own_or_root(None);
                let _ = tx.send(open(&name, 4096, writable, &trust).err());
            });
            let error = rx
                .recv_timeout(Duration::from_secs(5))
                .expect("the open returns");
            error.expect("refused").squat()
        }
    }

    impl Drop for Name {
        fn drop(&mut self) {
            self.clear();
        }
    }

    #[test]
    fn an_opener_says_what_stands_at_the_name() {
        let name = Name(format!("gpushare-shm-squat-test-{}", std::process::id()));
        symlink("/nowhere", name.path()).expect("symlink");
        assert_eq!(name.squat(true), Some(Squat::Link));
        assert_eq!(name.squat(false), Some(Squat::Link));
        name.clear();
        std::fs::create_dir(name.path()).expect("directory");
        assert_eq!(name.squat(true), Some(Squat::Directory));
        assert_eq!(name.squat(false), Some(Squat::Special));
        name.clear();
        let fifo = CString::new(name.path().into_os_string().into_encoded_bytes()).expect("path");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo");
        assert_eq!(name.squat(false), Some(Squat::Special));
        assert_eq!(name.squat(true), Some(Squat::Special));
        name.clear();
        std::fs::write(name.path(), [0u8; 100]).expect("file");
        assert_eq!(name.squat(true), Some(Squat::Size(100)));
        name.clear();
        let nothing = open(&name.0, 4096, true, &Trust::own_or_root(None));
        assert!(matches!(nothing, Ok(None)), "nothing there");
    }
}

//! Makes a shrunk shared-memory object harmless to the processes that map it.
//!
//! Whoever may write an object may also `ftruncate` it; every page of a
//! mapping past the object's new end then raises `SIGBUS` when touched,
//! killing the process that touched it (the node daemon, or another pod's
//! process reading a node table). Every [`super::Mapping`] is registered
//! here, and a `SIGBUS` handler, installed once per process when the first
//! object is mapped, catches faults inside a registered mapping: it maps a
//! private zero page over the faulting page, marks the mapping broken and
//! returns, so the faulting access completes (on zeros) and the process goes
//! on. Owners check [`super::Mapping::is_broken`] and stop trusting what the
//! mapping says (the ledger then refuses allocations: fail closed).
//!
//! Any other `SIGBUS` (a fault outside our mappings, or one sent by `kill`)
//! goes to the handler that was installed before ours, or, if there was
//! none, gets the default action: the process dies as it would have without
//! this library.

use std::sync::Once;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Mappings tracked at once: a limited process has a handful; the node
/// daemon two per pod.
const SLOTS: usize = 4096;

/// One registered mapping: `[start, end)`; `end == 0` is a free slot.
struct Range {
    start: AtomicUsize,
    end: AtomicUsize,
    broken: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)] // the array initialiser only
const FREE: Range = Range {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    broken: AtomicBool::new(false),
};

static RANGES: [Range; SLOTS] = [FREE; SLOTS];
static PAGE: AtomicUsize = AtomicUsize::new(4096);
/// The `SIGBUS` action in place before ours; set before ours is installed.
static PREVIOUS: OnceLock<Previous> = OnceLock::new();

/// A saved `sigaction` (plain data; read by the handler).
struct Previous(libc::sigaction);

// SAFETY: `sigaction` is plain data (a handler address, flags and a mask),
// written once before the handler that reads it is installed.
unsafe impl Sync for Previous {}
// SAFETY: as above.
unsafe impl Send for Previous {}

/// A registration, released on drop.
#[derive(Debug)]
pub(super) struct Guarded {
    slot: usize,
}

impl Guarded {
    /// Whether a fault was caught in the mapping (its object was shrunk).
    pub(super) fn is_broken(&self) -> bool {
        RANGES[self.slot].broken.load(Ordering::Acquire)
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let range = &RANGES[self.slot];
        range.end.store(0, Ordering::Release);
        range.start.store(0, Ordering::Release);
    }
}

/// Registers `[start, start + len)`, installing the handler on first use;
/// `None` when every slot is taken (the caller refuses the mapping).
pub(super) fn register(start: usize, len: usize) -> Option<Guarded> {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(install);
    for (slot, range) in RANGES.iter().enumerate() {
        if range
            .start
            .compare_exchange(0, start, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            range.broken.store(false, Ordering::Release);
            range.end.store(start + len, Ordering::Release);
            return Some(Guarded { slot });
        }
    }
    None
}

fn install() {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if let Ok(page) = usize::try_from(page)
        && page.is_power_of_two()
    {
        PAGE.store(page, Ordering::Relaxed);
    }
    // SAFETY: an all-zero sigaction is a valid out-buffer.
    let mut previous: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: reads the current action into our buffer; changes nothing.
    if unsafe { libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) } != 0 {
        return;
    }
    let _ = PREVIOUS.set(Previous(previous));
    // SAFETY: as above.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_sigbus as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
    // SAFETY: a valid action whose handler only calls async-signal-safe
    // functions (mmap, sigaction, raise) and touches atomics.
    unsafe {
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

extern "C" fn on_sigbus(
    signal: libc::c_int,
    info: *mut libc::siginfo_t,
    context: *mut libc::c_void,
) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler.
    let (code, address) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // A positive code is a fault the kernel raised (not `kill` or `raise`).
    if code > 0 && absorb(address) {
        return;
    }
    forward(signal, info, context);
}

/// Maps a zero page over `address` if it lies in a registered mapping.
fn absorb(address: usize) -> bool {
    let Some(range) = RANGES.iter().find(|range| {
        let end = range.end.load(Ordering::Acquire);
        end != 0 && (range.start.load(Ordering::Acquire)..end).contains(&address)
    }) else {
        return false;
    };
    let page = PAGE.load(Ordering::Relaxed);
    let base = address & !(page - 1);
    // SAFETY: replaces one page of a mapping this process registered (and
    // has not unmapped: unregistering precedes munmap) with private zeros;
    // nothing else lives at that address.
    let mapped = unsafe {
        libc::mmap(
            base as *mut libc::c_void,
            page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if mapped == libc::MAP_FAILED {
        return false;
    }
    range.broken.store(true, Ordering::Release);
    true
}

/// Hands the signal to the handler installed before ours, or to the default
/// action.
fn forward(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    let previous = PREVIOUS.get().map(|previous| previous.0);
    if let Some(previous) = previous {
        let handler = previous.sa_sigaction;
        if handler != libc::SIG_DFL && handler != libc::SIG_IGN {
            if previous.sa_flags & libc::SA_SIGINFO != 0 {
                // SAFETY: the previous owner installed this as an SA_SIGINFO
                // handler of this signature.
                let handler: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    unsafe { std::mem::transmute(handler) };
                handler(signal, info, context);
            } else {
                // SAFETY: the previous owner installed this as a plain handler.
                let handler: extern "C" fn(libc::c_int) = unsafe { std::mem::transmute(handler) };
                handler(signal);
            }
            return;
        }
    }
    // SAFETY: an all-zero sigaction with SIG_DFL (0) is the default action;
    // the signal is blocked while we run, so `raise` delivers it once we
    // return, and a fault would recur anyway.
    unsafe {
        let default: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, &default, std::ptr::null_mut());
        libc::raise(signal);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Creation, Trust, create, open, unlink};
    use std::sync::atomic::{AtomicU64, Ordering};

    struct Object(String);

    impl Object {
        fn new(test: &str) -> Self {
            Self(format!("gpushare-guard-test-{}-{test}", std::process::id()))
        }
    }

    impl Drop for Object {
        fn drop(&mut self) {
            let _ = unlink(&self.0);
        }
    }

    fn shrink(name: &str, len: i64) {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/dev/shm/{name}"))
            .expect("open for truncation");
        file.set_len(len as u64).expect("truncate");
    }

    #[test]
    fn a_shrunk_object_reads_as_zeros_and_is_marked_broken() {
        let object = Object::new("shrunk");
        let len = 3 * 4096;
        let mapping = create(&object.0, len, &Creation::default())
            .expect("create")
            .expect("new");
        let reader = open(&object.0, len, true, &Trust::own_or_root(None))
            .expect("open")
            .expect("ready");
        let word = |mapping: &super::super::Mapping, offset: usize| {
            // SAFETY: the offset is inside the mapping and 8-byte aligned.
            unsafe { &*(mapping.base().as_ptr().add(offset) as *const AtomicU64) }
        };
        word(&mapping, 2 * 4096).store(7, Ordering::Release);
        assert_eq!(word(&reader, 2 * 4096).load(Ordering::Acquire), 7);
        shrink(&object.0, 4096);
        assert!(!reader.is_broken(), "no fault yet");
        assert_eq!(
            word(&reader, 0).load(Ordering::Acquire),
            0,
            "first page kept"
        );
        assert!(
            !reader.is_broken(),
            "the first page is still inside the file"
        );
        assert_eq!(
            word(&reader, 2 * 4096).load(Ordering::Acquire),
            0,
            "past the end: zeros, not SIGBUS"
        );
        word(&reader, 2 * 4096 + 8).fetch_add(1, Ordering::AcqRel);
        assert!(reader.is_broken());
        assert!(!mapping.is_broken(), "the other mapping did not fault yet");
        word(&mapping, 2 * 4096).store(1, Ordering::Release);
        assert!(mapping.is_broken());
    }

    /// Run by the test below in a child process: maps one object through
    /// this module (which installs the guard) and another one directly,
    /// shrinks the other one and touches it.
    #[test]
    #[ignore = "run in a child process by foreign_sigbus_still_kills"]
    fn child_faults_outside_its_mappings() {
        if std::env::var_os("GPUSHARE_GUARD_CHILD").is_none() {
            return;
        }
        let object = Object::new("child");
        let _mapping = create(&object.0, 4096, &Creation::default()).expect("create");
        let other = Object::new("child-other");
        let file = std::fs::File::create_new(format!("/dev/shm/{}", other.0)).expect("create");
        file.set_len(4096).expect("size");
        // SAFETY: a fresh shared mapping of our own file, never unmapped.
        let base = unsafe {
            use std::os::fd::AsRawFd;
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        file.set_len(0).expect("shrink");
        drop((object, other));
        // SAFETY: inside the mapping; the read faults (the file is empty).
        let word = unsafe { std::ptr::read_volatile(base as *const u64) };
        println!("survived {word}");
    }

    #[test]
    fn foreign_sigbus_still_kills() {
        use std::os::unix::process::ExitStatusExt;
        let output = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "shm::guard::tests::child_faults_outside_its_mappings",
                "--ignored",
                "--nocapture",
            ])
            .env("GPUSHARE_GUARD_CHILD", "1")
            .output()
            .expect("child runs");
        assert_eq!(output.status.signal(), Some(libc::SIGBUS), "{output:?}");
        assert!(!String::from_utf8_lossy(&output.stdout).contains("survived"));
    }
}

//! Host memory faulted in ahead of its pinning, on a few threads.
//!
//! The first swap-out of a range pins host memory nobody has touched: the
//! kernel must find and zero every page as the driver registers it, on the
//! one thread that registers, and that, not the copy, sets the pace
//! (about 2.9 s for 8 GiB on an H200, against 0.2 s to register the same
//! memory already faulted in). Here the spans still to be pinned are
//! faulted in by several threads at once, in the order the swap pins them,
//! while it pins and copies those before: each span is waited for just
//! before it is pinned ([`Faulting::wait`]).
//!
//! A span that cannot be faulted in here is left to the driver, which
//! faults it in as it pins it (as without this module): the threads only
//! ever make a swap sooner.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::{Scope, Thread};
use std::time::Duration;

/// The most threads that fault memory in at once: the kernel's zeroing
/// of pages scales with them until the host's memory bandwidth is spent.
const MAX_THREADS: usize = 8;

/// How long a waiting swap sleeps between looks, unless woken sooner.
const WAIT_STEP: Duration = Duration::from_millis(1);

/// The smallest page the kernel maps: touching one byte of each faults
/// all of a span in where `MADV_POPULATE_WRITE` is not known.
const PAGE: usize = 4096;

/// Part of a host buffer, not pinned yet, that holds nothing: its address
/// and length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub address: usize,
    pub len: usize,
}

/// Spans being faulted in by worker threads, taken in order.
pub(crate) struct Faulting<'a> {
    spans: &'a [Span],
    /// The index of the next span a worker takes.
    next: AtomicUsize,
    done: Box<[AtomicBool]>,
    stop: AtomicBool,
    /// Whether any worker runs: without one, [`Self::wait`] never waits.
    started: AtomicBool,
    waiter: Thread,
}

impl<'a> Faulting<'a> {
    /// Spans to fault in, for the calling thread to wait on.
    pub(crate) fn new(spans: &'a [Span]) -> Self {
        Self {
            spans,
            next: AtomicUsize::new(0),
            done: spans.iter().map(|_| AtomicBool::new(false)).collect(),
            stop: AtomicBool::new(false),
            started: AtomicBool::new(false),
            waiter: std::thread::current(),
        }
    }

    /// Starts the workers in `scope` (at most [`MAX_THREADS`], and no more
    /// than the spans or the CPUs this process may use); returns how many
    /// started. A worker the system will not start is one fewer.
    ///
    /// # Safety
    ///
    /// Every span is memory of a live private mapping of this process that
    /// holds nothing anyone reads before writing it, and stays mapped
    /// until `scope` ends.
    pub(crate) unsafe fn start<'scope>(&'scope self, scope: &'scope Scope<'scope, '_>) -> usize {
        let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let wanted = MAX_THREADS.min(cpus).min(self.spans.len());
        let started = (0..wanted)
            .filter(|n| {
                std::thread::Builder::new()
                    .name(format!("gpushare-fault-{n}"))
                    // SAFETY: forwarded from the caller, for every span.
                    .spawn_scoped(scope, || unsafe { self.work() })
                    .is_ok()
            })
            .count();
        self.started.store(started > 0, Ordering::Release);
        started
    }

    /// Returns once span `index` is faulted in (at once without workers);
    /// the time waited.
    pub(crate) fn wait(&self, index: usize) -> Duration {
        let began = std::time::Instant::now();
        if self.started.load(Ordering::Acquire) {
            while self
                .done
                .get(index)
                .is_some_and(|done| !done.load(Ordering::Acquire))
            {
                std::thread::park_timeout(WAIT_STEP);
            }
        }
        began.elapsed()
    }

    /// Tells the workers to take no more spans; they end with the one
    /// they are on.
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// # Safety
    ///
    /// As [`Self::start`].
    unsafe fn work(&self) {
        while !self.stop.load(Ordering::Acquire) {
            let index = self.next.fetch_add(1, Ordering::AcqRel);
            let Some(span) = self.spans.get(index) else {
                break;
            };
            // SAFETY: forwarded from the caller of `start`.
            unsafe { fault_in(*span) };
            self.done[index].store(true, Ordering::Release);
            self.waiter.unpark();
        }
    }
}

/// Faults `span` in: asks the kernel to (`MADV_POPULATE_WRITE`, Linux
/// 5.14), else writes a zero into each page, which it holds already.
///
/// # Safety
///
/// `span` is memory of a live private mapping of this process that holds
/// nothing anyone reads before writing it.
unsafe fn fault_in(span: Span) {
    // SAFETY: the span lies in a mapping of this process (caller).
    let asked = unsafe {
        libc::madvise(
            span.address as *mut c_void,
            span.len,
            libc::MADV_POPULATE_WRITE,
        )
    };
    if asked == 0 {
        return;
    }
    for page in (span.address..span.address + span.len).step_by(PAGE) {
        // SAFETY: the page lies in a writable mapping of this process that
        // holds nothing yet (caller): a zero is what a new page reads as.
        unsafe { std::ptr::write_volatile(page as *mut u8, 0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A private anonymous mapping of `len` bytes, unmapped on drop.
    struct Mapping {
        address: usize,
        len: usize,
    }

    impl Mapping {
        fn new(len: usize) -> Self {
            // SAFETY: a new private anonymous mapping.
            let address = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(address, libc::MAP_FAILED);
            Self {
                address: address as usize,
                len,
            }
        }

        /// How many of its pages are in memory (`mincore`).
        fn resident_pages(&self) -> usize {
            let mut pages = vec![0u8; self.len.div_ceil(PAGE)];
            // SAFETY: the mapping is live; one byte per page out.
            let rc =
                unsafe { libc::mincore(self.address as *mut c_void, self.len, pages.as_mut_ptr()) };
            assert_eq!(rc, 0);
            pages.iter().filter(|&&p| p & 1 == 1).count()
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: the mapping `new` made, unmapped once.
            unsafe { libc::munmap(self.address as *mut c_void, self.len) };
        }
    }

    #[test]
    fn every_span_is_in_memory_once_waited_for_and_the_rest_untouched() {
        const PAGES: usize = 64;
        let mapping = Mapping::new(PAGES * PAGE);
        assert_eq!(mapping.resident_pages(), 0, "nothing touched yet");
        // Four spans of eight pages in the first half; the second half is
        // no span's.
        let spans: Vec<Span> = (0..4)
            .map(|i| Span {
                address: mapping.address + i * 8 * PAGE,
                len: 8 * PAGE,
            })
            .collect();
        let faulting = Faulting::new(&spans);
        std::thread::scope(|scope| {
            // SAFETY: the spans lie in `mapping`, which holds nothing and
            // outlives the scope.
            let workers = unsafe { faulting.start(scope) };
            assert!(workers >= 1);
            for index in 0..spans.len() {
                faulting.wait(index);
                assert!(faulting.done[index].load(Ordering::Acquire));
            }
        });
        assert_eq!(mapping.resident_pages(), PAGES / 2);
    }

    #[test]
    fn stopped_workers_take_no_more_spans_and_without_workers_nothing_waits() {
        let mapping = Mapping::new(16 * PAGE);
        let spans: Vec<Span> = (0..16)
            .map(|i| Span {
                address: mapping.address + i * PAGE,
                len: PAGE,
            })
            .collect();
        let faulting = Faulting::new(&spans);
        faulting.stop();
        std::thread::scope(|scope| {
            // SAFETY: as above.
            unsafe { faulting.start(scope) };
        });
        assert_eq!(mapping.resident_pages(), 0, "stopped before any span");

        // Never started: a wait returns (it would hang otherwise) and the
        // span is left to the driver.
        let idle = Faulting::new(&spans);
        idle.wait(3);
        assert!(!idle.done[3].load(Ordering::Acquire));
        assert_eq!(mapping.resident_pages(), 0);
    }
}

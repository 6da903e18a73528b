//! The sampler's shared state: measured launches waiting for the GPU, the
//! spare events their brackets reuse, the pace of first measurements, and
//! how far the GPU runs behind the pod's launches.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crossbeam_queue::ArrayQueue;

use gpushare_utils::bucket::monotonic_ns;

use super::sample::Sample;
use crate::driver::Timing;
use crate::metering::Charge;
use crate::sys::CUevent;

/// Samples waiting for the GPU beyond this many are not taken.
const MAX_PENDING_SAMPLES: usize = 256;
/// Spare events kept for reuse.
const SPARE_EVENTS: usize = 2 * MAX_PENDING_SAMPLES;
/// At most one measurement a function's fit wants (its first, its first
/// at a second grid size) is taken this often.
const FIRST_SAMPLE_INTERVAL_NS: u64 = 1_000_000;

/// Measured launches on their way to the monitor, and the events they use.
pub(super) struct Sampler {
    samples: ArrayQueue<Sample>,
    /// Spare events (context, event), reused by later samples.
    events: ArrayQueue<(usize, usize)>,
    /// A launching thread reads samples, where no monitor runs.
    reading_here: AtomicBool,
    /// When a new function's first launch was last measured.
    first_sampled_at_ns: AtomicU64,
    /// When the launch of the oldest measurement still running was made; 0
    /// when none runs or it holds launches no more.
    backlog_since_ns: AtomicU64,
}

/// A launching thread's turn at reading samples; the turn ends on drop.
pub(super) struct ReadingHere<'a>(&'a AtomicBool);

impl Drop for ReadingHere<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Default for Sampler {
    fn default() -> Self {
        Self {
            samples: ArrayQueue::new(MAX_PENDING_SAMPLES),
            events: ArrayQueue::new(SPARE_EVENTS),
            reading_here: AtomicBool::new(false),
            first_sampled_at_ns: AtomicU64::new(0),
            backlog_since_ns: AtomicU64::new(0),
        }
    }
}

impl Sampler {
    /// No room for another sample.
    pub(super) fn is_full(&self) -> bool {
        self.samples.is_full()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.samples.len()
    }

    /// The oldest sample waiting.
    pub(super) fn pop(&self) -> Option<Sample> {
        self.samples.pop()
    }

    /// Queues `sample` to be read; when the queue is full it is given up,
    /// its events kept for reuse, and its charge handed back.
    pub(super) fn queue(&self, timing: &Timing, sample: Sample) -> Result<(), Charge> {
        let Err(sample) = self.samples.push(sample) else {
            return Ok(());
        };
        self.recycle(timing, sample.context, sample.start);
        self.recycle(timing, sample.context, sample.end);
        Err(sample.charge)
    }

    /// An event of `context`: a spare one, or a new one (the current context
    /// is the stream's on the launching thread).
    pub(super) fn event(&self, timing: &Timing, context: usize) -> Option<CUevent> {
        if let Some((owner, event)) = self.events.pop() {
            if owner == context {
                return Some(event as CUevent);
            }
            self.recycle(timing, owner, event as CUevent);
        }
        timing.create_event()
    }

    /// Keeps `event` of `context` for reuse, or destroys it when enough are kept.
    pub(super) fn recycle(&self, timing: &Timing, context: usize, event: CUevent) {
        if self.events.push((context, event as usize)).is_err() {
            timing.destroy(event);
        }
    }

    /// Whether a launch whose measurement a fit wants (a new function's
    /// first, or its first at a second grid size) may be measured now (at most
    /// one every [`FIRST_SAMPLE_INTERVAL_NS`]: a program that makes new
    /// functions all the time, JIT per shape, must not sample every launch).
    #[cold]
    #[inline(never)]
    pub(super) fn may_sample_first(&self) -> bool {
        let now = monotonic_ns();
        let last = self.first_sampled_at_ns.load(Ordering::Relaxed);
        now.saturating_sub(last) >= FIRST_SAMPLE_INTERVAL_NS
            && self
                .first_sampled_at_ns
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// The calling thread's turn at reading samples, unless another
    /// thread's is under way.
    pub(super) fn read_here(&self) -> Option<ReadingHere<'_>> {
        (!self.reading_here.swap(true, Ordering::Acquire))
            .then_some(ReadingHere(&self.reading_here))
    }

    /// When the launch of the oldest measurement still running was made; 0
    /// when none holds launches.
    #[inline]
    pub(super) fn backlog_since(&self) -> u64 {
        self.backlog_since_ns.load(Ordering::Relaxed)
    }

    /// The monitor waits for the measurement of a launch made at `since`.
    pub(super) fn backlog_from(&self, since: u64) {
        self.backlog_since_ns.store(since.max(1), Ordering::Relaxed);
    }

    /// The monitor waits for no measurement.
    pub(super) fn backlog_cleared(&self) {
        self.backlog_since_ns.store(0, Ordering::Relaxed);
    }

    /// Stops holding launches for the measurement running since `since`,
    /// unless the monitor moved on already.
    pub(super) fn release_backlog(&self, since: u64) {
        self.backlog_since_ns
            .compare_exchange(since, 0, Ordering::Relaxed, Ordering::Relaxed)
            .ok();
    }
}

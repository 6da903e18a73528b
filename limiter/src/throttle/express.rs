//! The express door: a thread's next launch of the kernel it launched last,
//! admitted from the thread's own state alone.
//!
//! Why: a host-bound loop (a launch every ~20 µs, the application's work in
//! between) runs the launch path cold, and there its cost is the cache lines
//! it touches, not its instructions: the entry static, the limiter, the
//! throttle's fields, the device and budget, the class, the activity stamp,
//! the cadence, and ~6 KB of admission code, each line a miss. Once a full
//! admission found that nothing but the price can change for a while (a
//! single-device pod without classes, far from its limit, the thread paying
//! from its lease, the function measured, no sample due), it opens the door
//! for the same function, block size, shared memory and stream: a launch that
//! matches is priced by the cost model at its grid's waves (the function's
//! price read live), paid from the lease, and runs, touching the door, the
//! lease, the function's cost-model entry and the coarse clock.
//!
//! What stays exact: every launch is priced and charged as on the full path
//! (the cost model books it for settlement; the lease, bought in the bucket,
//! pays it). What the full path would do otherwise is bounded in time by the
//! door's deadline, which is the earliest of the next activity stamp, the
//! next look for a latency pod, the cadence's backstop and [`SPAN_NS`] (the
//! hold of a backlogged GPU starts at most that late), and in launches by
//! the cadence: the door closes before the launch due to be measured, and
//! the launches it let through are counted into the cadence at the next full
//! admission. A lease that runs out, a launch of another kernel or stream, a
//! failed launch's refund all go the full way.

use gpushare_utils::bucket::ComputeBucket;
use gpushare_utils::clock::monotonic_coarse_ns;
use gpushare_utils::thread_local::ZeroInit;

use super::{Throttle, Work, lease};
use crate::driver::Timing;
use crate::metering::LaunchKey;
use crate::sys::{CU_STREAM_PER_THREAD, CUresult, CUstream};
use crate::waves::waves_of;

/// Longest a door stays open.
pub(super) const SPAN_NS: u64 = 2_000_000;
/// Most launches a door lets through before a full admission.
pub(super) const MAX_LAUNCHES: u64 = 256;

/// What the door admits, and until when.
#[derive(Clone, Copy)]
pub(super) struct Door {
    /// `None`: closed.
    throttle: Option<&'static Throttle>,
    timing: Option<&'static Timing>,
    bucket: Option<ComputeBucket>,
    /// The kernel's function, or the graph's exec.
    work: usize,
    graph: bool,
    threads: u32,
    shared_bytes: u32,
    /// Blocks in one wave of the function (kernels).
    per_wave: u64,
    /// The stream as the launch API took it.
    stream: usize,
    per_thread: bool,
    /// Launches it may still let through.
    left: u64,
    /// Launches it let through since the last full admission.
    passed: u64,
    /// Coarse-clock deadline.
    until_ns: u64,
}

// SAFETY: all zero is a closed door: `None` references (their null niche;
// the bucket's only niches are its references), integers and `false`.
unsafe impl ZeroInit for Door {}

gpushare_utils::initial_exec_thread_local! {
    /// This thread's door (initial-exec: read on every launch).
    static DOOR: Door;
}

/// What the full admission that opens a door knows.
pub(super) struct Opening {
    pub(super) throttle: &'static Throttle,
    pub(super) timing: Option<&'static Timing>,
    pub(super) bucket: ComputeBucket,
    pub(super) work: Work,
    /// Blocks in one wave of the kernel's function (0 for a graph).
    pub(super) per_wave: u64,
    pub(super) stream: CUstream,
    pub(super) per_thread: bool,
    pub(super) launches: u64,
    pub(super) until_ns: u64,
}

/// Opens this thread's door as `opening` says (closes it if it lets no
/// launch through).
pub(super) fn open(opening: Opening) {
    let (work, graph, threads, shared_bytes) = match opening.work {
        Work::Kernel(grid) => (grid.function, false, grid.threads, grid.shared_bytes),
        Work::Graph(exec) => (exec, true, 0, 0),
    };
    let door = Door {
        throttle: Some(opening.throttle),
        timing: opening.timing,
        bucket: Some(opening.bucket),
        work,
        graph,
        threads,
        shared_bytes,
        per_wave: opening.per_wave,
        stream: opening.stream as usize,
        per_thread: opening.per_thread,
        left: opening.launches.min(MAX_LAUNCHES),
        passed: 0,
        until_ns: opening.until_ns,
    };
    if door.left == 0 || (!graph && door.per_wave == 0) {
        close();
    } else {
        DOOR.with(|cell| cell.set(door));
    }
}

/// Closes this thread's door; returns how many launches it let through
/// since the last full admission.
pub(super) fn close() -> u64 {
    DOOR.with(|cell| cell.replace(gpushare_utils::thread_local::zeroed()).passed)
}

/// Runs `launch` of `work` on `stream` through this thread's door, if it
/// is open to it; gives `launch` back otherwise.
#[inline]
pub(super) fn enter<F: FnOnce() -> CUresult>(
    work: Work,
    stream: CUstream,
    per_thread: bool,
    launch: F,
) -> std::result::Result<CUresult, F> {
    let mut door = DOOR.with(|cell| cell.get());
    let Some((throttle, bucket)) = door.throttle.zip(door.bucket) else {
        return Err(launch);
    };
    if door.left == 0 || door.stream != stream as usize || door.per_thread != per_thread {
        return Err(launch);
    }
    let (key, waves) = match work {
        Work::Kernel(grid)
            if !door.graph
                && grid.function == door.work
                && grid.threads == door.threads
                && grid.shared_bytes == door.shared_bytes =>
        {
            (
                LaunchKey::kernel(grid.function),
                waves_of(grid.blocks, door.per_wave),
            )
        }
        Work::Graph(exec) if door.graph && exec == door.work => (LaunchKey::graph(exec), 1),
        _ => return Err(launch),
    };
    if monotonic_coarse_ns() >= door.until_ns {
        return Err(launch);
    }
    let stream = if per_thread && stream.is_null() {
        CU_STREAM_PER_THREAD
    } else {
        stream
    };
    if door
        .timing
        .is_some_and(|timing| timing.is_capturing(stream))
    {
        return Err(launch);
    }
    let charge = throttle.model.charge(key, waves);
    if charge.unmeasured || !lease::pay(&bucket, charge.ns) {
        throttle.model.refund(&charge);
        if charge.unmeasured {
            throttle.model.abandon(&charge);
        }
        return Err(launch);
    }
    door.left -= 1;
    door.passed += 1;
    DOOR.with(|cell| cell.set(door));
    let result = launch();
    if !result.is_success() {
        // Nothing runs: give the charge back.
        bucket.correct(-(charge.ns as i64));
        throttle.model.refund(&charge);
    }
    Ok(result)
}

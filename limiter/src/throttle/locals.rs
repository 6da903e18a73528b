//! This thread's state on the launch path, in initial-exec thread-locals
//! (read on every launch at a fixed offset from the thread pointer): its
//! count towards its next sample, its charges not yet added to the cost
//! model, and the run of its launches being measured.

use std::cell::Cell;

use super::cadence::Cadence;
use super::run::Run;
use crate::metering::Batch;

gpushare_hook::initial_exec_thread_local! {
    /// This thread's count towards its next sample (initial-exec: read on
    /// every launch).
    static CADENCE: Cadence;
}

gpushare_hook::initial_exec_thread_local! {
    /// This thread's charges not yet added to their entry of the cost model.
    static BATCH: Batch;
}

gpushare_hook::initial_exec_thread_local! {
    /// The run of this thread's launches being measured, if any.
    static RUN: Run;
}

/// Runs `f` on the value in a thread's `cell`, then stores it back.
#[inline]
fn update<T: Copy, R>(cell: &Cell<T>, f: impl FnOnce(&mut T) -> R) -> R {
    let mut value = cell.get();
    let result = f(&mut value);
    cell.set(value);
    result
}

/// Runs `f` on this thread's cadence.
#[inline]
pub(super) fn with_cadence<R>(f: impl FnOnce(&mut Cadence) -> R) -> R {
    CADENCE.with(|cell| update(cell, f))
}

/// Runs `f` on this thread's batch of charges.
#[inline]
pub(super) fn with_batch<R>(f: impl FnOnce(&mut Batch) -> R) -> R {
    BATCH.with(|cell| update(cell, f))
}

/// Runs `f` on this thread's run.
#[inline]
pub(super) fn with_run<R>(f: impl FnOnce(&mut Run) -> R) -> R {
    RUN.with(|cell| update(cell, f))
}

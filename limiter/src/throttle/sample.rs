//! A measured launch's records: its bracket while the launch is made (held
//! in a thread-local), then the sample the monitor reads once the GPU ran it.

use std::cell::Cell;

use super::run::Tally;
use crate::metering::Charge;
use crate::sys::CUevent;

/// One launch bracketed by events, or a run of launches ([`super::run`]).
pub(super) struct Sample {
    pub(super) context: usize,
    pub(super) start: CUevent,
    pub(super) end: CUevent,
    pub(super) graph: bool,
    pub(super) device: usize,
    /// The launch's charge; a run's sample has none (the default).
    pub(super) charge: Charge,
    /// `Some` for a run: what its launches were charged.
    pub(super) run: Option<Tally>,
    /// `Some` when the stream had no work queued as the bracket began: the
    /// bracket then also holds this host time between its start and the
    /// launch call (long if the thread was preempted), and the launch latency.
    pub(super) idle_gap_ns: Option<u64>,
    /// When the launch was made (host clock).
    pub(super) submitted_at: u64,
    /// How long the launch call took (host clock).
    pub(super) call_ns: u64,
    /// Taken at the relaxed cadence: the limit did not bind.
    pub(super) relaxed: bool,
}

// SAFETY: the only fields that are not `Send` are the two events, plain
// driver handles that any thread may query, time or destroy; a sample is
// moved to the monitor thread, never shared.
unsafe impl Send for Sample {}

/// A measured launch's bracket: its start recorded, its end event ready to
/// record the moment the launch returns.
pub(super) struct Bracket {
    pub(super) context: usize,
    pub(super) start: CUevent,
    pub(super) end: CUevent,
    /// The stream had no work queued.
    pub(super) idle: bool,
    pub(super) recorded_at: u64,
    /// When the launch was submitted (set just before the call).
    pub(super) submitted_at: u64,
    /// How long the launch call took, once it returned.
    pub(super) call_ns: u64,
    /// The end is recorded, once the launch returned.
    pub(super) closed: bool,
}

thread_local! {
    /// The bracket of the measured launch this thread is making, from its
    /// admission until the driver returned it: a thread makes one launch at
    /// a time, and most launches are not measured.
    static IN_FLIGHT: Cell<Option<Bracket>> = const { Cell::new(None) };
}

/// Holds the bracket of the launch this thread is about to make.
pub(super) fn set_in_flight(bracket: Bracket) {
    IN_FLIGHT.set(Some(bracket));
}

/// The bracket held for the launch this thread just made.
pub(super) fn take_in_flight() -> Option<Bracket> {
    IN_FLIGHT.take()
}

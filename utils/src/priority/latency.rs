//! What a latency process writes in its device's line and what a batch
//! process reads there: latency work stamped, kernels in flight entered
//! and left (a stale count dropped), the next arrival predicted, and batch
//! pods seen waiting.

use std::sync::atomic::Ordering;

use super::{CONTENDED_REFRESH_NS, CONTENDED_WINDOW_NS, FLIGHT_GRACE_NS, LatencyDevice};
use crate::node_table::plausible_stamp;

impl LatencyDevice {
    /// Marks latency work at `now_ns`: never moves the stamp back, except
    /// from the future beyond [`FUTURE_SLACK_NS`] (garbage, which would
    /// otherwise keep every later stamp out).
    ///
    /// [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS
    pub fn stamp_active(&self, now_ns: u64) {
        let stamped = self.active_at_ns.load(Ordering::Relaxed);
        if stamped < now_ns || !plausible_stamp(stamped, now_ns) {
            self.active_at_ns.store(now_ns, Ordering::Release);
        }
    }

    /// One more latency process has work in flight. Counts left by
    /// processes that died in flight are dropped first.
    pub fn enter_flight(&self, now_ns: u64) {
        self.drop_stale_flight(now_ns);
        self.stamp_active(now_ns);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// Drops the in-flight counts when no process refreshed the line for
    /// [`FLIGHT_GRACE_NS`]: a process counted in flight refreshes it every
    /// few µs, so these counts are of processes that died in flight.
    /// Otherwise a live latency pod's stamps would make them count again
    /// after each of its requests, holding batch pods for [`STALL_NS`](super::STALL_NS) each
    /// time. Called by latency processes not in flight on the device; true
    /// if it dropped any.
    pub fn drop_stale_flight(&self, now_ns: u64) -> bool {
        let counted = self.in_flight.load(Ordering::Acquire);
        let active_at = self.active_at_ns.load(Ordering::Acquire);
        // A stamp from the future is garbage: nobody refreshed the line.
        let quiet = if plausible_stamp(active_at, now_ns) {
            now_ns.saturating_sub(active_at)
        } else {
            u64::MAX
        };
        // A process entering meanwhile changes the count: the exchange fails.
        counted != 0
            && quiet > FLIGHT_GRACE_NS
            && self
                .in_flight
                .compare_exchange(counted, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    /// Publishes the prediction of the next request: at `next_ns`, with
    /// `period_ns` (0: none).
    pub fn publish_prediction(&self, next_ns: u64, period_ns: u64) {
        // The period first: a reader that sees the new arrival with the old
        // period still has a plausible pair.
        self.period_ns.store(period_ns, Ordering::Relaxed);
        self.next_arrival_ns.store(next_ns, Ordering::Release);
    }

    /// A batch pod whose launches latency pods hold launched at `now_ns`:
    /// stored only when the stamp is [`CONTENDED_REFRESH_NS`] old (or from
    /// the future beyond [`FUTURE_SLACK_NS`]: garbage).
    ///
    /// [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS
    pub fn stamp_contended(&self, now_ns: u64) {
        let stamped = self.contended_at_ns.load(Ordering::Relaxed);
        if now_ns.saturating_sub(stamped) >= CONTENDED_REFRESH_NS
            || !plausible_stamp(stamped, now_ns)
        {
            self.contended_at_ns.store(now_ns, Ordering::Relaxed);
        }
    }

    /// Whether a batch pod that latency pods hold launched on the device
    /// within [`CONTENDED_WINDOW_NS`] of `now_ns` (a stamp from the future
    /// beyond [`FUTURE_SLACK_NS`] is none).
    ///
    /// [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS
    pub fn contended(&self, now_ns: u64) -> bool {
        let stamped = self.contended_at_ns.load(Ordering::Relaxed);
        stamped != 0
            && plausible_stamp(stamped, now_ns)
            && now_ns.saturating_sub(stamped) < CONTENDED_WINDOW_NS
    }

    /// One latency process has no more work in flight (never below 0).
    pub fn leave_flight(&self, now_ns: u64) {
        self.stamp_active(now_ns);
        let _ = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

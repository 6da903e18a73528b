//! A batch pod's launches next to a latency pod: keep the thread's launches
//! in flight bounded, learn how long they take, and hold them while the
//! latency pod is active or its next request is due.

use gpushare_utils::bucket::monotonic_ns;
use gpushare_utils::pod::PodClass;
use gpushare_utils::priority::NodePriority;

use super::gate::{Gate, STARVATION_NS, gate};

use super::{Priority, THREAD, Ticket, recorded, wait_until};
use crate::context::Context;
use crate::driver::Timing;
use crate::sys::{CUevent, CUstream};

/// Longest a batch launch waits for its own earlier one (its stream may wait
/// on something this thread has yet to do).
const IN_FLIGHT_WAIT_MAX_NS: u64 = 50_000_000;

impl Priority {
    /// A batch launch on `device` at `now`: first its pod's turn, where the
    /// GPU takes turns; then free with no latency pod there; else it waits
    /// for its window, and while the gate holds.
    pub(super) fn before_batch(
        &self,
        ctx: &'static Context,
        device: usize,
        timing: Option<&Timing>,
        now: u64,
    ) -> Ticket {
        // A process that sets turns itself makes the table if none is there.
        let Some(table) = self.table(now, self.tuning.turn_us > 0) else {
            return Ticket::Free;
        };
        let now = self.take_turn(ctx, table, device, now);
        if let Some(line) = table.device(device) {
            line.stamp_contended(now);
        }
        let estimate = || THREAD.with(|thread| thread.spans.estimate());
        let mut kernel_ns = estimate();
        if gate(
            table.latency(device, now),
            now,
            self.tuning.hold_ns,
            kernel_ns,
        ) == Gate::Free
        {
            return Ticket::Free;
        }
        let mut since = now;
        if let Some(timing) = timing {
            self.wait_in_flight(timing);
            // The latency pod may have become active, or its request due,
            // while this thread waited for its previous launch (whose time
            // the wait may have learnt).
            since = monotonic_ns();
            kernel_ns = estimate();
        }
        if matches!(
            gate(
                table.latency(device, since),
                since,
                self.tuning.hold_ns,
                kernel_ns
            ),
            Gate::Hold | Gate::Predicted
        ) {
            self.hold(table, device, since, kernel_ns);
        }
        Ticket::Bounded
    }

    /// After a bounded batch launch: records its event in the ring.
    pub(super) fn after_batch(&self, timing: &Timing, stream: CUstream) {
        THREAD.with(|thread| {
            let head = thread.head.get() % self.tuning.window;
            let slot = &thread.ring[head];
            if let Some(event) = recorded(timing, slot.get(), stream) {
                slot.set(event);
                thread.launched_at[head].set(monotonic_ns());
                thread.head.set(head + 1);
            }
        });
    }

    /// Waits until this thread has fewer than the window's launches in
    /// flight: the oldest of its ring is done. A wait that saw it pending
    /// learns how long that launch took (launch to completion, seen within a
    /// yield of the spin); one found done at once says nothing.
    fn wait_in_flight(&self, timing: &Timing) {
        THREAD.with(|thread| {
            let oldest = thread.head.get() % self.tuning.window;
            let event = thread.ring[oldest].get();
            if event == 0 {
                return;
            }
            let (mut pending, mut done) = (false, false);
            wait_until(monotonic_ns().saturating_add(IN_FLIGHT_WAIT_MAX_NS), || {
                done = !matches!(timing.query(event as CUevent), Ok(false));
                pending |= !done;
                done
            });
            if pending && done {
                let took = monotonic_ns().saturating_sub(thread.launched_at[oldest].get());
                thread.spans.add(took);
            }
        });
    }

    /// Holds a batch launch whose kernels take `kernel_ns` while a latency
    /// pod on `device` is active or about to be (at most [`STARVATION_NS`]);
    /// counts the time held.
    fn hold(&self, table: &NodePriority, device: usize, since: u64, kernel_ns: u64) {
        let hold_ns = self.tuning.hold_ns;
        wait_until(since.saturating_add(STARVATION_NS), || {
            let now = monotonic_ns();
            !matches!(
                gate(table.latency(device, now), now, hold_ns, kernel_ns),
                Gate::Hold | Gate::Predicted
            )
        });
        let held = monotonic_ns().saturating_sub(since);
        if let Some(slot) = self.slot(table, device, PodClass::Batch) {
            slot.add_hold(held);
        }
        tracing::trace!(device, held, "batch launch held");
    }
}

//! Holding a launch: until its pod's bucket has budget again
//! (trap-and-wait, asking the hypervisor where one sets the limits and does
//! not count the pod as wanting the GPU yet), until its new function's first
//! measurement comes, and while the GPU runs too far behind the pod's
//! launches. All of it out of line: the launch path only branches here.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpushare_utils::bucket::{Admission, ComputeBucket, monotonic_ns};

use super::Throttle;
use super::summary::Held;
use crate::context::Context;
use crate::driver::Timing;
use crate::metering::Charge;

/// A launch that waited for budget resumes once the bucket holds this many
/// of its price beyond it (at most [`RESUME_MAX_NS`]): see
/// [`ComputeBucket::admit_above`].
const RESUME_LAUNCHES: u64 = 8;
const RESUME_MAX_NS: u64 = 500_000;
/// Longest a launch waits for its function's first measurement (beyond
/// [`UNMEASURED_AHEAD`](crate::metering::UNMEASURED_AHEAD) launches):
/// bounded, in case the stream waits on something this thread has yet to do.
const FIRST_MEASUREMENT_WAIT_NS: u64 = 5_000_000;
/// How often such a launch looks whether the measurement came.
const FIRST_MEASUREMENT_POLL: Duration = Duration::from_micros(20);
/// A measurement still running this long after its launch means the GPU
/// runs this far behind the pod's launches: the pod's launches are held until
/// it completes, so that work priced before any measurement could correct its
/// price never piles up beyond this (the bounded queue of in-flight work).
const MAX_BACKLOG_NS: u64 = 10_000_000;
/// Longest a launch is held for one backlogged measurement (its stream may
/// wait on something this thread has yet to do); that measurement then
/// holds no more launches.
const BACKLOG_HOLD_MAX_NS: u64 = 20_000_000;
/// How often a held launch looks again.
const BACKLOG_POLL: Duration = Duration::from_micros(50);
/// After the hypervisor grants nothing, a waiting thread asks again after
/// this long at the earliest, doubling up to [`ADMISSION_BACKOFF_MAX_NS`];
/// meanwhile the local bucket's refill decides.
const ADMISSION_BACKOFF_NS: u64 = 100_000_000;
const ADMISSION_BACKOFF_MAX_NS: u64 = 1_600_000_000;

thread_local! {
    /// When this thread may ask the hypervisor for admission again, and the
    /// current backoff.
    static NEXT_ADMISSION_NS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
}

impl Throttle {
    /// Holds a launch of a function whose first measurement is in flight,
    /// so that an unmeasured function cannot queue an unbounded burst.
    #[cold]
    #[inline(never)]
    pub(super) fn wait_for_measurement(
        &self,
        ctx: &'static Context,
        timing: Option<&Timing>,
        charge: &Charge,
    ) {
        let start = monotonic_ns();
        let deadline = start.saturating_add(FIRST_MEASUREMENT_WAIT_NS);
        while self.model.awaiting_measurement(charge) && monotonic_ns() < deadline {
            std::thread::sleep(FIRST_MEASUREMENT_POLL);
            if let Some(timing) = timing {
                self.read_samples_here(ctx, timing);
            }
        }
        Held::add(&self.held.measurement_ns, start);
    }

    /// Holds a launch while the GPU runs more than [`MAX_BACKLOG_NS`] behind
    /// the pod's launches (the caller saw a measurement running).
    #[cold]
    #[inline(never)]
    pub(super) fn hold_while_backlogged(&self) {
        let since = self.sampler.backlog_since();
        if since == 0 {
            return;
        }
        let now = monotonic_ns();
        if now.saturating_sub(since) < MAX_BACKLOG_NS {
            return;
        }
        let deadline = now.saturating_add(BACKLOG_HOLD_MAX_NS);
        while self.sampler.backlog_since() == since {
            if monotonic_ns() >= deadline {
                // Stuck behind something else: stop holding for it.
                self.sampler.release_backlog(since);
                break;
            }
            std::thread::sleep(BACKLOG_POLL);
        }
        Held::add(&self.held.backlog_ns, now);
    }

    /// Charges `cost` once the bucket allows it, after an admission at
    /// `start` found no budget; returns the time it did.
    #[cold]
    #[inline(never)]
    pub(super) fn wait_for_budget(
        &self,
        ctx: &'static Context,
        bucket: &ComputeBucket,
        cost: u64,
        device: usize,
        start: u64,
    ) -> u64 {
        bucket.waiting.fetch_add(1, Ordering::Relaxed);
        // Where the GPU takes turns, the next pod uses this one's.
        self.priority.pass_turn(device);
        let floor = cost.saturating_mul(RESUME_LAUNCHES).min(RESUME_MAX_NS) as i64;
        let mut now = start;
        loop {
            match bucket.admit_above(now, cost, floor) {
                Admission::Pass => break,
                Admission::Wait(wait) => {
                    // Trap: under a hypervisor, ask it for admission while
                    // the bucket is empty (it counts the pod in and answers
                    // with what the bucket holds, waiting at most 1 ms for
                    // some: the rest up to the floor refills here); while
                    // it grants nothing (or does not answer), the local
                    // bucket's refill decides, and it is asked less often.
                    let empty = bucket.tokens_ns.load(Ordering::Relaxed) <= 0;
                    if !(empty && self.hypervisor_granted(ctx, device, cost, now)) {
                        std::thread::sleep(wait);
                    }
                    now = monotonic_ns();
                }
            }
        }
        bucket.waiting.fetch_sub(1, Ordering::Relaxed);
        Held::add(&self.held.budget_ns, start);
        tracing::trace!(
            start,
            cost,
            waited = now.saturating_sub(start),
            "waited for budget"
        );
        now
    }

    /// Asks the hypervisor to admit `cost` on `device`, unless it already
    /// counts the pod as wanting the device (its rates count the pod in, and
    /// the local refill is all it would wait for) or this thread was refused
    /// recently; true when it granted budget.
    fn hypervisor_granted(
        &self,
        ctx: &'static Context,
        device: usize,
        cost: u64,
        now: u64,
    ) -> bool {
        let Some(link) = ctx.hypervisor() else {
            return false;
        };
        let (next, backoff) = NEXT_ADMISSION_NS.with(Cell::get);
        if now < next {
            return false;
        }
        let uuid = ctx.device_uuid(device);
        let counted = ctx
            .hypervisor_limits()
            .zip(uuid.as_deref())
            .is_some_and(|(limits, uuid)| limits.demand_seen(uuid));
        if counted {
            return false;
        }
        let granted = uuid.is_some_and(|uuid| link.admission(&uuid, cost).is_ok_and(|ns| ns > 0));
        let state = if granted {
            (0, 0)
        } else {
            let backoff = (backoff * 2).clamp(ADMISSION_BACKOFF_NS, ADMISSION_BACKOFF_MAX_NS);
            (monotonic_ns().saturating_add(backoff), backoff)
        };
        NEXT_ADMISSION_NS.with(|cell| cell.set(state));
        granted
    }
}

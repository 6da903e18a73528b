//! The latency pod's watcher thread: keeps its device's "latency work in
//! flight" stamp fresh while its tracked launches run, times queueing probes,
//! stamps the heartbeat, drops in-flight counts of dead processes; and counts
//! the process out of flight at exit.

use std::sync::atomic::Ordering;
use std::time::Duration;

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::bucket::monotonic_ns;
use gpushare_utils::pod::PodClass;
use gpushare_utils::priority::{HEARTBEAT_NS, NodePriority};

use super::{MAX_PROBES, Priority, Probe, TRACKED, WATCH_POLL};
use crate::context::{AtExit, Context, register_at_exit};
use crate::driver::Timing;
use crate::sys::CUevent;

/// With a request predicted, the idle watcher polls from this long before
/// it: the request's first launch then finds it awake, and needs no wake-up.
const WAKE_LEAD_NS: u64 = 100_000;

impl Priority {
    /// Starts the watcher thread, once (at the first latency launch).
    pub(super) fn start_watcher(&'static self, ctx: &'static Context) {
        self.watcher.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("cuda-limiter-priority".into())
                .spawn(move || self.watch(ctx));
            match spawned {
                Ok(handle) => {
                    self.watcher_thread.set(handle.thread().clone()).ok();
                    if !register_at_exit(self) {
                        tracing::warn!("cannot register the exit handler; batch pods may wait up to 50 ms after this process exits");
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "cannot start the priority watcher; only launches mark latency work");
                }
            }
        });
    }

    /// The watcher: keeps the active stamp fresh while latency work is in
    /// flight, times queueing probes, stamps the heartbeat.
    fn watch(&'static self, ctx: &'static Context) {
        // Its own driver calls never go through the detours.
        let _guard = gpushare_hook::DetourGuard::enter_always();
        // SAFETY: sets this thread's timer slack (1 µs), nothing else.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000u64) };
        let (Some(timing), Some(table)) = (
            ctx.driver().and_then(|driver| driver.timing.as_ref()),
            self.table.get(),
        ) else {
            return;
        };
        timing.relax_capture_mode();
        let mut probes: Vec<Probe> = Vec::with_capacity(MAX_PROBES);
        let mut heartbeat_at = 0;
        let mut was_pending = 0u32;
        loop {
            let generation = self.generation.load(Ordering::SeqCst);
            let now = monotonic_ns();
            let busy = self.stamp_in_flight(timing, table, now, &mut was_pending);
            while let Some(probe) = self.probes.pop() {
                probes.push(probe);
            }
            probes.retain(|probe| match timing.query(probe.event as CUevent) {
                Ok(false) => true,
                done => {
                    if done.is_ok()
                        && let Some(slot) = self.slot(table, probe.device, PodClass::Latency)
                    {
                        slot.add_queue_delay(now.saturating_sub(probe.submitted_at));
                    }
                    timing.destroy(probe.event as CUevent);
                    false
                }
            });
            if now.saturating_sub(heartbeat_at) >= HEARTBEAT_NS / 2 {
                heartbeat_at = now;
                self.heartbeat(table, now);
            }
            let wake_at = self.predicted_wake(table, now);
            if busy || !probes.is_empty() || wake_at.is_some_and(|at| at <= now) {
                std::thread::sleep(WATCH_POLL);
                continue;
            }
            let nap = wake_at.map_or(HEARTBEAT_NS / 2, |at| (at - now).min(HEARTBEAT_NS / 2));
            self.watcher_parked.store(true, Ordering::SeqCst);
            if self.generation.load(Ordering::SeqCst) == generation {
                std::thread::park_timeout(Duration::from_nanos(nap));
            }
            self.watcher_parked.store(false, Ordering::SeqCst);
        }
    }

    /// Stamps the devices whose latency trackers are pending, and counts
    /// this process in or out of flight there; true while any is pending or
    /// its process still counts in flight. `was_pending`: the devices the
    /// previous poll found pending.
    fn stamp_in_flight(
        &self,
        timing: &Timing,
        table: &NodePriority,
        now: u64,
        was_pending: &mut u32,
    ) -> bool {
        let mut pending = 0u32;
        for (event, device) in &TRACKED {
            let handle = event.load(Ordering::Acquire);
            if handle == 0 || handle == usize::MAX {
                continue;
            }
            if timing.query(handle as CUevent) == Ok(false) {
                pending |= 1 << (device.load(Ordering::Relaxed).wrapping_sub(1) % 32);
            }
        }
        let now = monotonic_ns().max(now);
        let mut lingering = false;
        for device in 0..MAX_DEVICES.min(32) {
            let (bit, Some(line)) = (1u32 << device, table.device(device)) else {
                continue;
            };
            if pending & bit != 0 {
                if self.in_flight.fetch_or(bit, Ordering::AcqRel) & bit == 0 {
                    line.enter_flight(now);
                } else {
                    line.stamp_active(now);
                }
                continue;
            }
            if self.in_flight.load(Ordering::Relaxed) & bit == 0 {
                continue;
            }
            // The request goes on while launches come within the hold: a
            // launch that just counted the process in has no tracker yet,
            // and a host gap between two launches of one request is no new
            // request (the start the predictor counts).
            let launched = self.launched_at[device].load(Ordering::Acquire);
            if now.saturating_sub(launched) < self.tuning.hold_ns {
                lingering = true;
            } else if self.in_flight.fetch_and(!bit, Ordering::AcqRel) & bit != 0 {
                // Work just seen done leaves now; after a request whose work
                // was done within the hold, the launch's stamp stands.
                line.leave_flight(if *was_pending & bit != 0 {
                    now
                } else {
                    launched
                });
            }
        }
        *was_pending = pending;
        pending != 0 || lingering
    }

    /// Stamps the heartbeat; where the process is not in flight, drops the
    /// counts of processes that died in flight.
    fn heartbeat(&self, table: &NodePriority, now: u64) {
        let devices = self.latency_devices.load(Ordering::Relaxed);
        let flying = self.in_flight.load(Ordering::Acquire);
        for device in devices_in(devices) {
            if let Some(line) = table.device(device) {
                line.present_at_ns.store(now, Ordering::Release);
                if flying & (1 << device) == 0 && line.drop_stale_flight(now) {
                    tracing::debug!(device, "dropped in-flight counts of dead latency processes");
                }
            }
        }
    }

    /// When the idle watcher should poll again for this process's next
    /// predicted request: [`WAKE_LEAD_NS`] before the earliest prediction on
    /// its devices that is not stale (nor implausible: another process may
    /// have written the line); `None` without one.
    fn predicted_wake(&self, table: &NodePriority, now: u64) -> Option<u64> {
        if !self.tuning.predict {
            return None;
        }
        let devices = self.latency_devices.load(Ordering::Relaxed);
        devices_in(devices)
            .filter_map(|device| {
                let line = table.latency(device, now);
                let (next, period) = (line.next_arrival_ns, line.period_ns);
                (period != 0 && now < next.saturating_add(period / 2))
                    .then(|| next.saturating_sub(WAKE_LEAD_NS))
            })
            .min()
    }
}

/// At a normal exit, counts this process out of flight everywhere, so
/// batch pods go on at once rather than after [`STALL_NS`].
///
/// [`STALL_NS`]: gpushare_utils::priority::STALL_NS
impl AtExit for Priority {
    const WHAT: &'static str = "while leaving the priority table";

    fn at_exit(&'static self) {
        let (Some(table), bits) = (self.table.get(), self.in_flight.swap(0, Ordering::AcqRel))
        else {
            return;
        };
        let now = monotonic_ns();
        for device in devices_in(bits) {
            if let Some(line) = table.device(device) {
                line.leave_flight(now);
            }
        }
    }
}

/// The devices of a per-device bit set (bit `d`: device `d`).
fn devices_in(bits: u32) -> impl Iterator<Item = usize> {
    (0..MAX_DEVICES.min(32)).filter(move |device| bits & (1 << device) != 0)
}

//! A latency pod's launches: stamp the device's line, count the process in
//! flight, start requests (and predict the next), track and probe the work.
//! A co-run MPS client does all this only while a batch pod that waits for
//! it launches on the device (the line's `contended_at_ns`).

use std::sync::atomic::Ordering;

use gpushare_utils::bucket::monotonic_ns;
use gpushare_utils::pod::PodClass;
use gpushare_utils::priority::{LatencyDevice, NodePriority};

use super::{
    Launch, Priority, Probe, QUEUE_SAMPLE_INTERVAL_NS, THREAD, TRACKED, ThreadState, Ticket,
    recorded,
};
use crate::context::Context;
use crate::driver::Timing;
use crate::sys::{CUevent, CUstream};

impl Priority {
    /// A latency launch: stamps its device's line; the first launch with no
    /// work of the process in flight there starts a request.
    pub(super) fn before_latency(
        &'static self,
        ctx: &'static Context,
        launch: Launch<'_>,
    ) -> Ticket {
        let Launch {
            device,
            stream,
            timing,
            now,
        } = launch;
        let Some(table) = self.table(now, true) else {
            return Ticket::Free;
        };
        if self.corun.get().is_some() && !table.contended(device, now) {
            // Co-run with no batch pod that waits for this one: its kernels
            // run beside theirs, and only the heartbeat is read (a batch
            // client that took the whole GPU then keeps its work in flight
            // bounded until it is seen).
            self.be_present(ctx, device);
            return Ticket::Free;
        }
        if let (Some(line), Some(launched_at)) =
            (table.device(device), self.launched_at.get(device))
        {
            // Before the bit: the watcher must not count the process out
            // between this launch and its tracker.
            launched_at.store(now, Ordering::Release);
            let bit = 1 << (device % 32);
            if self.in_flight.load(Ordering::Relaxed) & bit == 0
                && self.in_flight.fetch_or(bit, Ordering::AcqRel) & bit == 0
            {
                line.enter_flight(now);
                self.request_started(line, device, now);
            } else {
                line.stamp_active(now);
            }
            line.launches.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(timing) = timing {
            self.probe_queue(timing, table, device, stream, now);
        }
        self.be_present(ctx, device);
        Ticket::Latency { device }
    }

    /// The watcher stamps this process's heartbeat on `device`'s line.
    fn be_present(&'static self, ctx: &'static Context, device: usize) {
        let bit = 1 << (device % 32);
        if self.latency_devices.load(Ordering::Relaxed) & bit == 0 {
            self.latency_devices.fetch_or(bit, Ordering::Relaxed);
        }
        self.start_watcher(ctx);
    }

    /// A request started on `device` at `now`: publishes the prediction of
    /// the next one (none while the starts are too few or irregular).
    fn request_started(&self, line: &LatencyDevice, device: usize, now: u64) {
        if !self.tuning.predict {
            return;
        }
        let Some(arrivals) = self.arrivals.get(device) else {
            return;
        };
        match arrivals.record(now) {
            Some(prediction) => line.publish_prediction(prediction.next_ns, prediction.period_ns),
            // Withdraw a prediction that no longer holds (one store, only
            // when there is one).
            None if line.period_ns.load(Ordering::Relaxed) != 0 => line.publish_prediction(0, 0),
            None => {}
        }
    }

    /// After a latency launch: re-records the thread's tracker, wakes the
    /// watcher if it is parked.
    pub(super) fn after_latency(&self, timing: &Timing, device: usize, stream: CUstream) {
        THREAD.with(|thread| self.track(timing, thread, device, stream));
        self.generation.fetch_add(1, Ordering::SeqCst);
        if self.watcher_parked.load(Ordering::SeqCst)
            && let Some(watcher) = self.watcher_thread.get()
        {
            watcher.unpark();
        }
    }

    /// Re-records this thread's tracker event after its latency launch.
    fn track(&self, timing: &Timing, thread: &ThreadState, device: usize, stream: CUstream) {
        let (slot, event) = match thread.tracker.get() {
            Some(tracker) => tracker,
            None => {
                let Some(slot) = TRACKED.iter().position(|(event, _)| {
                    event
                        .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                }) else {
                    return; // every slot taken: the launch stamps cover this thread
                };
                (slot, 0)
            }
        };
        let Some(event) = recorded(timing, event, stream) else {
            TRACKED[slot].0.store(0, Ordering::Release);
            thread.tracker.set(None);
            return;
        };
        TRACKED[slot].1.store(device + 1, Ordering::Relaxed);
        TRACKED[slot].0.store(event, Ordering::Release);
        thread.tracker.set(Some((slot, event)));
    }

    /// Records an event before a latency launch, at most every
    /// [`QUEUE_SAMPLE_INTERVAL_NS`] per thread, for the watcher to time.
    fn probe_queue(
        &self,
        timing: &Timing,
        table: &NodePriority,
        device: usize,
        stream: CUstream,
        now: u64,
    ) {
        let due = THREAD.with(|thread| {
            let due = now.saturating_sub(thread.probed_at_ns.get()) >= QUEUE_SAMPLE_INTERVAL_NS;
            if due {
                thread.probed_at_ns.set(now);
            }
            due
        });
        if !due || self.probes.is_full() || self.slot(table, device, PodClass::Latency).is_none() {
            return;
        }
        if let Some(event) = recorded(timing, 0, stream) {
            let probe = Probe {
                event,
                device,
                submitted_at: monotonic_ns(),
            };
            if let Err(probe) = self.probes.push(probe) {
                timing.destroy(probe.event as CUevent);
            }
        }
    }
}

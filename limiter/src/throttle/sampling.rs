//! Measuring launches: event brackets around sampled launches, the launch
//! overheads they hold (calibrated once per context), and the monitor
//! thread that turns completed brackets into prices and corrections.

use std::cell::Cell;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use gpushare_utils::bucket::monotonic_ns;

use super::summary::Held;
use super::{CONTENTION_INTERVAL, MAX_SAMPLED_CALL_NS, POLL_INTERVAL, Throttle};
use crate::context::Context;
use crate::driver::Timing;
use crate::metering::Charge;
use crate::sys::{CUevent, CUresult, CUstream};

/// How long an idle monitor naps while the pod's limit binds: the most a
/// periodic sample then waits to be read (settlement, backlog detection).
const MONITOR_NAP: Duration = Duration::from_millis(1);
/// The monitor naps while it got a sample taken at the binding cadence this
/// recently, else it parks and the next sample wakes it. Samples at the
/// relaxed cadence (the limit does not bind) come every 16 to 128 ms a
/// thread: waking the monitor for each is one system call on the launching
/// thread per sample, where napping would wake it 1,000 times a second on
/// CPUs the application may need (a pod's CPU quota, a process pinned to one
/// CPU).
const NAPPING_FOR_NS: u64 = 100_000_000;

/// The GPU time of a sampled launch out of its event bracket: less what the
/// bracket holds besides the kernel (`overhead`), and less `late`, how late
/// its kernel started for a slow launch call ([`late_ns`]). A kernel no
/// longer than the overhead still costs a quarter of the bracket it would
/// have had without `late`: a price never drops to nothing on an
/// overestimated overhead. Lateness the bracket cannot hold (the host's and
/// the GPU's clocks disagree) is not believed.
fn kernel_ns(bracket: u64, overhead: u64, late: u64) -> u64 {
    let bracket = if late < bracket {
        bracket - late
    } else {
        bracket
    };
    bracket.saturating_sub(overhead).max(bracket / 4)
}

/// How late a kernel launched into an idle stream may have started for its
/// launch call taking `call` where calls typically take `typical`: what the
/// call took beyond twice that. A call's delay counts for its kernel only
/// if it came before the kernel was submitted; a module loaded in the call
/// does, and is long; a few hundred ns of jitter may come after (and a
/// kernel longer than the call then hides it), and taken off, they made a
/// 25% limit deliver 25.8% on the driver double.
fn late_ns(call: u64, typical: u64) -> u64 {
    call.saturating_sub(typical.saturating_mul(2))
}

/// What the monitor does while it has no sample to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MonitorRest {
    /// Reading samples: it sees a new one without being woken.
    Awake,
    /// Napping [`MONITOR_NAP`]: only a first measurement wakes it.
    Napping,
    /// Parked until woken, or the next contention check.
    Parked,
}

/// A [`MonitorRest`] shared between the monitor and launching threads.
#[derive(Debug, Default)]
pub(super) struct RestState(AtomicU8);

impl RestState {
    fn load(&self, order: Ordering) -> MonitorRest {
        match self.0.load(order) {
            0 => MonitorRest::Awake,
            1 => MonitorRest::Napping,
            _ => MonitorRest::Parked,
        }
    }

    fn store(&self, rest: MonitorRest, order: Ordering) {
        self.0.store(rest as u8, order);
    }
}

/// One launch bracketed by events.
pub(super) struct Sample {
    pub(super) context: usize,
    pub(super) start: CUevent,
    pub(super) end: CUevent,
    pub(super) graph: bool,
    pub(super) device: usize,
    pub(super) charge: Charge,
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

// SAFETY: events are plain driver handles, usable from any thread.
unsafe impl Send for Sample {}

impl Throttle {
    /// Measures the launch overhead once per context, at its first sample
    /// (the launching thread has that context current).
    pub(super) fn calibrate(&self, timing: &Timing, context: usize, stream: CUstream) {
        // A lock-free set of contexts: claim the first empty slot, unless
        // the context is there already (or the set is full: the overhead of
        // an earlier context stands for it).
        let claimed = self.calibrated.iter().find_map(|slot| {
            match slot.compare_exchange(0, context, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => Some(true),
                Err(owner) if owner == context => Some(false),
                Err(_) => None,
            }
        });
        if claimed != Some(true) {
            return;
        }
        // The sampled stream itself when it is idle: launch latency depends
        // on the kind of stream.
        let began = monotonic_ns();
        let idle = timing.stream_idle(stream) == Some(true);
        let measured = timing.launch_overheads(idle.then_some(stream));
        Held::add(&self.held.calibration_ns, began);
        match measured {
            Some(overheads) => {
                // Without graphs, a graph's launch is priced like a kernel's.
                let extras = [
                    (&self.kernel_idle_call_ns, overheads.kernel_idle_call_ns),
                    (&self.kernel_idle_extra_ns, overheads.kernel_idle_ns),
                    (&self.kernel_queued_extra_ns, overheads.kernel_queued_ns),
                    (
                        &self.graph_idle_extra_ns,
                        overheads.graph_idle_ns.unwrap_or(overheads.kernel_idle_ns),
                    ),
                    (
                        &self.graph_queued_extra_ns,
                        overheads
                            .graph_queued_ns
                            .unwrap_or(overheads.kernel_queued_ns),
                    ),
                ];
                for (extra, ns) in extras {
                    extra.store(ns, Ordering::Relaxed);
                }
                tracing::debug!(?overheads, "launch overhead measured");
            }
            None => tracing::warn!("launch overhead not measured; samples include it"),
        }
    }

    /// Records a start event on `stream`, from the pool of its context,
    /// and takes the end event from there; also says whether the stream was
    /// idle. Out of line: a few launches a second are measured, and the
    /// admission's code stays a few lines for the others.
    #[cold]
    #[inline(never)]
    pub(super) fn begin_sample(
        &'static self,
        timing: &Timing,
        stream: CUstream,
    ) -> Option<Bracket> {
        if self.samples.is_full() {
            return None;
        }
        let context = timing.stream_context(stream)? as usize;
        self.calibrate(timing, context, stream);
        let start = self.event(timing, context)?;
        let Some(end) = self.event(timing, context) else {
            self.recycle(timing, context, start);
            return None;
        };
        let idle = timing.stream_idle(stream).unwrap_or(false);
        if timing.record(start, stream) {
            Some(Bracket {
                context,
                start,
                end,
                idle,
                recorded_at: monotonic_ns(),
                submitted_at: 0,
                call_ns: 0,
                closed: false,
            })
        } else {
            // Pooled events whose context is gone fail to record: drop them.
            timing.destroy(start);
            timing.destroy(end);
            None
        }
    }

    /// Closes the bracket of a measured launch that returned `result`, the
    /// moment it returned: what the thread does after is the limiter's own
    /// bookkeeping, not the pod's GPU time (on a cold path, microseconds).
    /// Also times the call, whose length, against the calibrated one, says
    /// how late the kernel may have started. If the end cannot be recorded,
    /// its event is given back and the bracket stays open.
    pub(super) fn close_bracket(
        &self,
        timing: &Timing,
        bracket: &mut Bracket,
        stream: CUstream,
        result: CUresult,
    ) {
        bracket.call_ns = monotonic_ns().saturating_sub(bracket.submitted_at);
        if !result.is_success() {
            self.recycle(timing, bracket.context, bracket.end);
        } else if timing.record(bracket.end, stream) {
            bracket.closed = true;
        } else {
            // A pooled event whose context is gone fails to record: drop it.
            timing.destroy(bracket.end);
        }
    }

    /// Queues `sample` for the monitor if its bracket was closed, else
    /// gives its start event back.
    pub(super) fn end_sample(
        &'static self,
        ctx: &'static Context,
        timing: &Timing,
        sample: Sample,
        closed: bool,
    ) {
        if !closed {
            self.model.abandon(&sample.charge);
            self.recycle(timing, sample.context, sample.start);
            return;
        }
        let first = sample.charge.first;
        if !self.queue(timing, sample) {
            return;
        }
        self.held.samples.fetch_add(1, Ordering::Relaxed);
        self.start_monitor(ctx);
        let Some(monitor) = self.monitor_thread.get() else {
            self.read_samples_here(ctx, timing);
            return;
        };
        // Pairs with the monitor's store of `monitor_parked` before it looks
        // at the queue: one of the two sees the other. A napping monitor
        // looks again within [`MONITOR_NAP`] by itself: only a function's
        // first measurement, which later launches may wait for, wakes it
        // (a wake is a system call on the launching thread).
        std::sync::atomic::fence(Ordering::SeqCst);
        let wake = match self.monitor_rest.load(Ordering::SeqCst) {
            MonitorRest::Parked => true,
            MonitorRest::Napping => first,
            MonitorRest::Awake => false,
        };
        if wake {
            monitor.unpark();
        }
    }

    /// Where no monitor thread runs (none could be started: a pod at its
    /// limit of processes and threads), reads on the calling thread the
    /// samples whose launches completed, so that prices and corrections
    /// still follow measurements, a sample late, and a new function's first
    /// measurement still comes: without it, every later launch of the
    /// function would wait the longest for one, and prices would stay at
    /// the first guess. Only once starting the monitor failed, one thread at
    /// a time; samples still running wait for the next sampled launch.
    pub(super) fn read_samples_here(&self, ctx: &'static Context, timing: &Timing) {
        let monitor_failed = self.monitor.is_completed() && self.monitor_thread.get().is_none();
        if !monitor_failed || self.reading_here.swap(true, Ordering::Acquire) {
            return;
        }
        timing.with_relaxed_capture(|| {
            for _ in 0..self.samples.len() {
                let Some(sample) = self.samples.pop() else {
                    break;
                };
                if let Some(running) = self.read(ctx, timing, sample) {
                    self.queue(timing, running);
                }
            }
        });
        self.reading_here.store(false, Ordering::Release);
    }

    /// Queues `sample` to be read; false when the queue is full: the sample
    /// is given up, its events kept for reuse.
    fn queue(&self, timing: &Timing, sample: Sample) -> bool {
        let Err(sample) = self.samples.push(sample) else {
            return true;
        };
        self.model.abandon(&sample.charge);
        self.recycle(timing, sample.context, sample.start);
        self.recycle(timing, sample.context, sample.end);
        false
    }

    /// Reads `sample` if its launch completed; gives it back while the
    /// launch still runs.
    fn read(&self, ctx: &'static Context, timing: &Timing, sample: Sample) -> Option<Sample> {
        match timing.query(sample.end) {
            Ok(true) => self.complete(ctx, timing, sample),
            Ok(false) => return Some(sample),
            Err(code) => {
                // The context is gone: its events with it.
                self.model.abandon(&sample.charge);
                tracing::debug!(code = code.0, "sample lost");
            }
        }
        None
    }

    /// Starts the monitor thread, once: at the first sample, or at the first
    /// activity stamp (elastic pods need it before any sample).
    pub(super) fn start_monitor(&'static self, ctx: &'static Context) {
        self.monitor.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("cuda-limiter-monitor".into())
                .spawn(move || self.monitor(ctx));
            match spawned {
                Ok(handle) => {
                    self.monitor_thread.set(handle.thread().clone()).ok();
                }
                Err(error) => {
                    tracing::error!(%error, "cannot start the monitor; launching threads read the measurements");
                }
            }
        });
    }

    /// An event of `context`: a spare one, or a new one (the current context
    /// is the stream's on the launching thread).
    fn event(&self, timing: &Timing, context: usize) -> Option<CUevent> {
        if let Some((owner, event)) = self.events.pop() {
            if owner == context {
                return Some(event as CUevent);
            }
            self.recycle(timing, owner, event as CUevent);
        }
        timing.create_event()
    }

    fn recycle(&self, timing: &Timing, context: usize, event: CUevent) {
        if self.events.push((context, event as usize)).is_err() {
            timing.destroy(event);
        }
    }

    /// The monitor thread: turns completed samples into prices and
    /// corrections, and keeps elastic pods' contention up to date.
    fn monitor(&'static self, ctx: &'static Context) {
        // Its own driver calls never go through the detours.
        let _guard = gpushare_hook::DetourGuard::enter_always();
        let Some(timing) = ctx.driver().and_then(|driver| driver.timing.as_ref()) else {
            return;
        };
        timing.relax_capture_mode();
        let mut contention_checked = monotonic_ns();
        // When the last sample taken at the binding cadence was read.
        let mut binding_sampled_at = 0;
        let mut current: Option<Sample> = None;
        loop {
            let now = monotonic_ns();
            if now.saturating_sub(contention_checked) >= CONTENTION_INTERVAL.as_nanos() as u64 {
                contention_checked = now;
                self.update_contention(ctx, now);
            }
            let sample = match current.take() {
                Some(sample) => Some(sample),
                None => self.samples.pop().inspect(|sample| {
                    if !sample.relaxed {
                        binding_sampled_at = now;
                    }
                    self.backlog_since_ns
                        .store(sample.submitted_at.max(1), Ordering::Relaxed);
                }),
            };
            let Some(sample) = sample else {
                self.backlog_since_ns.store(0, Ordering::Relaxed);
                // While the limit binds, nap; otherwise park until woken
                // (or the next contention check).
                let (rest, timeout) = if now.saturating_sub(binding_sampled_at) < NAPPING_FOR_NS {
                    (MonitorRest::Napping, MONITOR_NAP)
                } else {
                    (MonitorRest::Parked, CONTENTION_INTERVAL)
                };
                self.monitor_rest.store(rest, Ordering::SeqCst);
                if self.samples.is_empty() {
                    std::thread::park_timeout(timeout);
                    self.held.monitor_wakeups.fetch_add(1, Ordering::Relaxed);
                }
                self.monitor_rest
                    .store(MonitorRest::Awake, Ordering::SeqCst);
                continue;
            };
            if let Some(running) = self.read(ctx, timing, sample) {
                current = Some(running);
                std::thread::sleep(POLL_INTERVAL);
                self.held.monitor_wakeups.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn complete(&self, ctx: &'static Context, timing: &Timing, sample: Sample) {
        let bracket = if sample.call_ns > MAX_SAMPLED_CALL_NS {
            self.held.discarded_samples.fetch_add(1, Ordering::Relaxed);
            None
        } else {
            timing.elapsed_ns(sample.start, sample.end)
        };
        match bracket {
            Some(bracket) => {
                // A launch queued behind earlier work is measured from that
                // work's end: its back-to-back period plus the events' own
                // time. From an idle stream the bracket also holds the host's
                // way to the launch call, the launch latency, and for a
                // kernel, however much longer than calibrated its call took
                // (a module loaded in it: the kernel starts that much
                // later). Not for a graph: its call grows with its nodes,
                // whose work may start while the call still submits the
                // rest, and the calibrated graph has one node.
                let (overhead, late) = match (sample.idle_gap_ns, sample.graph) {
                    (None, true) => (self.graph_queued_extra_ns.load(Ordering::Relaxed), 0),
                    (None, false) => (self.kernel_queued_extra_ns.load(Ordering::Relaxed), 0),
                    (Some(gap), true) => {
                        (gap + self.graph_idle_extra_ns.load(Ordering::Relaxed), 0)
                    }
                    (Some(gap), false) => (
                        gap + self.kernel_idle_extra_ns.load(Ordering::Relaxed),
                        late_ns(
                            sample.call_ns,
                            self.kernel_idle_call_ns.load(Ordering::Relaxed),
                        ),
                    ),
                };
                let measured = kernel_ns(bracket, overhead, late);
                let contended = self.activity().is_some_and(|table| {
                    table.contended(sample.device, self.pod_key(ctx), monotonic_ns())
                });
                let owed = self.model.record(&sample.charge, measured, contended);
                let tokens = self
                    .budget(ctx, sample.device, ctx.hypervisor_limits().is_some())
                    .map(|budget| {
                        budget.bucket.correct(owed);
                        budget.bucket.tokens_ns.load(Ordering::Relaxed)
                    });
                tracing::trace!(
                    submitted_at = sample.submitted_at,
                    bracket,
                    idle_gap = ?sample.idle_gap_ns,
                    call = sample.call_ns,
                    overhead,
                    late,
                    measured,
                    charged = sample.charge.ns,
                    waves = sample.charge.waves,
                    owed,
                    ?tokens,
                    first = sample.charge.first,
                    relaxed = sample.relaxed,
                    "sample"
                );
            }
            None => self.model.abandon(&sample.charge),
        }
        self.recycle(timing, sample.context, sample.start);
        self.recycle(timing, sample.context, sample.end);
    }

    fn update_contention(&self, ctx: &'static Context, now: u64) {
        let Some(table) = self.activity() else {
            return;
        };
        if ctx.hypervisor_limits().is_some() {
            return; // the hypervisor decides elastic shares
        }
        for (device, budget) in self.budgets.iter().enumerate() {
            if let Some(Some(budget)) = budget.get()
                && budget.elastic
            {
                let contended = table.contended(device, self.pod_key(ctx), now);
                let was = budget
                    .bucket
                    .uncontended
                    .swap(u32::from(!contended), Ordering::Relaxed);
                if was != u32::from(!contended) {
                    tracing::debug!(
                        device,
                        contended,
                        "elastic ceiling {}",
                        if contended { "off" } else { "on" }
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{kernel_ns, late_ns};

    #[test]
    fn a_bracket_is_charged_its_kernel_less_overhead_and_lateness() {
        // Queued: the events' own time taken off.
        assert_eq!(kernel_ns(50_000, 2_000, 0), 48_000);
        // From an idle stream, a call 1.5 µs slower than calibrated: a
        // 200 ns kernel in a 2 µs bracket with 300 ns of overhead.
        assert_eq!(kernel_ns(2_000, 300, 1_500), 200);
        // Lateness never counts against a kernel's floor: a quarter of the
        // bracket as a call as fast as calibrated would have made it.
        assert_eq!(kernel_ns(2_000, 600, 1_500), 125);
        assert_eq!(kernel_ns(2_000, 3_000, 0), 500);
        // Lateness the bracket cannot hold is not believed.
        assert_eq!(kernel_ns(1_000, 200, 5_000), 800);
    }

    #[test]
    fn a_call_is_late_only_beyond_twice_its_typical_length() {
        assert_eq!(late_ns(300, 200), 0);
        assert_eq!(late_ns(400, 200), 0);
        // A module loaded in the call.
        assert_eq!(late_ns(60_400, 200), 60_000);
        // Not calibrated: nothing is late.
        assert_eq!(late_ns(60_400, u64::MAX), 0);
    }
}

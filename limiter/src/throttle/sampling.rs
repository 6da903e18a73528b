//! Measuring launches: event brackets around sampled launches (from the
//! [`Sampler`](super::sampler::Sampler)'s events), their overheads taken off
//! ([`Overheads`](super::overheads::Overheads), calibrated once per
//! context), and the completed measurement turned into a price and a
//! correction of the bucket.

use std::sync::atomic::Ordering;

use gpushare_utils::bucket::monotonic_ns;

use super::locals::with_run;
use super::overheads::kernel_ns;
use super::run::{Closed, Run, Tally};
use super::sample::{Bracket, Sample};
use super::summary::Held;
use super::{MAX_SAMPLED_CALL_NS, Metered, Throttle};
use crate::context::Context;
use crate::driver::Timing;
use crate::metering::{Charge, Contention};
use crate::sys::{CUresult, CUstream};

/// How long into its turn a pod's launch is measured as the GPU's only
/// work, as if no other pod launched there: by then the previous holder's
/// queue, a step or two of a host-synchronised loop, has mostly run. Taken
/// as time-sliced (the median of recent measurements, a quarter's weight
/// above the price), four pods' inference steps taking turns on an H200
/// paid 1-3% less than their throughput said they ran; their measurements
/// read 2.5% over the price in a turn's first 250 µs, 0.7-1.2% from then
/// to 1.5 ms, and 9% in the last two of a turn, which the next holder's
/// kernels overlap (so they are read after the turn ended: time-sliced).
const TURN_SETTLED_NS: u64 = 500_000;

impl Throttle {
    /// Measures the launch overhead once per context, at its first sample
    /// (the launching thread has that context current).
    fn calibrate(&self, timing: &Timing, context: usize, stream: CUstream) {
        if !self.overheads.claim(context) {
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
                self.overheads.store(&overheads);
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
        if self.sampler.is_full() {
            return None;
        }
        let context = timing.stream_context(stream)? as usize;
        self.calibrate(timing, context, stream);
        let start = self.sampler.event(timing, context)?;
        let Some(end) = self.sampler.event(timing, context) else {
            self.sampler.recycle(timing, context, start);
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
            self.sampler.recycle(timing, bracket.context, bracket.end);
        } else if timing.record(bracket.end, stream) {
            bracket.closed = true;
        } else {
            // A pooled event whose context is gone fails to record: drop it.
            timing.destroy(bracket.end);
        }
    }

    /// Queues the measurement of a sampled launch for the monitor.
    #[cold]
    #[inline(never)]
    pub(super) fn finish_sample(
        &'static self,
        ctx: &'static Context,
        timing: &Timing,
        device: usize,
        metered: &Metered,
        bracket: &Bracket,
    ) {
        // The precise time: the rate window is measured between samples.
        super::locals::with_cadence(|cadence| {
            cadence.sampled(bracket.submitted_at, metered.relaxed);
        });
        // The measurement settles this thread's own launches too.
        super::locals::with_batch(|batch| self.model.flush(batch));
        let pending = Sample {
            call_ns: bracket.call_ns,
            context: bracket.context,
            start: bracket.start,
            end: bracket.end,
            graph: metered.key.is_graph(),
            device,
            charge: metered.charge,
            run: None,
            idle_gap_ns: bracket
                .idle
                .then(|| bracket.submitted_at.saturating_sub(bracket.recorded_at)),
            submitted_at: bracket.submitted_at,
            relaxed: metered.relaxed,
        };
        self.end_sample(ctx, timing, pending, bracket.closed);
    }

    /// Queues `sample` for the monitor if its bracket was closed, else
    /// gives its start event back.
    fn end_sample(
        &'static self,
        ctx: &'static Context,
        timing: &Timing,
        sample: Sample,
        closed: bool,
    ) {
        if !closed {
            self.model.abandon(&sample.charge);
            self.sampler.recycle(timing, sample.context, sample.start);
            return;
        }
        // Launches wait only for a function's first measurement.
        let awaited = sample.charge.wanted && sample.charge.unmeasured;
        let counter = match sample.run {
            None => &self.held.samples,
            Some(_) => &self.held.runs,
        };
        if !self.queue(timing, sample) {
            return;
        }
        counter.fetch_add(1, Ordering::Relaxed);
        self.start_monitor(ctx);
        if !self.monitor.notify(awaited) {
            self.read_samples_here(ctx, timing);
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
        if !self.monitor.failed() {
            return;
        }
        let Some(_turn) = self.sampler.read_here() else {
            return;
        };
        timing.with_relaxed_capture(|| {
            for _ in 0..self.sampler.len() {
                let Some(sample) = self.sampler.pop() else {
                    break;
                };
                if let Some(running) = self.read(ctx, timing, sample) {
                    self.queue(timing, running);
                }
            }
        });
    }

    /// Queues `sample` to be read; false when the queue is full: the sample
    /// is given up, its events kept for reuse.
    fn queue(&self, timing: &Timing, sample: Sample) -> bool {
        match self.sampler.queue(timing, sample) {
            Ok(()) => true,
            Err(charge) => {
                self.model.abandon(&charge);
                false
            }
        }
    }

    /// Reads `sample` if its launch completed; gives it back while the
    /// launch still runs.
    pub(super) fn read(
        &self,
        ctx: &'static Context,
        timing: &Timing,
        sample: Sample,
    ) -> Option<Sample> {
        match timing.query(sample.end) {
            Ok(true) => self.complete(ctx, timing, sample),
            Ok(false) => return Some(sample),
            Err(error) => {
                // The context is gone: its events with it.
                self.model.abandon(&sample.charge);
                tracing::debug!(%error, "sample lost");
            }
        }
        None
    }

    /// What else ran on the device while the completed `sample` did, as
    /// read now: nothing where no other pod launched within the stamps'
    /// window, or where the GPU takes turns and this pod has held its turn
    /// since [`TURN_SETTLED_NS`] before the sample began (the others waited
    /// for it); else others' kernels beside it (co-run) or in time slices.
    fn contention(&self, ctx: &'static Context, sample: &Sample) -> Contention {
        let now = monotonic_ns();
        let own_turn = || {
            self.priority
                .turn_held_since(sample.device, now)
                .is_some_and(|began| began.saturating_add(TURN_SETTLED_NS) <= sample.submitted_at)
        };
        if !self.stamps.contended(ctx, sample.device, now) || own_turn() {
            Contention::Alone
        } else if self.priority.is_corun() {
            Contention::SharedSms
        } else {
            Contention::TimeSliced
        }
    }

    /// Prices a completed sample and settles the bucket for it; a run
    /// moves the scale of brackets instead.
    fn complete(&self, ctx: &'static Context, timing: &Timing, sample: Sample) {
        if let Some(tally) = sample.run {
            self.complete_run(ctx, timing, &sample, tally);
            self.sampler.recycle(timing, sample.context, sample.start);
            self.sampler.recycle(timing, sample.context, sample.end);
            return;
        }
        let bracket = if sample.call_ns > MAX_SAMPLED_CALL_NS {
            self.held.discarded_samples.fetch_add(1, Ordering::Relaxed);
            None
        } else {
            timing.elapsed_ns(sample.start, sample.end)
        };
        match bracket {
            Some(bracket) => {
                let (overhead, late) =
                    self.overheads
                        .of(sample.idle_gap_ns, sample.graph, sample.call_ns);
                let measured = self.runs.apply(kernel_ns(bracket, overhead, late));
                let contention = self.contention(ctx, &sample);
                let owed = self.model.record(&sample.charge, measured, contention);
                let tokens = self
                    .budgets
                    .get(ctx, sample.device, ctx.hypervisor_limits().is_some())
                    .map(|budget| {
                        let bucket = budget
                            .bucket
                            .with_capacity(self.priority.bank_ns(sample.device));
                        bucket.correct(owed);
                        bucket.tokens_ns.load(Ordering::Relaxed)
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
                    ?contention,
                    wanted = sample.charge.wanted,
                    relaxed = sample.relaxed,
                    "sample"
                );
            }
            None => self.model.abandon(&sample.charge),
        }
        self.sampler.recycle(timing, sample.context, sample.start);
        self.sampler.recycle(timing, sample.context, sample.end);
    }
}

/// Runs of launches ([`super::run`]): opened at a due sample, closed before
/// a launch on another stream, a full run, or a wait for budget.
impl Throttle {
    /// Opens a run at this launch on `stream` charged `charge`: its start
    /// event recorded before it. False (the caller takes a sample instead)
    /// where the stream is idle, so that the run would hold the launch
    /// latency, or no event can be had.
    #[cold]
    #[inline(never)]
    pub(super) fn open_run(
        &self,
        timing: &Timing,
        stream: CUstream,
        device: usize,
        charge: &Charge,
    ) -> bool {
        if self.sampler.is_full() || timing.stream_idle(stream) != Some(false) {
            return false;
        }
        let Some(context) = timing.stream_context(stream) else {
            return false;
        };
        let context = context as usize;
        let Some(start) = self.sampler.event(timing, context) else {
            return false;
        };
        if !timing.record(start, stream) {
            // A pooled event whose context is gone fails to record: drop it.
            timing.destroy(start);
            return false;
        }
        with_run(|run| run.open(stream, context, device, start, charge));
        true
    }

    /// Records the end of the run `closed` (before the launch that closed
    /// it) and queues it for the monitor.
    #[cold]
    #[inline(never)]
    pub(super) fn close_run(&'static self, ctx: &'static Context, timing: &Timing, closed: Closed) {
        let Some(end) = self.sampler.event(timing, closed.context) else {
            self.sampler.recycle(timing, closed.context, closed.start);
            return;
        };
        if !timing.record(end, closed.stream) {
            // The context is gone, or the stream captures: drop the events.
            timing.destroy(closed.start);
            timing.destroy(end);
            return;
        }
        let sample = Sample {
            context: closed.context,
            start: closed.start,
            end,
            graph: false,
            device: closed.device,
            charge: Charge::default(),
            run: Some(closed.tally),
            idle_gap_ns: None,
            submitted_at: monotonic_ns(),
            call_ns: 0,
            relaxed: true,
        };
        self.end_sample(ctx, timing, sample, true);
    }

    /// A launch counted into this thread's open run: the run no longer
    /// counts unless the stream still has work queued (the launch then
    /// starts as the work before it ends, with no idle gap in the run).
    #[cold]
    #[inline(never)]
    pub(super) fn check_run_busy(&self, timing: &Timing, stream: CUstream) {
        if timing.stream_idle(stream) != Some(false) {
            with_run(Run::spoil);
        }
    }

    /// Closes this thread's open run, if any, before it waits (the stream
    /// runs dry meanwhile, and the run would not count).
    pub(super) fn close_run_before_wait(
        &'static self,
        ctx: &'static Context,
        timing: Option<&Timing>,
    ) {
        if let Some(timing) = timing
            && let Some(closed) = with_run(Run::close)
        {
            self.close_run(ctx, timing, closed);
        }
    }

    /// Moves the scale of brackets by a completed run that counts: one of
    /// two launches or more, all priced from measurements, that ran and
    /// found the stream busy, while no other pod launched on the device.
    fn complete_run(&self, ctx: &'static Context, timing: &Timing, sample: &Sample, tally: Tally) {
        let elapsed = timing.elapsed_ns(sample.start, sample.end);
        let alone = self.contention(ctx, sample) == Contention::Alone;
        let counts = tally.priced && tally.launches >= 2 && alone;
        if let (true, Some(elapsed)) = (counts, elapsed) {
            // The events' own time, as in a queued launch's bracket.
            let (overhead, _) = self.overheads.of(None, false, 0);
            self.runs
                .note(elapsed.saturating_sub(overhead), tally.charged_ns);
            self.held.runs_counted.fetch_add(1, Ordering::Relaxed);
        }
        tracing::trace!(
            elapsed = ?elapsed,
            launches = tally.launches,
            charged = tally.charged_ns,
            priced = tally.priced,
            alone,
            scale_ppm = self.runs.ppm(),
            "run"
        );
    }
}

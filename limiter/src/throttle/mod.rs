//! Compute shares: every launch on a limited device is admitted against the
//! pod's budget of GPU time.
//!
//! 1. The launch is priced by the [`CostModel`]: its function's measured GPU
//!    time per wave times the waves its grid runs in ([`Waves`]), so a grid
//!    size never seen before costs what its function's others did. It is
//!    charged that in the pod's [`ComputeBucket`], shared by all its
//!    processes in the ledger region. With budget, that is a clock read and a
//!    few atomic operations, no lock, no system call; while the pod is far
//!    from its limit, a thread pays from GPU time it bought ahead ([`lease`])
//!    and touches the shared bucket once in dozens of launches.
//! 2. Without budget the calling thread waits (trap-and-wait) for the time
//!    the bucket needs to refill a few launches' worth, in sleeps of at most
//!    2 ms, so it wakes within about the timer slack (tens of µs) of budget
//!    returning, and a throttled loop runs in short back-to-back bursts.
//!    Launches of one thread are never reordered: the thread itself waits.
//! 3. A few launches are measured: each function's first, then about one
//!    per [`SAMPLE_INTERVAL_NS`] per thread while the limit binds, per
//!    [`RELAXED_CHARGED_NS`] of GPU time charged (every 16 to 128 ms) while
//!    it does not (picked by counting launches: [`cadence`]), bracketed by
//!    two events, the second recorded the moment the launch returns. A
//!    monitor thread reads their elapsed GPU time when they complete, feeds
//!    the cost model, and debits or credits the bucket so that every launch
//!    of the function since its last measurement is paid at the measured
//!    rate: what the pod pays follows what it used, even where prices lag.
//!    A launch queued behind earlier work is measured from that work's end,
//!    which is what a saturating loop spends per launch. When the stream was
//!    idle as the bracket began, the host's way to the launch and the launch
//!    latency beyond the back-to-back gap (both measured once per context
//!    with kernels of our own, launched directly and as a graph) are
//!    subtracted, and so is a kernel launch call's delay beyond twice its
//!    usual length (a module loaded in it): pods pay for their kernels, not
//!    for idle gaps. One due sample in four opens a [`run`] instead: the
//!    thread's next launches on the stream bracketed together, which says
//!    how much of a single bracket is the launch's own back-to-back time.
//! 4. Launches into a stream being captured do not run and are not charged;
//!    the graph is charged when launched.
//! 5. Every limited pod stamps the node's activity table; an elastic pod runs
//!    up to its ceiling while no other pod launched on the device recently.
//! 6. Once admitted, a launch passes its pod's class ([`priority`]): a batch
//!    launch waits while a latency pod on the device is active.
//!
//! The [`Throttle`] is made of parts, each owning its state behind a small
//! API: `budgets` (the device of a launch and the bucket that pays for it),
//! the [`CostModel`] and [`Waves`] (prices), `sampler` (samples waiting for
//! the GPU, spare events, the backlog), `overheads` (what a bracket holds
//! besides its kernel, per context), `runs` (the scale of brackets that
//! runs set), `monitor` (the thread that reads samples, and its rest),
//! `stamp` (the node's activity table), `summary` (where launches waited)
//! and [`priority`]. The launch path (this file),
//! `sampling`, `wait` and the monitor's loop run through them.

use std::sync::atomic::Ordering;

use gpushare_hook::AfterCall;
use gpushare_utils::bucket::{Admission, CAPACITY_NS, ComputeBucket, monotonic_ns};
use gpushare_utils::clock::monotonic_coarse_ns;
use gpushare_utils::node_table::TableAccess;

use crate::config::{ComputeLimit, DeviceLimits};
use crate::context::Context;
use crate::driver::Timing;
use crate::error::{LimiterError, Pass, Result};
use crate::metering::{Charge, CostModel, LaunchKey, UNMEASURED_AHEAD};
use crate::mps::CorunSms;
use crate::sys::{CU_STREAM_PER_THREAD, CUfunction, CUresult, CUstream};
use crate::waves::{GpuShape, Grid, Waves};

mod budgets;
mod cadence;
mod lease;
mod locals;
mod monitor;
mod overheads;
pub(crate) mod priority;
mod run;
mod sample;
mod sampler;
mod sampling;
mod stamp;
mod summary;
mod wait;

use budgets::Budgets;
use locals::{with_batch, with_cadence, with_run};
use monitor::Monitor;
use overheads::Overheads;
use priority::Priority;
use run::{Run, RunScale};
use sampler::Sampler;
use stamp::Stamps;
use summary::Held;

/// About one sampled launch per thread this often while the pod's limit
/// binds (its bucket holds less than [`RELAXED_TOKENS_NS`]): hundreds of
/// measurements a second to fit from, where prices decide what runs.
pub(crate) const SAMPLE_INTERVAL_NS: u64 = 2_000_000;
/// About one sampled launch per thread per this much GPU time charged while
/// the limit does not bind, at most one per [`RELAXED_SAMPLE_INTERVAL_NS`]
/// and at least one per [`MAX_RELAXED_INTERVAL_NS`]. A sample costs its
/// thread about 10 µs of driver calls on an H100 (a stream query, two event
/// records). There prices only need to say when the limit starts to bind,
/// and what a settlement corrects is the price's error times the GPU time
/// charged since the last: at 4 ms, a 25% error moves the bucket by 1 ms of
/// its 5. (On the H100, the paced loop with 1–3 samples a process instead of
/// ~10 cost what it did with 16 ms: its cost is the admission of every
/// launch, not the samples.)
/// The first launch after the bucket drops below [`RELAXED_TOKENS_NS`]
/// samples at the binding interval within [`SAMPLE_INTERVAL_NS`] × 4.
pub(crate) const RELAXED_CHARGED_NS: u64 = 4_000_000;
/// The shortest relaxed interval: a thread charged a quarter of the GPU's
/// time or more.
pub(crate) const RELAXED_SAMPLE_INTERVAL_NS: u64 = 16_000_000;
/// The longest relaxed interval: a thread charged little.
pub(crate) const MAX_RELAXED_INTERVAL_NS: u64 = 128_000_000;
/// A bucket holding at least this much is not near its limit.
const RELAXED_TOKENS_NS: i64 = CAPACITY_NS / 2;
/// A bucket holding at least this much admits on the coarse clock, which
/// lags by at most a tick (1 to 4 ms): that only delays a refill (the time is
/// banked, never lost or counted twice: a refill ignores a clock behind the
/// last one), which 4 ms of GPU time in hand does not need. The activity
/// stamp (10 ms apart, read over 200 ms) and the cadence (2 to 128 ms
/// intervals) take the same lag. On the H100 machine's host the precise
/// clock costs 41 ns a launch, the coarse one 9.
const COARSE_TOKENS_NS: i64 = CAPACITY_NS * 4 / 5;
/// A sampled launch whose call took longer than this is not measured: the
/// driver loaded the function's module in the call (lazy loading: a first
/// launch takes milliseconds), or the thread was preempted in it; either
/// way its bracket holds host time the kernel did not use.
pub(crate) const MAX_SAMPLED_CALL_NS: u64 = 100_000;

/// What a launch runs: a kernel grid or an instantiated graph.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Work {
    Kernel(Grid),
    Graph(usize),
}

/// A launch let through by [`Throttle::admit`]: what is done once the
/// driver returned (the detour makes the launch).
pub(crate) struct Admitted {
    throttle: &'static Throttle,
    ctx: &'static Context,
    device: usize,
    stream: CUstream,
    timing: Option<&'static Timing>,
    ticket: priority::Ticket,
    /// `None` where no compute limit applies (only the pod's class).
    metered: Option<Metered>,
    /// The launch is measured: its bracket waits in a thread-local
    /// ([`sample::set_in_flight`]), not in this record, which the detour
    /// holds across the driver's call (136 bytes, not ~200 copied by memcpy).
    sampled: bool,
}

impl Admitted {
    /// Whether nothing is left to do after the launch returned `result`: it
    /// ran (nothing to refund), is not measured, and its class needs nothing.
    #[inline]
    fn done_by(&self, result: CUresult) -> bool {
        result.is_success() && matches!(self.ticket, priority::Ticket::Free) && !self.sampled
    }
}

impl AfterCall<CUresult> for Admitted {
    /// Most launches leave nothing to do after them: their code is not
    /// fetched (a launch after a stretch of application work runs cold).
    #[inline]
    fn after(self, result: CUresult) {
        if !self.done_by(result) {
            self.throttle.launched(self, result);
        }
    }
}

/// A launch charged against a compute limit.
struct Metered {
    bucket: &'static ComputeBucket,
    key: LaunchKey,
    charge: Charge,
    /// Whether the limit did not bind: the relaxed sampling interval.
    relaxed: bool,
}

/// The driver as the wave counter asks it.
struct DriverShape<'a>(&'a Timing);

impl GpuShape for DriverShape<'_> {
    fn sm_count(&self, device: usize) -> Option<u32> {
        self.0.sm_count(i32::try_from(device).ok()?)
    }

    fn blocks_per_sm(&self, function: usize, threads: u32, shared_bytes: u32) -> Option<u32> {
        self.0
            .blocks_per_sm(function as CUfunction, threads, shared_bytes)
    }
}

/// The compute limits of this process's pod: its parts, each with its own
/// state, and the launch path that runs through them.
pub(crate) struct Throttle {
    /// Per device: the bucket that pays for its launches.
    budgets: Budgets,
    /// What launches cost, by function and waves.
    model: CostModel,
    waves: Waves,
    /// Measured launches waiting for the GPU, and their events.
    sampler: Sampler,
    /// What a bracket holds besides its kernel, per context.
    overheads: Overheads,
    /// How much of a bracket is the launch's own back-to-back time, as
    /// runs of launches measured end to end say.
    runs: RunScale,
    /// The thread that reads the measurements.
    monitor: Monitor,
    /// This process's stamps in the node's activity table.
    stamps: Stamps,
    /// Where launches waited, for the exit summary.
    held: Held,
    /// The pod's class at the launch.
    priority: Priority,
}

impl Throttle {
    /// `tables`: how the node's activity table is mapped, `activity`: its name.
    pub(crate) fn new(
        configured: DeviceLimits<ComputeLimit>,
        priority: Priority,
        tables: TableAccess,
        activity: String,
    ) -> Self {
        Self {
            budgets: Budgets::new(configured),
            model: CostModel::default(),
            waves: Waves::default(),
            sampler: Sampler::default(),
            overheads: Overheads::default(),
            runs: RunScale::default(),
            monitor: Monitor::default(),
            stamps: Stamps::new(tables, activity),
            held: Held::default(),
            priority,
        }
    }

    /// The compute limits the environment configured.
    pub(crate) fn configured(&self) -> &DeviceLimits<ComputeLimit> {
        self.budgets.configured()
    }

    /// This process is an MPS client of a co-run GPU running on `sms`.
    pub(crate) fn join_corun(&self, sms: CorunSms) {
        self.priority.join_corun(sms);
    }

    /// Admits one launch of `work` on `stream`, waiting for budget if
    /// there is none; `per_thread` says the launch API took stream 0 as the
    /// per-thread default stream. Its budget, its price and admission, its
    /// class, whether it is measured (the start event is then recorded).
    /// The detour then makes the launch and hands [`Admitted`] the result.
    ///
    /// One copy of code for every launch API (not one of 3 KB per API), with
    /// the rare branches out of line, so that few lines of code are fetched
    /// when the path runs cold after a stretch of application work: on the
    /// driver double, 428 instructions a launch in the limiter.
    #[inline(never)]
    pub(crate) fn admit(
        &'static self,
        ctx: &'static Context,
        work: Work,
        stream: CUstream,
        per_thread: bool,
    ) -> Result<Admitted> {
        let driver = ctx
            .driver()
            .ok_or(LimiterError::Bypass(Pass::DriverNotResolved))?;
        let device = self.budgets.device(driver)?;
        // Whether the hypervisor's limits are in force, read once a launch.
        let hypervised = ctx.hypervisor_limits().is_some();
        let budget = self.budgets.get(ctx, device, hypervised);
        if budget.is_none() && !self.priority.engaged(hypervised) {
            return Err(LimiterError::Bypass(Pass::DeviceUnlimited));
        }
        let stream = if per_thread && stream.is_null() {
            CU_STREAM_PER_THREAD
        } else {
            stream
        };
        let timing = driver.timing.as_ref();
        if timing.is_some_and(|timing| timing.is_capturing(stream)) {
            return Err(LimiterError::Bypass(Pass::Captured));
        }
        let admitted = |ticket, metered, sampled| Admitted {
            throttle: self,
            ctx,
            device,
            stream,
            timing,
            ticket,
            metered,
            sampled,
        };
        let launch_at = |now| priority::Launch {
            device,
            stream,
            timing,
            now,
        };
        let Some(budget) = budget else {
            // No compute limit here: only the class applies.
            let ticket = self.priority.before(ctx, launch_at(monotonic_ns()));
            return Ok(admitted(ticket, None, false));
        };

        let (key, waves) = match work {
            Work::Kernel(grid) => {
                let waves = timing.map_or(1, |timing| {
                    self.waves.count(device, grid, &DriverShape(timing))
                });
                (LaunchKey::kernel(grid.function), waves)
            }
            Work::Graph(exec) => (LaunchKey::graph(exec), 1),
        };
        let charge = with_batch(|batch| self.model.charge(key, waves, batch));
        // A new function's first launch is measured, and its first at a
        // second grid size, at most one such a [`FIRST_SAMPLE_INTERVAL_NS`]:
        // a program that makes new functions all the time (JIT per shape)
        // must not sample every launch.
        let wanted = charge.wanted && self.sampler.may_sample_first();
        if charge.unmeasured && !charge.wanted && charge.ahead >= UNMEASURED_AHEAD {
            self.wait_for_measurement(ctx, timing, &charge);
        }
        if self.sampler.backlog_since() != 0 {
            self.hold_while_backlogged();
        }
        let classless = !hypervised && self.priority.classless_locally();
        // Seen as deep as a turn where the GPU takes turns (never for a pod
        // without classes: no turns, no hypervisor).
        let deep;
        let bucket = if classless {
            budget.bucket
        } else {
            deep = budget.bucket.with_capacity(self.priority.bank_ns(device));
            &deep
        };
        // A pod without classes whose bucket is far from its limit admits on
        // the coarse clock (see [`COARSE_TOKENS_NS`]), from the thread's
        // prepaid lease ([`lease`]); otherwise on the precise clock, in the
        // bucket. Waiting is out of line, so that the launch path stays a few
        // cache lines of code.
        let leased = classless && lease::pay(budget.bucket, charge.ns);
        let coarse =
            leased || classless && bucket.tokens_ns.load(Ordering::Relaxed) >= COARSE_TOKENS_NS;
        let mut now = if coarse {
            monotonic_coarse_ns()
        } else {
            monotonic_ns()
        };
        let paid = leased || coarse && lease::renew(budget.bucket, now, charge.ns);
        if !paid {
            if !coarse {
                // Near the limit every launch is metered in the bucket.
                lease::give_back();
            }
            if bucket.admit(now, charge.ns) != Admission::Pass {
                self.close_run_before_wait(ctx, timing);
                now = self.wait_for_budget(ctx, bucket, charge.ns, device, monotonic_ns());
            }
        }
        // A thread's first launch is never paid from a lease: the process's
        // first limited launch is seen here.
        if !leased && self.held.first_launch_ns.load(Ordering::Relaxed) == 0 {
            self.first_launch();
        }
        // Every limited pod stamps the node table, so elastic pods see it.
        self.mark_active(ctx, device, now);
        let ticket = if classless && self.priority.dormant_at(now) {
            priority::Ticket::Free
        } else {
            self.priority.before(ctx, launch_at(now))
        };

        // A lease is bought with plenty in the bucket.
        let relaxed = leased || bucket.tokens_ns.load(Ordering::Relaxed) >= RELAXED_TOKENS_NS;
        let due = with_cadence(|cadence| cadence.due(now, cadence.interval(relaxed), charge.ns));
        let mut sampled = false;
        if let Some(timing) = timing {
            // An open run counts this launch, or closes before it; while
            // one is open, its launches are measured together, and only a
            // function's first measurement is taken on its own.
            let in_run = match with_run(|run| run.add(stream, &charge)) {
                run::Added::Outside => false,
                run::Added::Counted => {
                    self.check_run_busy(timing, stream);
                    true
                }
                run::Added::Spoiled => true,
                run::Added::Closed(closed) => {
                    self.close_run(ctx, timing, closed);
                    false
                }
            };
            let due = due && !in_run;
            let opened = due
                && !wanted
                && with_run(Run::wants_one)
                && self.open_run(timing, stream, device, &charge);
            if opened {
                with_cadence(|cadence| cadence.sampled(now, relaxed));
            } else if (wanted || due)
                && let Some(mut bracket) = self.begin_sample(timing, stream)
            {
                bracket.submitted_at = monotonic_ns();
                sample::set_in_flight(bracket);
                sampled = true;
            }
        }
        if !sampled {
            self.model.abandon(&charge);
        }
        let metered = Metered {
            bucket: budget.bucket,
            key,
            charge,
            relaxed,
        };
        Ok(admitted(ticket, Some(metered), sampled))
    }

    /// Everything after a launch that returned `result`, when there is
    /// anything: a refund, a class's record, a measurement.
    #[inline(never)]
    fn launched(&'static self, launch: Admitted, result: CUresult) {
        let mut sample = launch.sampled.then(sample::take_in_flight).flatten();
        // A measured launch's bracket closes before anything else runs.
        if let (Some(bracket), Some(timing)) = (sample.as_mut(), launch.timing) {
            self.close_bracket(timing, bracket, launch.stream, result);
        }
        if let Some(metered) = &launch.metered
            && !result.is_success()
        {
            // Nothing runs: give the charge back, and an open run that
            // counted it is no measure of its launches.
            with_run(Run::spoil);
            metered
                .bucket
                .with_capacity(self.priority.bank_ns(launch.device))
                .correct(-(metered.charge.ns as i64));
            with_batch(|batch| self.model.refund(&metered.charge, batch));
        }
        self.priority
            .after(launch.ticket, launch.stream, launch.timing, result);
        if let (Some(metered), Some(timing), Some(bracket)) =
            (&launch.metered, launch.timing, &sample)
        {
            self.finish_sample(launch.ctx, timing, launch.device, metered, bracket);
        }
    }

    /// The process's first limited launch: the exit summary starts counting.
    #[cold]
    #[inline(never)]
    fn first_launch(&'static self) {
        let now = monotonic_ns();
        if self
            .held
            .first_launch_ns
            .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.print_summary_at_exit();
        }
    }

    /// Stamps the node's activity table for `device`, at most every 10 ms.
    #[inline]
    fn mark_active(&'static self, ctx: &'static Context, device: usize, now: u64) {
        if let Some(last) = self.stamps.due(device, now) {
            self.stamp_activity(ctx, device, now, last);
        }
    }

    /// Takes a stamp that was due; the monitor keeps elastic pods'
    /// contention up to date from then on.
    #[cold]
    #[inline(never)]
    fn stamp_activity(&'static self, ctx: &'static Context, device: usize, now: u64, last: u64) {
        if self.stamps.stamp(ctx, device, now, last) {
            self.start_monitor(ctx);
        }
    }
}

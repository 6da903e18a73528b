//! Compute shares: every launch on a limited device is admitted against the
//! pod's budget of GPU time.
//!
//! 1. The launch is charged the estimated GPU time of its kind
//!    ([`Estimates`]; unknown kinds a default) in the pod's
//!    [`ComputeBucket`], shared by all its processes in the ledger region.
//!    With budget, that is a clock read and a few atomic operations.
//! 2. Without budget the calling thread waits (trap-and-wait) for the time
//!    the bucket needs to refill, in sleeps of at most 2 ms, so it wakes
//!    within about the timer slack (tens of µs) of budget returning. Launches
//!    of one thread are never reordered: the thread itself waits.
//! 3. A sample of launches (the first of each kind, then at most one per
//!    [`SAMPLE_INTERVAL_NS`] per thread) is bracketed by two events. A
//!    monitor thread reads their elapsed GPU time when they complete, updates
//!    the kind's estimate and corrects the bucket by the difference. Event
//!    pairs bracket exactly the one launch, so a host-bound program that
//!    leaves the GPU idle between kernels is charged only for its kernels.
//!    When the launch followed a wait (the GPU had drained the pod's work),
//!    the launch latency inside the bracket (measured once per context with
//!    an empty kernel of our own, launched directly and as a graph) is
//!    subtracted: pods pay for kernels.
//! 4. Launches into a stream being captured do not run and are not charged;
//!    the graph is charged when launched.
//! 5. Every limited pod stamps the node's activity table; an elastic pod runs
//!    up to its ceiling while no other pod launched on the device recently.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, Once, OnceLock};
use std::time::Duration;

use gpushare_utils::activity::{self, MARK_INTERVAL_NS, NodeActivity};
use gpushare_utils::bucket::{Admission, ComputeBucket, monotonic_ns};
use gpushare_utils::config::{ComputeLimit, ComputePolicy, DeviceLimits, MAX_DEVICES};

use crate::driver::{Driver, Timing};
use crate::error::{LimiterError, Result};
use crate::estimates::{DEFAULT_ESTIMATE_NS, Estimates, LaunchKey};
use crate::runtime;
use crate::sys::{CU_STREAM_PER_THREAD, CUevent, CUresult, CUstream};

/// Names another node activity table (tests: one per test).
pub const NODE_REGION_VARIABLE: &str = "GPUSHARE_NODE_REGION";
/// At most one sampled launch per thread this often (two event records).
pub const SAMPLE_INTERVAL_NS: u64 = 1_000_000;
/// Samples waiting for the GPU beyond this many are not taken.
const MAX_PENDING_SAMPLES: usize = 256;
/// How often the monitor polls a sample whose events are not done.
const POLL_INTERVAL: Duration = Duration::from_micros(100);
/// How often the monitor re-checks contention for elastic pods.
const CONTENTION_INTERVAL: Duration = Duration::from_millis(50);

thread_local! {
    static LAST_SAMPLE_NS: Cell<u64> = const { Cell::new(0) };
}

/// A device's compute limit, resolved.
#[derive(Clone, Copy)]
struct DeviceBudget {
    bucket: &'static ComputeBucket,
    elastic: bool,
}

/// One launch bracketed by events.
struct Sample {
    context: usize,
    start: CUevent,
    end: CUevent,
    key: LaunchKey,
    device: usize,
    charged_ns: u64,
    /// The launch followed a wait for budget, so the GPU had drained this
    /// pod's work: the bracket holds the whole launch latency.
    after_wait: bool,
}

// SAFETY: events are plain driver handles, usable from any thread.
unsafe impl Send for Sample {}

/// The compute limits of this process's pod.
pub struct Throttle {
    configured: DeviceLimits<ComputeLimit>,
    budgets: [OnceLock<Option<DeviceBudget>>; MAX_DEVICES],
    estimates: Estimates,
    samples: Mutex<VecDeque<Sample>>,
    sampled: Condvar,
    /// Spare events per context, reused by later samples.
    events: Mutex<Vec<(usize, CUevent)>>,
    monitor: Once,
    activity: OnceLock<Option<NodeActivity>>,
    pod_key: OnceLock<u64>,
    marked_at_ns: [AtomicU64; MAX_DEVICES],
    /// Contexts whose launch overhead was measured.
    calibrated: Mutex<Vec<usize>>,
    /// Launch latency inside a bracket, kernels and graphs (see
    /// [`Timing::launch_overheads`]); 0 until measured.
    kernel_overhead_ns: AtomicU64,
    graph_overhead_ns: AtomicU64,
}

// SAFETY: the event handles held are driver handles, usable from any thread;
// everything else is atomics and locks.
unsafe impl Sync for Throttle {}
// SAFETY: as above.
unsafe impl Send for Throttle {}

impl Throttle {
    pub fn new(configured: DeviceLimits<ComputeLimit>) -> Self {
        Self {
            configured,
            budgets: [const { OnceLock::new() }; MAX_DEVICES],
            estimates: Estimates::default(),
            samples: Mutex::new(VecDeque::new()),
            sampled: Condvar::new(),
            events: Mutex::new(Vec::new()),
            monitor: Once::new(),
            activity: OnceLock::new(),
            pod_key: OnceLock::new(),
            marked_at_ns: [const { AtomicU64::new(0) }; MAX_DEVICES],
            calibrated: Mutex::new(Vec::new()),
            kernel_overhead_ns: AtomicU64::new(0),
            graph_overhead_ns: AtomicU64::new(0),
        }
    }

    /// The budget of `device`, resolved once; `None` when it is unlimited.
    /// Under a hypervisor, the bucket whose limits it sets in the pod's
    /// read-only limits object, looked at on every launch: limits change live.
    fn budget(&self, device: usize) -> Option<DeviceBudget> {
        if runtime::hypervisor().is_some() {
            let bucket = runtime::bucket(device)?;
            return bucket.is_limited().then_some(DeviceBudget {
                bucket,
                elastic: false,
            });
        }
        self.budgets
            .get(device)?
            .get_or_init(|| {
                let uuid = Driver::get().and_then(|driver| driver.device_uuid(device as i32));
                let limit = self.configured.resolve(device as u32, uuid.as_deref())?;
                if limit.policy == ComputePolicy::None {
                    return None;
                }
                // Unusable ledger: already reported; launch unthrottled
                // rather than block the application for ever.
                let bucket = runtime::bucket(device)?;
                bucket.configure(limit.percent, limit.ceiling());
                tracing::debug!(device, ?uuid, ?limit, "compute limit resolved");
                Some(DeviceBudget {
                    bucket,
                    elastic: limit.policy == ComputePolicy::Elastic,
                })
            })
            .as_ref()
            .copied()
    }

    /// Admits one launch of kind `key` on `stream`, waiting for budget if
    /// there is none, then runs `launch`; `per_thread` says the launch API
    /// took stream 0 as the per-thread default stream.
    pub fn launch(
        &'static self,
        key: LaunchKey,
        stream: CUstream,
        per_thread: bool,
        launch: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let driver = Driver::get().ok_or(LimiterError::Bypass("driver not resolved"))?;
        let device = driver
            .current_device()
            .map_err(|_| LimiterError::Bypass("no current context"))?;
        let device = usize::try_from(device).map_err(|_| LimiterError::Bypass("bad device"))?;
        let budget = self
            .budget(device)
            .ok_or(LimiterError::Bypass("device unlimited"))?;
        let stream = if per_thread && stream.is_null() {
            CU_STREAM_PER_THREAD
        } else {
            stream
        };
        let timing = driver.timing.as_ref();
        if timing.is_some_and(|timing| timing.is_capturing(stream)) {
            return Err(LimiterError::Bypass("captured into a graph"));
        }

        let estimate = self.estimates.get(key);
        let cost = estimate.unwrap_or(DEFAULT_ESTIMATE_NS);
        let (now, waited) = self.wait_for_budget(budget.bucket, cost, device);
        // Every limited pod stamps the node table, so elastic pods see it.
        self.mark_active(device, now);

        let due = now.saturating_sub(LAST_SAMPLE_NS.with(Cell::get)) >= SAMPLE_INTERVAL_NS;
        let sample = match timing {
            Some(timing) if estimate.is_none() || due => self.begin_sample(timing, stream),
            _ => None,
        };
        let result = launch();
        if !result.is_success() {
            // Nothing runs: give the charge back.
            budget.bucket.correct(-(cost as i64));
        }
        if let (Some((context, start)), Some(timing)) = (sample, timing) {
            LAST_SAMPLE_NS.with(|last| last.set(now));
            let pending = Sample {
                context,
                start,
                end: std::ptr::null_mut(),
                key,
                device,
                charged_ns: cost,
                after_wait: waited,
            };
            self.end_sample(timing, pending, stream, result);
        }
        Ok(result)
    }

    /// Charges `cost` once the bucket allows it; returns the time it did,
    /// and whether it had to wait.
    fn wait_for_budget(&self, bucket: &ComputeBucket, cost: u64, device: usize) -> (u64, bool) {
        let mut now = monotonic_ns();
        let mut waited = false;
        loop {
            match bucket.admit(now, cost) {
                Admission::Pass => break,
                Admission::Wait(wait) => {
                    if !waited {
                        waited = true;
                        bucket.waiting.fetch_add(1, Ordering::Relaxed);
                    }
                    // Trap: under a hypervisor, ask it for admission; if it
                    // does not answer, the local bucket's refill decides.
                    let admitted = runtime::hypervisor().is_some_and(|link| {
                        let uuid =
                            Driver::get().and_then(|driver| driver.device_uuid(device as i32));
                        uuid.is_some_and(|uuid| link.admission(&uuid, cost).is_ok())
                    });
                    if !admitted {
                        std::thread::sleep(wait);
                    }
                    now = monotonic_ns();
                }
            }
        }
        if waited {
            bucket.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        (now, waited)
    }

    /// Measures the launch overhead once per context, at its first sample
    /// (the launching thread has that context current).
    fn calibrate(&self, timing: &Timing, context: usize) {
        let Ok(mut calibrated) = self.calibrated.lock() else {
            return;
        };
        if calibrated.contains(&context) {
            return;
        }
        calibrated.push(context);
        drop(calibrated);
        match timing.launch_overheads() {
            Some(overheads) => {
                let graph = overheads.graph_ns.unwrap_or(overheads.kernel_ns);
                self.kernel_overhead_ns
                    .store(overheads.kernel_ns, Ordering::Relaxed);
                self.graph_overhead_ns.store(graph, Ordering::Relaxed);
                tracing::debug!(?overheads, "launch overhead measured");
            }
            None => tracing::warn!("launch overhead not measured; samples include it"),
        }
    }

    /// Records a start event on `stream`, from the pool of its context.
    fn begin_sample(&'static self, timing: &Timing, stream: CUstream) -> Option<(usize, CUevent)> {
        if self.samples.lock().ok()?.len() >= MAX_PENDING_SAMPLES {
            return None;
        }
        let context = timing.stream_context(stream)? as usize;
        self.calibrate(timing, context);
        let start = self.event(timing, context)?;
        if timing.record(start, stream) {
            Some((context, start))
        } else {
            // A pooled event whose context is gone fails to record: drop it.
            timing.destroy(start);
            None
        }
    }

    /// Records the end event of `sample` (whose start is recorded) and
    /// queues it for the monitor.
    fn end_sample(
        &'static self,
        timing: &Timing,
        mut sample: Sample,
        stream: CUstream,
        result: CUresult,
    ) {
        let Some(end) = self.event(timing, sample.context) else {
            self.recycle(sample.context, sample.start);
            return;
        };
        if !result.is_success() {
            self.recycle(sample.context, sample.start);
            self.recycle(sample.context, end);
            return;
        }
        if !timing.record(end, stream) {
            timing.destroy(end);
            self.recycle(sample.context, sample.start);
            return;
        }
        sample.end = end;
        if let Ok(mut samples) = self.samples.lock() {
            samples.push_back(sample);
        }
        self.sampled.notify_one();
        self.start_monitor();
    }

    /// Starts the monitor thread, once: at the first sample, or at the first
    /// activity stamp (elastic pods need it before any sample).
    fn start_monitor(&'static self) {
        self.monitor.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("cuda-limiter-monitor".into())
                .spawn(move || self.monitor());
            if let Err(error) = spawned {
                tracing::error!(%error, "cannot start the monitor; estimates stay at defaults");
            }
        });
    }

    /// An event of `context`: a spare one, or a new one (the current context
    /// is the stream's on the launching thread).
    fn event(&self, timing: &Timing, context: usize) -> Option<CUevent> {
        if let Ok(mut spare) = self.events.lock()
            && let Some(index) = spare.iter().position(|(owner, _)| *owner == context)
        {
            return Some(spare.swap_remove(index).1);
        }
        timing.create_event()
    }

    fn recycle(&self, context: usize, event: CUevent) {
        if let Ok(mut spare) = self.events.lock() {
            spare.push((context, event));
        }
    }

    /// Stamps the node's activity table for `device`, at most every 10 ms.
    fn mark_active(&'static self, device: usize, now: u64) {
        let Some(marked) = self.marked_at_ns.get(device) else {
            return;
        };
        let last = marked.load(Ordering::Relaxed);
        if now.saturating_sub(last) < MARK_INTERVAL_NS
            || marked
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_err()
        {
            return;
        }
        if let Some(table) = self.activity() {
            table.mark(device, self.pod_key(), now);
        }
        self.start_monitor();
    }

    fn activity(&self) -> Option<&NodeActivity> {
        self.activity
            .get_or_init(|| match std::env::var(NODE_REGION_VARIABLE) {
                Ok(name) => NodeActivity::open_named(&name),
                Err(_) => NodeActivity::open(),
            }
            .map_or_else(
                |error| {
                    tracing::warn!(%error, "no node activity table: elastic pods stay at their share");
                    None
                },
                Some,
            ))
            .as_ref()
    }

    fn pod_key(&self) -> u64 {
        *self.pod_key.get_or_init(|| {
            runtime::limiter().map_or(1, |limiter| activity::pod_key(limiter.pod.as_str()))
        })
    }

    /// The monitor thread: turns completed samples into estimates and
    /// corrections, and keeps elastic pods' contention up to date.
    fn monitor(&'static self) {
        // Its own driver calls never go through the detours.
        let _guard = gpushare_utils::hook::DetourGuard::enter_always();
        let Some(timing) = Driver::get().and_then(|driver| driver.timing.as_ref()) else {
            return;
        };
        timing.relax_capture_mode();
        let mut contention_checked = monotonic_ns();
        loop {
            let now = monotonic_ns();
            if now.saturating_sub(contention_checked) >= CONTENTION_INTERVAL.as_nanos() as u64 {
                contention_checked = now;
                self.update_contention(now);
            }
            let Ok(mut samples) = self.samples.lock() else {
                return;
            };
            let Some(sample) = samples.pop_front() else {
                let wait = self.sampled.wait_timeout(samples, CONTENTION_INTERVAL);
                drop(wait);
                continue;
            };
            drop(samples);
            match timing.query(sample.end) {
                Ok(true) => self.complete(timing, sample),
                Ok(false) => {
                    if let Ok(mut samples) = self.samples.lock() {
                        samples.push_front(sample);
                    }
                    std::thread::sleep(POLL_INTERVAL);
                }
                Err(code) => {
                    // The context is gone: its events with it.
                    tracing::debug!(code = code.0, "sample lost");
                }
            }
        }
    }

    fn complete(&self, timing: &Timing, sample: Sample) {
        if let Some(bracket) = timing.elapsed_ns(sample.start, sample.end) {
            // After a wait the GPU had drained the pod's work, so the
            // bracket holds the whole launch latency, which is not kernel
            // time; otherwise the launch was queued behind earlier work and
            // started at once. A kernel no longer than the latency still
            // costs a quarter of the bracket.
            let overhead = match (sample.after_wait, sample.key.is_graph()) {
                (false, _) => 0,
                (true, true) => self.graph_overhead_ns.load(Ordering::Relaxed),
                (true, false) => self.kernel_overhead_ns.load(Ordering::Relaxed),
            };
            let measured = bracket.saturating_sub(overhead).max(bracket / 4);
            // Correct by the estimate the sample settled on, not the raw
            // sample, which may include other contexts' time slices.
            let settled = self
                .estimates
                .record(sample.key, measured)
                .unwrap_or(measured);
            if let Some(budget) = self.budget(sample.device) {
                budget
                    .bucket
                    .correct(settled as i64 - sample.charged_ns as i64);
            }
        }
        self.recycle(sample.context, sample.start);
        self.recycle(sample.context, sample.end);
    }

    fn update_contention(&self, now: u64) {
        let Some(table) = self.activity() else {
            return;
        };
        if runtime::hypervisor().is_some() {
            return; // the hypervisor decides elastic shares
        }
        for (device, budget) in self.budgets.iter().enumerate() {
            if let Some(Some(budget)) = budget.get()
                && budget.elastic
            {
                let contended = table.contended(device, self.pod_key(), now);
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

//! The monitor thread: started once, it reads completed samples into prices
//! and corrections, keeps elastic pods' contention up to date, and rests
//! (naps or parks) between samples; launching threads wake it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Once, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use gpushare_utils::bucket::monotonic_ns;

use super::Throttle;
use super::sample::Sample;
use crate::context::Context;

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
/// How often the monitor polls a sample whose events are not done.
const POLL_INTERVAL: Duration = Duration::from_micros(100);
/// How often the monitor re-checks contention for elastic pods.
const CONTENTION_INTERVAL: Duration = Duration::from_millis(50);

/// What the monitor does while it has no sample to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MonitorRest {
    /// Reading samples: it sees a new one without being woken.
    Awake,
    /// Napping [`MONITOR_NAP`]: only a first measurement wakes it.
    Napping,
    /// Parked until woken, or the next contention check.
    Parked,
}

/// A [`MonitorRest`] shared between the monitor and launching threads.
#[derive(Debug, Default)]
struct RestState(AtomicU8);

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

/// The monitor thread's handle and rest.
pub(super) struct Monitor {
    started: Once,
    thread: OnceLock<Thread>,
    rest: RestState,
}

impl Default for Monitor {
    fn default() -> Self {
        Self {
            started: Once::new(),
            thread: OnceLock::new(),
            rest: RestState::default(),
        }
    }
}

impl Monitor {
    /// Starts the thread running `run`, once.
    fn start(&self, run: impl FnOnce() + Send + 'static) {
        self.started.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("cuda-limiter-monitor".into())
                .spawn(run);
            match spawned {
                Ok(handle) => {
                    self.thread.set(handle.thread().clone()).ok();
                }
                Err(error) => {
                    tracing::error!(%error, "cannot start the monitor; launching threads read the measurements");
                }
            }
        });
    }

    /// Starting the monitor was tried and failed: launching threads read
    /// the samples.
    pub(super) fn failed(&self) -> bool {
        self.started.is_completed() && self.thread.get().is_none()
    }

    /// Tells the monitor a sample is queued (`first`: a function's first
    /// measurement, which later launches may wait for); false when no
    /// monitor runs. A napping monitor looks again within [`MONITOR_NAP`]
    /// by itself: only a first measurement wakes it (a wake is a system call
    /// on the launching thread).
    pub(super) fn notify(&self, first: bool) -> bool {
        let Some(monitor) = self.thread.get() else {
            return false;
        };
        // Pairs with the monitor's store of its rest before it looks at the
        // queue: one of the two sees the other.
        std::sync::atomic::fence(Ordering::SeqCst);
        let wake = match self.rest.load(Ordering::SeqCst) {
            MonitorRest::Parked => true,
            MonitorRest::Napping => first,
            MonitorRest::Awake => false,
        };
        if wake {
            monitor.unpark();
        }
        true
    }
}

impl Throttle {
    /// Starts the monitor thread, once: at the first sample, or at the first
    /// activity stamp (elastic pods need it before any sample).
    pub(super) fn start_monitor(&'static self, ctx: &'static Context) {
        self.monitor.start(move || self.monitor(ctx));
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
        let rest = &self.monitor.rest;
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
                None => self.sampler.pop().inspect(|sample| {
                    if !sample.relaxed {
                        binding_sampled_at = now;
                    }
                    self.sampler.backlog_from(sample.submitted_at);
                }),
            };
            let Some(sample) = sample else {
                self.sampler.backlog_cleared();
                // While the limit binds, nap; otherwise park until woken
                // (or the next contention check).
                let (state, timeout) = if now.saturating_sub(binding_sampled_at) < NAPPING_FOR_NS {
                    (MonitorRest::Napping, MONITOR_NAP)
                } else {
                    (MonitorRest::Parked, CONTENTION_INTERVAL)
                };
                rest.store(state, Ordering::SeqCst);
                if self.sampler.is_empty() {
                    std::thread::park_timeout(timeout);
                    self.held.monitor_wakeups.fetch_add(1, Ordering::Relaxed);
                }
                rest.store(MonitorRest::Awake, Ordering::SeqCst);
                continue;
            };
            if let Some(running) = self.read(ctx, timing, sample) {
                current = Some(running);
                std::thread::sleep(POLL_INTERVAL);
                self.held.monitor_wakeups.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Turns elastic pods' ceilings on while no other pod launched on their
    /// device recently, off while one did (local limits only: under a
    /// hypervisor, it decides elastic shares).
    fn update_contention(&self, ctx: &'static Context, now: u64) {
        if self.stamps.activity().is_none() || ctx.hypervisor_limits().is_some() {
            return;
        }
        for (device, budget) in self.budgets.local() {
            if !budget.elastic {
                continue;
            }
            let contended = self.stamps.contended(ctx, device, now);
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

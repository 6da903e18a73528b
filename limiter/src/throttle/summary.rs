//! What the limit cost this process, printed at exit at `CUDA_LIMITER_LOG=info`:
//! tells a limit that binds from a limiter that costs.

use std::sync::atomic::{AtomicU64, Ordering};

use gpushare_utils::bucket::monotonic_ns;
use tracing::level_filters::LevelFilter;

use super::Throttle;
use crate::context::{AtExit, register_at_exit};

/// Where this process's launches waited, summed over its threads, and when
/// it first launched: logged at exit (`CUDA_LIMITER_LOG=info`), to tell a
/// limit that binds from a limiter that costs.
#[derive(Default)]
pub(super) struct Held {
    pub(super) first_launch_ns: AtomicU64,
    pub(super) budget_ns: AtomicU64,
    pub(super) measurement_ns: AtomicU64,
    pub(super) backlog_ns: AtomicU64,
    /// Measuring the launch overhead of a context, on a launching thread.
    pub(super) calibration_ns: AtomicU64,
    /// Launches bracketed by events for the monitor to measure.
    pub(super) samples: AtomicU64,
    /// Runs of launches measured, and those that moved the bracket scale.
    pub(super) runs: AtomicU64,
    pub(super) runs_counted: AtomicU64,
    /// Samples not measured: their launch call took too long.
    pub(super) discarded_samples: AtomicU64,
    /// Times the monitor thread ran again after a nap, a park or a poll.
    pub(super) monitor_wakeups: AtomicU64,
}

impl Held {
    /// Adds the time since `since` to `counter`.
    pub(super) fn add(counter: &AtomicU64, since: u64) {
        counter.fetch_add(monotonic_ns().saturating_sub(since), Ordering::Relaxed);
    }
}

impl Throttle {
    /// Has the summary printed at exit, when the log level asks for it.
    pub(super) fn print_summary_at_exit(&'static self) {
        if LevelFilter::current() >= LevelFilter::INFO && !register_at_exit(self) {
            tracing::debug!("cannot register the exit handler: no compute summary");
        }
    }
}

impl AtExit for Throttle {
    const WHAT: &'static str = "while printing the compute summary";

    /// Prints what the launches of this process cost it, at exit, when the
    /// log level is `info` or finer (local limits; under a hypervisor,
    /// `hypervisor status` tells): per limited device, the pod's launches
    /// and GPU time charged (as a share of the wall time since this
    /// process's first launch), and the time launches waited. Printed
    /// directly: at exit, `tracing`'s thread-locals are gone.
    fn at_exit(&'static self) {
        let first = self.held.first_launch_ns.load(Ordering::Relaxed);
        if first == 0 {
            return;
        }
        // The exiting thread's prepaid time is not charged as used.
        super::lease::give_back();
        let wall_ns = monotonic_ns().saturating_sub(first).max(1);
        let ms = |ns: u64| ns as f64 / 1e6;
        let held = |counter: &AtomicU64| ms(counter.load(Ordering::Relaxed));
        let (kernel_idle_extra_ns, kernel_queued_extra_ns, kernel_idle_call_ns) =
            self.overheads.kernel_figures();
        for (device, bucket) in self.budgets.used() {
            let charged_ns = bucket.charged_ns.load(Ordering::Relaxed);
            eprintln!(
                "[cuda-limiter pid={}] compute summary: device={device} pod_launches={} \
                 pod_charged_ms={:.1} pod_forfeited_ms={:.1} wall_ms={:.1} charged_share={:.4} waited_for_budget_ms={:.1} \
                 held_for_measurements_ms={:.1} held_for_backlog_ms={:.1} held_for_calibration_ms={:.1} \
                 kernel_idle_extra_ns={} kernel_idle_call_ns={} kernel_queued_extra_ns={} samples={} \
                 discarded_samples={} runs={} runs_counted={} bracket_scale={:.4} monitor_wakeups={}",
                std::process::id(),
                bucket.launches.load(Ordering::Relaxed),
                ms(charged_ns),
                held(&bucket.forfeited_ns),
                ms(wall_ns),
                charged_ns as f64 / wall_ns as f64,
                held(&self.held.budget_ns),
                held(&self.held.measurement_ns),
                held(&self.held.backlog_ns),
                held(&self.held.calibration_ns),
                kernel_idle_extra_ns,
                kernel_idle_call_ns,
                kernel_queued_extra_ns,
                self.held.samples.load(Ordering::Relaxed),
                self.held.discarded_samples.load(Ordering::Relaxed),
                self.held.runs.load(Ordering::Relaxed),
                self.held.runs_counted.load(Ordering::Relaxed),
                f64::from(self.runs.ppm()) / f64::from(super::run::SCALE_ONE_PPM),
                self.held.monitor_wakeups.load(Ordering::Relaxed),
            );
        }
    }
}

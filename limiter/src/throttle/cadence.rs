//! Which launches are measured: about one per interval per thread, picked by
//! counting launches, not by the clock.
//!
//! "The first launch once the interval has passed" is the launch after the
//! longest gap: in a throttled loop, the one right after the thread slept
//! for budget, which finds the GPU idle, its clocks lowered, and runs
//! longer than the launches queued behind it. Priced by such launches, a
//! loop that runs in bursts paid up to a quarter more than it used (50 µs
//! kernels on the H100: 52–63 µs a launch). Counting picks launches whatever
//! the gaps before them: the next sample is a random number of launches
//! away, on average the launches of one interval at the thread's rate
//! (measured over windows of at least an interval, since launches come in
//! bursts; random, so that a loop's period cannot alias with it).
//! A thread whose rate falls is sampled at the latest after
//! [`BACKSTOP_INTERVALS`] intervals. One whose rate rises (a server busy
//! again after idling) still has the stride of its idle rate, as short as one
//! launch: past [`MAX_PER_WINDOW`] samples in one rate window (about an
//! interval), the clock decides the next, which measures the rate afresh.
//! Before, every launch of the next interval was measured (about 10 µs of
//! driver calls each on an H100: 450 samples after one idle gap).
//!
//! While the limit does not bind, the interval follows the GPU time the
//! thread is charged: one sample per [`RELAXED_CHARGED_NS`] of it, within
//! [`RELAXED_SAMPLE_INTERVAL_NS`] and [`MAX_RELAXED_INTERVAL_NS`]. A sample
//! settles what was charged since the last at the measured price, so what a
//! settlement moves is the price's error times what was charged: per unit
//! of GPU time, not of wall time, the same bound for a busy thread and a
//! light one. A thread that keeps the GPU busy a quarter of the time or more
//! is measured every 16 ms as before; one that launches small kernels at a
//! high rate on a mostly idle GPU (a host-bound loop, which pays each
//! sample's driver calls in its own time) up to 8 times less often.

use super::{
    MAX_RELAXED_INTERVAL_NS, RELAXED_CHARGED_NS, RELAXED_SAMPLE_INTERVAL_NS, SAMPLE_INTERVAL_NS,
};
use crate::hash::mix;

/// A thread that launches far less often than its last rate is sampled
/// after this many intervals.
const BACKSTOP_INTERVALS: u64 = 4;
/// Samples by count in one rate window, at most: a steady loop takes about
/// one, a loop in bursts a few.
const MAX_PER_WINDOW: u64 = 8;
/// Most launches between two samples.
const MAX_STRIDE: u64 = 1 << 16;

/// One thread's count towards its next sample.
#[derive(Debug, Clone, Copy)]
pub(super) struct Cadence {
    /// Launches left before the next sample (1: this one); 0 until a rate
    /// is measured, when the clock decides.
    left: u64,
    /// When the last sample was taken.
    sampled_at_ns: u64,
    /// The thread's launches in one interval, as last measured; 0 before.
    per_interval: u64,
    /// Launches since `window_start_ns`, over which the rate is measured:
    /// at least an interval, since launches come in bursts.
    window_launches: u64,
    /// Samples taken since `window_start_ns`.
    window_samples: u64,
    window_start_ns: u64,
    /// GPU time charged since `window_start_ns`.
    window_charged_ns: u64,
    /// The interval while the limit does not bind, from the last window's
    /// charged rate; 0 until measured ([`RELAXED_SAMPLE_INTERVAL_NS`]).
    relaxed_ns: u64,
    /// Random state.
    seed: u64,
}

// SAFETY: all integers; all zero is a thread's state before its first
// launch ([`Cadence::new`]).
unsafe impl gpushare_hook::thread_local::ZeroInit for Cadence {}

impl Cadence {
    #[cfg(test)]
    const fn new() -> Self {
        Self {
            left: 0,
            sampled_at_ns: 0,
            per_interval: 0,
            window_launches: 0,
            window_samples: 0,
            window_start_ns: 0,
            window_charged_ns: 0,
            relaxed_ns: 0,
            seed: 0,
        }
    }

    /// The sampling interval: [`SAMPLE_INTERVAL_NS`] while the limit binds,
    /// else the thread's relaxed one.
    #[inline]
    pub(super) fn interval(&self, relaxed: bool) -> u64 {
        match (relaxed, self.relaxed_ns) {
            (false, _) => SAMPLE_INTERVAL_NS,
            (true, 0) => RELAXED_SAMPLE_INTERVAL_NS,
            (true, ns) => ns,
        }
    }

    /// Counts a launch at `now` charged `charged_ns`; true when it is to be
    /// measured, the interval being `interval_ns`.
    #[inline]
    pub(super) fn due(&mut self, now: u64, interval_ns: u64, charged_ns: u64) -> bool {
        self.window_launches += 1;
        self.window_charged_ns = self.window_charged_ns.saturating_add(charged_ns);
        let since = now.saturating_sub(self.sampled_at_ns);
        match self.left {
            // No rate measured yet: by the clock.
            0 => since >= interval_ns,
            1 => true,
            _ if since >= interval_ns * BACKSTOP_INTERVALS => true,
            _ => {
                self.left -= 1;
                false
            }
        }
    }

    /// A launch was measured at `now`, `relaxed` saying whether the limit
    /// did not bind: draws how many launches away the next one is.
    pub(super) fn sampled(&mut self, now: u64, relaxed: bool) {
        let window = now.saturating_sub(self.window_start_ns);
        if self.window_start_ns == 0 || window >= self.interval(relaxed) {
            if self.window_start_ns != 0 {
                // The window closed at the old interval; the next strides
                // are drawn for the interval the window's charge sets.
                self.relaxed_ns = relaxed_interval(self.window_charged_ns, window);
                self.per_interval = ((u128::from(self.window_launches)
                    * u128::from(self.interval(relaxed))
                    + u128::from(window / 2))
                    / u128::from(window))
                .clamp(1, u128::from(MAX_STRIDE)) as u64;
            }
            self.window_start_ns = now;
            self.window_launches = 0;
            self.window_charged_ns = 0;
            self.window_samples = 0;
        }
        self.window_samples += 1;
        self.seed = mix(self.seed ^ now);
        // Uniform in [1, 2 × per_interval − 1]: the mean is one interval's
        // launches. By the clock until a rate is measured, and once the
        // thread outran the rate (its window's samples exhausted).
        self.left = match self.per_interval {
            _ if self.window_samples >= MAX_PER_WINDOW => 0,
            0 => 0,
            per_interval => 1 + self.seed % (2 * per_interval - 1),
        };
        self.sampled_at_ns = now;
    }
}

/// The relaxed interval of a thread charged `charged_ns` in `window_ns`:
/// [`RELAXED_CHARGED_NS`] of GPU time at that rate, within bounds.
fn relaxed_interval(charged_ns: u64, window_ns: u64) -> u64 {
    let interval =
        u128::from(RELAXED_CHARGED_NS) * u128::from(window_ns) / u128::from(charged_ns.max(1));
    interval.clamp(
        u128::from(RELAXED_SAMPLE_INTERVAL_NS),
        u128::from(MAX_RELAXED_INTERVAL_NS),
    ) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    /// Runs `launches` launches at the times `at(i)`, each charged
    /// `charged_ns`, through a cadence that samples every due launch, the
    /// limit binding unless `relaxed`; returns the indices sampled.
    fn sampled_with(
        launches: u64,
        relaxed: bool,
        charged_ns: u64,
        at: impl Fn(u64) -> u64,
    ) -> Vec<u64> {
        let mut cadence = Cadence::new();
        (0..launches)
            .filter(|&i| {
                let now = at(i);
                let due = cadence.due(now, cadence.interval(relaxed), charged_ns);
                if due {
                    cadence.sampled(now, relaxed);
                }
                due
            })
            .collect()
    }

    /// The same, the limit binding.
    fn sampled(launches: u64, at: impl Fn(u64) -> u64) -> Vec<u64> {
        sampled_with(launches, false, 1_000, at)
    }

    #[test]
    fn a_steady_loop_is_sampled_once_an_interval_on_average() {
        // 20 µs a launch, 2 ms interval: 100 launches an interval.
        let picks = sampled(100_000, |i| MS + i * 20_000);
        let n = picks.len() as f64;
        assert!(
            (900.0..=1_100.0).contains(&n),
            "{n} samples of 1,000 intervals"
        );
    }

    #[test]
    fn launches_after_long_gaps_are_not_favoured() {
        // Bursts of 8 launches 2 µs apart, every 400 µs: the clock would
        // pick the first of a burst every time; counting, any position.
        let at = |i: u64| MS + (i / 8) * 400_000 + (i % 8) * 2_000;
        let picks = sampled(80_000, at);
        let mut positions = [0u32; 8];
        for i in &picks {
            positions[(i % 8) as usize] += 1;
        }
        let first = f64::from(positions[0]) / picks.len() as f64;
        assert!(
            first < 0.25,
            "first of a burst in {first} of samples: {positions:?}"
        );
        assert!(positions.iter().all(|&n| n > 0), "{positions:?}");
    }

    #[test]
    fn a_loop_in_bursts_is_sampled_at_its_mean_rate() {
        // Bursts of 9 launches 1 µs apart every 3.6 ms (2,500 launches a
        // second, 5 an interval): about 500 samples a second, not one a
        // burst, nor one a rate measured inside a burst.
        let at = |i: u64| MS + (i / 9) * 3_600_000 + (i % 9) * 1_000;
        let picks = sampled(25_000, at);
        let n = picks.len() as f64;
        assert!((4_000.0..=6_000.0).contains(&n), "{n} samples in 10 s");
    }

    #[test]
    fn a_thread_busy_again_after_idling_is_not_sampled_at_every_launch() {
        // One launch, 200 ms idle (a server between requests, or a first
        // launch that loaded modules), then 10,000 launches 25 µs apart:
        // the rate measured over the idle window is one launch an interval.
        let at = |i: u64| {
            if i == 0 {
                20 * MS
            } else {
                220 * MS + i * 25_000
            }
        };
        // Charged 10 µs a launch: the relaxed interval stays at its 16 ms.
        let picks = sampled_with(10_001, true, 10_000, at);
        assert_eq!(picks[..2], [0, 1]);
        // 250 ms of launches: about 16 samples, and at most 8 at the rate of
        // the idle window, not one a launch for 16 ms.
        assert!(
            picks.len() <= 16 + 8 + 4,
            "{} samples: {picks:?}",
            picks.len()
        );
        assert!(picks.len() >= 12, "{} samples: {picks:?}", picks.len());
    }

    #[test]
    fn a_thread_that_slows_down_is_still_sampled() {
        // 10,000 launches 2 µs apart, then one every 10 ms: sampled within
        // the backstop of the slowdown.
        let at = |i: u64| {
            if i < 10_000 {
                MS + i * 2_000
            } else {
                MS + 20 * MS + (i - 10_000) * 10 * MS
            }
        };
        let picks = sampled(10_100, at);
        let late: Vec<_> = picks.iter().filter(|&&i| i >= 10_000).collect();
        assert!(
            late.len() >= 90,
            "{} of 100 slow launches sampled",
            late.len()
        );
    }

    #[test]
    fn a_light_thread_is_sampled_once_per_its_share_of_charged_gpu_time() {
        // 20 µs a launch, 1 µs charged each (5% of the GPU), the limit not
        // binding: one sample per 4 ms charged is one per 80 ms, not 16.
        let picks = sampled_with(500_000, true, 1_000, |i| MS + i * 20_000);
        let n = picks.len() as f64;
        assert!((100.0..=160.0).contains(&n), "{n} samples in 10 s");
    }

    #[test]
    fn a_busy_thread_is_sampled_every_16_ms_when_the_limit_does_not_bind() {
        // 25 µs a launch, 10 µs charged each (40% of the GPU).
        let picks = sampled_with(400_000, true, 10_000, |i| MS + i * 25_000);
        let n = picks.len() as f64;
        assert!((560.0..=690.0).contains(&n), "{n} samples in 10 s");
    }

    #[test]
    fn the_relaxed_interval_is_bounded() {
        assert_eq!(relaxed_interval(0, 1_000 * MS), MAX_RELAXED_INTERVAL_NS);
        assert_eq!(relaxed_interval(1, 1_000 * MS), MAX_RELAXED_INTERVAL_NS);
        assert_eq!(
            relaxed_interval(16 * MS, 16 * MS),
            RELAXED_SAMPLE_INTERVAL_NS
        );
        assert_eq!(relaxed_interval(RELAXED_CHARGED_NS, 50 * MS), 50 * MS);
    }

    #[test]
    fn a_light_thread_whose_limit_starts_binding_is_sampled_at_the_binding_interval() {
        // 80 ms relaxed, then 2 s binding, 20 µs a launch, 1 µs charged.
        let mut cadence = Cadence::new();
        let mut binding_samples = 0;
        for i in 0..200_000u64 {
            let now = MS + i * 20_000;
            let relaxed = i < 100_000;
            if cadence.due(now, cadence.interval(relaxed), 1_000) {
                cadence.sampled(now, relaxed);
                binding_samples += u32::from(!relaxed);
            }
        }
        assert!(
            (800..=1_200).contains(&binding_samples),
            "{binding_samples} samples in 2 s binding"
        );
    }
}

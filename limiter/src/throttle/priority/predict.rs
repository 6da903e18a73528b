//! Arrival prediction: when a latency pod's next request will launch, and
//! how long a batch thread's launches take to complete.
//!
//! - Latency side: a request starts with a launch while the process has no
//!   work in flight on the device. From the last [`STARTS`] starts, the
//!   period is the median of their intervals; the prediction (the median
//!   of the starts each extrapolated to the next request: about the last
//!   start + period, but late starts do not move it) is published on the
//!   device's line only when the starts keep to a schedule: the median
//!   distance of their extrapolations from the prediction at most period /
//!   [`MAX_SPREAD_DIVISOR`]. Judged on the starts, not on the intervals: a
//!   request held up (say queued behind a batch kernel) starts late and
//!   makes two intervals irregular, one long and one short, so two such
//!   requests among nine starts made half the intervals irregular and
//!   stopped the prediction, which let more requests queue behind batch
//!   kernels (on a loaded 2-core machine, a test's periodic pod ran into
//!   batch kernels at 40-70% of its requests once that began).
//! - Batch side: each thread keeps the launch-to-completion times its
//!   in-flight wait observed; the estimate is the second longest of the last
//!   [`SPANS`] (one outlier, say a launch delayed behind a latency request,
//!   does not move it).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Request starts kept per device: nine starts, eight intervals.
pub(super) const STARTS: usize = 9;
/// Irregular arrivals: the starts' median distance from the schedule above
/// period / 8 (a fixed schedule with host jitter of tens of µs passes, and
/// so does one with up to four of nine starts late; a Poisson stream, whose
/// starts scatter over about a period, never does, and a prediction off by
/// more than a batch kernel would only cost the batch pod without sparing
/// the latency pod).
pub(super) const MAX_SPREAD_DIVISOR: u64 = 8;
/// Launch-to-completion times kept per batch thread.
pub(super) const SPANS: usize = 8;
/// Fewer samples than this give no batch estimate (no prediction).
const MIN_SPANS: usize = 4;

/// A prediction of the next request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Prediction {
    pub next_ns: u64,
    pub period_ns: u64,
}

/// The request starts of one device in this process. Written by the thread
/// whose launch counted the process into flight (one per request), so the
/// atomics only keep a rare race between two threads well defined.
pub(super) struct Arrivals {
    starts: [AtomicU64; STARTS],
    count: AtomicU64,
}

impl Arrivals {
    pub(super) const fn new() -> Self {
        Self {
            starts: [const { AtomicU64::new(0) }; STARTS],
            count: AtomicU64::new(0),
        }
    }

    /// Records a request start at `now_ns`; the prediction it gives, if any.
    pub(super) fn record(&self, now_ns: u64) -> Option<Prediction> {
        let count = self.count.load(Ordering::Relaxed);
        self.starts[(count % STARTS as u64) as usize].store(now_ns, Ordering::Relaxed);
        let count = count + 1;
        self.count.store(count, Ordering::Relaxed);
        if count < STARTS as u64 {
            return None;
        }
        // Oldest first: the slot after the newest.
        let mut starts = [0u64; STARTS];
        for (k, start) in starts.iter_mut().enumerate() {
            *start =
                self.starts[((count + k as u64) % STARTS as u64) as usize].load(Ordering::Relaxed);
        }
        predict(&starts)
    }
}

/// The prediction from `starts` (oldest first), if they are regular.
pub(super) fn predict(starts: &[u64; STARTS]) -> Option<Prediction> {
    let mut intervals = [0u64; STARTS - 1];
    for (interval, pair) in intervals.iter_mut().zip(starts.windows(2)) {
        // Out of order (two threads raced): no prediction from this window.
        *interval = pair[1].checked_sub(pair[0])?;
    }
    let period = median(&mut intervals);
    if period == 0 {
        return None;
    }
    // Each start extrapolated to the next request; their median, rather than
    // the last start plus the period, so that late starts (a host wake-up
    // delay, a request queued behind other work) do not shift the prediction.
    let mut next = [0u64; STARTS];
    for (k, (at, start)) in next.iter_mut().zip(starts).enumerate() {
        *at = start.checked_add(period.checked_mul((STARTS - k) as u64)?)?;
    }
    next.sort_unstable();
    let next_ns = next[STARTS / 2];
    let mut distances = next.map(|at| at.abs_diff(next_ns));
    distances.sort_unstable();
    if distances[STARTS / 2] > period / MAX_SPREAD_DIVISOR {
        return None;
    }
    Some(Prediction {
        next_ns,
        period_ns: period,
    })
}

/// The median of eight values (the mean of the middle two), sorting them.
fn median(values: &mut [u64; STARTS - 1]) -> u64 {
    values.sort_unstable();
    let (low, high) = (values[3], values[4]);
    low + (high - low) / 2
}

/// One batch thread's launch-to-completion times.
pub(super) struct Spans {
    spans: [Cell<u64>; SPANS],
    count: Cell<usize>,
    /// [`kernel_estimate`] of the spans, kept current.
    estimate: Cell<u64>,
}

impl Spans {
    pub(super) const fn new() -> Self {
        Self {
            spans: [const { Cell::new(0) }; SPANS],
            count: Cell::new(0),
            estimate: Cell::new(0),
        }
    }

    pub(super) fn add(&self, ns: u64) {
        let count = self.count.get();
        self.spans[count % SPANS].set(ns);
        self.count.set(count.wrapping_add(1));
        let mut spans = [0u64; SPANS];
        let len = (count + 1).min(SPANS);
        for (span, cell) in spans.iter_mut().zip(&self.spans).take(len) {
            *span = cell.get();
        }
        self.estimate.set(kernel_estimate(&spans[..len]));
    }

    /// How long this thread's launches take to complete; 0: not known yet.
    pub(super) fn estimate(&self) -> u64 {
        self.estimate.get()
    }
}

/// The second longest of `spans`; 0 with fewer than [`MIN_SPANS`].
pub(super) fn kernel_estimate(spans: &[u64]) -> u64 {
    if spans.len() < MIN_SPANS {
        return 0;
    }
    let (mut first, mut second) = (0, 0);
    for &span in spans {
        if span > first {
            (first, second) = (span, first);
        } else if span > second {
            second = span;
        }
    }
    second
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;

    fn starts(intervals: [u64; STARTS - 1]) -> [u64; STARTS] {
        let mut starts = [5_000 * MS; STARTS];
        for k in 1..STARTS {
            starts[k] = starts[k - 1] + intervals[k - 1];
        }
        starts
    }

    #[test]
    fn a_regular_schedule_is_predicted() {
        let starts = starts([2 * MS; 8]);
        assert_eq!(
            predict(&starts),
            Some(Prediction {
                next_ns: starts[8] + 2 * MS,
                period_ns: 2 * MS
            })
        );
    }

    #[test]
    fn jitter_within_an_eighth_is_predicted_and_one_missed_request_ignored() {
        // ±60 µs of host jitter and one request that came a period late.
        let jittery = [
            2 * MS + 60 * US,
            2 * MS - 40 * US,
            4 * MS,
            2 * MS - 60 * US,
            2 * MS + 20 * US,
            2 * MS,
            2 * MS - 10 * US,
            2 * MS + 30 * US,
        ];
        let mut starts = starts(jittery);
        let prediction = predict(&starts).expect("regular enough");
        assert!(
            prediction.period_ns.abs_diff(2 * MS) <= 30 * US,
            "{prediction:?}"
        );
        let next = prediction.next_ns;
        assert!(
            next.abs_diff(starts[8] + 2 * MS) <= 100 * US,
            "{prediction:?}"
        );
        // The last request came 150 µs late: the next is expected on the
        // schedule, not 150 µs late too.
        starts[8] += 150 * US;
        let late = predict(&starts).expect("still regular");
        assert!(late.next_ns.abs_diff(next) <= 30 * US, "{late:?} vs {next}");
    }

    #[test]
    fn requests_held_up_now_and_then_keep_the_schedule_predicted() {
        // A 2 ms schedule on which three of nine requests started 1 ms late
        // (queued behind a batch kernel): six of the eight intervals are 1
        // or 3 ms, but the starts keep to the schedule.
        let mut starts = starts([2 * MS; 8]);
        for late in [1, 4, 7] {
            starts[late] += MS;
        }
        let prediction = predict(&starts).expect("on schedule but for three late starts");
        assert_eq!(prediction.period_ns, 2 * MS);
        assert_eq!(prediction.next_ns, starts[0] + 18 * MS);
        // Five of nine late, each by another amount: no schedule is kept.
        let mut starts = self::starts([2 * MS; 8]);
        for (k, late) in [(1, 300), (3, 600), (4, 900), (6, 1_200), (7, 1_500)] {
            starts[k] += late * US;
        }
        assert_eq!(predict(&starts), None);
    }

    #[test]
    fn irregular_arrivals_are_not_predicted() {
        // Exponential-like intervals around 2 ms.
        let poisson = [
            300 * US,
            3_900 * US,
            1_100 * US,
            2_600 * US,
            700 * US,
            5_200 * US,
            1_500 * US,
            900 * US,
        ];
        assert_eq!(predict(&starts(poisson)), None);
        // Every interval off by a quarter period, alternately long and short:
        // the starts drift off any schedule.
        let wobbly = [
            2_500 * US,
            1_500 * US,
            2_500 * US,
            2_500 * US,
            1_500 * US,
            1_500 * US,
            2_500 * US,
            2_500 * US,
        ];
        assert_eq!(predict(&starts(wobbly)), None);
        // Two requests at the same instant, or out of order.
        assert_eq!(predict(&starts([0; 8])), None);
        let mut backwards = starts([2 * MS; 8]);
        backwards.swap(3, 4);
        assert_eq!(predict(&backwards), None);
    }

    #[test]
    fn nine_starts_are_needed_and_the_window_slides() {
        let arrivals = Arrivals::new();
        let t = 7_000 * MS;
        for k in 0..8 {
            assert_eq!(arrivals.record(t + k * 2 * MS), None, "start {k}");
        }
        let prediction = arrivals.record(t + 16 * MS).expect("nine starts");
        assert_eq!(
            (prediction.next_ns, prediction.period_ns),
            (t + 18 * MS, 2 * MS)
        );
        // The schedule changes to 3 ms: once most intervals are 3 ms, the
        // period follows; while they are half and half, no prediction.
        let mut at = t + 16 * MS;
        let mut seen = Vec::new();
        for _ in 0..8 {
            at += 3 * MS;
            seen.push(arrivals.record(at).map(|p| p.period_ns));
        }
        let want: Vec<Option<u64>> =
            [[Some(2 * MS); 3].as_slice(), &[None], &[Some(3 * MS); 4]].concat();
        assert_eq!(seen, want);
    }

    #[test]
    fn the_batch_estimate_is_the_second_longest_of_the_last_eight() {
        assert_eq!(kernel_estimate(&[200 * US; 3]), 0);
        assert_eq!(
            kernel_estimate(&[200 * US, 210 * US, 190 * US, 5 * MS]),
            210 * US
        );
        let spans = Spans::new();
        for _ in 0..3 {
            spans.add(200 * US);
        }
        assert_eq!(spans.estimate(), 0);
        spans.add(9 * MS); // one outlier
        assert_eq!(spans.estimate(), 200 * US);
        for _ in 0..7 {
            spans.add(100 * US);
        }
        // The outlier is still among the last eight; it is ignored.
        assert_eq!(spans.estimate(), 100 * US);
        spans.add(3 * MS);
        spans.add(3 * MS);
        assert_eq!(spans.estimate(), 3 * MS);
    }
}

//! The admission latency histogram: fixed buckets of atomic counts that
//! every admission records into without a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::status::LatencySnapshot;

/// Upper bounds of the latency buckets, in microseconds.
pub const LATENCY_BOUNDS_US: [u64; 12] = [
    50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 1_000_000,
];

/// Admission latency, from the request's arrival to the answer.
#[derive(Debug, Default)]
pub struct LatencyHistogram {
    /// One more than the bounds: the last counts everything above.
    counts: [AtomicU64; LATENCY_BOUNDS_US.len() + 1],
    sum_ns: AtomicU64,
    count: AtomicU64,
    /// Requests answered with no budget: the pod's bucket refills later
    /// than the admission's hold, or the pod is suspended.
    timeouts: AtomicU64,
}

impl LatencyHistogram {
    /// Counts one admission request that took `took` from arrival to answer;
    /// `granted` false counts it as a timeout too (no budget in the hold).
    pub fn record(&self, took: Duration, granted: bool) {
        let us = took.as_micros();
        let at = LATENCY_BOUNDS_US
            .iter()
            .position(|&b| us <= u128::from(b))
            .unwrap_or(LATENCY_BOUNDS_US.len());
        self.counts[at].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.count.fetch_add(1, Ordering::Relaxed);
        if !granted {
            self.timeouts.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The counts so far, for the status and `/metrics`; concurrent
    /// records may land in some fields and not yet in others.
    pub fn snapshot(&self) -> LatencySnapshot {
        let buckets = self
            .counts
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    LATENCY_BOUNDS_US.get(i).copied().unwrap_or(u64::MAX),
                    c.load(Ordering::Relaxed),
                )
            })
            .collect();
        LatencySnapshot {
            buckets,
            count: self.count.load(Ordering::Relaxed),
            sum_seconds: self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9,
            timeouts: self.timeouts.load(Ordering::Relaxed),
        }
    }
}

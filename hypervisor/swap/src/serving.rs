//! How the node serves its swapped pods, for the status and the metrics:
//! swaps by cause (ahead of need, on demand, by an operator), the waits of
//! swap-ins and allocations by cause, the last swaps in order, and the
//! pods resident on each GPU (which the daemon adds when it reports).

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The upper bounds, in seconds, of the wait histograms' buckets.
pub const WAIT_BOUNDS_S: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// How many swaps [`ServingReport::recent`] keeps.
pub const RECENT: usize = 64;

/// Why a swap was done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwapCause {
    /// Out ahead of need: to keep a GPU's `headroom` free.
    Ahead,
    /// On demand: out to make room for an allocation or a swap-in, or in
    /// at a trapped call of the pod.
    Demand,
    /// Asked by an operator (a swap, a drain).
    Operator,
}

impl SwapCause {
    /// As the metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ahead => "ahead",
            Self::Demand => "demand",
            Self::Operator => "operator",
        }
    }
}

/// Which way a swap went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// To host memory.
    Out,
    /// Back to the GPUs.
    In,
}

impl Direction {
    /// As the metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Out => "out",
            Self::In => "in",
        }
    }
}

/// What a swap-in or an allocation waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitCause {
    /// A trapped call's swap-in, behind the swaps under way or asked first.
    Queue,
    /// A swap-in, for the pods swapped out to make its room (none where the
    /// GPU had it free, as `headroom` keeps it).
    SwapOut,
    /// A swap-in, for its own restore.
    SwapIn,
    /// An allocation the GPU could not hold, for the room made for it; a
    /// swap-in refused for want of room, from its pod's first ask until
    /// it is back.
    Room,
}

impl WaitCause {
    /// As the metrics label it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queue => "queue",
            Self::SwapOut => "swap_out",
            Self::SwapIn => "swap_in",
            Self::Room => "room",
        }
    }
}

/// Waits of one cause: how many fell in each bucket of [`WAIT_BOUNDS_S`]
/// (not cumulative; the last count is over the last bound), their sum.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Waits {
    /// Waits per bucket, one more than [`WAIT_BOUNDS_S`].
    pub buckets: Vec<u64>,
    /// How many waits.
    pub count: u64,
    /// Their seconds together.
    pub sum_s: f64,
}

impl Waits {
    fn record(&mut self, waited: Duration) {
        let seconds = waited.as_secs_f64();
        if self.buckets.len() != WAIT_BOUNDS_S.len() + 1 {
            self.buckets = vec![0; WAIT_BOUNDS_S.len() + 1];
        }
        let at = WAIT_BOUNDS_S.partition_point(|&bound| bound < seconds);
        self.buckets[at] += 1;
        self.count += 1;
        self.sum_s += seconds;
    }
}

/// One swap done, in the order they were.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwapEvent {
    /// The pod.
    pub pod: String,
    /// Out or in.
    pub direction: Direction,
    /// Why.
    pub cause: SwapCause,
}

/// A pod on its GPU, for the resident set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentPod {
    /// The pod.
    pub pod: String,
    /// Bytes it holds there by its ledger.
    pub bytes: u64,
}

/// How the node serves its swapped pods, as the status shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ServingReport {
    /// By GPU UUID: its pods that are on it now.
    pub resident: BTreeMap<String, Vec<ResidentPod>>,
    /// Pods whose swap-in waits for room, in the order they asked.
    pub waiting: Vec<String>,
    /// Swaps done, by direction and cause: `"out.ahead"`, `"in.demand"`…
    pub swaps: BTreeMap<String, u64>,
    /// Waits by cause.
    pub waits: BTreeMap<WaitCause, Waits>,
    /// The last [`RECENT`] swaps, oldest first.
    pub recent: VecDeque<SwapEvent>,
}

impl ServingReport {
    /// Swaps done `direction` for `cause`.
    pub fn swaps_of(&self, direction: Direction, cause: SwapCause) -> u64 {
        self.swaps
            .get(&swap_key(direction, cause))
            .copied()
            .unwrap_or(0)
    }

    /// What pod `pod` may see: the node's counts and waits, and of the
    /// pods its own alone.
    pub fn only(&mut self, pod: &str) {
        for pods in self.resident.values_mut() {
            pods.retain(|p| p.pod == pod);
        }
        self.resident.retain(|_, pods| !pods.is_empty());
        self.waiting.retain(|p| p == pod);
        self.recent.retain(|e| e.pod == pod);
    }

    /// Waits recorded for `cause`.
    pub fn waits_of(&self, cause: WaitCause) -> u64 {
        self.waits.get(&cause).map_or(0, |w| w.count)
    }
}

fn swap_key(direction: Direction, cause: SwapCause) -> String {
    format!("{}.{}", direction.as_str(), cause.as_str())
}

/// The swaps by cause, the waits and the last swaps, recorded as they are
/// done.
#[derive(Debug, Default)]
pub struct ServingBoard {
    inner: Mutex<ServingReport>,
}

impl ServingBoard {
    /// A swap of `pod` was done `direction` for `cause`.
    pub fn swapped(&self, pod: &str, direction: Direction, cause: SwapCause) {
        let mut inner = self.lock();
        *inner.swaps.entry(swap_key(direction, cause)).or_default() += 1;
        if inner.recent.len() == RECENT {
            inner.recent.pop_front();
        }
        inner.recent.push_back(SwapEvent {
            pod: pod.to_owned(),
            direction,
            cause,
        });
    }

    /// Something waited `waited` for `cause`.
    pub fn waited(&self, cause: WaitCause, waited: Duration) {
        self.lock().waits.entry(cause).or_default().record(waited);
    }

    /// The report, with `resident` and `waiting` as the daemon sees them.
    pub fn report(
        &self,
        resident: BTreeMap<String, Vec<ResidentPod>>,
        waiting: Vec<String>,
    ) -> ServingReport {
        ServingReport {
            resident,
            waiting,
            ..self.lock().clone()
        }
    }

    fn lock(&self) -> MutexGuard<'_, ServingReport> {
        // Every update is one step: a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swaps_are_counted_by_cause_and_the_last_kept_in_order() {
        let board = ServingBoard::default();
        board.swapped("a", Direction::Out, SwapCause::Ahead);
        board.swapped("b", Direction::In, SwapCause::Demand);
        for _ in 1..RECENT {
            board.swapped("c", Direction::Out, SwapCause::Demand);
        }
        let report = board.report(BTreeMap::new(), Vec::new());
        assert_eq!(report.swaps_of(Direction::Out, SwapCause::Ahead), 1);
        assert_eq!(report.swaps_of(Direction::In, SwapCause::Demand), 1);
        assert_eq!(
            report.swaps_of(Direction::Out, SwapCause::Demand),
            RECENT as u64 - 1
        );
        assert_eq!(report.swaps_of(Direction::In, SwapCause::Operator), 0);
        assert_eq!(report.recent.len(), RECENT);
        assert_eq!(report.recent[0].pod, "b", "the oldest went first");
    }

    #[test]
    fn waits_fall_in_their_buckets() {
        let board = ServingBoard::default();
        board.waited(WaitCause::SwapIn, Duration::from_millis(3));
        board.waited(WaitCause::SwapIn, Duration::from_millis(10));
        board.waited(WaitCause::SwapIn, Duration::from_secs(40));
        let report = board.report(BTreeMap::new(), Vec::new());
        let waits = &report.waits[&WaitCause::SwapIn];
        assert_eq!(waits.count, 3);
        assert_eq!(waits.buckets[0], 1, "up to 5 ms");
        assert_eq!(waits.buckets[1], 1, "a bound is within its bucket");
        assert_eq!(waits.buckets[WAIT_BOUNDS_S.len()], 1, "over the last");
        assert!((waits.sum_s - 40.013).abs() < 1e-9);
        assert_eq!(report.waits_of(WaitCause::Room), 0);
    }
}

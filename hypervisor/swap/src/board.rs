//! Each pod's swap state as the status, the metrics and the API show it.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpushare_utils::limits::Residency;
use serde::{Deserialize, Serialize};

/// One pod's record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodSwap {
    /// Where it is, as the daemon last moved it.
    pub state: Residency,
    /// Bytes of its device memory in host memory now.
    pub bytes_on_host: u64,
    /// Seconds since the epoch when it reached its state.
    pub since: u64,
    /// Why the last swap of the pod failed; `None` once one succeeds.
    pub last_error: Option<String>,
    /// Swaps out done.
    pub swap_outs: u64,
    /// Swaps in done.
    pub swap_ins: u64,
    /// Swaps refused or failed.
    pub failures: u64,
    /// Seconds the last swap-out took.
    pub last_swap_out_s: Option<f64>,
    /// Seconds the last swap-in took.
    pub last_swap_in_s: Option<f64>,
    /// A move to another GPU under way: its limits are there already, its
    /// processes are held until they are restored there.
    pub moving: Option<Move>,
    /// Moves to another GPU done.
    pub moves: u64,
    /// Seconds the last move took (out of one GPU and into the other).
    pub last_move_s: Option<f64>,
}

/// A pod's move between two GPUs of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    /// The GPU it leaves.
    pub from: String,
    /// The GPU it goes to.
    pub to: String,
}

impl Default for PodSwap {
    fn default() -> Self {
        Self {
            state: Residency::Resident,
            bytes_on_host: 0,
            since: now_s(),
            last_error: None,
            swap_outs: 0,
            swap_ins: 0,
            failures: 0,
            last_swap_out_s: None,
            last_swap_in_s: None,
            moving: None,
            moves: 0,
            last_move_s: None,
        }
    }
}

/// Totals over the node, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SwapTotals {
    /// Pods in host memory now.
    pub swapped_pods: u64,
    /// Their bytes in host memory.
    pub bytes_on_host: u64,
    /// Swaps out done since start.
    pub swap_outs: u64,
    /// Swaps in done since start.
    pub swap_ins: u64,
    /// Swaps refused or failed since start.
    pub failures: u64,
    /// Seconds spent swapping out since start.
    pub swap_out_seconds: f64,
    /// Seconds spent swapping in since start.
    pub swap_in_seconds: f64,
    /// Moves to another GPU done since start.
    pub moves: u64,
    /// Seconds spent moving since start.
    pub move_seconds: f64,
}

/// Every pod's record, and the node's totals.
#[derive(Debug, Default)]
pub struct SwapBoard {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    pods: BTreeMap<String, PodSwap>,
    totals: SwapTotals,
}

impl SwapBoard {
    /// The pod's record (a resident one when it never swapped).
    pub fn pod(&self, pod: &str) -> PodSwap {
        self.lock().pods.get(pod).cloned().unwrap_or_default()
    }

    /// Every pod that ever swapped.
    pub fn pods(&self) -> BTreeMap<String, PodSwap> {
        self.lock().pods.clone()
    }

    /// The node's totals.
    pub fn totals(&self) -> SwapTotals {
        let inner = self.lock();
        let mut totals = inner.totals;
        totals.swapped_pods = inner
            .pods
            .values()
            .filter(|p| p.state != Residency::Resident)
            .count() as u64;
        totals.bytes_on_host = inner.pods.values().map(|p| p.bytes_on_host).sum();
        totals
    }

    /// The pod moves to `state`.
    pub fn set_state(&self, pod: &str, state: Residency) {
        let mut inner = self.lock();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.state = state;
        record.since = now_s();
    }

    /// A swap-out of `bytes` finished in `took`.
    pub fn swapped_out(&self, pod: &str, bytes: u64, took: Duration) {
        let mut inner = self.lock();
        inner.totals.swap_outs += 1;
        inner.totals.swap_out_seconds += took.as_secs_f64();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.state = Residency::Swapped;
        record.since = now_s();
        record.bytes_on_host = bytes;
        record.swap_outs += 1;
        record.last_error = None;
        record.last_swap_out_s = Some(took.as_secs_f64());
    }

    /// A swap-in finished in `took`.
    pub fn swapped_in(&self, pod: &str, took: Duration) {
        let mut inner = self.lock();
        inner.totals.swap_ins += 1;
        inner.totals.swap_in_seconds += took.as_secs_f64();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.state = Residency::Resident;
        record.since = now_s();
        record.bytes_on_host = 0;
        record.swap_ins += 1;
        record.last_error = None;
        record.last_swap_in_s = Some(took.as_secs_f64());
    }

    /// The pod, in host memory, is moving to another GPU: the next swap-in
    /// restores it there; `None`: no move is under way (moved back to the
    /// GPU its processes are on before any restore).
    pub fn moving(&self, pod: &str, to: Option<Move>) {
        self.lock().pods.entry(pod.to_owned()).or_default().moving = to;
    }

    /// The move under way of `pod`, if any.
    pub fn move_of(&self, pod: &str) -> Option<Move> {
        self.lock().pods.get(pod).and_then(|p| p.moving.clone())
    }

    /// The pod's move finished in `took` (out of its GPU and into the
    /// other), with the swap-in that ended it.
    pub fn moved(&self, pod: &str, took: Duration) {
        let mut inner = self.lock();
        inner.totals.moves += 1;
        inner.totals.move_seconds += took.as_secs_f64();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.moving = None;
        record.moves += 1;
        record.last_move_s = Some(took.as_secs_f64());
    }

    /// A swap failed; the pod is left in `state`.
    pub fn failed(&self, pod: &str, state: Residency, error: &str) {
        let mut inner = self.lock();
        inner.totals.failures += 1;
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.state = state;
        record.since = now_s();
        if state == Residency::Resident {
            record.bytes_on_host = 0;
        }
        record.failures += 1;
        record.last_error = Some(error.to_owned());
    }

    /// A pod found in host memory that this board did not know of (swapped
    /// by an earlier run of the daemon) holds `bytes` there.
    pub fn found_swapped(&self, pod: &str, bytes: u64) {
        let mut inner = self.lock();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        if record.state == Residency::Resident {
            record.state = Residency::Swapped;
            record.bytes_on_host = bytes;
            record.since = now_s();
        }
    }

    /// The swapped pod's processes all exited: its host memory went with
    /// them, and the pod is resident again (a new process starts on its GPU).
    pub fn processes_gone(&self, pod: &str) {
        let mut inner = self.lock();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.state = Residency::Resident;
        record.bytes_on_host = 0;
        record.moving = None;
        record.since = now_s();
    }

    /// The pod is gone: its record goes (its processes' host memory went
    /// with them).
    pub fn forget(&self, pod: &str) {
        self.lock().pods.remove(pod);
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update is one step: a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

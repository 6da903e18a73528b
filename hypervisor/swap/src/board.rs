//! Each pod's swap history, for the status, the metrics and the API.
//!
//! Where a pod's memory is (its [`Residency`]) is not kept here: the pod's
//! limits object holds it, which its processes obey and a restarted daemon
//! finds. The board keeps what that object cannot (bytes in host memory,
//! durations, the last error, the move under way, counts) and joins the
//! two only when it reports ([`SwapBoard::report`]), so the status can
//! never show a pod anywhere but where its limits say.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use gpushare_utils::limits::Residency;
use serde::{Deserialize, Serialize};

/// One pod's history of swaps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwapHistory {
    /// Bytes of its device memory in host memory, as its last swap-out put
    /// there (or, for a pod an earlier run of the daemon left away, as its
    /// ledger said when found); reported only while the pod is away.
    pub bytes_on_host: u64,
    /// Seconds since the epoch when it last changed residency.
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
    /// How the last swap-out moved the pod's memory; `None` before any (or
    /// for a pod an earlier run of the daemon swapped).
    #[serde(default)]
    pub last_swap_out_path: Option<SwapPath>,
    /// How the last swap-in brought it back.
    #[serde(default)]
    pub last_swap_in_path: Option<SwapPath>,
    /// Bytes the last swap-out moved to host memory.
    #[serde(default)]
    pub last_bytes_out: u64,
    /// Bytes the last swap-in brought back to the GPU.
    #[serde(default)]
    pub last_bytes_in: u64,
    /// Pinned host memory its processes keep of their fast swaps while the
    /// pod is on its GPUs, so that its next swap-out runs at the speed of
    /// the link: counted against `host_limit`, and given back when another
    /// pod's swap-out needs the room. Reported only while the pod is
    /// resident (away, its host memory is `bytes_on_host`).
    #[serde(default)]
    pub host_kept_bytes: u64,
    /// Why its last swap-out that could have gone by the fast path (every
    /// process backs its memory) was undone there, for the driver's
    /// checkpoint to take: a process refused or failed its own, or left
    /// memory its limiter does not back on the GPUs. `None` once a
    /// swap-out goes by the fast path.
    #[serde(default)]
    pub fast_declined: Option<String>,
    /// Its processes, whose memory they moved to host memory themselves,
    /// were then checkpointed by the driver (what they still held: their
    /// contexts), so that a move can restore them on another GPU: its next
    /// swap-in restores them first, then they bring their memory back.
    #[serde(default)]
    pub contexts_checkpointed: bool,
}

/// How a swap moved a pod's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SwapPath {
    /// The driver's checkpoint of every process (through pageable memory).
    Checkpoint,
    /// Each process's limiter moved the memory it backs itself to pinned
    /// host memory and back (`CUDA_LIMITER_FAST_SWAP`), at the speed of
    /// the link.
    Fast,
}

impl SwapPath {
    /// As the status and the metrics say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Checkpoint => "checkpoint",
            Self::Fast => "fast",
        }
    }
}

/// A finished swap: how, how many bytes, how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Swapped {
    /// The path it took.
    pub path: SwapPath,
    /// Bytes moved.
    pub bytes: u64,
    /// What it took.
    pub took: Duration,
    /// Pinned host memory the pod's processes keep after it (a fast
    /// swap-in's host copies; none for the driver's checkpoint).
    pub kept: u64,
}

/// One pod as the status shows it: where it is, read from its limits
/// object, beside its history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodSwap {
    /// Where its device memory is.
    pub state: Residency,
    /// Its swaps.
    #[serde(flatten)]
    pub history: SwapHistory,
}

/// A pod's move between two GPUs of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    /// The GPU it leaves.
    pub from: String,
    /// The GPU it goes to.
    pub to: String,
}

impl Default for SwapHistory {
    fn default() -> Self {
        Self {
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
            last_swap_out_path: None,
            last_swap_in_path: None,
            last_bytes_out: 0,
            last_bytes_in: 0,
            host_kept_bytes: 0,
            fast_declined: None,
            contexts_checkpointed: false,
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
    /// Swaps out done by the fast path since start (the others by the
    /// driver's checkpoint).
    pub fast_swap_outs: u64,
    /// Swaps in done by the fast path since start.
    pub fast_swap_ins: u64,
    /// Bytes moved to host memory since start.
    pub bytes_out: u64,
    /// Bytes moved back to the GPUs since start.
    pub bytes_in: u64,
    /// Pinned host memory that resident pods' processes keep for their
    /// next fast swap-out (each pod's `host_kept_bytes`).
    #[serde(default)]
    pub host_kept_bytes: u64,
    /// Idle pods whose processes made and pinned their host copies ahead
    /// of a swap-out since start.
    #[serde(default)]
    pub host_prepares: u64,
    /// The bytes those pinned.
    #[serde(default)]
    pub host_prepared_bytes: u64,
}

/// The node's swaps as the status shows them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SwapReport {
    /// Over the node.
    pub totals: SwapTotals,
    /// By pod id: each pod that ever swapped, or is away now.
    pub pods: BTreeMap<String, PodSwap>,
    /// How the node serves its pods: the resident set of each GPU, the
    /// pods waiting for room, swaps by cause, waits by cause.
    #[serde(default)]
    pub serving: crate::ServingReport,
}

/// Every pod's history, and the node's totals.
#[derive(Debug, Default)]
pub struct SwapBoard {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    pods: BTreeMap<String, SwapHistory>,
    totals: SwapTotals,
}

impl SwapBoard {
    /// The pod's history (an empty one when it never swapped).
    pub fn history(&self, pod: &str) -> SwapHistory {
        self.lock().pods.get(pod).cloned().unwrap_or_default()
    }

    /// The pod as the status shows it, `state` being where its limits
    /// object says it is.
    pub fn pod(&self, pod: &str, state: Residency) -> PodSwap {
        joined(self.history(pod), state)
    }

    /// The report for the pods `residencies` names, each where its limits
    /// object says: those that ever swapped or are away now, and the
    /// node's totals. Bytes in host memory count only for a pod away.
    pub fn report<'a>(
        &self,
        residencies: impl IntoIterator<Item = (&'a str, Residency)>,
    ) -> SwapReport {
        let inner = self.lock();
        let mut report = SwapReport {
            totals: inner.totals,
            pods: BTreeMap::new(),
            serving: crate::ServingReport::default(),
        };
        for (pod, state) in residencies {
            let history = match inner.pods.get(pod) {
                Some(history) => history.clone(),
                None if state != Residency::Resident => SwapHistory::default(),
                None => continue,
            };
            let shown = joined(history, state);
            if state == Residency::Resident {
                report.totals.host_kept_bytes += shown.history.host_kept_bytes;
            } else {
                report.totals.swapped_pods += 1;
                report.totals.bytes_on_host += shown.history.bytes_on_host;
            }
            report.pods.insert(pod.to_owned(), shown);
        }
        report
    }

    /// The pod's residency changed with no swap done (one begins, or the
    /// daemon found it away).
    pub fn changed(&self, pod: &str) {
        self.update(pod, |record| record.since = now_s());
    }

    /// A swap-out finished: `out.bytes` are in host memory.
    pub fn swapped_out(&self, pod: &str, out: Swapped) {
        let mut inner = self.lock();
        inner.totals.swap_outs += 1;
        inner.totals.fast_swap_outs += u64::from(out.path == SwapPath::Fast);
        inner.totals.bytes_out = inner.totals.bytes_out.saturating_add(out.bytes);
        inner.totals.swap_out_seconds += out.took.as_secs_f64();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.since = now_s();
        record.bytes_on_host = out.bytes;
        record.host_kept_bytes = 0;
        record.swap_outs += 1;
        record.last_error = None;
        record.last_swap_out_s = Some(out.took.as_secs_f64());
        record.last_swap_out_path = Some(out.path);
        record.contexts_checkpointed = false;
        if out.path == SwapPath::Fast {
            record.fast_declined = None;
        }
        record.last_bytes_out = out.bytes;
    }

    /// A swap-in finished: `back.bytes` are on the GPUs again.
    pub fn swapped_in(&self, pod: &str, back: Swapped) {
        let mut inner = self.lock();
        inner.totals.swap_ins += 1;
        inner.totals.fast_swap_ins += u64::from(back.path == SwapPath::Fast);
        inner.totals.bytes_in = inner.totals.bytes_in.saturating_add(back.bytes);
        inner.totals.swap_in_seconds += back.took.as_secs_f64();
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.since = now_s();
        record.bytes_on_host = 0;
        record.host_kept_bytes = back.kept;
        record.swap_ins += 1;
        record.last_error = None;
        record.last_swap_in_s = Some(back.took.as_secs_f64());
        record.last_swap_in_path = Some(back.path);
        record.last_bytes_in = back.bytes;
        record.contexts_checkpointed = false;
    }

    /// A fast swap-out of the pod was undone, for the reason `why`.
    pub fn fast_declined(&self, pod: &str, why: &str) {
        self.update(pod, |record| record.fast_declined = Some(why.to_owned()));
    }

    /// The processes of the pod, away by the fast path, were checkpointed
    /// by the driver (`true`: what they still held, for a move), or
    /// restored (`false`).
    pub fn contexts_checkpointed(&self, pod: &str, checkpointed: bool) {
        self.update(pod, |record| record.contexts_checkpointed = checkpointed);
    }

    /// The pod's processes keep `kept` bytes of host copies now (they gave
    /// some back, or are asked to prepare them).
    pub fn host_kept(&self, pod: &str, kept: u64) {
        self.update(pod, |record| record.host_kept_bytes = kept);
    }

    /// The pod's processes pinned `pinned` bytes of host copies ahead of a
    /// swap-out: they keep `kept` bytes now (`None`: the pod was swapped
    /// out meanwhile, and the copies hold its bytes away).
    pub fn host_prepared(&self, pod: &str, kept: Option<u64>, pinned: u64) {
        let mut inner = self.lock();
        inner.totals.host_prepares += 1;
        inner.totals.host_prepared_bytes = inner.totals.host_prepared_bytes.saturating_add(pinned);
        if let Some(kept) = kept {
            inner
                .pods
                .entry(pod.to_owned())
                .or_default()
                .host_kept_bytes = kept;
        }
    }

    /// The pod, in host memory, is moving to another GPU: the next swap-in
    /// restores it there; `None`: no move is under way (moved back to the
    /// GPU its processes are on before any restore).
    pub fn moving(&self, pod: &str, to: Option<Move>) {
        self.update(pod, |record| record.moving = to);
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

    /// A swap failed and left the pod `left`: back on its GPUs (its bytes
    /// in host memory are none), or still away.
    pub fn failed(&self, pod: &str, left: Residency, error: &str) {
        let mut inner = self.lock();
        inner.totals.failures += 1;
        let record = inner.pods.entry(pod.to_owned()).or_default();
        record.since = now_s();
        if left == Residency::Resident {
            record.bytes_on_host = 0;
        }
        record.failures += 1;
        record.last_error = Some(error.to_owned());
    }

    /// A pod found away whose bytes in host memory the board does not know
    /// (an earlier run of the daemon swapped it) holds `bytes` there.
    pub fn found_away(&self, pod: &str, bytes: u64) {
        self.update(pod, |record| {
            if record.bytes_on_host == 0 && bytes != 0 {
                record.bytes_on_host = bytes;
                record.since = now_s();
            }
        });
    }

    /// The swapped pod's processes all exited: its host memory went with
    /// them, and the pod is resident again (a new process starts on its GPU).
    pub fn processes_gone(&self, pod: &str) {
        self.update(pod, |record| {
            record.bytes_on_host = 0;
            record.host_kept_bytes = 0;
            record.moving = None;
            record.contexts_checkpointed = false;
            record.since = now_s();
        });
    }

    /// The pod is gone: its record goes (its processes' host memory went
    /// with them).
    pub fn forget(&self, pod: &str) {
        self.lock().pods.remove(pod);
    }

    fn update(&self, pod: &str, change: impl FnOnce(&mut SwapHistory)) {
        change(self.lock().pods.entry(pod.to_owned()).or_default());
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update is one step: a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The `history` of a pod that is `state`: nothing of it in host memory
/// while it is resident, whatever the history last saw, but the copies
/// its processes keep; those are its bytes in host memory while it is away.
fn joined(mut history: SwapHistory, state: Residency) -> PodSwap {
    if state == Residency::Resident {
        history.bytes_on_host = 0;
    } else {
        history.host_kept_bytes = 0;
    }
    PodSwap { state, history }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests;

//! Host copies that resident pods' processes keep of their fast swaps.
//!
//! A process that swapped its memory out by the fast path keeps its pinned
//! host copies after it is back on the GPU: its next swap-out then runs at
//! the speed of the link instead of pinning first. Those copies are host
//! memory all the same, so they count against `[swap] host_limit` beside
//! the bytes of pods away; when a swap-out needs room under the cap, other
//! pods' kept copies are given back (`Command::ReleaseHost`), those of the
//! most recently called pods first, before the swap-out is refused.
//!
//! **Prepared ahead** (`[swap] prepare_ahead`, a budget): a pod's
//! first fast swap-out would pin fresh host memory as it copies, seconds
//! for tens of GiB. Once a second, the idle pod that goes next on a GPU
//! (the policy's `prepare_next`: on an overcommitting GPU the next to
//! make room, on any other the likeliest to be swapped out by hand or by
//! a drain, in the same order) and lacks copies (it
//! was never asked, gave its copies back since, or has grown by
//! [`PREPARE_STEP`] since it was last asked) is asked to make them
//! (`Command::PrepareHost`) while it stays on its GPU, where the copies
//! resident pods keep stay within `prepare_ahead`, and `host_limit` and
//! the host's available memory leave room for them: its swap-out, when it
//! comes, only copies. The budget keeps host memory for what the pods
//! themselves need: pinned memory cannot be paged. One pod at a time on
//! the node, outside the swap lock; the bytes are counted as kept from the
//! moment they are asked for. A pod whose processes could not is not
//! asked again until it grows: a process that cannot answer (an older
//! limiter) holds the next pod's turn only once.
//!
//! **Ready**: a pod whose processes keep copies of all it holds (kept from
//! a fast swap-in that kept them all, or prepared), or are making them, is
//! ready, and goes first when room is made (the policy's ranking): its
//! swap-out only copies.

use std::sync::atomic::Ordering;

use gpushare_utils::clock::monotonic_ms;
use gpushare_utils::limits::Residency;
use gpushare_utils::protocol::{Command, CommandResult};
use http_bidir_comm::ClientId;
use hypervisor_config::SwapSettings;
use hypervisor_core::scheduler::SwapView;
use hypervisor_swap::{Candidate, SwapTotals};

use super::SwapRefusal;
use super::fast::answer_within;
use super::room::room_policy;
use crate::{Hypervisor, lock};

/// How much a pod's memory on its GPUs grows, by its ledger, before its
/// processes are asked again for the host copies they lack: a program
/// that allocates as it works gets copies for its new memory too.
const PREPARE_STEP: u64 = 256 << 20;

impl Hypervisor {
    /// Makes room under `[swap] host_limit` for `pod`'s swap-out of
    /// `bytes`; see the module documentation. The pod's own kept copies
    /// hold its bytes already: it needs only the rest.
    pub(super) async fn host_room_for(&self, pod: &str, bytes: u64) -> Result<(), SwapRefusal> {
        let limit = self.core().settings.swap.host_limit;
        loop {
            let report = self.swap_status();
            let own = report
                .pods
                .get(pod)
                .map_or(0, |p| p.history.host_kept_bytes);
            let needed = bytes.saturating_sub(own);
            let on_host = report
                .totals
                .bytes_on_host
                .saturating_add(report.totals.host_kept_bytes)
                .saturating_sub(own);
            if on_host.saturating_add(needed) <= limit {
                return Ok(());
            }
            let first = self.first_to_give_back(
                report
                    .pods
                    .iter()
                    .filter(|(other, swap)| *other != pod && swap.history.host_kept_bytes > 0)
                    .map(|(other, _)| other.clone()),
            );
            let full = SwapRefusal::HostFull {
                on_host,
                limit,
                bytes: needed,
            };
            match first {
                // Nothing given back: refused rather than asked again.
                Some(other) if self.release_host_of(&other).await > 0 => {}
                _ => return Err(full),
            }
        }
    }

    /// Of the pods `keeping` host copies, the one to give them back first:
    /// the most recently called.
    fn first_to_give_back(&self, keeping: impl Iterator<Item = String>) -> Option<String> {
        let views = self.core().scheduler.swap_views();
        let mut kept: Vec<(String, u64)> = keeping
            .map(|pod| {
                let last_call = views
                    .iter()
                    .find(|v| v.pod == pod)
                    .map_or(u64::MAX, |v| v.region.last_call_ms());
                (pod, last_call)
            })
            .collect();
        hypervisor_swap::give_back_order(&mut kept);
        kept.into_iter().next().map(|(pod, _)| pod)
    }

    /// Whether the pod of `view` has its host copies ready: its processes
    /// keep copies of all it holds, or are making them (a swap-out then
    /// waits for what is left of that, and only copies).
    pub(super) fn copies_ready(&self, view: &SwapView, kept: u64) -> bool {
        kept > 0 && !self.lacks_copies(view)
    }

    /// Whether `pod`'s processes are making host copies now.
    pub(super) fn being_prepared(&self, pod: &str) -> bool {
        lock(&self.shared.swapper.being_prepared).as_deref() == Some(pod)
    }

    /// Whether the pod of `view` lacks host copies of what it holds: its
    /// processes were never asked for them (nor brought it back keeping
    /// them all), gave them back since, or it has grown by
    /// [`PREPARE_STEP`] since.
    pub(super) fn lacks_copies(&self, view: &SwapView) -> bool {
        // What it holds on all its GPUs, as `prepare` records it.
        let at = lock(&self.shared.swapper.prepared_at)
            .get(&view.pod)
            .copied();
        at.is_none_or(|at| view.bytes() > at.saturating_add(PREPARE_STEP))
    }

    /// Records, as the pod of `view` is brought back, whether its
    /// processes keep host copies of `all` it holds (a fast swap-in that
    /// kept every copy it brought back) or lack some.
    pub(super) fn copies_kept(&self, view: &SwapView, all: bool) {
        let mut prepared_at = lock(&self.shared.swapper.prepared_at);
        if all {
            prepared_at.insert(view.pod.clone(), view.bytes());
        } else {
            prepared_at.remove(&view.pod);
        }
    }

    /// The host memory copies may be made in: what `host_limit` leaves
    /// beside the bytes of pods away and the copies kept (the board's
    /// `totals`), and the host's available memory leaves beside its
    /// reserve.
    pub(super) fn room_to_prepare(settings: &SwapSettings, totals: &SwapTotals) -> u64 {
        let taken = totals.bytes_on_host.saturating_add(totals.host_kept_bytes);
        let available = hypervisor_swap::host::available().map_or(u64::MAX, |available| {
            available.saturating_sub(hypervisor_swap::HOST_RESERVE)
        });
        settings.host_limit.saturating_sub(taken).min(available)
    }

    /// Asks `pod`'s `workers` to prepare its copies, unless another pod's
    /// are being prepared (false then).
    pub(super) async fn prepare_alone(&self, pod: &str, workers: &[ClientId]) -> bool {
        let preparing = &self.shared.swapper.preparing;
        if preparing.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.prepare(pod, workers).await;
        preparing.store(false, Ordering::Release);
        true
    }

    /// Asks the idle pod that goes next on a GPU to pin its host copies
    /// ahead of its swap-out; see the module documentation.
    pub(crate) async fn prepare_ahead(&self) {
        let preparing = &self.shared.swapper.preparing;
        if preparing.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some((pod, workers)) = self.pod_to_prepare().await {
            self.prepare(&pod, &workers).await;
        }
        preparing.store(false, Ordering::Release);
    }

    /// The pod [`Self::prepare_ahead`] prepares and its workers: the first
    /// the policy gives on a GPU among the pods whose processes all take
    /// the fast path and lack copies.
    async fn pod_to_prepare(&self) -> Option<(String, Vec<ClientId>)> {
        for (uuid, settings) in self.all_gpus() {
            if settings.prepare_ahead == 0 {
                continue;
            }
            let (views, candidates) = self.candidates_on(&uuid, |_| true);
            // A pod that room never takes (it is also on a GPU that does
            // not overcommit) may still be swapped by hand or drained.
            let candidates: Vec<Candidate> = candidates
                .into_iter()
                .map(|candidate| Candidate {
                    stays: false,
                    ..candidate
                })
                .collect();
            let totals = self.swap_status().totals;
            let host_room = Self::room_to_prepare(&settings, &totals).min(
                settings
                    .prepare_ahead
                    .saturating_sub(totals.host_kept_bytes),
            );
            let lacks = |candidate: &Candidate| {
                views
                    .iter()
                    .find(|v| v.pod == candidate.pod)
                    .is_none_or(|view| self.lacks_copies(view))
            };
            // The pods' processes are proven (a walk of `/proc`) in the
            // order the policy gives, only until one takes the fast path.
            let mut slow: Vec<String> = Vec::new();
            while let Some(next) = hypervisor_swap::prepare_next(
                &candidates,
                |c| !slow.contains(&c.pod) && lacks(c),
                host_room,
                monotonic_ms(),
                room_policy(&settings),
            ) {
                let pids = self.pids_of(&next.pod).await;
                match self.fast_workers(&next.pod, &pids) {
                    // Copies of a pod holding managed memory would go
                    // unused: its swap-out is the checkpoint's.
                    Some(workers) if !self.holds_managed(&next.pod) => {
                        return Some((next.pod.clone(), workers));
                    }
                    _ => slow.push(next.pod.clone()),
                }
            }
            tracing::debug!(gpu = %uuid, host_room, "no idle pod to prepare within the host room");
        }
        None
    }

    /// Whether a process of `pod` last answered that it holds managed
    /// memory, which its own swap cannot move.
    fn holds_managed(&self, pod: &str) -> bool {
        self.core()
            .workers
            .last_answer_says(pod, |result| result.managed_bytes > 0)
    }

    /// Asks `pod`'s `workers` to prepare, counting the bytes it holds on its
    /// GPUs as kept meanwhile; records what they keep after, while the pod
    /// is still resident (a swap since has recorded its own).
    async fn prepare(&self, pod: &str, workers: &[ClientId]) {
        let board = self.swap_board();
        let holds = self
            .core()
            .scheduler
            .swap_views()
            .iter()
            .find(|v| v.pod == pod)
            .map_or(0, SwapView::bytes);
        board.host_kept(pod, holds);
        // Counted from now; a swap-out asked meanwhile waits for the copies
        // (its processes answer commands in turn), then only copies.
        lock(&self.shared.swapper.prepared_at).insert(pod.to_owned(), holds);
        *lock(&self.shared.swapper.being_prepared) = Some(pod.to_owned());
        let answers = self
            .ask(workers, &Command::PrepareHost, answer_within(holds))
            .await;
        let (mut kept, mut pinned) = (0u64, 0u64);
        for (worker, answer) in answers {
            match answer {
                Ok(CommandResult {
                    ok: true,
                    swap: Some(report),
                    ..
                }) => {
                    kept = kept.saturating_add(report.pinned_bytes);
                    pinned = pinned.saturating_add(report.pinned_new_bytes);
                }
                Ok(CommandResult { message, .. }) => {
                    tracing::warn!(pod, %worker, %message, "host copies not prepared");
                }
                Err(why) => tracing::warn!(pod, %worker, %why, "host copies not prepared"),
            }
        }
        *lock(&self.shared.swapper.being_prepared) = None;
        let _one = self.shared.swapper.ops.lock().await;
        let views = self.core().scheduler.swap_views();
        let view = views.iter().find(|v| v.pod == pod);
        // Copies are of the memory the pod holds on its GPUs: a report of
        // more (a process lying, to fill host_limit for its neighbours'
        // swaps) is believed only up to that.
        let bound = view.map_or(0, SwapView::bytes);
        let (kept, pinned) = (kept.min(bound), pinned.min(bound));
        // A pod swapped out meanwhile (its swap-out waited for these
        // copies) has them as its bytes away, not as copies kept.
        let kept = view
            .is_some_and(|v| v.region.residency() == Residency::Resident)
            .then_some(kept);
        lock(&self.shared.swapper.prepared_at)
            .retain(|known, _| views.iter().any(|v| v.pod == *known));
        if pinned == 0 {
            if let Some(kept) = kept {
                board.host_kept(pod, kept);
            }
            return;
        }
        board.host_prepared(pod, kept, pinned);
        tracing::info!(
            pod,
            pinned,
            ?kept,
            "host copies prepared ahead of a swap-out"
        );
    }

    /// Asks `pod`'s processes to give back the host copies they keep;
    /// records what they keep after (a process that did not answer keeps
    /// its own). The bytes given back.
    pub(super) async fn release_host_of(&self, pod: &str) -> u64 {
        let workers = self.workers_of(pod);
        let answers = self
            .ask(&workers, &Command::ReleaseHost, answer_within(0))
            .await;
        let mut released = 0u64;
        for (worker, answer) in answers {
            match answer {
                Ok(CommandResult {
                    ok: true,
                    swap: Some(report),
                    ..
                }) => released = released.saturating_add(report.bytes),
                Ok(CommandResult { message, .. }) => {
                    tracing::warn!(pod, %worker, %message, "host copies not given back");
                }
                Err(why) => tracing::warn!(pod, %worker, %why, "host copies not given back"),
            }
        }
        let board = self.swap_board();
        let kept = board.history(pod).host_kept_bytes.saturating_sub(released);
        board.host_kept(pod, kept);
        lock(&self.shared.swapper.prepared_at).remove(pod);
        tracing::info!(
            pod,
            released,
            kept,
            "a resident pod's host copies given back for another's swap"
        );
        released
    }
}

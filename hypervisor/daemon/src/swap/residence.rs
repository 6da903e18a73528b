//! Where each pod's device memory is, in one book: the pod's limits object,
//! which its processes' calls obey and a restarted daemon finds. The swap
//! board keeps only the history (bytes in host memory, durations, errors,
//! counts). [`Residence`] is the daemon's one writer of a pod's residency:
//! each change writes the limits object and records the board's history in
//! the same call; the status, the metrics and the API read the residency
//! from the limits object alone.
//!
//! The sweep is left with what no swap of this run records: a pod an
//! earlier run left away (its bytes in host memory, its move under way),
//! and a swapped pod whose processes all exited.

use gpushare_utils::limits::Residency;
use hypervisor_config::SwapSettings;
use hypervisor_core::region::PodRegion;
use hypervisor_core::scheduler::SwapView;
use std::collections::BTreeMap;

use hypervisor_swap::{PodSwap, ResidentPod, SwapBoard, SwapReport, Swapped};

use crate::{Hypervisor, lock};

/// One pod's residency and its board history, changed together.
pub(super) struct Residence<'a> {
    pod: &'a str,
    region: &'a PodRegion,
    board: &'a SwapBoard,
}

impl<'a> Residence<'a> {
    pub(super) fn new(view: &'a SwapView, board: &'a SwapBoard) -> Self {
        Self {
            pod: &view.pod,
            region: &view.region,
            board,
        }
    }

    /// Where the pod's device memory is.
    pub(super) fn residency(&self) -> Residency {
        self.region.residency()
    }

    /// A swap-out begins: the pod's calls wait from now on.
    pub(super) fn swapping_out(&self) {
        self.region.set_residency(Residency::SwappingOut);
        self.board.changed(self.pod);
    }

    /// The pod's memory is in host memory, as `out` says.
    pub(super) fn swapped_out(&self, out: Swapped) {
        self.region.set_residency(Residency::Swapped);
        self.board.swapped_out(self.pod, out);
    }

    /// The swap-out failed with `error`, undone: the pod runs on.
    pub(super) fn swap_out_failed(&self, error: &str) {
        self.region.set_residency(Residency::Resident);
        self.board.failed(self.pod, Residency::Resident, error);
    }

    /// The fast swap-out was undone for the reason `why`: the driver's
    /// checkpoint is tried next.
    pub(super) fn fast_declined(&self, why: &str) {
        self.swap_out_failed(why);
        self.board.fast_declined(self.pod, why);
    }

    /// A swap-out failed with `error` half-way and could not be undone:
    /// `out` is in host memory, and the pod stays away for its next
    /// swap-in.
    pub(super) fn left_away(&self, out: Swapped, error: &str) {
        self.region.set_residency(Residency::Swapped);
        self.board.swapped_out(self.pod, out);
        self.board.failed(self.pod, Residency::Swapped, error);
    }

    /// A swap-in begins.
    pub(super) fn swapping_in(&self) {
        self.region.set_residency(Residency::SwappingIn);
        self.board.changed(self.pod);
    }

    /// The pod is back on its GPUs, as `back` says.
    pub(super) fn swapped_in(&self, back: Swapped) {
        self.region.set_residency(Residency::Resident);
        self.board.swapped_in(self.pod, back);
    }

    /// The swap-in failed with `error`: the pod stays in host memory, for
    /// the next swap-in to try again.
    pub(super) fn swap_in_failed(&self, error: &str) {
        self.region.set_residency(Residency::Swapped);
        self.board.failed(self.pod, Residency::Swapped, error);
    }

    /// A pod found away with no swap of this run under way reads swapped:
    /// its next swap-in finishes what an earlier run left half-way.
    fn settle(&self) {
        if self.residency() != Residency::Swapped {
            self.region.set_residency(Residency::Swapped);
            self.board.changed(self.pod);
        }
    }

    /// The pod, away, holds `bytes` in host memory by its ledger; the
    /// board's own figure, from a swap-out of this run, stands.
    fn found_away(&self, bytes: u64) {
        self.board.found_away(self.pod, bytes);
    }

    /// The swapped pod's processes all exited: it is resident again, with
    /// no move waiting, and its host memory is free.
    fn processes_gone(&self) {
        self.region.set_pending_move(None);
        self.region.set_residency(Residency::Resident);
        self.board.processes_gone(self.pod);
    }
}

impl Hypervisor {
    /// The node's swaps: each scheduled pod that ever swapped or is away
    /// now, where its limits object says it is, and the node's totals.
    pub fn swap_status(&self) -> SwapReport {
        let views = self.core().scheduler.swap_views();
        let mut report = self
            .swap_board()
            .report(views.iter().map(|v| (v.pod.as_str(), v.region.residency())));
        let mut resident: BTreeMap<String, Vec<ResidentPod>> = BTreeMap::new();
        for view in &views {
            if view.region.residency() != Residency::Resident {
                continue;
            }
            for gpu in &view.gpus {
                resident
                    .entry(gpu.uuid.to_ascii_lowercase())
                    .or_default()
                    .push(ResidentPod {
                        pod: view.pod.clone(),
                        bytes: gpu.bytes,
                    });
            }
        }
        let swapper = &self.shared.swapper;
        report.serving = swapper.serving.report(resident, swapper.asks.waiting());
        report
    }

    /// An allocation waited `waited` for the room asked for it.
    pub(crate) fn waited_for_room(&self, waited: std::time::Duration) {
        let serving = &self.shared.swapper.serving;
        serving.waited(hypervisor_swap::WaitCause::Room, waited);
    }

    /// The pod `pod` as the status shows it: where its limits object says
    /// (resident where it has none: it is not scheduled), with its history.
    pub fn pod_swap(&self, pod: &str) -> PodSwap {
        let view = self.core().scheduler.swap_view(pod);
        let residency = view.map_or(Residency::Resident, |v| v.region.residency());
        self.swap_board().pod(pod, residency)
    }

    /// The host memory `settings`' `host_limit` leaves for more swapped
    /// pods, beside those away in host memory now.
    pub(super) fn host_room(&self, settings: &SwapSettings) -> u64 {
        settings
            .host_limit
            .saturating_sub(self.swap_status().totals.bytes_on_host)
    }

    /// Once a second, while no swap runs: a pod this run did not swap but
    /// finds away (an earlier run swapped it, or died half-way) reads
    /// swapped, its bytes in host memory and its move under way are
    /// recorded, and its processes' next call brings it back; a swapped pod
    /// whose processes all exited is resident again; a resident pod whose
    /// processes all left keeps no host copies (they went with them).
    pub(crate) async fn sweep_swapped(&self) {
        let Ok(_one) = self.shared.swapper.ops.try_lock() else {
            return;
        };
        let (away, resident): (Vec<SwapView>, Vec<SwapView>) = self
            .core()
            .scheduler
            .swap_views()
            .into_iter()
            .partition(|v| v.region.residency() != Residency::Resident);
        let board = self.swap_board();
        for view in resident {
            let workerless = self.core().workers.in_pod(&view.pod).next().is_none();
            if workerless && board.history(&view.pod).host_kept_bytes > 0 {
                board.host_kept(&view.pod, 0);
                lock(&self.shared.swapper.prepared_at).remove(&view.pod);
                tracing::info!(pod = %view.pod, "the pod's processes left; the host copies they kept went with them");
            }
        }
        for view in away {
            let residence = Residence::new(&view, board);
            residence.settle();
            let pids = self.pids_of(&view.pod).await;
            let alive = pids.iter().any(|&pid| {
                !gpushare_utils::process::process_is_gone(i32::try_from(pid).unwrap_or(i32::MAX), 0)
            });
            // Processes the daemon cannot see (another pid namespace, not
            // yet adopted) still hold their ledger's bytes until reclaimed.
            if alive || view.bytes() > 0 {
                residence.found_away(view.bytes());
                if board.move_of(&view.pod).is_none() {
                    board.moving(&view.pod, self.pending_move(&view));
                }
            } else {
                residence.processes_gone();
                tracing::info!(pod = %view.pod, "the swapped pod's processes exited; its host memory is free");
            }
        }
    }
}

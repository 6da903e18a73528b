//! A move of a pod whose processes back their memory themselves
//! (`CUDA_LIMITER_FAST_SWAP`): the processes move their memory to host
//! memory at the speed of the link, then the driver's checkpoint takes
//! only what they still hold on the GPU (their contexts and the driver's
//! memory for them, a few hundred MiB each), so that its restore can put
//! them on the other GPU; once restored there, they bring their memory
//! back onto it, again at the speed of the link. The driver's checkpoint
//! alone moves every byte through pageable memory, at a tenth of that.
//!
//! An active pod (a CUDA call as the move begins, for a while) and one
//! whose processes cannot move their memory themselves move by the
//! checkpoint alone, as before.

use hypervisor_core::scheduler::SwapView;
use hypervisor_swap::{SwapError, SwapPath};

use super::{SwapRefusal, Wait, flatten};
use crate::Hypervisor;

impl Hypervisor {
    /// Takes the resident pod off its GPU for a move, its processes
    /// `pids` held in the driver's checkpoint at the end, so that a
    /// restore can put them on another GPU; how its memory went.
    pub(super) async fn swap_out_for_move(
        &self,
        view: &SwapView,
        pids: &[u32],
    ) -> Result<SwapPath, SwapRefusal> {
        if self.fast_workers(&view.pod, pids).is_none() {
            self.swap_out_locked(view, Wait::No).await?;
            return Ok(SwapPath::Checkpoint);
        }
        match self.swap_out_locked(view, Wait::Quiet).await {
            Ok(_) => {}
            // A busy pod moves all the same: the checkpoint's lock waits
            // for the work it submitted.
            Err(SwapRefusal::Swap(SwapError::Active)) => {
                self.swap_out_locked(view, Wait::No).await?;
                return Ok(SwapPath::Checkpoint);
            }
            Err(error) => return Err(error),
        }
        let history = self.swap_board().history(&view.pod);
        if history.last_swap_out_path != Some(SwapPath::Fast) {
            return Ok(SwapPath::Checkpoint);
        }
        if let Err(error) = self.checkpoint_contexts(view, pids.to_vec()).await {
            // Nothing moved yet: the pod comes back where it was.
            if let Err(back) = self.swap_in_locked(view).await {
                tracing::error!(pod = %view.pod, error = %back, "the pod could not come back after its processes' checkpoint failed");
            }
            return Err(error);
        }
        Ok(SwapPath::Fast)
    }

    /// Checkpoints the processes `pids` of a pod that is away by the fast
    /// path (what they still hold: their contexts), for a move: its next
    /// swap-in restores them, onto the GPU it moves to, before they bring
    /// their memory back. The pod is away already, its calls held at the
    /// limiter's gate: nothing waits for it to be idle.
    pub(super) async fn checkpoint_contexts(
        &self,
        view: &SwapView,
        pids: Vec<u32>,
    ) -> Result<(), SwapRefusal> {
        let driver = self.checkpoint_driver().await?;
        let outcome =
            tokio::task::spawn_blocking(move || hypervisor_swap::swap_out(&driver, &pids, || true))
                .await;
        match flatten(outcome) {
            Ok(timing) => {
                self.swap_board().contexts_checkpointed(&view.pod, true);
                tracing::info!(pod = %view.pod, seconds = timing.total().as_secs_f64(), "the processes of a pod away by the fast path checkpointed, for a move");
                Ok(())
            }
            Err(error) => {
                tracing::warn!(pod = %view.pod, %error, "the processes of a pod away by the fast path could not be checkpointed for a move");
                Err(error)
            }
        }
    }
}

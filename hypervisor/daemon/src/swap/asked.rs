//! A trapped call's swap-in (`POST /api/v1/swap-in`), served in the order
//! the pods asked: asks take the node's swap lock in the order they
//! arrive, and a pod refused for want of room keeps its place
//! (`hypervisor-swap`'s `asks`), so a later ask for a GPU it waits on
//! waits behind it ([`SwapRefusal::Behind`]) instead of taking the room
//! first. Each swap-in's wait is recorded by cause: behind other swaps,
//! for the swap-outs made for it, for its own restore (the last two in
//! `Hypervisor::swap_in_locked`), and, for a pod refused for want of room
//! on the way, from its first ask until it is back.

use std::time::Instant;

use gpushare_utils::limits::Residency;
use gpushare_utils::protocol::SwapAnswer;
use hypervisor_swap::{SwapCause, WaitCause};

use super::{SwapRefusal, answer};
use crate::Hypervisor;

impl Hypervisor {
    /// Brings `pod` back for its processes' trapped call, in its turn; once
    /// it is back, idle pods are swapped out in the background to keep the
    /// GPUs' headroom.
    pub async fn swap_in_asked(&self, pod: &str) -> Result<SwapAnswer, SwapRefusal> {
        let asked = Instant::now();
        let asks = self.shared.swapper.asks.clone();
        let _asking = asks.ask(pod);
        let pod = pod.to_owned();
        let back = self
            .exclusive(move |hv| async move {
                let view = hv.view(&pod)?;
                let serving = &hv.shared.swapper.serving;
                if view.region.residency() == Residency::Resident {
                    asks.served(&pod);
                    return Ok((answer(&view), false));
                }
                if let Some(first) = hv.first_waiting_before(&view) {
                    return Err(SwapRefusal::Behind { first });
                }
                serving.waited(WaitCause::Queue, asked.elapsed());
                match hv.swap_in_counted(&view, SwapCause::Demand).await {
                    Ok(took) => {
                        if let Some(waited) = asks.served(&pod) {
                            serving.waited(WaitCause::Room, waited);
                        }
                        Ok((answer(&view), took.is_some()))
                    }
                    Err(error) => {
                        if matches!(error, SwapRefusal::NoRoom { .. }) {
                            asks.refused_for_room(&pod);
                        }
                        Err(error)
                    }
                }
            })
            .await?;
        let (answer, swapped) = back;
        if swapped {
            let hv = self.clone();
            tokio::spawn(async move { hv.keep_headroom().await });
        }
        Ok(answer)
    }

    /// The first pod that asked before `view`'s and still waits for room on
    /// one of its GPUs.
    fn first_waiting_before(&self, view: &hypervisor_core::scheduler::SwapView) -> Option<String> {
        let ahead = self.shared.swapper.asks.ahead_of(&view.pod);
        if ahead.is_empty() {
            return None;
        }
        let core = self.core();
        ahead.into_iter().find(|pod| {
            core.scheduler.swap_view(pod).is_some_and(|other| {
                other.region.residency() != Residency::Resident
                    && other.gpus.iter().any(|g| {
                        view.gpus
                            .iter()
                            .any(|mine| mine.uuid.eq_ignore_ascii_case(&g.uuid))
                    })
            })
        })
    }
}

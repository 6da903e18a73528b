//! A trapped call's swap-in (`POST /api/v1/swap-in`), served in the order
//! the pods asked: asks take the node's swap lock in the order they
//! arrive, and a pod refused for want of room keeps its place
//! (`hypervisor-swap`'s `asks`), so a later ask for a GPU it waits on
//! waits behind it ([`SwapRefusal::Behind`]) instead of taking the room
//! first: while room can be made for it now, and, once it has waited
//! `room_wait`, while room could ever be made for it. Otherwise later pods
//! pass it, so a pod that cannot come back does not hold up those that
//! can, and one that waited long has what frees up kept for it. Each
//! swap-in's wait is recorded by cause: behind other swaps, for the
//! swap-outs made for it, for its own restore (the last two in
//! `Hypervisor::swap_in_locked`), and, for a pod refused for want of room
//! on the way, from its first ask until it is back.

use std::time::{Duration, Instant};

use gpushare_utils::clock::monotonic_ms;
use gpushare_utils::limits::Residency;
use gpushare_utils::protocol::SwapAnswer;
use hypervisor_core::scheduler::SwapView;
use hypervisor_swap::{SwapCause, WaitCause, room_ever, room_now};

use super::room::{room_policy, within_quota};
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

    /// The first pod that asked before `view`'s, still waits for room on
    /// one of its GPUs and keeps its place there ([`Self::keeps_its_place`]).
    fn first_waiting_before(&self, view: &SwapView) -> Option<String> {
        let ahead = self.shared.swapper.asks.ahead_of(&view.pod);
        if ahead.is_empty() {
            return None;
        }
        let waiting: Vec<(SwapView, Duration)> = {
            let core = self.core();
            ahead
                .into_iter()
                .filter_map(|(pod, waited)| Some((core.scheduler.swap_view(&pod)?, waited)))
                .filter(|(other, _)| {
                    other.region.residency() != Residency::Resident
                        && other.gpus.iter().any(|g| {
                            view.gpus
                                .iter()
                                .any(|mine| mine.uuid.eq_ignore_ascii_case(&g.uuid))
                        })
                })
                .collect()
        };
        waiting
            .into_iter()
            .find(|(other, waited)| self.keeps_its_place(other, *waited))
            .map(|(other, _)| other.pod)
    }

    /// Whether `waiting`, a pod that first asked `waited` ago and was
    /// refused for want of room, keeps later asks behind it: while room can
    /// be made for it now on every GPU it needs (its next ask takes it, not
    /// a later pod); and once it has waited `room_wait`, while room could
    /// ever be made for it there (what frees up is kept for it). A later pod
    /// passes it otherwise: one that cannot come back yet, or can never come
    /// back while the pods that never go hold their memory, does not hold
    /// up the pods that can.
    fn keeps_its_place(&self, waiting: &SwapView, waited: Duration) -> bool {
        let settings = self.core().settings.swap.clone();
        let host_room = self.host_room(&settings);
        let (policy, now) = (room_policy(&settings), monotonic_ms());
        let aged = waited >= settings.room_wait;
        waiting.gpus.iter().all(|gpu| {
            let need = within_quota(waiting, &gpu.uuid, gpu.bytes);
            let Some(free) = self.free_on(&gpu.uuid) else {
                return true;
            };
            let (_, candidates) = self.candidates_on(&gpu.uuid, |pod| pod != waiting.pod);
            room_now(&candidates, need, free, host_room, now, policy)
                || (aged && room_ever(&candidates, need, free, host_room, policy))
        })
    }
}

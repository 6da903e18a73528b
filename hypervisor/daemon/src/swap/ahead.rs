//! Ahead of need: the pods' uses sampled from their last-call stamps
//! (every [`USE_SAMPLE`]), which rank the idle pods, and each overcommitting
//! GPU's `headroom` kept free by swapping idle pods out in the background
//! (once a second, and after each swap-in a trapped call asked for), so
//! that a swapped pod's call waits for its own swap-in only, not for a
//! swap-out first.
//!
//! Background swap-outs give way: each takes the node's swap lock only
//! when no swap holds or waits for it, one pod at a time, and never a pod
//! brought back within `min_resident`. Nor do they hold the lock while
//! host memory is pinned: a pod whose processes take the fast path and
//! lack host copies has them made first, outside the lock
//! (`Command::PrepareHost`), and its swap-out, in a pass after, only
//! copies; a request that needs a swap meanwhile does not wait seconds
//! of pinning behind it. Where the host has no room for those copies but
//! by giving back the copies another pod keeps, and that pod may go
//! itself within moments (just brought back, or just called), the pass
//! waits for it once instead: its swap-out only copies, where giving its
//! copies back would cost a pinning now and another at its own next
//! swap-out (a pod brought back for one request, on a host full of
//! swapped pods, is then the one that goes again).

use std::sync::Arc;
use std::time::Duration;

use gpushare_utils::clock::monotonic_ms;
use http_bidir_comm::ClientId;
use hypervisor_swap::{RoomFor, SwapCause};

use super::room::room_policy;
use crate::Hypervisor;

/// How often the pods' last-call stamps are sampled: finer than a use
/// (`hypervisor_swap::uses::CORRELATED_MS`), so that two uses apart are
/// seen apart.
pub(crate) const USE_SAMPLE: Duration = Duration::from_millis(100);

/// The most pods one background pass swaps out (or has prepared).
const PASS: usize = 8;

/// What one step of a background pass did.
enum Step {
    /// A pod went.
    Went,
    /// The pod chosen could not go: the next is tried.
    CouldNot(String),
    /// The pod chosen lacks host copies: its workers make them first,
    /// outside the swap lock.
    Prepare(String, Vec<ClientId>),
    /// The pod chosen lacks host copies the host has no room for, and a
    /// pod that keeps its copies may go this soon: the pass waits for it
    /// rather than give its copies back to make another's.
    Wait(Duration),
}

impl Hypervisor {
    /// Samples every scheduled pod's last-call stamp into its uses, and
    /// forgets the pods no longer scheduled.
    pub(crate) fn sample_uses(&self) {
        let views = self.core().scheduler.swap_views();
        let uses = &self.shared.swapper.uses;
        let now = monotonic_ms();
        for view in &views {
            uses.observe(&view.pod, view.region.last_call_ms(), now);
        }
        uses.retain(|pod| views.iter().any(|v| v.pod == pod));
    }

    /// Swaps idle pods out, one at a time while no other swap holds or
    /// waits for the lock, until each overcommitting GPU has its
    /// `headroom` free, or no idle pod can go.
    pub(crate) async fn keep_headroom(&self) {
        let mut passed_over: Vec<String> = Vec::new();
        let mut may_wait = true;
        for _ in 0..PASS {
            let Ok(one) = Arc::clone(&self.shared.swapper.ops).try_lock_owned() else {
                return;
            };
            let hv = self.clone();
            let skip = passed_over.clone();
            let went = tokio::spawn(async move {
                let _one = one;
                hv.swap_one_ahead(&skip, may_wait).await
            })
            .await;
            match went {
                Ok(Some(Step::Went)) => {}
                Ok(Some(Step::CouldNot(pod))) => passed_over.push(pod),
                Ok(Some(Step::Prepare(pod, workers))) => {
                    if !self.prepare_alone(&pod, &workers).await {
                        return;
                    }
                }
                Ok(Some(Step::Wait(after))) => {
                    // Once a pass: a pod that stays busy is not waited for
                    // again and again.
                    may_wait = false;
                    tokio::time::sleep(after).await;
                }
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(%error, "the headroom task failed");
                    return;
                }
            }
        }
    }

    /// One pod swapped out ahead of need on the first GPU short of its
    /// headroom, or the one chosen to have its host copies made first:
    /// `None` where none is short or no pod (but those `passed_over`) can
    /// go; or, where `may_wait`, how long to wait for a pod whose copies
    /// are ready ([`hypervisor_swap::ready_soon`]).
    async fn swap_one_ahead(&self, passed_over: &[String], may_wait: bool) -> Option<Step> {
        for (uuid, settings) in self.overcommitting_gpus() {
            if settings.headroom == 0 {
                continue;
            }
            let Some(free) = self.free_on(&uuid).filter(|&free| free < settings.headroom) else {
                continue;
            };
            // A pod whose copies are being made would be swapped out with
            // the lock held until they are.
            let (views, candidates) = self.candidates_on(&uuid, |pod| {
                !passed_over.iter().any(|p| p == pod) && !self.being_prepared(pod)
            });
            let host_room = self.host_room(&settings);
            let Some((pod, ready)) = hypervisor_swap::ahead(
                &candidates,
                host_room,
                monotonic_ms(),
                room_policy(&settings),
            )
            .map(|c| (c.pod.clone(), c.ready)) else {
                continue;
            };
            let view = views.into_iter().find(|v| v.pod == pod)?;
            // Copies are made once: a pod whose processes could not make
            // them, or have grown little since, is swapped as it is; so is
            // one whose copies the host cannot take even once other pods'
            // kept copies are given back (as its swap-out would).
            if !ready && self.lacks_copies(&view) {
                let pids = self.pids_of(&pod).await;
                if let Some(workers) = self.fast_workers(&pod, &pids) {
                    let bytes = view.bytes();
                    let room = || Self::room_to_prepare(&settings, &self.swap_status().totals);
                    if room() < bytes {
                        let soon = hypervisor_swap::ready_soon(
                            &candidates,
                            settings.headroom - free,
                            host_room,
                            monotonic_ms(),
                            room_policy(&settings),
                            RoomFor::Headroom,
                        );
                        if let Some(ms) = soon.filter(|_| may_wait) {
                            return Some(Step::Wait(Duration::from_millis(ms)));
                        }
                        let _ = self.host_room_for(&pod, bytes).await;
                    }
                    if room() >= bytes {
                        return Some(Step::Prepare(pod, workers));
                    }
                }
            }
            return Some(match self.swap_out_counted(&view, SwapCause::Ahead).await {
                Ok(()) => {
                    tracing::info!(gpu = %uuid, pod = %pod, headroom = settings.headroom, "swapped out ahead of need");
                    Step::Went
                }
                Err(error) => {
                    tracing::info!(pod = %pod, %error, "the pod cannot go ahead of need; the next one is tried");
                    Step::CouldNot(pod)
                }
            });
        }
        None
    }
}

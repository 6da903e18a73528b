//! Ahead of need: the pods' uses sampled from their last-call stamps
//! (every [`USE_SAMPLE`]), which rank the idle pods, and each overcommitting
//! GPU's `headroom` kept free by swapping idle pods out in the background
//! (once a second, and after each swap-in a trapped call asked for), so
//! that a swapped pod's call waits for its own swap-in only, not for a
//! swap-out first.
//!
//! Background swap-outs give way: each takes the node's swap lock only
//! when no swap holds or waits for it, one pod at a time, and never a pod
//! brought back within `min_resident`.

use std::sync::Arc;
use std::time::Duration;

use gpushare_utils::clock::monotonic_ms;
use hypervisor_swap::SwapCause;

use super::room::room_policy;
use crate::Hypervisor;

/// How often the pods' last-call stamps are sampled: finer than a use
/// (`hypervisor_swap::uses::CORRELATED_MS`), so that two uses apart are
/// seen apart.
pub(crate) const USE_SAMPLE: Duration = Duration::from_millis(100);

/// The most pods one background pass swaps out.
const PASS: usize = 8;

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
        for _ in 0..PASS {
            let Ok(one) = Arc::clone(&self.shared.swapper.ops).try_lock_owned() else {
                return;
            };
            let hv = self.clone();
            let skip = passed_over.clone();
            let went = tokio::spawn(async move {
                let _one = one;
                hv.swap_one_ahead(&skip).await
            })
            .await;
            match went {
                Ok(Some(Ok(()))) => {}
                Ok(Some(Err(pod))) => passed_over.push(pod),
                Ok(None) => return,
                Err(error) => {
                    tracing::warn!(%error, "the headroom task failed");
                    return;
                }
            }
        }
    }

    /// One pod swapped out ahead of need on the first GPU short of its
    /// headroom: `None` where none is short or no pod (but those
    /// `passed_over`) can go; `Err(pod)` where the pod chosen could not.
    async fn swap_one_ahead(&self, passed_over: &[String]) -> Option<Result<(), String>> {
        for (uuid, settings) in self.overcommitting_gpus() {
            if settings.headroom == 0
                || self
                    .free_on(&uuid)
                    .is_none_or(|free| free >= settings.headroom)
            {
                continue;
            }
            let (views, candidates) =
                self.candidates_on(&uuid, |pod| !passed_over.iter().any(|p| p == pod));
            let host_room = self.host_room(&settings);
            let Some(pod) = hypervisor_swap::ahead(
                &candidates,
                host_room,
                monotonic_ms(),
                room_policy(&settings),
            )
            .map(|c| c.pod.clone()) else {
                continue;
            };
            let view = views.into_iter().find(|v| v.pod == pod)?;
            return Some(match self.swap_out_counted(&view, SwapCause::Ahead).await {
                Ok(()) => {
                    tracing::info!(gpu = %uuid, pod = %pod, headroom = settings.headroom, "swapped out ahead of need");
                    Ok(())
                }
                Err(error) => {
                    tracing::info!(pod = %pod, %error, "the pod cannot go ahead of need; the next one is tried");
                    Err(pod)
                }
            });
        }
        None
    }
}

//! Room on a GPU that overcommits: idle pods of the GPU swapped out for a
//! pod that needs memory the GPU does not have free, asked by one of its
//! workers whose allocation the driver refused (`POST /api/v1/room`), or
//! before the pod's own swap-in or move there.
//!
//! Room is made only for what the asker may really hold: it must be placed
//! on the GPU, and it is given no more than its quota there leaves (less
//! what it holds by its ledger or by NVML), whatever it asks for. Nothing
//! is swapped while the GPU has that much free, as NVML says; the pods go
//! one at a time, in the policy's order (`hypervisor-swap`'s `policy`: the
//! least used of late first, by the uses [`super::ahead`] samples), until
//! it has. Where the first would pin host memory as it goes (its processes
//! keep no copies) and a pod that keeps them may go within moments (just
//! brought back, or just called), room waits for that one, once: its
//! swap-out only copies. A pod that cannot go (memory the driver cannot
//! checkpoint, a process that does not stop) is passed over for the next.
//! A pod that is also placed on a GPU that does not overcommit never goes:
//! under Kubernetes that is a pod whose claim asked for a device whose
//! `overcommit` attribute is false, to be never swapped.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpushare_utils::clock::monotonic_ms;
use gpushare_utils::limits::Residency;
use hypervisor_config::SwapSettings;
use hypervisor_core::scheduler::SwapView;
use hypervisor_swap::{Candidate, RoomPolicy, RoomStep, SwapCause, room_ever};
use tokio::time::Instant;

use super::SwapRefusal;
use crate::{Hypervisor, lock};

/// The most room asks one pod may have in flight at once. Each holds its
/// request up to `room_wait` and takes the node's swap lock every
/// [`ROOM_POLL`] while only busy pods could make the room, so a pod that
/// opened many could keep that lock from its neighbours' swaps. A process
/// asks for one allocation at a time on each thread that allocates; asks
/// past this are answered at once, with no room made.
pub const ROOM_ASKS_PER_POD: u32 = 8;

/// The room asks each pod has in flight.
#[derive(Default)]
pub(crate) struct RoomAsks(Arc<Mutex<BTreeMap<String, u32>>>);

impl RoomAsks {
    /// One more ask of `pod` in flight, while it has fewer than
    /// [`ROOM_ASKS_PER_POD`].
    fn take(&self, pod: &str) -> Option<RoomSlot> {
        let mut asks = lock(&self.0);
        let count = asks.entry(pod.to_owned()).or_insert(0);
        if *count >= ROOM_ASKS_PER_POD {
            return None;
        }
        *count += 1;
        Some(RoomSlot {
            asks: Arc::clone(&self.0),
            pod: pod.to_owned(),
        })
    }
}

/// A room ask in flight, counted until it is dropped.
pub struct RoomSlot {
    asks: Arc<Mutex<BTreeMap<String, u32>>>,
    pod: String,
}

impl Drop for RoomSlot {
    fn drop(&mut self) {
        let mut asks = lock(&self.asks);
        if let Some(count) = asks.get_mut(&self.pod) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                asks.remove(&self.pod);
            }
        }
    }
}

impl Hypervisor {
    /// A room ask of `pod` in flight, counted until dropped; `None` while
    /// it has [`ROOM_ASKS_PER_POD`] already.
    pub fn room_slot(&self, pod: &str) -> Option<RoomSlot> {
        self.shared.swapper.room_asks.take(pod)
    }

    /// Room for an allocation of `bytes` of `asker` on the GPU `uuid`:
    /// idle pods there swapped out until the GPU has free what the
    /// allocation may take (at most what `asker`'s quota there leaves);
    /// returns the bytes freed, by NVML (0: the GPU had the room already,
    /// `asker` is not placed there or may hold no more, overcommit is off
    /// there, or no idle pod could go within `wait`), and whether the GPU
    /// has the room at the end, whoever freed it. Where no idle pod
    /// can make the room yet but pods that are busy now could once idle
    /// (pods still loading, as many start at once), it tries again every
    /// [`ROOM_POLL`] until `wait` has passed. Each round runs to its end
    /// whether or not the caller waits for it. `driver_free`: what the
    /// asker's driver said was free as it refused (see [`room_target`]).
    pub async fn make_room(
        &self,
        uuid: &str,
        bytes: u64,
        asker: &str,
        driver_free: Option<u64>,
        wait: Duration,
    ) -> RoomMade {
        let deadline = Instant::now() + wait;
        let (mut freed, mut target) = (0u64, None);
        loop {
            let (uuid, asker) = (uuid.to_owned(), asker.to_owned());
            let round = self
                .exclusive(move |hv| async move {
                    let left = hv.core().scheduler.quota_left(&asker, &uuid);
                    let Some(left) = left else {
                        tracing::warn!(gpu = %uuid, pod = %asker, "room asked on a GPU the pod is not placed on; none made");
                        return Ok(Round::default());
                    };
                    // The first round sets the room to make; the next ones
                    // make the rest of the same.
                    let (need, said) = match target {
                        Some(target) => (target, None),
                        None => (
                            bytes.min(left),
                            driver_free.map(|free| DriverSaid {
                                free,
                                at_most: left,
                            }),
                        ),
                    };
                    Ok(hv.room_round(&uuid, need, &asker, said).await)
                })
                .await
                .unwrap_or_default();
            freed = freed.saturating_add(round.made.freed);
            target = Some(round.made.target);
            if !round.may_come || Instant::now() + ROOM_POLL >= deadline {
                let room = round.made.target > 0 && round.made.free >= round.made.target;
                return RoomMade { freed, room };
            }
            tokio::time::sleep(ROOM_POLL).await;
        }
    }

    /// One round of [`Self::make_room`]: the room made, and whether more
    /// could come (the GPU is still short, and pods that are busy now
    /// could make the rest once idle).
    async fn room_round(
        &self,
        uuid: &str,
        need: u64,
        asker: &str,
        said: Option<DriverSaid>,
    ) -> Round {
        let made = self.make_room_locked(uuid, need, asker, said).await;
        let may_come = made.free < made.target
            && self.overcommit_on(uuid).is_some_and(|settings| {
                let (_, candidates) = self.candidates_on(uuid, |pod| pod != asker);
                let host_room = self.host_room(&settings);
                room_ever(
                    &candidates,
                    made.target,
                    made.free,
                    host_room,
                    room_policy(&settings),
                )
            });
        Round { made, may_come }
    }

    /// Before a swap-in: where a GPU of the pod overcommits and has less
    /// free than the pod held there (within its quota), idle pods make room.
    /// What its processes still hold there (their contexts, on the fast
    /// path) counts too: NVML's free memory includes what the driver keeps,
    /// and the pods that run take transient memory meanwhile, so a swap-in
    /// given room for only what it moves was refused for want of memory.
    /// Where they could not make enough, the swap-in is refused (the pod
    /// waits, swapped, and its next ask tries again): tried, it would fail
    /// for want of memory at every ask. Returns the bytes freed.
    pub(super) async fn room_for(&self, view: &SwapView) -> Result<u64, SwapRefusal> {
        let mut freed = 0u64;
        for gpu in &view.gpus {
            let need = within_quota(view, &gpu.uuid, gpu.bytes);
            freed += self
                .make_room_locked(&gpu.uuid, need, &view.pod, None)
                .await
                .freed;
            if self.overcommit_on(&gpu.uuid).is_some()
                && let Some(free) = self.free_on(&gpu.uuid)
                && free < need
            {
                return Err(SwapRefusal::NoRoom {
                    gpu: gpu.uuid.clone(),
                    free,
                    need,
                });
            }
        }
        Ok(freed)
    }

    /// Swaps idle pods of the GPU `uuid` (not `asker`) out, one at a time,
    /// until the GPU has `need` bytes free by NVML (more where the asker's
    /// driver said it had less: [`room_target`]), where it overcommits;
    /// returns the bytes freed, and the free memory it was to reach and
    /// reached.
    pub(super) async fn make_room_locked(
        &self,
        uuid: &str,
        need: u64,
        asker: &str,
        said: Option<DriverSaid>,
    ) -> Made {
        let Some(settings) = self.overcommit_on(uuid) else {
            return Made::default();
        };
        let Some(before) = self.free_on(uuid) else {
            tracing::warn!(
                gpu = uuid,
                for_pod = asker,
                "the GPU's free memory is unknown; no room made"
            );
            return Made::default();
        };
        let need = room_target(need, before, said);
        let mut free = before;
        let mut passed_over: Vec<String> = Vec::new();
        let mut may_wait = true;
        while free < need {
            let lacking = need - free;
            let pick = self.room_victim(uuid, lacking, asker, &passed_over, &settings, may_wait);
            let victim = match pick {
                Some(Pick::Go(victim)) => victim,
                Some(Pick::Soon(after)) => {
                    // Once: a pod that stays busy is not waited for again.
                    may_wait = false;
                    tokio::time::sleep(after).await;
                    continue;
                }
                None => break,
            };
            if let Err(error) = self.swap_out_counted(&victim, SwapCause::Demand).await {
                tracing::info!(pod = %victim.pod, %error, "the pod cannot make room; the next one is tried");
                passed_over.push(victim.pod);
            }
            let Some(now) = self.free_on(uuid) else {
                break;
            };
            free = now;
        }
        let freed = free.saturating_sub(before);
        if freed > 0 {
            tracing::info!(gpu = uuid, need, free, freed, for_pod = asker, "room made");
        } else if before < need {
            tracing::debug!(
                gpu = uuid,
                need,
                free,
                for_pod = asker,
                "no room could be made"
            );
        }
        Made {
            freed,
            target: need,
            free,
        }
    }

    /// The first pod to swap out of the GPU `uuid` towards `lacking` bytes,
    /// by the policy: idle, resident, not `asker` nor one `passed_over`;
    /// or, where it lacks host copies, `may_wait`, and a pod that keeps
    /// its own may go within moments ([`hypervisor_swap::ready_soon`]),
    /// how long until then: its swap-out only copies, where the first's
    /// pins host memory as the asker waits (and, on a full host, only once
    /// the other gave its copies back).
    fn room_victim(
        &self,
        uuid: &str,
        lacking: u64,
        asker: &str,
        passed_over: &[String],
        settings: &SwapSettings,
        may_wait: bool,
    ) -> Option<Pick> {
        let (views, candidates) = self.candidates_on(uuid, |pod| {
            pod != asker && !passed_over.iter().any(|p| p == pod)
        });
        let (host_room, policy) = (self.host_room(settings), room_policy(settings));
        let now = monotonic_ms();
        match hypervisor_swap::room_step(&candidates, lacking, host_room, now, policy, may_wait)? {
            RoomStep::Wait(ms) => Some(Pick::Soon(Duration::from_millis(ms))),
            RoomStep::Go(first) => views.into_iter().find(|v| v.pod == first.pod).map(Pick::Go),
        }
    }

    /// The resident pods of the GPU `uuid` that `may` allows, but for those
    /// sharing memory by CUDA IPC, and each as the policy sees it: its
    /// bytes there, its uses, its class there, and whether it must stay (a
    /// GPU of it does not overcommit).
    pub(super) fn candidates_on(
        &self,
        uuid: &str,
        may: impl Fn(&str) -> bool,
    ) -> (Vec<SwapView>, Vec<Candidate>) {
        let (views, overcommit) = {
            let core = self.core();
            // A pod whose processes last said their memory is shared by
            // CUDA IPC can go by neither path: never a candidate (each
            // process's answers say again, its health pings too).
            let shares = |pod: &str| core.workers.last_answer_says(pod, |result| result.shared);
            let views: Vec<SwapView> = core
                .scheduler
                .swap_views_on(uuid)
                .into_iter()
                .filter(|v| may(&v.pod) && v.region.residency() == Residency::Resident)
                .filter(|v| !shares(&v.pod))
                .collect();
            (views, core.settings.swap.clone())
        };
        let uses = &self.shared.swapper.uses;
        let board = self.swap_board();
        let candidates = views
            .iter()
            .map(|v| {
                let (last_call_ms, seen) = (v.region.last_call_ms(), uses.of(&v.pod));
                let kept = board.history(&v.pod).host_kept_bytes;
                let preparing = self.being_prepared(&v.pod);
                Candidate {
                    pod: v.pod.clone(),
                    bytes: v.bytes_on(uuid),
                    last_call_ms,
                    previous_use_ms: seen.previous_to(last_call_ms),
                    back_ms: seen.back_ms,
                    latency: v
                        .gpus
                        .iter()
                        .any(|g| g.latency && g.uuid.eq_ignore_ascii_case(uuid)),
                    stays: v
                        .gpus
                        .iter()
                        .any(|g| !g.index.is_some_and(|i| overcommit.overcommits(i))),
                    ready: self.copies_ready(v, kept) && !preparing,
                    preparing,
                }
            })
            .collect();
        (views, candidates)
    }

    /// The `[swap]` settings where the daemon makes room on the GPU `uuid`;
    /// `None` where it does not.
    pub(super) fn overcommit_on(&self, uuid: &str) -> Option<SwapSettings> {
        let core = self.core();
        let index = core
            .scheduler
            .gpus()
            .iter()
            .find(|g| g.uuid.eq_ignore_ascii_case(uuid))?
            .index;
        core.settings
            .swap
            .overcommits(index)
            .then(|| core.settings.swap.clone())
    }

    /// The node's GPUs that overcommit, by UUID, each with the settings.
    pub(super) fn overcommitting_gpus(&self) -> Vec<(String, SwapSettings)> {
        self.gpus_where(SwapSettings::overcommits)
    }

    /// The node's GPUs, by UUID, each with the settings: pods are swapped
    /// on any of them by hand, drained or moved off.
    pub(super) fn all_gpus(&self) -> Vec<(String, SwapSettings)> {
        self.gpus_where(|_, _| true)
    }

    fn gpus_where(&self, keep: impl Fn(&SwapSettings, u32) -> bool) -> Vec<(String, SwapSettings)> {
        let core = self.core();
        let swap = &core.settings.swap;
        core.scheduler
            .gpus()
            .iter()
            .filter(|g| keep(swap, g.index))
            .map(|g| (g.uuid.clone(), swap.clone()))
            .collect()
    }

    /// The GPU's free memory, as the observer reads it now.
    pub(super) fn free_on(&self, uuid: &str) -> Option<u64> {
        self.free_memory()
            .into_iter()
            .find(|(gpu, _)| gpu.eq_ignore_ascii_case(uuid))
            .map(|(_, free)| free)
    }
}

/// How often [`Hypervisor::make_room`] tries again while pods that could
/// make the room are busy.
const ROOM_POLL: Duration = Duration::from_millis(100);

/// The next step of making room.
enum Pick {
    /// This pod goes.
    Go(SwapView),
    /// A pod whose host copies are ready may go this soon.
    Soon(Duration),
}

/// What a room request got.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RoomMade {
    /// Bytes freed for it, by NVML.
    pub freed: u64,
    /// Whether the GPU had free what it was to have, as the request ended:
    /// freed by it, or by another swap while it waited (an idle pod swapped
    /// out ahead of need).
    pub room: bool,
}

/// Room made on a GPU.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Made {
    /// Bytes freed, by NVML.
    pub(super) freed: u64,
    /// The free memory, by NVML, that was to be had.
    pub(super) target: u64,
    /// The free memory, by NVML, once done (0 where it is unknown).
    pub(super) free: u64,
}

/// One round of room made for an allocation.
#[derive(Debug, Default)]
struct Round {
    made: Made,
    /// Whether more room could come: the GPU is still short of it, and
    /// pods busy now could make it once idle.
    may_come: bool,
}

/// What an asker's driver said was free as it refused an allocation, and
/// the most room that may be made on its word beyond NVML's figure: what
/// the asker's quota leaves on the GPU.
#[derive(Debug, Clone, Copy)]
pub(super) struct DriverSaid {
    pub(super) free: u64,
    pub(super) at_most: u64,
}

/// What a driver that refused an allocation while it said it had that
/// much free lacked of it at least: its granularity (on an H200, 128 MiB
/// was refused with 129.75 MiB free by the driver's own count).
const REFUSED_SHORT: u64 = 2 << 20;

/// The free memory, by NVML, that room for `need` bytes takes, NVML
/// saying `before` is free: `need`; or where the asker's driver refused
/// it, `need` and the gap between NVML's figure and what the driver could
/// use, for NVML counts as free memory the driver keeps for itself (on an
/// H200, an allocation of 1 GiB was refused while NVML showed more than
/// that free). The driver could use what it said was free, but less than
/// `need` (it refused that): short of `need` by [`REFUSED_SHORT`] where it
/// said it had as much. The gap is taken on the asker's word only up to
/// what its quota leaves, and the target does not rise with the room
/// already made: an asker that says less than its driver did, again and
/// again, has no more idle pods swapped than its quota could take.
fn room_target(need: u64, before: u64, said: Option<DriverSaid>) -> u64 {
    match said {
        Some(said) => {
            let usable = said.free.min(need.saturating_sub(REFUSED_SHORT));
            need.saturating_add(before.saturating_sub(usable).min(said.at_most))
        }
        None => need,
    }
}

/// `bytes` of the pod `view` on the GPU `uuid`, at most its quota there
/// (its ledger, which the pod writes, may say more).
pub(super) fn within_quota(view: &SwapView, uuid: &str, bytes: u64) -> u64 {
    match view.region.usage(uuid).map(|usage| usage.quota) {
        Some(0) => bytes,
        Some(quota) => bytes.min(quota),
        None => 0,
    }
}

/// The policy `settings` make room by.
pub(super) fn room_policy(settings: &SwapSettings) -> RoomPolicy {
    let ms = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    RoomPolicy {
        idle_after_ms: ms(settings.idle_after),
        latency: settings.latency_pods,
        ranking: settings.ranking,
        min_resident_ms: ms(settings.min_resident),
    }
}

#[cfg(test)]
mod tests {
    use super::{DriverSaid, REFUSED_SHORT, room_target};

    const GIB: u64 = 1 << 30;

    #[test]
    fn room_is_made_for_what_the_driver_lacks_where_it_said() {
        let said = |free, at_most| Some(DriverSaid { free, at_most });
        // NVML's figure alone, where the driver said nothing, or said it
        // had enough and NVML shows less than the allocation.
        assert_eq!(room_target(GIB, GIB / 2, None), GIB);
        assert_eq!(room_target(GIB, GIB / 2, said(2 * GIB, 4 * GIB)), GIB);
        // The driver refused 128 MiB saying it had 129.75 free, as NVML
        // did: it could not use all of that, so room is made past it.
        let (mib, free) = (1u64 << 20, 129 * (1u64 << 20) + 768 * 1024);
        assert_eq!(
            room_target(128 * mib, free, said(free, 4 * GIB)),
            free + REFUSED_SHORT
        );
        // NVML shows 1.5 GiB free, the driver had 0.5: 0.5 more is needed
        // than NVML shows, so room until NVML shows 2 GiB.
        assert_eq!(
            room_target(GIB, 3 * GIB / 2, said(GIB / 2, 4 * GIB)),
            2 * GIB
        );
        // Never less than the allocation, nor past the end of the numbers.
        assert_eq!(room_target(GIB, 0, said(GIB / 2, 4 * GIB)), GIB);
        assert_eq!(room_target(GIB, u64::MAX, said(0, u64::MAX)), u64::MAX);
        // A driver said to have nothing free, on a GPU with 6 GiB free by
        // NVML: the gap is taken up to what the quota leaves (2 GiB), and
        // asked again once room was made, the target stays.
        assert_eq!(room_target(GIB, 6 * GIB, said(0, 2 * GIB)), 3 * GIB);
        assert_eq!(room_target(GIB, 9 * GIB, said(0, 2 * GIB)), 3 * GIB);
    }
}

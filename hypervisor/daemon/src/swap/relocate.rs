//! Moving a pod to another GPU of the node (`POST …/pods/{id}/move`), and
//! draining a GPU (`POST …/gpus/{gpu}/drain`): each pod of it moved to the
//! GPU with the most memory free, or, where it cannot move, swapped out.
//!
//! A move is a swap-out, the pod's limits and ledger entry re-keyed to the
//! new GPU while its processes are held, and a swap-in that restores them
//! there (the driver's GPU pairs). The processes keep their CUDA device
//! numbers; the device they numbered now reports the new GPU's UUID (the
//! driver's answer after such a restore), under which they find their
//! quota and usage. A restore that fails leaves the move under way: the
//! pod's next swap-in, a trapped call's included, finishes it there. The
//! pod's limits object keeps a move under way, so that a restarted daemon
//! finishes it too.

use std::collections::BTreeSet;
use std::time::Instant;

use gpushare_utils::limits::{Residency, uuid_key};
use hypervisor_core::scheduler::{MovePlan, ScheduleError, SwapView};
use hypervisor_core::spec::GpuSelector;
use hypervisor_swap::{Move, ProcessState, RawUuid, SwapCause, SwapPath, parse_uuid};
use serde::{Deserialize, Serialize};

use super::{SwapRefusal, room};
use crate::Hypervisor;

/// What a move did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoveAnswer {
    /// The pod.
    pub pod: String,
    /// The GPU it left.
    pub from: String,
    /// The GPU it is on now.
    pub to: String,
    /// Bytes of device memory it held (on all its GPUs, all moved through
    /// host memory).
    pub bytes: u64,
    /// Seconds from the first lock to the last unlock.
    pub seconds: f64,
    /// Where its memory is now: `resident` on the new GPU, or `swapped`
    /// for a pod that was in host memory: its next swap-in restores it on
    /// the new GPU.
    pub residency: String,
    /// How its memory went: `fast` (its processes moved it themselves,
    /// the driver's checkpoint took their contexts) or `checkpoint` (the
    /// driver's checkpoint took all of it); `None` for a pod without a
    /// process, which moves by its limits alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<SwapPath>,
}

/// What a drain did with each pod of the GPU.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DrainReport {
    /// The GPU drained.
    pub gpu: String,
    /// Pods moved to another GPU.
    pub moved: Vec<MoveAnswer>,
    /// Pods swapped out instead: no GPU had room, or Kubernetes gave them
    /// this GPU. Their next CUDA call brings them back here.
    pub swapped: Vec<String>,
    /// Pods left on the GPU, with the reason (an active pod that may not
    /// move, memory the driver cannot checkpoint).
    pub left: Vec<DrainLeft>,
}

/// A pod a drain left on its GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainLeft {
    /// The pod.
    pub pod: String,
    /// Why.
    pub reason: String,
}

impl Hypervisor {
    /// Moves `pod` from its GPU `from` (its only one when `None`) to the
    /// node's GPU `to`, with its quota, usage and shares; its processes
    /// wait in their next CUDA call while it moves.
    pub async fn move_pod(
        &self,
        pod: &str,
        from: Option<&GpuSelector>,
        to: &GpuSelector,
    ) -> Result<MoveAnswer, SwapRefusal> {
        if self.placements_pinned() {
            return Err(SwapRefusal::Pinned);
        }
        let (pod, from, to) = (pod.to_owned(), from.cloned(), to.clone());
        self.exclusive(move |hv| async move {
            let plan = hv.move_plan(&pod, from.as_ref(), &to)?;
            hv.move_locked(&plan).await
        })
        .await
    }

    /// Empties the GPU `gpu`: each of its pods moves to the other GPU with
    /// the most memory free that holds it, or is swapped out where none
    /// does or Kubernetes gave it this GPU.
    pub async fn drain_gpu(&self, gpu: &GpuSelector) -> Result<DrainReport, SwapRefusal> {
        let gpu = gpu.clone();
        self.exclusive(move |hv| async move { hv.drain_locked(&gpu).await })
            .await
    }

    async fn drain_locked(&self, gpu: &GpuSelector) -> Result<DrainReport, SwapRefusal> {
        let (uuid, views) = {
            let core = self.core();
            let uuid = core
                .scheduler
                .observed(gpu)
                .map(|g| g.uuid.clone())
                .ok_or_else(|| SwapRefusal::UnknownGpu(gpu.to_string()))?;
            let views = core.scheduler.swap_views_on(&uuid);
            (uuid, views)
        };
        let mut free = self.free_memory();
        let mut report = DrainReport {
            gpu: uuid.clone(),
            ..DrainReport::default()
        };
        let from = GpuSelector::Uuid(uuid.clone());
        for view in views {
            let need = view.bytes_on(&uuid);
            let target = (!self.placements_pinned())
                .then(|| {
                    free.sort_by_key(|(_, bytes)| std::cmp::Reverse(*bytes));
                    free.iter()
                        .filter(|(_, bytes)| *bytes >= need)
                        .find_map(|(to, _)| {
                            self.move_plan(&view.pod, Some(&from), &GpuSelector::Uuid(to.clone()))
                                .ok()
                        })
                })
                .flatten();
            if let Some(plan) = target {
                match self.move_locked(&plan).await {
                    Ok(moved) => {
                        if let Some((_, bytes)) = free.iter_mut().find(|(g, _)| *g == plan.to) {
                            *bytes = bytes.saturating_sub(need);
                        }
                        report.moved.push(moved);
                        continue;
                    }
                    Err(error) => {
                        tracing::warn!(pod = %view.pod, %error, "drain: the pod could not move; swapping it out");
                    }
                }
            }
            if view.region.residency() == Residency::Swapped {
                report.swapped.push(view.pod.clone());
                continue;
            }
            match self.swap_out_counted(&view, SwapCause::Operator).await {
                Ok(()) => report.swapped.push(view.pod.clone()),
                Err(error) => report.left.push(DrainLeft {
                    pod: view.pod.clone(),
                    reason: error.to_string(),
                }),
            }
        }
        tracing::info!(
            gpu = %uuid,
            moved = report.moved.len(),
            swapped = report.swapped.len(),
            left = report.left.len(),
            "GPU drained"
        );
        Ok(report)
    }

    /// Under `[swap] drain_unhealthy`: drains each GPU that turned
    /// unhealthy since the last call (`drained`: those drained already; a
    /// GPU healthy again leaves it, to be drained at its next fault).
    pub(crate) async fn drain_the_unhealthy(&self, drained: &mut BTreeSet<String>) {
        let unhealthy = self.unhealthy_gpus();
        drained.retain(|uuid| unhealthy.contains_key(uuid));
        if !self.core().settings.swap.drain_unhealthy {
            return;
        }
        for (uuid, sick) in unhealthy {
            if drained.contains(&uuid) {
                continue;
            }
            tracing::warn!(gpu = %uuid, fault = %sick.fault.reason(), "draining the unhealthy GPU");
            match self.drain_gpu(&GpuSelector::Uuid(uuid.clone())).await {
                Ok(report) => tracing::warn!(
                    gpu = %uuid,
                    moved = report.moved.len(),
                    swapped = report.swapped.len(),
                    left = ?report.left,
                    "unhealthy GPU drained"
                ),
                Err(error) => {
                    tracing::error!(gpu = %uuid, %error, "the unhealthy GPU could not be drained");
                }
            }
            drained.insert(uuid);
        }
    }

    /// The scheduler's plan, refused where the target GPU is unhealthy.
    fn move_plan(
        &self,
        pod: &str,
        from: Option<&GpuSelector>,
        to: &GpuSelector,
    ) -> Result<MovePlan, SwapRefusal> {
        let plan = self
            .core()
            .scheduler
            .move_plan(pod, from, to)
            .map_err(|error| match error {
                ScheduleError::NoSuchPod(pod) => SwapRefusal::UnknownPod(pod),
                other => SwapRefusal::Move(other.to_string()),
            })?;
        if let Some((_, sick)) = self
            .unhealthy_gpus()
            .iter()
            .find(|(uuid, _)| uuid.eq_ignore_ascii_case(&plan.to))
        {
            return Err(SwapRefusal::Move(format!(
                "{} is unhealthy ({})",
                plan.to,
                sick.fault.reason()
            )));
        }
        Ok(plan)
    }

    async fn move_locked(&self, plan: &MovePlan) -> Result<MoveAnswer, SwapRefusal> {
        let view = self.view(&plan.pod)?;
        let to = Move {
            from: plan.from.clone(),
            to: plan.to.clone(),
        };
        // The pairs are checked before anything moves.
        pairs(&to, &self.node_gpus())?;
        let need = room::within_quota(&view, &plan.from, view.bytes_on(&plan.from));
        self.room_on(&plan.to, need, &plan.pod).await?;
        let started = Instant::now();
        let answer = |residency: Residency, path: Option<SwapPath>| MoveAnswer {
            pod: plan.pod.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
            bytes: view.bytes(),
            seconds: started.elapsed().as_secs_f64(),
            residency: residency.as_str().to_owned(),
            path,
        };
        let relocate = || {
            self.core()
                .scheduler
                .relocate(plan, Instant::now())
                .map_err(|error| SwapRefusal::Move(error.to_string()))
        };
        // A pod without a process moves by its limits alone; a pod in host
        // memory stays there, and its next swap-in restores it on the new
        // GPU.
        let pids = self.pids_of(&plan.pod).await;
        if pids.is_empty() {
            relocate()?;
            self.swap_board().moved(&plan.pod, started.elapsed());
            return Ok(answer(Residency::Resident, None));
        }
        if view.region.residency() == Residency::Swapped {
            // A pod away by the fast path leaves its processes' contexts
            // on the GPU: the driver takes those now.
            let history = self.swap_board().history(&plan.pod);
            let path = history.last_swap_out_path.unwrap_or(SwapPath::Checkpoint);
            if path == SwapPath::Fast && !history.contexts_checkpointed {
                self.checkpoint_contexts(&view, pids.clone()).await?;
            }
            // The limits go ahead of the processes only where the driver
            // holds every one of them in host memory.
            if !self.all_checkpointed(pids).await? {
                return Err(SwapRefusal::Move(
                    "the pod is shown in host memory, but the driver shows a process of it on the GPU; swap it in first".to_owned(),
                ));
            }
            // Its processes are where they were checkpointed: on the GPU an
            // earlier move under way left, or on `from`.
            let from = self
                .pending_move(&view)
                .map_or_else(|| plan.from.clone(), |earlier| earlier.from);
            relocate()?;
            let to = Move {
                from,
                to: plan.to.clone(),
            };
            self.await_restore(&view, (!to.from.eq_ignore_ascii_case(&to.to)).then_some(to));
            tracing::info!(pod = %plan.pod, from = %plan.from, to = %plan.to, "swapped pod moved; it comes back on the new GPU");
            return Ok(answer(Residency::Swapped, Some(path)));
        }
        let path = self.swap_out_for_move(&view, &pids).await?;
        if let Err(error) = relocate() {
            // Nothing followed the pod: it comes back where it was.
            if let Err(back) = self.swap_in_locked(&view).await {
                tracing::error!(pod = %plan.pod, error = %back, "the pod could not come back after a refused move");
            }
            return Err(error);
        }
        self.await_restore(&view, Some(to));
        let moved = self.view(&plan.pod)?;
        self.swap_in_locked(&moved).await?;
        self.swap_board().moved(&plan.pod, started.elapsed());
        let done = answer(Residency::Resident, Some(path));
        tracing::info!(pod = %plan.pod, from = %plan.from, to = %plan.to, bytes = done.bytes, seconds = done.seconds, path = path.as_str(), "pod moved to another GPU");
        Ok(done)
    }

    /// Whether the driver shows every process of `pids` that still runs
    /// checkpointed.
    async fn all_checkpointed(&self, pids: Vec<u32>) -> Result<bool, SwapRefusal> {
        let driver = self.checkpoint_driver().await?;
        tokio::task::spawn_blocking(move || {
            pids.iter().all(|&pid| match driver.state(pid) {
                Ok(state) => state == ProcessState::Checkpointed,
                Err(_) => gpushare_utils::process::process_is_gone(
                    i32::try_from(pid).unwrap_or(i32::MAX),
                    0,
                ),
            })
        })
        .await
        .map_err(|error| SwapRefusal::Task(error.to_string()))
    }

    /// Makes sure the GPU `gpu` has `need` bytes free for `asker`, making
    /// room there where it overcommits.
    async fn room_on(&self, gpu: &str, need: u64, asker: &str) -> Result<(), SwapRefusal> {
        self.make_room_locked(gpu, need, asker, None).await;
        let free = self.free_on(gpu).unwrap_or(0);
        if free >= need {
            return Ok(());
        }
        Err(SwapRefusal::NoRoom {
            gpu: gpu.to_owned(),
            free,
            need,
        })
    }

    /// The move waiting for the pod's restore, as its limits object keeps it
    /// (for a daemon that restarted since, too), its GPUs found among the
    /// node's by their keys.
    pub(super) fn pending_move(&self, view: &SwapView) -> Option<Move> {
        let (from, to) = view.region.pending_move()?;
        let gpus = self.node_gpus();
        let find = |key: u64| gpus.iter().find(|uuid| uuid_key(uuid) == key).cloned();
        match (find(from), find(to)) {
            (Some(from), Some(to)) => Some(Move { from, to }),
            _ => {
                tracing::error!(pod = %view.pod, "the pod's move waits for a GPU the node does not show; it is restored where it was");
                None
            }
        }
    }

    /// Records the move waiting for the pod's restore (`None`: none), in
    /// its limits object and on the swap board.
    pub(super) fn await_restore(&self, view: &SwapView, to: Option<Move>) {
        view.region
            .set_pending_move(to.as_ref().map(|m| (m.from.as_str(), m.to.as_str())));
        self.swap_board().moving(&view.pod, to);
    }

    /// The UUIDs of the node's GPUs, as last observed.
    pub(super) fn node_gpus(&self) -> Vec<String> {
        self.core()
            .scheduler
            .gpus()
            .iter()
            .map(|g| g.uuid.clone())
            .collect()
    }

    /// Each observed GPU's free memory, by UUID.
    pub(super) fn free_memory(&self) -> Vec<(String, u64)> {
        self.shared
            .observer
            .gpus()
            .unwrap_or_default()
            .into_iter()
            .map(|g| (g.uuid, g.memory_total.saturating_sub(g.memory_used)))
            .collect()
    }
}

/// The driver's GPU pairs for `to`: the two GPUs exchanged, every other
/// GPU of the node (`gpus`, by UUID) onto itself.
pub(super) fn pairs(to: &Move, gpus: &[String]) -> Result<Vec<(RawUuid, RawUuid)>, SwapRefusal> {
    let raw = |uuid: &str| {
        parse_uuid(uuid).map_err(|error| SwapRefusal::Move(format!("{uuid}: {error}")))
    };
    let others = gpus
        .iter()
        .map(|uuid| raw(uuid))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(hypervisor_swap::move_pairs(
        raw(&to.from)?,
        raw(&to.to)?,
        &others,
    ))
}

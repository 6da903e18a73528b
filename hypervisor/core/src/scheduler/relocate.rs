//! Moving a pod to another GPU of the node: what may move where
//! ([`Scheduler::move_plan`]), and the pod's limits, ledger and placement
//! following it there ([`Scheduler::relocate`]) while its processes are
//! held in host memory. A moved pod stays where it was moved: its spec
//! still names the first GPU, and each placement of it (a reload, a
//! changed observation, a restarted daemon, which reads the move back
//! from the pod's limits object) resolves that GPU to the one it is on.

use std::time::Instant;

use gpushare_utils::limits::uuid_key;
use hypervisor_observer::GpuInfo;

use super::placement::{place, write_layout};
use super::{Placement, Pod, ScheduleError, Scheduler};
use crate::spec::GpuSelector;

/// A pod's GPU its spec names, and the GPU the pod was moved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relocation {
    /// [`uuid_key`] of the GPU the spec names.
    pub(crate) origin: u64,
    /// The GPU it is on, as the observer spells it.
    pub(crate) to: String,
}

/// A move the scheduler allows: from which GPU to which.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MovePlan {
    /// The pod's id.
    pub pod: String,
    /// The GPU it leaves (its UUID as placed).
    pub from: String,
    /// The GPU it goes to (its UUID as observed).
    pub to: String,
    /// The pod's other placed GPUs, where it stays.
    pub stays: Vec<String>,
}

impl Scheduler {
    /// Checks that `pod` may move from its GPU `from` (its only GPU when
    /// `None`) to the node's GPU `to`: both placed and observed, distinct,
    /// the pod not on `to` already, neither in co-run mode (an MPS client's
    /// memory is its server's, which the driver cannot checkpoint).
    pub fn move_plan(
        &self,
        pod: &str,
        from: Option<&GpuSelector>,
        to: &GpuSelector,
    ) -> Result<MovePlan, ScheduleError> {
        let invalid = |reason: String| ScheduleError::Invalid {
            pod: pod.to_owned(),
            reason,
        };
        let p = self
            .pods
            .get(pod)
            .ok_or_else(|| ScheduleError::NoSuchPod(pod.to_owned()))?;
        let placed: Vec<&Placement> = p.gpus.iter().filter_map(|g| g.placement.as_ref()).collect();
        let from = match from {
            Some(selector) => {
                let gpu = self
                    .observed(selector)
                    .ok_or_else(|| invalid(format!("{selector} is not a GPU of this node")))?;
                placed
                    .iter()
                    .find(|pl| pl.uuid.eq_ignore_ascii_case(&gpu.uuid))
                    .map(|pl| pl.uuid.clone())
                    .ok_or_else(|| invalid(format!("the pod is not on {selector}")))?
            }
            None => match placed.as_slice() {
                [only] => only.uuid.clone(),
                [] => return Err(invalid("the pod is on no GPU".to_owned())),
                _ => {
                    return Err(invalid(
                        "the pod is on several GPUs: say which one moves".to_owned(),
                    ));
                }
            },
        };
        let to = self
            .observed(to)
            .ok_or_else(|| invalid(format!("{to} is not a GPU of this node")))?
            .uuid
            .clone();
        if placed.iter().any(|pl| pl.uuid.eq_ignore_ascii_case(&to)) {
            return Err(invalid(format!("the pod is on {to} already")));
        }
        if let Some(corun) = &self.corun
            && let Some(gpu) = [&from, &to]
                .into_iter()
                .find(|uuid| corun.gpus.iter().any(|c| c.eq_ignore_ascii_case(uuid)))
        {
            return Err(invalid(format!(
                "{gpu} is in co-run mode: its clients' memory is the MPS server's, which cannot move"
            )));
        }
        let stays = placed
            .iter()
            .filter(|pl| !pl.uuid.eq_ignore_ascii_case(&from))
            .map(|pl| pl.uuid.clone())
            .collect();
        Ok(MovePlan {
            pod: pod.to_owned(),
            from,
            to,
            stays,
        })
    }

    /// Moves the limits and the ledger entry of `plan`'s pod from its GPU
    /// to the new one, and its placement with them, so that the pod's
    /// processes, restored there, find their quota and usage under the
    /// GPU's UUID the driver now reports. Done while the processes are held
    /// (checkpointed and locked): none of them looks an entry up meanwhile.
    pub fn relocate(&mut self, plan: &MovePlan, now: Instant) -> Result<(), ScheduleError> {
        let p = self
            .pods
            .get_mut(&plan.pod)
            .ok_or_else(|| ScheduleError::NoSuchPod(plan.pod.clone()))?;
        p.region
            .relocate(&plan.from, &plan.to)
            .map_err(|source| ScheduleError::Region {
                pod: plan.pod.clone(),
                source,
            })?;
        let from_key = uuid_key(&plan.from);
        let origin = match p
            .relocations
            .iter()
            .position(|r| uuid_key(&r.to) == from_key)
        {
            Some(at) => p.relocations.swap_remove(at).origin,
            None => from_key,
        };
        if origin != uuid_key(&plan.to) {
            p.relocations.push(Relocation {
                origin,
                to: plan.to.clone(),
            });
        }
        place(p, &self.gpus);
        write_layout(p);
        tracing::info!(pod = %plan.pod, from = %plan.from, to = %plan.to, "pod moved");
        self.tick(now, None);
        Ok(())
    }

    /// The observed GPU `selector` names.
    pub fn observed(&self, selector: &GpuSelector) -> Option<&GpuInfo> {
        self.gpus.iter().find(|g| selector.selects(g))
    }
}

/// The moves a pod's limits object records (a pod this daemon, or an
/// earlier run of it, moved), by the GPUs observed now; a move to a GPU
/// not observed is dropped, and the pod placed as its spec says.
pub(crate) fn recorded(pod: &Pod, gpus: &[GpuInfo]) -> Vec<Relocation> {
    pod.region
        .relocations()
        .into_iter()
        .filter_map(|(origin, key)| {
            let gpu = gpus.iter().find(|g| uuid_key(&g.uuid) == key)?;
            Some(Relocation {
                origin,
                to: gpu.uuid.clone(),
            })
        })
        .collect()
}

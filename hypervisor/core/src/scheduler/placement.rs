//! Where a pod's GPUs are: its per-GPU state rebuilt from a changed spec,
//! each GPU its spec names resolved to one of the node's (or to the GPU the
//! pod was moved to), and its quotas written and published there.

use std::time::Instant;

use gpushare_utils::ledger::MAX_DEVICES;
use gpushare_utils::limits::uuid_key;
use hypervisor_observer::GpuInfo;

use super::{Placement, Pod, PodGpu};
use crate::spec::{GpuSelector, GpuSpec};

/// Rebuilds the per-GPU state from the spec, keeping the demand history of
/// GPUs named the same way as before.
pub(super) fn rebuild_gpus(pod: &mut Pod, now: Instant) {
    let mut old: Vec<PodGpu> = std::mem::take(&mut pod.gpus);
    pod.gpus = pod
        .spec
        .gpus
        .iter()
        .map(
            |spec| match old.iter().position(|g| g.spec.gpu == spec.gpu) {
                Some(at) => {
                    let mut kept = old.swap_remove(at);
                    kept.spec = spec.clone();
                    kept
                }
                None => PodGpu::new(spec.clone(), now),
            },
        )
        .collect();
}

/// Why GPU limits set at run time cannot be applied as given: more GPUs than
/// a pod's objects hold, a GPU this node does not have, or one GPU selected
/// twice. Each would leave a GPU the pod was meant to have unplaced (and so
/// unlimited) or a limit silently dropped; the request is refused whole.
pub(super) fn check_gpus(specs: &[GpuSpec], gpus: &[GpuInfo]) -> Result<(), String> {
    if specs.len() > MAX_DEVICES {
        return Err(format!(
            "{} GPUs given; a pod holds at most {MAX_DEVICES}",
            specs.len()
        ));
    }
    let mut selected: Vec<(&str, &GpuSelector)> = Vec::with_capacity(specs.len());
    for spec in specs {
        let found = gpus.iter().find(|g| spec.gpu.selects(g));
        let Some(gpu) = found else {
            return Err(format!("{} is not a GPU of this node", spec.gpu));
        };
        if let Some((_, first)) = selected.iter().find(|(uuid, _)| *uuid == gpu.uuid) {
            return Err(format!("{first} and {} select the same GPU", spec.gpu));
        }
        selected.push((gpu.uuid.as_str(), &spec.gpu));
    }
    Ok(())
}

/// Resolves every GPU of `pod` to a UUID (the GPU it was moved to, where it
/// was); returns whether any placement changed. A GPU named twice (by index
/// and by UUID) is placed once.
pub(super) fn place(pod: &mut Pod, gpus: &[GpuInfo]) -> bool {
    let mut taken: Vec<String> = Vec::new();
    let mut resolved = Vec::with_capacity(pod.gpus.len());
    for gpu in &pod.gpus {
        let found = match &gpu.spec.gpu {
            GpuSelector::Index(i) => gpus
                .iter()
                .find(|g| g.index == *i)
                .map(|g| (g.uuid.clone(), Some(g.index))),
            GpuSelector::Uuid(u) => Some(
                gpus.iter()
                    .find(|g| g.uuid.eq_ignore_ascii_case(u))
                    .map_or((u.clone(), None), |g| (g.uuid.clone(), Some(g.index))),
            ),
        }
        .map(|(uuid, index)| relocated(pod, &uuid, gpus).unwrap_or((uuid, index)));
        let placement = found.and_then(|(uuid, host_index)| {
            let key = uuid.to_ascii_lowercase();
            if taken.contains(&key) || taken.len() >= MAX_DEVICES {
                tracing::warn!(pod = %pod.spec.id, gpu = %gpu.spec.gpu, "GPU not placed: given twice, or more than the pod's objects hold");
                return None;
            }
            taken.push(key);
            Some(Placement { uuid, host_index })
        });
        resolved.push(placement);
    }
    let mut changed = false;
    for (gpu, placement) in pod.gpus.iter_mut().zip(resolved) {
        if placement.is_none() && gpu.placement.is_some()
            || placement.is_some() && gpu.placement.is_none()
        {
            tracing::info!(pod = %pod.spec.id, gpu = %gpu.spec.gpu, placed = placement.is_some(), "GPU placement changed");
        }
        if placement != gpu.placement {
            changed = true;
            gpu.placement = placement;
        }
    }
    changed
}

/// Writes the quotas of the pod's placed GPUs, forgets the others, sets the
/// suspension and publishes the limits.
pub(super) fn write_layout(pod: &Pod) {
    let mut placed = Vec::new();
    for gpu in &pod.gpus {
        if let Some(p) = &gpu.placement {
            // The rate follows in the tick that comes next, under the same lock.
            pod.region.claim(&p.uuid, &gpu.spec);
            placed.push(p.uuid.as_str());
        }
    }
    pod.region.set_suspended(pod.suspended);
    pod.region.publish(&placed);
}

/// Where the GPU `uuid` of `pod`'s spec is now: the GPU the pod was moved
/// to, when it was.
fn relocated(pod: &Pod, uuid: &str, gpus: &[GpuInfo]) -> Option<(String, Option<u32>)> {
    let key = uuid_key(uuid);
    let moved = pod.relocations.iter().find(|r| r.origin == key)?;
    Some(
        gpus.iter()
            .find(|g| g.uuid.eq_ignore_ascii_case(&moved.to))
            .map_or((moved.to.clone(), None), |g| {
                (g.uuid.clone(), Some(g.index))
            }),
    )
}

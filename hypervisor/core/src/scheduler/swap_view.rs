//! What swapping needs to know of the pods: their objects, where they are
//! placed, what they hold there and their class.

use std::sync::Arc;

use gpushare_utils::pod::PodClass;

use super::{Pod, Scheduler};
use crate::region::PodRegion;

/// A pod as swapping sees it.
#[derive(Debug, Clone)]
pub struct SwapView {
    /// The pod's id.
    pub pod: String,
    /// Its ledger (usage, last call) and limits (residency).
    pub region: Arc<PodRegion>,
    /// Its placed GPUs.
    pub gpus: Vec<SwapGpu>,
}

/// One placed GPU of a [`SwapView`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapGpu {
    /// The GPU's UUID as placed.
    pub uuid: String,
    /// Its NVML index, when the observer knows the GPU.
    pub index: Option<u32>,
    /// Bytes the pod holds there by its ledger, driver overhead included.
    pub bytes: u64,
    /// Whether the pod is of the latency class there.
    pub latency: bool,
}

impl SwapView {
    /// Bytes the pod holds on all its GPUs.
    pub fn bytes(&self) -> u64 {
        self.gpus.iter().map(|g| g.bytes).sum()
    }

    /// Bytes the pod holds on the GPU `uuid`.
    pub fn bytes_on(&self, uuid: &str) -> u64 {
        self.gpus
            .iter()
            .filter(|g| g.uuid.eq_ignore_ascii_case(uuid))
            .map(|g| g.bytes)
            .sum()
    }
}

impl Scheduler {
    /// `pod` as swapping sees it; `None` where it is not scheduled.
    pub fn swap_view(&self, pod: &str) -> Option<SwapView> {
        self.pods.get(pod).map(view)
    }

    /// Every scheduled pod placed on the GPU `uuid`.
    pub fn swap_views_on(&self, uuid: &str) -> Vec<SwapView> {
        self.pods
            .values()
            .map(view)
            .filter(|v| v.gpus.iter().any(|g| g.uuid.eq_ignore_ascii_case(uuid)))
            .collect()
    }

    /// Every scheduled pod.
    pub fn swap_views(&self) -> Vec<SwapView> {
        self.pods.values().map(view).collect()
    }

    /// What `pod` may still allocate on the GPU `uuid`: its quota there
    /// (the daemon's, in its limits) less what it holds there, by its
    /// ledger or by NVML at the last audit, whichever is more (a pod that
    /// over-reports only lowers its own figure); `u64::MAX` without a quota.
    /// `None` where the pod is not placed on the GPU, or its ledger cannot
    /// say.
    pub fn quota_left(&self, pod: &str, uuid: &str) -> Option<u64> {
        let pod = self.pods.get(pod)?;
        let (gpu, placed) = pod.gpus.iter().find_map(|gpu| {
            let placement = gpu.placement.as_ref()?;
            placement
                .uuid
                .eq_ignore_ascii_case(uuid)
                .then_some((gpu, &placement.uuid))
        })?;
        let usage = pod.region.usage(placed)?;
        if usage.quota == 0 {
            return Some(u64::MAX);
        }
        let held = usage.used.max(gpu.nvml_bytes.unwrap_or(0));
        Some(usage.quota.saturating_sub(held))
    }
}

fn view(pod: &Pod) -> SwapView {
    let gpus = pod
        .gpus
        .iter()
        .filter_map(|gpu| {
            let placement = gpu.placement.as_ref()?;
            Some(SwapGpu {
                uuid: placement.uuid.clone(),
                index: placement.host_index,
                bytes: pod.region.usage(&placement.uuid).map_or(0, |u| u.used),
                latency: gpu.spec.class == PodClass::Latency,
            })
        })
        .collect();
    SwapView {
        pod: pod.spec.id.to_string(),
        region: Arc::clone(&pod.region),
        gpus,
    }
}

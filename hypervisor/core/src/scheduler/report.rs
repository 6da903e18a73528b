//! The scheduler's status report.

use std::sync::atomic::Ordering;

use gpushare_utils::bucket::PPM;
use serde::Serialize;

use super::*;

/// Snapshot of one pod's GPU.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct GpuStatus {
    /// The GPU as the pod's spec names it: a UUID, or `index N`.
    pub gpu: String,
    /// The UUID it was placed on; `None`: not placed (no GPU of the node at
    /// that index, the same GPU given twice, or more GPUs than a region
    /// holds), so not limited.
    pub uuid: Option<String>,
    /// The GPU's NVML index; `None` where it is not placed or its UUID is
    /// not among the GPUs last observed.
    pub host_index: Option<u32>,
    /// `fixed`, `elastic` or `none` ([`Policy::as_str`]).
    pub policy: String,
    /// Weight among the pods that want the GPU.
    pub weight: u32,
    /// Hard cap in percent, as configured; `None`: none set.
    pub cap_percent: Option<u8>,
    /// Guaranteed share in percent, as configured; `None`: none set.
    pub share_percent: Option<u8>,
    /// Memory quota in bytes, from the ledger (the spec's while unplaced);
    /// 0 = unlimited.
    pub memory_quota: u64,
    /// Bytes the pod's live processes hold on the GPU, driver overhead
    /// included, from the ledger; 0 while unplaced.
    pub memory_used: u64,
    /// Highest `memory_used` since the region was created.
    pub memory_peak: u64,
    /// Device memory NVML attributes to the pod's processes (those the
    /// daemon's pid namespace shows), at the last audit; `None`: not seen.
    #[serde(default)]
    pub memory_nvml: Option<u64>,
    /// The pod's processes hold more than its ledger says (see
    /// [`Scheduler::audit`]).
    #[serde(default)]
    pub memory_under_reported: bool,
    /// Of `memory_used`, what the driver holds for the pod's processes
    /// outside allocations (contexts, modules, heaps, graph and pool
    /// memory), as they measured it.
    #[serde(default)]
    pub memory_driver_held: u64,
    /// Memory NVML attributes to the pod beyond its ledger, charged to it
    /// by the audit (counted in its reports and refusals, not in
    /// `memory_used`).
    #[serde(default)]
    pub memory_unaccounted: u64,
    /// Host memory the pod's processes hold past the quota
    /// (oversubscription), its peak, and the cap (0 = no oversubscription).
    #[serde(default)]
    pub spill_used: u64,
    /// Highest `spill_used` since the region was created, in bytes.
    #[serde(default)]
    pub spill_peak: u64,
    /// The pod-wide spill cap on this GPU, in bytes; 0 = no
    /// oversubscription.
    #[serde(default)]
    pub spill_limit: u64,
    /// Granted share in ppm; 0 = unlimited.
    pub rate_ppm: u32,
    /// The most the pod may take while others leave the GPU idle, in ppm
    /// of wall time; equal to `rate_ppm` for a fixed share.
    pub ceiling_ppm: u32,
    /// GPU time charged per wall time over the last second, in ppm.
    pub achieved_ppm: u32,
    /// What the GPU's elastic pods split, in ppm of wall time: 1,000,000,
    /// or more on a co-run GPU that idles while they use all they are given
    /// ([`super::capacity`]).
    #[serde(default)]
    pub elastic_capacity_ppm: u32,
    /// The pod's threads waiting for budget on the GPU now.
    pub waiting: u32,
    /// Launches admitted on the GPU since the region was created.
    pub launches: u64,
    /// GPU nanoseconds charged for them (prices settled by measurements):
    /// over a window, its growth per wall time is what the pod was charged.
    #[serde(default)]
    pub charged_ns: u64,
    /// GPU nanoseconds the pod earned beyond its bucket's depth and so
    /// forfeited: a pod that idles, or waits longer than its bucket holds
    /// (a turn of other pods), between bursts.
    #[serde(default)]
    pub forfeited_ns: u64,
    /// GPU nanoseconds left in the pod's bucket; negative is debt the
    /// next refills pay off first.
    pub tokens_ns: i64,
    /// Whether the pod wants the GPU (launches, waiters or an admission
    /// request within [`ACTIVE_WINDOW`]) and so takes part in the split;
    /// never for a suspended pod or policy `none`.
    pub active: bool,
    /// On a co-run GPU: the share of the SMs, in percent, a client of the
    /// pod that starts now takes.
    #[serde(default)]
    pub sm_percent: Option<u8>,
}

/// Snapshot of one pod.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct PodStatus {
    /// The pod's id.
    pub id: String,
    /// Path of the pod's ledger in `/dev/shm`.
    pub region: String,
    /// Whether its launches are held (admin API, or left so by an earlier
    /// run of the daemon).
    pub suspended: bool,
    /// Workers registered for the pod now.
    pub workers: usize,
    /// One entry per GPU of its spec, placed or not.
    pub gpus: Vec<GpuStatus>,
    /// Held time and queueing delay under priority classes.
    #[serde(default)]
    pub priority: Option<crate::priority::PriorityStatus>,
    /// The pod's ledger was shrunk under the daemon (by a process that may
    /// write it): its usage figures read as zero and its processes' next
    /// allocations are refused.
    #[serde(default)]
    pub ledger_shrunk: bool,
}

impl Scheduler {
    /// Snapshot of every pod; `workers` counts a pod's workers.
    pub fn status(&self, workers: impl Fn(&str) -> usize) -> Vec<PodStatus> {
        self.pods
            .iter()
            .map(|(id, pod)| PodStatus {
                id: id.clone(),
                region: pod.region.path().display().to_string(),
                suspended: pod.suspended,
                workers: workers(id),
                gpus: pod.gpus.iter().map(|g| gpu_status(pod, g, self)).collect(),
                priority: self
                    .tables
                    .priority
                    .as_ref()
                    .and_then(|table| crate::priority::status(table, id)),
                ledger_shrunk: pod.region.is_shrunk(),
            })
            .collect()
    }
}

pub(crate) fn gpu_status(pod: &Pod, g: &PodGpu, scheduler: &Scheduler) -> GpuStatus {
    let uuid = g.placement.as_ref().map(|p| p.uuid.as_str());
    let bucket = uuid.and_then(|u| pod.region.bucket(u));
    let usage = uuid.and_then(|u| pod.region.usage(u));
    let spill = uuid.and_then(|u| pod.region.spill(u));
    GpuStatus {
        gpu: g.spec.gpu.to_string(),
        uuid: g.placement.as_ref().map(|p| p.uuid.clone()),
        host_index: g.placement.as_ref().and_then(|p| p.host_index),
        policy: g.spec.policy.as_str().to_owned(),
        weight: g.spec.weight,
        cap_percent: g.spec.cap_percent,
        share_percent: g.spec.share_percent,
        memory_quota: usage.map_or(g.spec.memory_bytes, |u| u.quota),
        memory_used: usage.map_or(0, |u| u.used),
        memory_peak: usage.map_or(0, |u| u.peak),
        memory_nvml: g.nvml_bytes,
        memory_under_reported: g.under_reported,
        memory_driver_held: uuid.map_or(0, |u| pod.region.driver_held(u)),
        memory_unaccounted: uuid.map_or(0, |u| pod.region.unaccounted(u)),
        spill_used: spill.map_or(0, |s| s.spilled),
        spill_peak: spill.map_or(0, |s| s.peak),
        spill_limit: spill.map_or(g.spec.spill_bytes, |s| s.limit),
        rate_ppm: bucket.map_or(g.grant.rate_ppm, |b| {
            b.limits().rate_ppm.load(Ordering::Relaxed)
        }),
        ceiling_ppm: bucket.map_or(g.grant.ceiling_ppm, |b| {
            b.limits().ceiling_ppm.load(Ordering::Relaxed)
        }),
        achieved_ppm: g.achieved_ppm,
        elastic_capacity_ppm: uuid.map_or(PPM as u32, |u| scheduler.elastic_capacity(u)),
        waiting: bucket.map_or(0, |b| b.waiting.load(Ordering::Relaxed)),
        launches: bucket.map_or(0, |b| b.launches.load(Ordering::Relaxed)),
        charged_ns: bucket.map_or(0, |b| b.charged_ns.load(Ordering::Relaxed)),
        forfeited_ns: bucket.map_or(0, |b| b.forfeited_ns.load(Ordering::Relaxed)),
        tokens_ns: bucket.map_or(0, |b| b.tokens_ns.load(Ordering::Relaxed)),
        active: g.active,
        sm_percent: uuid.and_then(|u| pod.region.sm_percent(u)),
    }
}

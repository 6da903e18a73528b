//! The scheduler's periodic work: rates from the fair share, the audit of
//! each pod's ledger against what the driver reports, reclaim.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use gpushare_utils::pod::PodClass;

use crate::fairshare::{self};
use crate::spec::Policy;
use hypervisor_corun as corun;
use hypervisor_observer::ProcessMemory;

use super::*;

/// Usage NVML sees beyond what a pod's ledger says, tolerated (rounding,
/// driver memory taken since the pod last measured it).
pub(super) const AUDIT_SLACK: u64 = 256 << 20;

/// Usage NVML sees beyond a pod's ledger that is not charged to the pod
/// (rounding); past it, the whole excess is charged as driver-held memory.
pub(super) const UNACCOUNTED_SLACK: u64 = 64 << 20;

/// A pod whose processes hold more than its ledger says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub pod: String,
    pub uuid: String,
    pub ledger: u64,
    pub nvml: u64,
}

impl Scheduler {
    /// One scheduling round: of every GPU, or of the GPU `only` (lowercase
    /// UUID). A round of every GPU first tries again the pods left out
    /// whose turn has come ([`super::retry`]).
    pub fn tick(&mut self, now: Instant, only: Option<&str>) {
        if only.is_none() && !self.failed.is_empty() {
            self.retry_due(now);
        }
        let mut by_gpu: BTreeMap<String, Vec<(String, usize)>> = BTreeMap::new();
        for (id, pod) in &mut self.pods {
            for (k, gpu) in pod.gpus.iter_mut().enumerate() {
                let Some(placement) = &gpu.placement else {
                    continue;
                };
                let key = placement.uuid.to_ascii_lowercase();
                if only.is_some_and(|u| u != key) {
                    continue;
                }
                if let Some(bucket) = pod.region.bucket(&placement.uuid) {
                    let launches = bucket.launches.load(Ordering::Relaxed);
                    if bucket.waiting.load(Ordering::Relaxed) > 0 || launches != gpu.last_launches {
                        gpu.last_demand = Some(now);
                    }
                    gpu.last_launches = launches;
                    let elapsed = now.saturating_duration_since(gpu.window_start);
                    if elapsed >= ACHIEVED_WINDOW {
                        let charged = bucket.charged_ns.load(Ordering::Relaxed);
                        let used = charged.saturating_sub(gpu.window_charged);
                        gpu.achieved_ppm =
                            (u128::from(used) * 1_000_000 / elapsed.as_nanos().max(1))
                                .min(u128::from(u32::MAX)) as u32;
                        gpu.window_charged = charged;
                        gpu.window_start = now;
                    }
                }
                gpu.active = !pod.suspended
                    && gpu.spec.policy != Policy::None
                    && gpu
                        .last_demand
                        .is_some_and(|t| now.saturating_duration_since(t) < ACTIVE_WINDOW);
                pod.region.set_demand_seen(&placement.uuid, gpu.active);
                by_gpu.entry(key).or_default().push((id.clone(), k));
            }
        }
        for (key, members) in &by_gpu {
            let entries: Vec<fairshare::Entry> = members
                .iter()
                .filter_map(|(id, k)| self.pods.get(id).and_then(|p| p.gpus.get(*k)))
                .map(|g| fairshare::Entry {
                    policy: g.spec.policy,
                    weight: g.spec.weight,
                    bound_percent: g.spec.bound_percent(),
                    floor_percent: g.spec.floor_percent(),
                    active: g.active,
                })
                .collect();
            if entries.len() != members.len() {
                continue;
            }
            self.tables.contended(key, self.capped_batch(members), now);
            self.write_turn_pods(members);
            self.write_sm_percents(members);
            let grants = fairshare::plan(&entries, self.elastic_capacity(key));
            for ((id, k), grant) in members.iter().zip(grants) {
                let Some(pod) = self.pods.get_mut(id) else {
                    continue;
                };
                let Some(gpu) = pod.gpus.get_mut(*k) else {
                    continue;
                };
                gpu.grant = grant;
                if let Some(placement) = &gpu.placement
                    && pod.region.write_grant(&placement.uuid, grant)
                {
                    pod.notify.notify_waiters();
                }
            }
        }
        // A GPU no pod is placed on any more has no capped pod wanting it.
        if only.is_none() {
            for gpu in &self.gpus {
                if !by_gpu.contains_key(&gpu.uuid.to_ascii_lowercase()) {
                    self.tables.contended(&gpu.uuid, 0, now);
                }
            }
        }
    }

    /// How many pods of `members` (a GPU's pods, by id and GPU position)
    /// want the GPU as batch pods with a compute cap: where two or more do,
    /// a time-sliced GPU takes turns ([`crate::turns::TurnPlan::contended`]).
    fn capped_batch(&self, members: &[(String, usize)]) -> usize {
        members
            .iter()
            .filter_map(|(id, k)| self.pods.get(id)?.gpus.get(*k))
            .filter(|gpu| {
                gpu.active && gpu.spec.class == PodClass::Batch && gpu.spec.bound_percent() < 100
            })
            .count()
    }

    /// Tells each of `members` (a GPU's pods, by id and GPU position) how
    /// many batch pods want the GPU: those that take turns where it does.
    /// A launch waits for its turn at most a turn of each other one
    /// ([`gpushare_utils::priority::TurnLine::patience_ns`]), whatever a pod
    /// writes in the node's turn line.
    fn write_turn_pods(&self, members: &[(String, usize)]) {
        let gpus: Vec<(&Pod, &PodGpu)> = members
            .iter()
            .filter_map(|(id, k)| {
                let pod = self.pods.get(id)?;
                Some((pod, pod.gpus.get(*k)?))
            })
            .collect();
        let pods = gpus
            .iter()
            .filter(|(_, gpu)| gpu.active && gpu.spec.class == PodClass::Batch)
            .count();
        for (pod, gpu) in gpus {
            if let Some(placement) = &gpu.placement {
                pod.region.set_turn_pods(&placement.uuid, pods);
            }
        }
    }

    /// On a co-run GPU, the pods of `members` (its pods, by id and GPU
    /// position): what the next MPS client of each takes
    /// ([`corun::active_thread_percentage`]), which depends on whether a pod
    /// of the other class is provisioned on the GPU, running or not.
    fn write_sm_percents(&self, members: &[(String, usize)]) {
        let Some(corun) = &self.corun else {
            return;
        };
        let gpus: Vec<(&Pod, &PodGpu, &Placement)> = members
            .iter()
            .filter_map(|(id, k)| {
                let pod = self.pods.get(id)?;
                let gpu = pod.gpus.get(*k)?;
                Some((pod, gpu, gpu.placement.as_ref()?))
            })
            .collect();
        if !gpus.iter().any(|(_, _, p)| corun.covers(&p.uuid)) {
            return;
        }
        let has = |class| gpus.iter().any(|(_, gpu, _)| gpu.spec.class == class);
        let (latency, batch) = (has(PodClass::Latency), has(PodClass::Batch));
        for (pod, gpu, placement) in gpus {
            let beside_other_class = match gpu.spec.class {
                PodClass::Latency => batch,
                PodClass::Batch => latency,
            };
            let percent = corun::active_thread_percentage(
                gpu.spec.class,
                corun.latency_reserve,
                gpu.spec.sm_share,
                beside_other_class,
            );
            pod.region.set_sm_percent(&placement.uuid, percent);
        }
    }

    /// Checks each pod's reported usage against NVML's per-process figures
    /// (`memory`: per lowercase GPU UUID, what NVML attributes to each pid):
    /// a pod whose processes hold more than its ledger says (beyond
    /// [`AUDIT_SLACK`]) bypasses or forges its accounting. Returns the pods
    /// and GPUs newly found so, with (ledger, NVML) bytes.
    pub fn audit(&mut self, memory: &BTreeMap<String, Vec<ProcessMemory>>) -> Vec<Mismatch> {
        let mut found = Vec::new();
        for (id, pod) in &mut self.pods {
            let pids = pod.region.pids();
            for gpu in &mut pod.gpus {
                let Some(placement) = &gpu.placement else {
                    continue;
                };
                let Some(processes) = memory.get(&placement.uuid.to_ascii_lowercase()) else {
                    // Unseen: the last charge stands (fail closed).
                    gpu.nvml_bytes = None;
                    continue;
                };
                let seen: u64 = processes
                    .iter()
                    .filter(|p| pids.contains(&p.pid))
                    .map(|p| p.bytes)
                    .fold(0, u64::saturating_add);
                let ledger = pod.region.usage(&placement.uuid).map_or(0, |u| u.used);
                gpu.nvml_bytes = Some(seen);
                // What no hook charged is charged now: the pod's next
                // allocations see it, on every process.
                let excess = seen.saturating_sub(ledger);
                let charged = if excess > UNACCOUNTED_SLACK {
                    excess
                } else {
                    0
                };
                // Processes on a ledger the pod replaced count there, not in
                // the current one: at least that much is the pod's too.
                let charged = charged.max(pod.region.retired_usage(&placement.uuid));
                pod.region.set_unaccounted(&placement.uuid, charged);
                let under = seen > ledger.saturating_add(AUDIT_SLACK);
                if under && !gpu.under_reported {
                    found.push(Mismatch {
                        pod: id.clone(),
                        uuid: placement.uuid.clone(),
                        ledger,
                        nvml: seen,
                    });
                }
                gpu.under_reported = under;
            }
        }
        found
    }

    /// Gives back the memory of dead processes in every pod; returns the
    /// bytes per pod where any was given back.
    pub fn reclaim_dead(&self) -> Vec<(String, u64)> {
        self.pods
            .iter()
            .filter_map(|(id, pod)| {
                let bytes = pod.region.reclaim_dead();
                (bytes > 0).then(|| (id.clone(), bytes))
            })
            .collect()
    }

    /// Gives back the memory of `pod`'s dead processes.
    pub fn reclaim_pod(&self, pod: &str) -> u64 {
        self.pods.get(pod).map_or(0, |p| p.region.reclaim_dead())
    }
}

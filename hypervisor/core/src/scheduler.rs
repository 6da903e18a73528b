//! The pods, their regions, and the weighted fair sharing of each GPU.
//!
//! [`Scheduler::apply`] takes the full list of [`PodSpec`]s (from the config
//! file, or later a Kubernetes pod watcher), opens regions for new pods,
//! rewrites changed limits and forgets removed pods. [`Scheduler::tick`]
//! (every 10 ms, and at once for the GPU of an admission request) reads
//! every bucket's demand and writes every bucket's rate:
//!
//! 1. A pod wants a GPU when its bucket has waiting launches, its launch count
//!    moved since the last tick, or it asked for admission, within the last
//!    [`ACTIVE_WINDOW`].
//! 2. Per GPU, [`fairshare::plan`](crate::fairshare::plan) splits 100%
//!    among the pods that want it, by weight, within caps and above
//!    guaranteed shares; idle pods get the share they would have if
//!    everyone wanted the GPU. On a co-run GPU that idles while its elastic
//!    pods use all they are given, they split more ([`capacity`]).
//! 3. Rates and ceilings are stored into the buckets (marked managed); a rate
//!    that rose wakes the pod's admission waiters.
//!
//! GPUs are named by UUID in the pod's limits and ledger, never by index: a
//! GPU given by `index` in the config is resolved to its UUID through the
//! observer, and each process finds its GPUs by UUID whatever
//! `CUDA_VISIBLE_DEVICES` numbers them. Nothing a worker reports can move a
//! quota to another GPU.
//!
//! The periodic work (rates, audit, reclaim) is in [`tick`], which also
//! tries again the pods left out ([`retry`]); the status report in
//! [`report`].

pub mod capacity;
mod placement;
mod relocate;
mod report;
mod retry;
mod swap_view;
mod tick;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpushare_utils::node_table::pod_key;
use gpushare_utils::pod::PodId;
use gpushare_utils::protocol::PodGpuLimits;
use tokio::sync::Notify;

use crate::fairshare::Allotment;
use crate::node_tables::NodeTables;
use crate::region::{PodRegion, RegionError, RegionOptions};
use crate::spec::{GpuSpec, PodSpec, Policy, Token};
use crate::turns::{GpuTurns, TurnOptions, TurnPlan};
use hypervisor_corun::CorunOptions;
use hypervisor_observer::GpuInfo;

use placement::{check_gpus, place, rebuild_gpus, write_layout};
pub use relocate::MovePlan;
use relocate::Relocation;
pub use report::{GpuStatus, PodStatus};
use retry::LeftOut;
pub use swap_view::{SwapGpu, SwapView};

/// A pod wants a GPU for this long after the last sign of demand.
pub const ACTIVE_WINDOW: Duration = Duration::from_millis(200);

/// Achieved shares are measured over windows this long.
pub(crate) const ACHIEVED_WINDOW: Duration = Duration::from_secs(1);

/// Why a scheduler operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// The pod is not scheduled: not in the current spec list, or left out
    /// because its region could not be opened.
    #[error("no pod {0}")]
    NoSuchPod(String),
    /// The pod's region (ledger or limits object) could not be opened.
    #[error("pod {pod}: {source}")]
    Region {
        /// The pod's id.
        pod: String,
        /// What went wrong with its objects in `/dev/shm`.
        #[source]
        source: RegionError,
    },
    /// GPU limits that would not hold as given; nothing was changed.
    #[error("pod {pod}: {reason}")]
    Invalid {
        /// The pod's id.
        pod: String,
        /// Which limit cannot be placed: too many GPUs, a GPU the node does
        /// not have, or one GPU selected twice.
        reason: String,
    },
}

/// What [`Scheduler::apply`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Pods new to the list whose regions were opened.
    pub added: Vec<String>,
    /// Pods whose GPU limits changed (their workers are told).
    pub changed: Vec<String>,
    /// Pods no longer in the list; their regions stay with the last limits.
    pub removed: Vec<String>,
    /// Pods left out, with the reason: their region could not be opened.
    /// Tried again on the periodic tick until served.
    pub failed: Vec<(String, String)>,
}

/// Where a pod's GPU sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Placement {
    /// As the observer (or else the config) spells it.
    pub(crate) uuid: String,
    pub(crate) host_index: Option<u32>,
}

#[derive(Debug)]
pub(crate) struct PodGpu {
    pub(crate) spec: GpuSpec,
    pub(crate) placement: Option<Placement>,
    pub(crate) last_launches: u64,
    pub(crate) last_demand: Option<Instant>,
    pub(crate) active: bool,
    pub(crate) grant: Allotment,
    pub(crate) window_start: Instant,
    pub(crate) window_charged: u64,
    pub(crate) achieved_ppm: u32,
    /// What NVML attributes to the pod's processes on the GPU, at the last audit.
    pub(crate) nvml_bytes: Option<u64>,
    /// The last audit found more than the ledger says.
    pub(crate) under_reported: bool,
    /// When the GPU's last busy sample came, and what the pod had been
    /// charged by then ([`capacity`]).
    pub(crate) busy_mark: Option<(Instant, u64)>,
}

impl PodGpu {
    fn new(spec: GpuSpec, now: Instant) -> Self {
        Self {
            spec,
            placement: None,
            last_launches: 0,
            last_demand: None,
            active: false,
            grant: Allotment::default(),
            window_start: now,
            window_charged: 0,
            achieved_ppm: 0,
            nvml_bytes: None,
            under_reported: false,
            busy_mark: None,
        }
    }
}

pub(crate) struct Pod {
    pub(crate) spec: PodSpec,
    pub(crate) region: Arc<PodRegion>,
    pub(crate) suspended: bool,
    pub(crate) gpus: Vec<PodGpu>,
    pub(crate) notify: Arc<Notify>,
    /// GPUs of the spec the pod was moved away from, and where to.
    pub(crate) relocations: Vec<Relocation>,
}

/// What an admission request waits on.
#[derive(Clone)]
pub struct AdmissionTarget {
    /// The pod's region, whose bucket the request refills and reads.
    pub region: Arc<PodRegion>,
    /// The GPU's UUID as placed (the observer's spelling).
    pub uuid: String,
    /// Woken when the pod's rate rises, its suspension changes or it is
    /// removed: a waiter then looks at its bucket again.
    pub notify: Arc<Notify>,
}

/// The pods and GPUs of the node.
pub struct Scheduler {
    pub(crate) gpus: Vec<GpuInfo>,
    pub(crate) pods: BTreeMap<String, Pod>,
    /// Pods left out, tried again from the tick ([`retry`]).
    pub(crate) failed: BTreeMap<String, LeftOut>,
    pub(crate) regions: RegionOptions,
    /// The node's activity and priority tables (made at start).
    pub(crate) tables: NodeTables,
    /// Co-run mode: its GPUs and the SMs kept for latency pods there.
    pub(crate) corun: Option<CorunOptions>,
    /// What the elastic pods of a co-run GPU split, in ppm, by lowercase
    /// UUID, where it is more than the GPU's time ([`capacity`]).
    pub(crate) capacity: BTreeMap<String, u32>,
}

impl Scheduler {
    /// No pods yet, the node's `gpus` as first observed; regions are opened
    /// with `regions` and the node-wide tables are `tables`.
    pub fn new(gpus: Vec<GpuInfo>, regions: RegionOptions, tables: NodeTables) -> Self {
        Self {
            gpus,
            pods: BTreeMap::new(),
            failed: BTreeMap::new(),
            regions,
            tables,
            corun: None,
            capacity: BTreeMap::new(),
        }
    }

    /// The node's activity and priority tables.
    pub fn tables(&self) -> &NodeTables {
        &self.tables
    }

    /// Checks the node tables and every pod's ledger, and repairs what a
    /// pod damaged ([`NodeTables::check`], [`PodRegion::check_ledger`]).
    pub fn check_tables(&mut self) {
        self.tables.check();
        for (id, pod) in &self.pods {
            if let Some(repair) = pod.region.check_ledger() {
                tracing::info!(pod = id, ?repair, "pod ledger repaired");
            }
        }
    }

    /// Batch pods take turns on `options`' GPUs of the node, always or while
    /// capped batch pods contend for one ([`tick`]), and on no other
    /// ([`NodeTables::set_turns`]).
    pub fn set_turns(&mut self, options: Option<&TurnOptions>) {
        self.tables.set_turns(TurnPlan::new(&self.gpus, options));
    }

    /// Each GPU's turns, as the priority table says now; a holder by the id
    /// of the pod it is.
    pub fn turns_status(&self) -> Vec<GpuTurns> {
        let pod = |key| self.pods.keys().find(|id| pod_key(id) == key).cloned();
        self.tables.turns().status(
            self.tables.priority.as_ref(),
            gpushare_utils::clock::monotonic_ns(),
            pod,
        )
    }

    /// Co-run mode: each tick gives the pods of `options`' GPUs the share of
    /// the SMs their next MPS client takes ([`tick`]).
    pub fn set_corun(&mut self, options: CorunOptions) {
        self.corun = Some(options);
    }

    /// The GPUs last observed.
    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    /// Ids of the pods scheduled.
    pub fn pod_ids(&self) -> Vec<String> {
        self.pods.keys().cloned().collect()
    }

    /// The token of `pod`.
    pub fn token(&self, pod: &str) -> Option<&Token> {
        self.pods.get(pod).map(|p| &p.spec.token)
    }

    /// The typed id of `pod`; `None` where it is not scheduled.
    pub fn pod_id(&self, pod: &str) -> Option<&PodId> {
        self.pods.get(pod).map(|p| &p.spec.id)
    }

    /// Sets the options applied to regions opened from now on.
    pub fn set_region_options(&mut self, regions: RegionOptions) {
        self.regions = regions;
    }

    /// Makes the pods exactly `specs` (see the module documentation).
    pub fn apply(&mut self, specs: Vec<PodSpec>, now: Instant) -> ApplyReport {
        let mut report = ApplyReport::default();
        let wanted: std::collections::HashSet<String> =
            specs.iter().map(|s| s.id.to_string()).collect();
        let gone: Vec<String> = self
            .pods
            .keys()
            .filter(|id| !wanted.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            // Dropping the pod gives our ledger slot back; the region stays
            // with its last limits.
            if let Some(pod) = self.pods.remove(&id) {
                pod.notify.notify_waiters();
            }
            report.removed.push(id);
        }
        self.failed.retain(|id, _| wanted.contains(id));
        for spec in specs {
            let id = spec.id.to_string();
            match self.pods.get_mut(&id) {
                Some(pod) => {
                    let gpus_changed = pod.spec.gpus != spec.gpus;
                    pod.spec.token = spec.token;
                    if gpus_changed {
                        pod.spec.gpus = spec.gpus;
                        rebuild_gpus(pod, now);
                        place(pod, &self.gpus);
                        write_layout(pod);
                        report.changed.push(id);
                    }
                }
                None => match self.open_or_leave_out(spec, now) {
                    Ok(()) => report.added.push(id),
                    Err(reason) => report.failed.push((id, reason)),
                },
            }
        }
        self.tick(now, None);
        report
    }

    /// Opens the regions of pods left out whose next try is due (the
    /// periodic [`Self::tick`] does too); returns those now served.
    pub fn retry_failed(&mut self, now: Instant) -> Vec<String> {
        let added = self.retry_due(now);
        if !added.is_empty() {
            self.tick(now, None);
        }
        added
    }

    pub(crate) fn open_pod(&mut self, spec: PodSpec, now: Instant) -> Result<(), ScheduleError> {
        let region =
            PodRegion::open(&spec.id, &self.regions).map_err(|source| ScheduleError::Region {
                pod: spec.id.to_string(),
                source,
            })?;
        // A pod suspended before a restart stays suspended.
        let suspended = region.any_suspended();
        let mut pod = Pod {
            gpus: Vec::new(),
            spec,
            region: Arc::new(region),
            suspended,
            notify: Arc::new(Notify::new()),
            relocations: Vec::new(),
        };
        // A pod moved before a restart stays where it was moved.
        pod.relocations = relocate::recorded(&pod, &self.gpus);
        rebuild_gpus(&mut pod, now);
        place(&mut pod, &self.gpus);
        write_layout(&pod);
        // Launches counted before now are not demand.
        for gpu in &mut pod.gpus {
            if let Some(bucket) = gpu
                .placement
                .as_ref()
                .and_then(|p| pod.region.bucket(&p.uuid))
            {
                gpu.last_launches = bucket.launches.load(Ordering::Relaxed);
                gpu.window_charged = bucket.charged_ns.load(Ordering::Relaxed);
            }
        }
        tracing::info!(pod = %pod.spec.id, region = %pod.region.path().display(), suspended, "pod scheduled");
        self.pods.insert(pod.spec.id.to_string(), pod);
        Ok(())
    }

    /// New observation of the node's GPUs; re-places pods when it changed.
    pub fn update_gpus(&mut self, gpus: Vec<GpuInfo>, now: Instant) {
        if gpus == self.gpus {
            return;
        }
        let moved = gpus.len() != self.gpus.len()
            || gpus
                .iter()
                .zip(&self.gpus)
                .any(|(a, b)| a.index != b.index || a.uuid != b.uuid);
        self.gpus = gpus;
        if moved {
            for pod in self.pods.values_mut() {
                if place(pod, &self.gpus) {
                    write_layout(pod);
                }
            }
            self.tick(now, None);
        }
    }

    /// Replaces `pod`'s GPU limits (admin API); returns its new limits.
    pub fn set_gpus(
        &mut self,
        pod: &str,
        gpus: Vec<GpuSpec>,
        now: Instant,
    ) -> Result<Vec<PodGpuLimits>, ScheduleError> {
        let p = self
            .pods
            .get_mut(pod)
            .ok_or_else(|| ScheduleError::NoSuchPod(pod.to_owned()))?;
        check_gpus(&gpus, &self.gpus).map_err(|reason| ScheduleError::Invalid {
            pod: pod.to_owned(),
            reason,
        })?;
        p.spec.gpus = gpus;
        rebuild_gpus(p, now);
        place(p, &self.gpus);
        write_layout(p);
        self.tick(now, None);
        self.device_limits(pod)
    }

    /// Suspends or resumes `pod` (the flag in every bucket of its region).
    pub fn set_suspended(
        &mut self,
        pod: &str,
        suspended: bool,
        now: Instant,
    ) -> Result<(), ScheduleError> {
        let p = self
            .pods
            .get_mut(pod)
            .ok_or_else(|| ScheduleError::NoSuchPod(pod.to_owned()))?;
        p.suspended = suspended;
        p.region.set_suspended(suspended);
        p.notify.notify_waiters();
        tracing::info!(pod, suspended, "suspension changed");
        self.tick(now, None);
        Ok(())
    }

    /// Whether `pod`'s launches are held; `None` where it is not scheduled.
    pub fn is_suspended(&self, pod: &str) -> Option<bool> {
        self.pods.get(pod).map(|p| p.suspended)
    }

    /// The limits of `pod`'s placed GPUs, as the protocol carries them.
    ///
    /// `share_percent` is the cap of a fixed pod, the guaranteed share (at
    /// least 1) of an elastic pod, 0 (unlimited) for policy none;
    /// `ceiling_percent` is the most the pod may take (100 for policy none).
    pub fn device_limits(&self, pod: &str) -> Result<Vec<PodGpuLimits>, ScheduleError> {
        let p = self
            .pods
            .get(pod)
            .ok_or_else(|| ScheduleError::NoSuchPod(pod.to_owned()))?;
        Ok(p.gpus
            .iter()
            .filter_map(|g| {
                let placement = g.placement.as_ref()?;
                let (share, ceiling) = match g.spec.policy {
                    Policy::None => (0, 100),
                    Policy::Fixed => (g.spec.bound_percent(), g.spec.bound_percent()),
                    Policy::Elastic => (g.spec.floor_percent().max(1), g.spec.bound_percent()),
                };
                Some(PodGpuLimits {
                    uuid: placement.uuid.clone(),
                    memory_bytes: g.spec.memory_bytes,
                    share_percent: share,
                    ceiling_percent: ceiling,
                    weight: g.spec.weight,
                })
            })
            .collect())
    }

    /// Notes an admission request of `pod` on GPU `uuid` and, when that makes
    /// the pod active, reschedules that GPU at once (a pod already active is
    /// already counted: the periodic tick keeps it up to date); returns what
    /// the request waits on.
    pub fn admission(&mut self, pod: &str, uuid: &str, now: Instant) -> Option<AdmissionTarget> {
        let p = self.pods.get_mut(pod)?;
        let suspended = p.suspended;
        let gpu = p.gpus.iter_mut().find(|g| {
            g.placement
                .as_ref()
                .is_some_and(|pl| pl.uuid.eq_ignore_ascii_case(uuid))
        })?;
        gpu.last_demand = Some(now);
        let placement = gpu.placement.as_ref()?;
        let target = AdmissionTarget {
            region: Arc::clone(&p.region),
            uuid: placement.uuid.clone(),
            notify: Arc::clone(&p.notify),
        };
        let becomes_active = !gpu.active && !suspended && gpu.spec.policy != Policy::None;
        if becomes_active {
            let key = placement.uuid.to_ascii_lowercase();
            self.tick(now, Some(&key));
        }
        Some(target)
    }
}

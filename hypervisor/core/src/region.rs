//! A pod's two shared-memory objects, as the hypervisor writes them:
//!
//! - the **ledger** (`/dev/shm/gpushare-pod-<pod>`): usage and bucket state,
//!   written by the pod's processes; the hypervisor reads it and gives back
//!   dead processes' memory;
//! - the **limits** (`/dev/shm/gpushare-limits-<pod>`): quotas, rates,
//!   ceilings, suspension, per GPU UUID; written only by the hypervisor,
//!   read-only to the pod.
//!
//! Both are created with `O_EXCL|O_NOFOLLOW`, owner and mode set on the
//! descriptor ([`gpushare_utils::shm`]): the ledger owned by `region_uid` /
//! `region_gid` when configured (the pods' user must write it), mode
//! `region_mode` (default 0600, never group- or other-writable); the limits
//! owned by the hypervisor, mode 0644 (0640 with `region_gid`). An existing
//! object is adopted only from a trusted owner (the hypervisor, or
//! `region_uid` for the ledger), when nobody else may write it and it has
//! the right size. Anything else at the name (a squat: a link, a directory,
//! a FIFO, a file planted by another user, one left empty) is removed
//! without being followed ([`squat`]) and the object made again.
//!
//! Opening registers the hypervisor as one of the ledger's process slots; it
//! holds no memory there. The pods' uid may write its ledger, so maintenance
//! checks it and makes it again where a pod spoiled it ([`ledgers`]); the
//! daemon keeps the ledgers it replaced, whose processes are the pod's still. Neither object is unlinked while the pod is
//! configured: pods keep their last limits while the hypervisor is away.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use gpushare_utils::bucket::Bucket;
use gpushare_utils::ledger::{DeviceUsage, LedgerError, PodLedger, SpillUsage};
use gpushare_utils::limits::{LimitsError, PodLimits, Residency};
use gpushare_utils::pod::PodId;
use gpushare_utils::shm::{self, Creation, Squat, Trust};

use crate::fairshare::Allotment;
use crate::spec::GpuSpec;

pub(crate) mod entry;
mod ledgers;
pub(crate) mod squat;

use ledgers::Ledgers;
pub use ledgers::{LedgerRepair, MAX_LEDGER_REMAKES};

/// Ownership and mode applied to every region file the hypervisor opens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegionOptions {
    /// Permission bits; `None` keeps what the file has (0600 when the
    /// hypervisor creates it), less any o+w bit.
    pub mode: Option<u32>,
    /// Owner of the pods' ledgers and the node tables (`region_uid`): the
    /// pods' user, who must write them; such files are trusted when adopted.
    /// `None`: the hypervisor's own uid.
    pub uid: Option<u32>,
    /// Group of every region file and node table (`region_gid`), so the
    /// pods' processes may read them under a group-readable mode; `None`:
    /// the hypervisor's group.
    pub gid: Option<u32>,
}

/// Why a region could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The pod's ledger (`gpushare-pod-<pod>`) could not be created, opened
    /// or mapped, or is not a ledger.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    /// The pod's limits object (`gpushare-limits-<pod>`) could not be
    /// created, adopted or mapped.
    #[error(transparent)]
    Limits(#[from] LimitsError),
    /// Something else stands at the name and may not be removed.
    #[error("/dev/shm/{name} is {found}, which the hypervisor cannot remove: {source}")]
    Squat {
        /// The `/dev/shm` entry's name.
        name: String,
        /// What stands there instead of the object: a link, a directory, a
        /// file of an untrusted owner, of the wrong size or mode.
        found: Squat,
        /// Why removing it failed (usually no permission on `/dev/shm`).
        #[source]
        source: std::io::Error,
    },
}

/// Where `/dev/shm` entries live.
const SHM_DIR: &str = "/dev/shm";

/// One pod's objects, opened by the hypervisor.
pub struct PodRegion {
    ledgers: Ledgers,
    limits: PodLimits,
    path: PathBuf,
}

impl std::fmt::Debug for PodRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodRegion")
            .field("path", &self.path)
            .finish()
    }
}

impl PodRegion {
    /// Creates or adopts the ledger and the limits of `pod`. Whatever else
    /// stands at their names (a link, a directory, a file of an untrusted
    /// owner, writable by others or of the wrong size) is removed and the
    /// object made again, so that squatting a pod's name before it is
    /// provisioned blocks nobody.
    pub fn open(pod: &PodId, options: &RegionOptions) -> Result<Self, RegionError> {
        let name = PodLedger::name_of(pod.as_str());
        let mut owners = vec![shm::effective_uid()];
        owners.extend(options.uid);
        let trust = Trust::only(&owners);
        let creation = Creation {
            uid: options.uid,
            gid: options.gid,
            mode: options.mode.unwrap_or(0o600),
        };
        let ledger = replacing_planted(&name, || {
            PodLedger::open_with(&name, &trust, &creation, Duration::from_secs(1))
                .map_err(RegionError::from)
        })?;
        let limits = replacing_planted(&PodLimits::name_of(pod.as_str()), || {
            PodLimits::create_or_adopt(
                pod.as_str(),
                &Creation {
                    uid: None,
                    gid: options.gid,
                    mode: if options.gid.is_some() { 0o640 } else { 0o644 },
                },
            )
            .map_err(RegionError::from)
        })?;
        let path = PathBuf::from(SHM_DIR).join(name);
        Ok(Self {
            ledgers: Ledgers::new(ledger, trust, creation),
            limits,
            path,
        })
    }

    /// Whether the pod's ledger was shrunk under the daemon (by a process
    /// that may write it): its figures then read as zeros.
    pub fn is_shrunk(&self) -> bool {
        self.ledgers.current().is_shrunk()
    }

    /// The ledger's file, e.g. `/dev/shm/gpushare-pod-a`.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The compute bucket of the GPU `uuid`, when the pod has limits there.
    pub fn bucket(&self, uuid: &str) -> Option<Bucket<'_>> {
        let gpu = self.limits.find(uuid)?;
        let ledger = self.ledgers.current();
        let state = ledger.compute_state(ledger.device_for(uuid).ok()?).ok()?;
        Some(Bucket::new(state, &gpu.compute))
    }

    /// Quota (from the limits), usage and peak (from the ledger) of the GPU `uuid`.
    pub fn usage(&self, uuid: &str) -> Option<DeviceUsage> {
        let quota = self.limits.find(uuid)?.quota.load(Ordering::Acquire);
        let ledger = self.ledgers.current();
        let usage = ledger.usage(ledger.device_for(uuid).ok()?).ok()?;
        Some(DeviceUsage { quota, ..usage })
    }

    /// The pod's spill of the GPU `uuid`: spilled bytes and peak (from the
    /// ledger), and the cap (from the limits).
    pub fn spill(&self, uuid: &str) -> Option<SpillUsage> {
        let limit = self.limits.find(uuid)?.spill_limit.load(Ordering::Acquire);
        let ledger = self.ledgers.current();
        let usage = ledger.spill_usage(ledger.device_for(uuid).ok()?).ok()?;
        Some(SpillUsage { limit, ..usage })
    }

    /// Writes the quota, class and spill cap of `spec` for the GPU `uuid`
    /// (its bucket marked managed).
    pub fn claim(&self, uuid: &str, spec: &GpuSpec) {
        match self.limits.set(uuid, spec.memory_bytes) {
            Ok(gpu) => {
                gpu.set_class(spec.class);
                gpu.spill_limit.store(spec.spill_bytes, Ordering::Release);
            }
            Err(error) => tracing::warn!(%error, uuid, "quota not written"),
        }
    }

    /// Moves the pod's ledger entry and limits of the GPU `from` to the GPU
    /// `to` ([`PodLedger::relocate_device`], [`PodLimits::relocate`]); on a
    /// refusal nothing moved.
    pub fn relocate(&self, from: &str, to: &str) -> Result<(), RegionError> {
        let ledger = self.ledgers.current();
        ledger.relocate_device(from, to)?;
        if let Err(error) = self.limits.relocate(from, to) {
            // Only the ledger's keys changed; changing them back cannot be refused.
            let _ = ledger.relocate_device(to, from);
            return Err(error.into());
        }
        Ok(())
    }

    /// The moves the limits record: (key of the GPU the spec names, key of
    /// the GPU the pod is on).
    pub fn relocations(&self) -> Vec<(u64, u64)> {
        self.limits.relocations()
    }

    /// Charges the pod `bytes` of driver-held memory on the GPU `uuid` that
    /// its ledger does not count (the audit's finding; 0 clears it).
    pub fn set_unaccounted(&self, uuid: &str, bytes: u64) {
        if let Some(gpu) = self.limits.find(uuid) {
            gpu.unaccounted.store(bytes, Ordering::Release);
        }
    }

    /// Driver-held memory the pod's processes charged themselves on the GPU
    /// `uuid` (contexts, modules, heaps, graph and pool memory).
    pub fn driver_held(&self, uuid: &str) -> u64 {
        self.ledgers
            .current()
            .device_for(uuid)
            .ok()
            .and_then(|entry| self.ledgers.current().driver_held(entry).ok())
            .unwrap_or(0)
    }

    /// What the processes still on ledgers the pod's current one replaced
    /// count on the GPU `uuid` (0 where none was replaced).
    pub fn retired_usage(&self, uuid: &str) -> u64 {
        let current = self.ledgers.current();
        self.ledgers
            .all()
            .filter(|ledger| !std::ptr::eq(*ledger, current))
            .filter_map(|ledger| ledger.usage(ledger.device_for(uuid).ok()?).ok())
            .map(|usage| usage.used)
            .fold(0, u64::saturating_add)
    }

    /// What the pod is charged on the GPU `uuid` beyond its ledger.
    pub fn unaccounted(&self, uuid: &str) -> u64 {
        self.limits
            .find(uuid)
            .map_or(0, |gpu| gpu.unaccounted.load(Ordering::Acquire))
    }

    /// Forgets every GPU but `keep`, then publishes the limits: the pod's
    /// processes may use them from now on.
    pub fn publish(&self, keep: &[&str]) {
        self.limits.retain(keep);
        self.limits.publish();
    }

    /// Tells the pod's processes whether the scheduler counts the pod as
    /// wanting the GPU `uuid` (their launches waiting for budget there then
    /// need not ask for admission).
    pub fn set_demand_seen(&self, uuid: &str, seen: bool) {
        self.limits.set_demand_seen(uuid, seen);
    }

    /// Tells the pod's processes how many pods take turns on the GPU `uuid`
    /// ([`PodLimits::set_turn_pods`]): how long their launches wait for a
    /// turn at most.
    pub fn set_turn_pods(&self, uuid: &str, pods: usize) {
        self.limits.set_turn_pods(uuid, pods);
    }

    /// Writes a grant into the bucket of `uuid`; returns whether the rate rose
    /// (waiters may be served sooner).
    pub fn write_grant(&self, uuid: &str, grant: Allotment) -> bool {
        let Some(gpu) = self.limits.find(uuid) else {
            return false;
        };
        let limits = &gpu.compute;
        let old = limits.rate_ppm.load(Ordering::Acquire);
        if limits.ceiling_ppm.load(Ordering::Relaxed) != grant.ceiling_ppm {
            limits
                .ceiling_ppm
                .store(grant.ceiling_ppm, Ordering::Release);
        }
        if old != grant.rate_ppm {
            limits.rate_ppm.store(grant.rate_ppm, Ordering::Release);
            return grant.rate_ppm == 0 || (old != 0 && grant.rate_ppm > old);
        }
        false
    }

    /// Sets the MPS active thread percentage a client of the pod that
    /// starts now takes on the co-run GPU `uuid` (0 clears it).
    pub fn set_sm_percent(&self, uuid: &str, percent: u8) {
        if let Some(gpu) = self.limits.find(uuid)
            && gpu.sm_percent() != Some(percent)
        {
            gpu.set_sm_percent(percent);
        }
    }

    /// What [`Self::set_sm_percent`] last wrote for the GPU `uuid`.
    pub fn sm_percent(&self, uuid: &str) -> Option<u8> {
        self.limits.find(uuid)?.sm_percent()
    }

    /// Sets or clears the suspended flag on every GPU of the pod.
    pub fn set_suspended(&self, suspended: bool) {
        for gpu in &self.limits.region().gpus {
            gpu.compute
                .suspended
                .store(u32::from(suspended), Ordering::Release);
        }
    }

    /// Whether any GPU of the pod is suspended (limits left by an earlier
    /// run of the hypervisor).
    pub fn any_suspended(&self) -> bool {
        self.limits
            .region()
            .gpus
            .iter()
            .any(|gpu| gpu.compute.suspended.load(Ordering::Acquire) != 0)
    }

    /// The move of the pod waiting for its processes' restore, as GPU keys
    /// (from, to); the limits object keeps it across daemon restarts.
    pub fn pending_move(&self) -> Option<(u64, u64)> {
        self.limits.pending_move()
    }

    /// Records the move waiting for the pod's restore (`None`: none).
    pub fn set_pending_move(&self, gpus: Option<(&str, &str)>) {
        self.limits.set_pending_move(gpus);
    }

    /// Where the pod's device memory is (the limits object keeps it across
    /// daemon restarts).
    pub fn residency(&self) -> Residency {
        self.limits.residency()
    }

    /// Moves the pod to `residency`: its processes' CUDA calls wait while
    /// it is anything but resident.
    pub fn set_residency(&self, residency: Residency) {
        self.limits.set_residency(residency);
    }

    /// `CLOCK_MONOTONIC` milliseconds of the pod's last CUDA call that needs
    /// its GPU, as its processes stamp it; 0: none yet.
    pub fn last_call_ms(&self) -> u64 {
        self.ledgers
            .all()
            .map(PodLedger::last_call_ms)
            .max()
            .unwrap_or(0)
    }

    /// The files of every ledger held for the pod: a process that maps one
    /// of them is one of the pod's (one that mapped a ledger before it was
    /// made again still does).
    pub fn ledger_files(&self) -> Vec<gpushare_utils::process::FileId> {
        self.ledgers.all().filter_map(PodLedger::file).collect()
    }

    /// Pids of the pod's registered processes that this daemon can see, in
    /// every ledger it held for the pod (processes that mapped one before
    /// it was replaced write it still), as the pod wrote them.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self
            .ledgers
            .all()
            .flat_map(PodLedger::pids_in_own_namespace)
            .filter_map(|pid| u32::try_from(pid).ok())
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Gives back what the pod's dead processes held, in every ledger held
    /// for the pod; returns the bytes. Judges only processes of the
    /// hypervisor's pid namespace (see the ledger).
    pub fn reclaim_dead(&self) -> u64 {
        self.ledgers
            .all()
            .map(PodLedger::reclaim_dead)
            .fold(0, u64::saturating_add)
    }

    /// Adds what the bucket of `uuid` has earned since its last refill
    /// ([`Bucket::refill_now`]); returns the tokens after. A trapped
    /// worker's thread waits on the hypervisor, so the hypervisor refills for it.
    /// Seen at the default depth, also where the pod banks a turn: the
    /// worker asks only once its own refill left the bucket empty.
    pub fn refill(&self, uuid: &str, now_ns: u64) -> i64 {
        self.bucket(uuid)
            .map_or(0, |bucket| bucket.refill_now(now_ns))
    }
}

/// What stands at the name in place of an object the daemon may use, when
/// `error` says so: the daemon owns the name and replaces it.
fn squat_in(error: &RegionError) -> Option<Squat> {
    match error {
        RegionError::Ledger(LedgerError::Shm(shm)) | RegionError::Limits(LimitsError::Shm(shm)) => {
            shm.squat()
        }
        // Left empty, or half-made, past the wait: nobody is making it.
        RegionError::Ledger(LedgerError::Timeout { .. })
        | RegionError::Limits(LimitsError::Missing { .. }) => Some(Squat::Unready),
        _ => None,
    }
}

/// Runs `open`; when it finds something else at `name` (a link, a
/// directory, a file it may not adopt), removes that without following it
/// ([`squat::remove`]) and runs `open` once more.
fn replacing_planted<T>(
    name: &str,
    open: impl Fn() -> Result<T, RegionError>,
) -> Result<T, RegionError> {
    let error = match open() {
        Err(error) => error,
        opened => return opened,
    };
    let Some(found) = squat_in(&error) else {
        return Err(error);
    };
    squat::remove(name).map_err(|source| RegionError::Squat {
        name: name.to_owned(),
        found,
        source,
    })?;
    tracing::warn!(name, %found, %error, "removed what stood at a name the hypervisor owns, to make its own object");
    open()
}

//! A pod's shared-memory region (`/dev/shm/gpushare-pod-<pod>`), as the
//! hypervisor writes it: memory quotas per device index, compute buckets
//! marked managed with the scheduler's rates, the suspended flag.
//!
//! Ownership and mode: the `shared_memory` crate creates regions 0600, owned
//! by whoever creates them first (the hypervisor, or a pod's process when the
//! pod started first). Pods running as another user than the hypervisor need
//! the operator to align ownership: `region_uid`/`region_gid`/`region_mode` in
//! the config are applied to every region the hypervisor opens. A region is
//! never left world-writable: an o+w bit found on one is removed.
//!
//! Opening registers the hypervisor as one of the region's process slots
//! (the ledger has no read-only open yet); it holds no memory there and gives
//! the slot back when the pod is removed or the hypervisor exits. The region
//! itself is never unlinked: pods keep their last limits while the
//! hypervisor is away.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use gpushare_utils::bucket::ComputeBucket;
use gpushare_utils::config::PodId;
use gpushare_utils::ledger::{DeviceUsage, LedgerError, MAX_DEVICES, POD_REGION_PREFIX, PodLedger};

use crate::config::RegionOptions;
use crate::fairshare::Grant;

/// Why a region could not be used.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error(transparent)]
    Ledger(#[from] LedgerError),
    #[error("cannot set owner or mode of {}: {source}", path.display())]
    Permissions {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Where `/dev/shm` entries live.
const SHM_DIR: &str = "/dev/shm";

/// One pod's region, opened by the hypervisor.
pub struct PodRegion {
    ledger: PodLedger,
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
    /// Creates or opens the region of `pod` and applies `options`.
    pub fn open(pod: &PodId, options: &RegionOptions) -> Result<Self, RegionError> {
        let ledger = PodLedger::open(pod.as_str())?;
        let path = PathBuf::from(SHM_DIR).join(format!("{POD_REGION_PREFIX}{pod}"));
        let region = Self { ledger, path };
        region.apply_permissions(options)?;
        Ok(region)
    }

    fn apply_permissions(&self, options: &RegionOptions) -> Result<(), RegionError> {
        let fail = |source| RegionError::Permissions {
            path: self.path.clone(),
            source,
        };
        if options.uid.is_some() || options.gid.is_some() {
            std::os::unix::fs::chown(&self.path, options.uid, options.gid).map_err(fail)?;
        }
        let current = std::fs::metadata(&self.path)
            .map_err(fail)?
            .permissions()
            .mode()
            & 0o777;
        let wanted = options.mode.unwrap_or(current) & !0o002;
        if wanted != current {
            std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(wanted))
                .map_err(fail)?;
        }
        Ok(())
    }

    /// The region's file, e.g. `/dev/shm/gpushare-pod-a`.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// The compute bucket of device index `dev`.
    pub fn bucket(&self, dev: usize) -> Option<&ComputeBucket> {
        self.ledger.compute(dev).ok()
    }

    /// Quota, usage and peak of device index `dev`.
    pub fn usage(&self, dev: usize) -> Option<DeviceUsage> {
        self.ledger.usage(dev).ok()
    }

    /// Takes device index `dev` over: the quota, the bucket marked managed,
    /// the local elastic flag cleared (the hypervisor decides elastic shares).
    pub fn claim(&self, dev: usize, quota: u64) {
        if let Err(error) = self.ledger.set_quota(dev, quota) {
            tracing::warn!(%error, dev, "quota not written");
        }
        if let Some(bucket) = self.bucket(dev) {
            bucket.managed.store(1, Ordering::Release);
            bucket.uncontended.store(0, Ordering::Release);
        }
    }

    /// Device index `dev` is no GPU of the pod's config: unlimited, managed.
    pub fn clear(&self, dev: usize) {
        self.claim(dev, 0);
        self.write_grant(dev, Grant::default());
    }

    /// Writes a grant into the bucket of `dev`; returns whether the rate rose
    /// (waiters may be served sooner).
    pub fn write_grant(&self, dev: usize, grant: Grant) -> bool {
        let Some(bucket) = self.bucket(dev) else {
            return false;
        };
        let old = bucket.rate_ppm.load(Ordering::Acquire);
        if bucket.ceiling_ppm.load(Ordering::Relaxed) != grant.ceiling_ppm {
            bucket
                .ceiling_ppm
                .store(grant.ceiling_ppm, Ordering::Release);
        }
        if old != grant.rate_ppm {
            bucket.rate_ppm.store(grant.rate_ppm, Ordering::Release);
            return grant.rate_ppm == 0 || (old != 0 && grant.rate_ppm > old);
        }
        false
    }

    /// Sets or clears the suspended flag on every device of the pod.
    pub fn set_suspended(&self, suspended: bool) {
        for dev in 0..MAX_DEVICES {
            if let Some(bucket) = self.bucket(dev) {
                bucket
                    .suspended
                    .store(u32::from(suspended), Ordering::Release);
            }
        }
    }

    /// Whether any device of the pod is suspended (a region left by an
    /// earlier run of the hypervisor).
    pub fn any_suspended(&self) -> bool {
        (0..MAX_DEVICES).any(|dev| {
            self.bucket(dev)
                .is_some_and(|b| b.suspended.load(Ordering::Acquire) != 0)
        })
    }

    /// Gives back what the pod's dead processes held; returns the bytes.
    /// Judges only processes of the hypervisor's pid namespace (see the ledger).
    pub fn reclaim_dead(&self) -> u64 {
        self.ledger.reclaim_dead()
    }

    /// Adds what the bucket of `dev` has earned since its last refill
    /// ([`ComputeBucket::refill_now`]); returns the tokens after. A trapped
    /// worker's thread waits on the hypervisor, so the hypervisor refills for it.
    pub fn refill(&self, dev: usize, now_ns: u64) -> i64 {
        self.bucket(dev)
            .map_or(0, |bucket| bucket.refill_now(now_ns))
    }
}

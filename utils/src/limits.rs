//! A pod's limits under a node hypervisor: one shared-memory object per pod
//! (`/dev/shm/gpushare-limits-<pod>`), written only by the hypervisor and
//! mapped read-only by the pod's processes, keyed by GPU UUID.
//!
//! Why a separate object: the pod's processes must write their usage (the
//! ledger), so any limit stored next to it could be raised by the pod. This
//! one is created by the hypervisor (`O_EXCL`, owner and mode set on the
//! descriptor, never writable by group or others) and opened `O_RDONLY` by
//! the limiter after checking who owns it ([`crate::shm`]).
//!
//! # Layout (version 1, 1,088 bytes, all atomics)
//!
//! | offset | size | what |
//! | --- | --- | --- |
//! | 0 | 64 | header: `magic` u64 @0, `version` u32 @8, `state` u32 @12 (2 = published), `generation` u64 @16, `residency` u32 @24 ([`Residency`]: where the pod's device memory is), `demand` u32 @28 (bit `i`: the hypervisor counts the pod as wanting GPU entry `i`), `moving_from` u64 @32 and `moving_to` u64 @40 (a move waiting for the pod's restore, as GPU keys), `turn_pods` u64 @48 (4 bits per GPU entry: the pods that take turns on that GPU, as the hypervisor counts them) |
//! | 64 | 16 × 64 | [`GpuLimits`]: `key` u64 @0 (hash of the lowercase UUID, 0 = empty), `quota` u64 @8 (bytes, 0 = unlimited), [`BucketLimits`](crate::bucket::BucketLimits) @16, `class` u32 @32 ([`PodClass::code`]), `sm_percent` u32 @36 (a co-run GPU's MPS active thread percentage for the pod's next client, 0 = as provisioned), `spill_limit` u64 @40 (bytes of host memory past the quota, 0 = no oversubscription) |
//!
//! A GPU is found by its UUID, so a quota follows the GPU whatever index a
//! container's `CUDA_VISIBLE_DEVICES` gives it, and nothing a worker says at
//! registration can move it.

use std::sync::atomic::Ordering;

use crate::MAX_DEVICES;
use crate::pod::PodClass;
use crate::shm::{self, Creation, Mapping, ShmError, Trust};

mod layout;

use layout::TURN_PODS_BITS;
pub use layout::{GpuLimits, LIMITS_SIZE, LimitsHeader, LimitsRegion, MAX_TURN_PODS, Residency};

/// Prefix of a pod's limits object.
pub const LIMITS_PREFIX: &str = "gpushare-limits-";
/// `b"GPUSHLIM"` as a little-endian u64.
pub const LIMITS_MAGIC: u64 = u64::from_le_bytes(*b"GPUSHLIM");
/// Layout version.
pub const LIMITS_VERSION: u32 = 1;
/// `state` once the hypervisor has written every entry.
const PUBLISHED: u32 = 2;

/// Errors of the limits object.
#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    /// Creating, opening or checking the shared-memory object failed.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The object does not exist, or is still empty (not sized yet).
    #[error("limits object {name} does not exist (the hypervisor has not provisioned this pod)")]
    Missing {
        /// Object name.
        name: String,
    },
    /// The hypervisor has not yet published the pod's limits.
    #[error("limits object {name} is not published yet")]
    NotPublished {
        /// Object name.
        name: String,
    },
    /// The object has the wrong magic or layout version.
    #[error(
        "limits object {name} has magic {magic:#x} version {version}, expected version {LIMITS_VERSION}"
    )]
    Foreign {
        /// Object name.
        name: String,
        /// Magic found in the header.
        magic: u64,
        /// Version found in the header.
        version: u32,
    },
    /// Every GPU entry is taken, so GPU `uuid` cannot be added.
    #[error("limits object {name} holds no room for GPU {uuid} ({MAX_DEVICES} at most)")]
    Full {
        /// Object name.
        name: String,
        /// UUID of the GPU that found no free entry.
        uuid: String,
    },
    /// A GPU's limits cannot move to the GPU asked.
    #[error("limits object {name}: {reason}")]
    Relocation {
        /// Object name.
        name: String,
        /// What stands in the way.
        reason: String,
    },
}

/// The key of a GPU: FNV-1a of its lowercase UUID, never 0.
pub fn uuid_key(uuid: &str) -> u64 {
    crate::fnv::fnv1a(uuid.trim().bytes().map(|byte| byte.to_ascii_lowercase())).max(1)
}

/// Without a configured spill cap, a pod may spill this fraction (1/N) of the
/// node's memory per device: pinned pages cannot be swapped or reclaimed, so
/// the node keeps the rest for the pods' own host memory and the kernel.
pub const SPILL_DEFAULT_DIVISOR: u64 = 4;

/// The spill cap a pod gets when none is configured, under a hypervisor
/// ([`GpuLimits::spill_limit`]) and in local mode alike:
/// [`SPILL_DEFAULT_DIVISOR`]th of `MemTotal` in `/proc/meminfo`; 0 (no
/// spill) when it cannot be read.
pub fn default_spill_limit() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_total(&text))
        .map_or(0, |bytes| bytes / SPILL_DEFAULT_DIVISOR)
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// A pod's limits object, mapped read-only (limiter) or read-write (hypervisor).
#[derive(Debug)]
pub struct PodLimits {
    name: String,
    map: Mapping,
}

impl PodLimits {
    /// The object name of `pod`'s limits.
    pub fn name_of(pod: &str) -> String {
        format!("{LIMITS_PREFIX}{pod}")
    }

    /// Opens `pod`'s published limits read-only, if owned by a `trust`ed uid
    /// and writable by nobody else.
    pub fn open_read_only(pod: &str, trust: &Trust) -> Result<Self, LimitsError> {
        let name = Self::name_of(pod);
        let map = shm::open(&name, LIMITS_SIZE, false, trust)?
            .ok_or_else(|| LimitsError::Missing { name: name.clone() })?;
        let limits = Self { name, map };
        limits.check()?;
        if limits.region().header.state.load(Ordering::Acquire) != PUBLISHED {
            return Err(LimitsError::NotPublished { name: limits.name });
        }
        Ok(limits)
    }

    /// Creates `pod`'s limits (the hypervisor), or reopens the object an
    /// earlier run created if we own it; anyone else's is refused.
    pub fn create_or_adopt(pod: &str, creation: &Creation) -> Result<Self, LimitsError> {
        let name = Self::name_of(pod);
        if let Some(map) = shm::create(&name, LIMITS_SIZE, creation)? {
            let limits = Self { name, map };
            let header = &limits.region().header;
            header.magic.store(LIMITS_MAGIC, Ordering::Relaxed);
            header.version.store(LIMITS_VERSION, Ordering::Relaxed);
            return Ok(limits);
        }
        let map = shm::open(
            &name,
            LIMITS_SIZE,
            true,
            &Trust::only(&[shm::effective_uid()]),
        )?
        .ok_or_else(|| LimitsError::Missing { name: name.clone() })?;
        let limits = Self { name, map };
        limits.check()?;
        Ok(limits)
    }

    fn check(&self) -> Result<(), LimitsError> {
        let header = &self.region().header;
        let magic = header.magic.load(Ordering::Acquire);
        let version = header.version.load(Ordering::Acquire);
        if magic != LIMITS_MAGIC || version != LIMITS_VERSION {
            return Err(LimitsError::Foreign {
                name: self.name.clone(),
                magic,
                version,
            });
        }
        Ok(())
    }

    /// The object's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The mapped object. Read-only mappings fault on any store: only the
    /// hypervisor, which maps it writable, may call the setters below.
    pub fn region(&self) -> &LimitsRegion {
        // SAFETY: the mapping is LIMITS_SIZE bytes (checked by `shm`),
        // page-aligned, lives as long as `self`, and is all atomics.
        unsafe { self.map.base().cast::<LimitsRegion>().as_ref() }
    }

    /// The limits of the GPU `uuid`, if the hypervisor gave the pod any.
    pub fn find(&self, uuid: &str) -> Option<&GpuLimits> {
        let key = uuid_key(uuid);
        self.region()
            .gpus
            .iter()
            .find(|gpu| gpu.key.load(Ordering::Acquire) == key)
    }

    /// Writes the limits of GPU `uuid` (hypervisor only).
    pub fn set(&self, uuid: &str, quota: u64) -> Result<&GpuLimits, LimitsError> {
        let key = uuid_key(uuid);
        let gpus = &self.region().gpus;
        let entry = match gpus.iter().find(|g| g.key.load(Ordering::Acquire) == key) {
            Some(entry) => entry,
            None => {
                let free = gpus
                    .iter()
                    .find(|g| g.key.load(Ordering::Acquire) == 0)
                    .ok_or_else(|| LimitsError::Full {
                        name: self.name.clone(),
                        uuid: uuid.to_owned(),
                    })?;
                free.quota.store(quota, Ordering::Release);
                free.compute.managed.store(1, Ordering::Release);
                free.key.store(key, Ordering::Release);
                free
            }
        };
        entry.quota.store(quota, Ordering::Release);
        entry.compute.managed.store(1, Ordering::Release);
        Ok(entry)
    }

    /// The smallest active thread percentage the hypervisor gives the pod's
    /// new MPS clients on any of its GPUs (a co-run pod has one GPU).
    pub fn sm_percent(&self) -> Option<u8> {
        self.region()
            .gpus
            .iter()
            .filter(|gpu| gpu.key.load(Ordering::Acquire) != 0)
            .filter_map(GpuLimits::sm_percent)
            .min()
    }

    /// Forgets every GPU not in `keep` (hypervisor only).
    pub fn retain(&self, keep: &[&str]) {
        let keys: Vec<u64> = keep.iter().map(|uuid| uuid_key(uuid)).collect();
        let region = self.region();
        for (at, gpu) in region.gpus.iter().enumerate() {
            let key = gpu.key.load(Ordering::Acquire);
            if key != 0 && !keys.contains(&key) {
                region.header.demand.fetch_and(!(1 << at), Ordering::AcqRel);
                region.header.turn_pods.fetch_and(
                    !(MAX_TURN_PODS << (at as u32 * TURN_PODS_BITS)),
                    Ordering::AcqRel,
                );
                gpu.key.store(0, Ordering::Release);
                gpu.quota.store(0, Ordering::Release);
                gpu.spill_limit.store(0, Ordering::Release);
                gpu.unaccounted.store(0, Ordering::Release);
                gpu.placed_as.store(0, Ordering::Release);
                gpu.compute.rate_ppm.store(0, Ordering::Release);
                gpu.compute.ceiling_ppm.store(0, Ordering::Release);
                gpu.compute.suspended.store(0, Ordering::Release);
                gpu.class.store(PodClass::Batch.code(), Ordering::Release);
                gpu.sm_percent.store(0, Ordering::Release);
            }
        }
    }

    /// Moves the limits of the GPU `from` to the GPU `to` (hypervisor
    /// only, while the pod's processes are held): the entry keeps its
    /// quota, bucket and class under `to`'s key, and remembers the GPU the
    /// pod was first placed on ([`GpuLimits::placed_as`]; cleared when it
    /// goes back there). Refused when the pod has no limits on `from`, or
    /// has some on `to` already.
    pub fn relocate(&self, from: &str, to: &str) -> Result<(), LimitsError> {
        let (from_key, to_key) = (uuid_key(from), uuid_key(to));
        let gpus = &self.region().gpus;
        if gpus.iter().any(|g| g.key.load(Ordering::Acquire) == to_key) {
            return Err(LimitsError::Relocation {
                name: self.name.clone(),
                reason: format!("the pod has limits on {to} already"),
            });
        }
        let Some(gpu) = gpus
            .iter()
            .find(|g| g.key.load(Ordering::Acquire) == from_key)
        else {
            return Err(LimitsError::Relocation {
                name: self.name.clone(),
                reason: format!("the pod has no limits on {from}"),
            });
        };
        let origin = match gpu.placed_as.load(Ordering::Acquire) {
            0 => from_key,
            origin => origin,
        };
        gpu.placed_as
            .store(if origin == to_key { 0 } else { origin }, Ordering::Release);
        gpu.key.store(to_key, Ordering::Release);
        Ok(())
    }

    /// The GPUs the hypervisor moved the pod to: ([`GpuLimits::placed_as`],
    /// the key of the GPU it is on now) for each.
    pub fn relocations(&self) -> Vec<(u64, u64)> {
        self.region()
            .gpus
            .iter()
            .filter_map(|g| {
                let key = g.key.load(Ordering::Acquire);
                let origin = g.placed_as.load(Ordering::Acquire);
                (key != 0 && origin != 0).then_some((origin, key))
            })
            .collect()
    }

    /// Whether the hypervisor counts the pod as wanting the GPU `uuid` now
    /// ([`LimitsHeader::demand`]).
    pub fn demand_seen(&self, uuid: &str) -> bool {
        self.entry_bit(uuid)
            .is_some_and(|bit| self.region().header.demand.load(Ordering::Acquire) & bit != 0)
    }

    /// Records whether the hypervisor counts the pod as wanting the GPU
    /// `uuid` (hypervisor only), writing the shared word only when that
    /// changes (the scheduler says it for every pod at every tick); false
    /// when the pod has no such GPU.
    pub fn set_demand_seen(&self, uuid: &str, seen: bool) -> bool {
        let Some(bit) = self.entry_bit(uuid) else {
            return false;
        };
        let demand = &self.region().header.demand;
        if (demand.load(Ordering::Acquire) & bit != 0) != seen {
            if seen {
                demand.fetch_or(bit, Ordering::AcqRel);
            } else {
                demand.fetch_and(!bit, Ordering::AcqRel);
            }
        }
        true
    }

    /// The [`LimitsHeader::demand`] bit of the GPU `uuid`'s entry.
    fn entry_bit(&self, uuid: &str) -> Option<u32> {
        Some(1 << self.entry_of(uuid_key(uuid))?)
    }

    /// The entry of the GPU whose [`uuid_key`] is `key`.
    fn entry_of(&self, key: u64) -> Option<usize> {
        self.region()
            .gpus
            .iter()
            .position(|gpu| gpu.key.load(Ordering::Acquire) == key)
    }

    /// The pods taking turns on the GPU keyed `gpu` ([`LimitsHeader::turn_pods`]).
    pub fn turn_pods(&self, gpu: u64) -> Option<usize> {
        let at = self.entry_of(gpu)?;
        let word = self.region().header.turn_pods.load(Ordering::Acquire);
        let count = (word >> (at as u32 * TURN_PODS_BITS)) & MAX_TURN_PODS;
        usize::try_from(count).ok().filter(|&count| count > 0)
    }

    /// Records the pods taking turns on the GPU `uuid` (hypervisor only).
    pub fn set_turn_pods(&self, uuid: &str, pods: usize) -> bool {
        let Some(at) = self.entry_of(uuid_key(uuid)) else {
            return false;
        };
        let shift = at as u32 * TURN_PODS_BITS;
        let mask = MAX_TURN_PODS << shift;
        let value = (pods as u64).min(MAX_TURN_PODS) << shift;
        let word = &self.region().header.turn_pods;
        let old = word.load(Ordering::Acquire);
        if old & mask != value {
            word.store(old & !mask | value, Ordering::Release);
        }
        true
    }

    /// The move waiting for the pod's restore, as GPU keys ([`uuid_key`]):
    /// (the GPU its checkpointed processes were on, the GPU they go to).
    pub fn pending_move(&self) -> Option<(u64, u64)> {
        let header = &self.region().header;
        let from = header.moving_from.load(Ordering::Acquire);
        let to = header.moving_to.load(Ordering::Acquire);
        (from != 0 && to != 0).then_some((from, to))
    }

    /// Records the move waiting for the pod's restore, from the GPU `from`
    /// to the GPU `to`; `None` clears it (hypervisor only).
    pub fn set_pending_move(&self, gpus: Option<(&str, &str)>) {
        let header = &self.region().header;
        let (from, to) = gpus.map_or((0, 0), |(from, to)| (uuid_key(from), uuid_key(to)));
        header.moving_to.store(to, Ordering::Release);
        header.moving_from.store(from, Ordering::Release);
    }

    /// Where the pod's device memory is. Sequentially consistent: a
    /// process stamps its call ([`crate::ledger::PodLedger::touch`]) before
    /// it reads this, and the hypervisor writes this before it reads the
    /// stamp, so one of them sees the other.
    pub fn residency(&self) -> Residency {
        Residency::from_code(self.region().header.residency.load(Ordering::SeqCst))
    }

    /// Moves the pod to `residency` (hypervisor only).
    pub fn set_residency(&self, residency: Residency) {
        self.region()
            .header
            .residency
            .store(residency.code(), Ordering::SeqCst);
    }

    /// Marks the limits complete and bumps the generation (hypervisor only).
    pub fn publish(&self) {
        let header = &self.region().header;
        header.generation.fetch_add(1, Ordering::AcqRel);
        header.state.store(PUBLISHED, Ordering::Release);
    }
}

#[cfg(test)]
mod tests;

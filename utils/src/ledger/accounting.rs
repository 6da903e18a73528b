//! Steps 3 to 5 of the protocol: reserve, release, overhead; and the pod's
//! compute bucket kept in the region for local mode.

use std::sync::atomic::{AtomicU64, Ordering};

use super::layout::*;
use super::{LedgerError, MAX_DEVICES, PodLedger, uuid_key};
use crate::bucket::{Bucket, BucketState};

/// Pod-wide usage of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceUsage {
    /// Bytes the pod may hold; 0 means unlimited.
    pub quota: u64,
    /// Bytes held now, driver overhead included.
    pub used: u64,
    /// Highest `used` since the region was created.
    pub peak: u64,
}

impl PodLedger {
    /// The entry of the GPU `uuid`, claimed on first use by any process of
    /// the pod: every process finds the same entry whatever index it sees
    /// the GPU at.
    pub fn device_for(&self, uuid: &str) -> Result<usize, LedgerError> {
        let key = uuid_key(uuid);
        let devices = &self.region().devices;
        if let Some(dev) = devices
            .iter()
            .position(|d| d.key.load(Ordering::Acquire) == key)
        {
            return Ok(dev);
        }
        for (dev, device) in devices.iter().enumerate() {
            match device
                .key
                .compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(dev),
                Err(found) if found == key => return Ok(dev),
                Err(_) => {}
            }
        }
        Err(LedgerError::DevicesFull {
            name: self.name.clone(),
            uuid: uuid.to_owned(),
            max: MAX_DEVICES,
        })
    }

    /// Moves the entry of the GPU `from` to the GPU `to` (the hypervisor,
    /// while every process of the pod is held): what the pod holds and its
    /// bucket are counted under `to` from now on, at the same index, so a
    /// process that found the entry before finds it still. An entry of `to`
    /// the pod no longer uses takes `from`'s key in exchange; one holding
    /// memory refuses the move. No entry of `from` (the pod never used the
    /// GPU) leaves nothing to move.
    pub fn relocate_device(&self, from: &str, to: &str) -> Result<(), LedgerError> {
        let (from_key, to_key) = (uuid_key(from), uuid_key(to));
        let devices = &self.region().devices;
        let find = |key| {
            devices
                .iter()
                .find(|d| d.key.load(Ordering::Acquire) == key)
        };
        let Some(source) = find(from_key) else {
            return Ok(());
        };
        if let Some(target) = find(to_key) {
            let held = target.used.load(Ordering::Acquire) | target.spilled.load(Ordering::Acquire);
            if held != 0 {
                return Err(LedgerError::DeviceInUse {
                    name: self.name.clone(),
                    uuid: to.to_owned(),
                });
            }
            target.key.store(from_key, Ordering::Release);
        }
        source.key.store(to_key, Ordering::Release);
        Ok(())
    }

    /// Sets the pod's quota on `dev` in bytes (0 = unlimited). Lowering it below
    /// current usage takes nothing back: reservations fail until usage drops.
    pub fn set_quota(&self, dev: usize, bytes: u64) -> Result<(), LedgerError> {
        self.device(dev)?.quota.store(bytes, Ordering::Release);
        Ok(())
    }

    /// The pod's quota on `dev` in bytes (0 = unlimited).
    pub fn quota(&self, dev: usize) -> Result<u64, LedgerError> {
        Ok(self.device(dev)?.quota.load(Ordering::Acquire))
    }

    /// Pod-wide quota, usage and peak of `dev`.
    pub fn usage(&self, dev: usize) -> Result<DeviceUsage, LedgerError> {
        let device = self.device(dev)?;
        Ok(DeviceUsage {
            quota: device.quota.load(Ordering::Acquire),
            used: device.used.load(Ordering::Acquire),
            peak: device.peak.load(Ordering::Acquire),
        })
    }

    /// Bytes this process has reserved on `dev` (driver overhead not included).
    pub fn process_usage(&self, dev: usize) -> Result<u64, LedgerError> {
        self.device(dev)?;
        Ok(self
            .registered_slot()
            .map_or(0, |slot| slot.used[dev].load(Ordering::Acquire)))
    }

    /// Driver overhead charged to this process on `dev`.
    pub fn process_overhead(&self, dev: usize) -> Result<u64, LedgerError> {
        self.device(dev)?;
        Ok(self
            .registered_slot()
            .map_or(0, |slot| slot.overhead[dev].load(Ordering::Acquire)))
    }

    /// Driver-held memory charged to the pod's live processes on `dev`
    /// (contexts, modules, heaps, graph and pool memory): the part of its
    /// usage no allocation call names.
    pub fn driver_held(&self, dev: usize) -> Result<u64, LedgerError> {
        self.device(dev)?;
        Ok(self
            .region()
            .processes
            .iter()
            .filter(|slot| slot.pid.load(Ordering::Acquire) != 0)
            .map(|slot| slot.overhead[dev].load(Ordering::Acquire))
            .fold(0, u64::saturating_add))
    }

    /// Reserves `bytes` on `dev` for this process, or fails with
    /// [`LedgerError::OverQuota`] if the pod would exceed its quota (after
    /// giving back what dead processes held).
    pub fn try_reserve(&self, dev: usize, bytes: u64) -> Result<(), LedgerError> {
        let quota = self.device(dev)?.quota.load(Ordering::Acquire);
        self.try_reserve_under(dev, bytes, quota)
    }

    /// Like [`try_reserve`](Self::try_reserve), against `quota` (0 =
    /// unlimited) given by the caller rather than the one in the region: under
    /// a hypervisor, the quota comes from the read-only limits.
    pub fn try_reserve_under(&self, dev: usize, bytes: u64, quota: u64) -> Result<(), LedgerError> {
        let device = self.device(dev)?;
        if bytes == 0 {
            return Ok(());
        }
        let slot = self.my_slot()?;
        self.check_intact()?;
        self.maybe_reclaim();
        if reserve_on(device, bytes, quota).is_err() {
            let reclaimed = self.reclaim_dead();
            tracing::debug!(
                dev,
                bytes,
                reclaimed,
                "over quota; scanned for dead processes"
            );
            if let Err((quota, used)) = reserve_on(device, bytes, quota) {
                return Err(LedgerError::OverQuota {
                    dev,
                    quota,
                    used,
                    requested: bytes,
                });
            }
        }
        slot.used[dev].fetch_add(bytes, Ordering::AcqRel);
        // Shrunk while reserving: the count went to zeros of our own.
        self.check_intact()
    }

    /// Gives back up to `bytes` on `dev` and returns how many this process
    /// actually held (less than `bytes` on a double free; never below zero).
    pub fn release(&self, dev: usize, bytes: u64) -> Result<u64, LedgerError> {
        let device = self.device(dev)?;
        if bytes == 0 {
            return Ok(0);
        }
        let slot = self.my_slot()?;
        let released = release_from(&slot.used[dev], &device.used, bytes);
        if released < bytes {
            tracing::debug!(
                dev,
                bytes,
                released,
                "release of more than this process holds"
            );
        }
        Ok(released)
    }

    /// Sets this process's driver overhead on `dev` to `bytes` and moves the
    /// pod's usage by the difference. Not checked against the quota: the memory
    /// is already taken, so usage may end above the quota.
    pub fn set_overhead(&self, dev: usize, bytes: u64) -> Result<(), LedgerError> {
        let device = self.device(dev)?;
        let slot = self.my_slot()?;
        let cell = &slot.overhead[dev];
        let mut old = cell.load(Ordering::Acquire);
        loop {
            if bytes >= old {
                // Device first, so it never counts less than the slots.
                let delta = bytes - old;
                add_saturating(device, delta);
                match cell.compare_exchange(old, bytes, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Ok(()),
                    Err(current) => {
                        sub_saturating(&device.used, delta);
                        old = current;
                    }
                }
            } else {
                match cell.compare_exchange(old, bytes, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => {
                        sub_saturating(&device.used, old - bytes);
                        return Ok(());
                    }
                    Err(current) => old = current,
                }
            }
        }
    }

    /// Raises this process's driver overhead on `dev` to `bytes`, the rise
    /// reserved against `quota` (0 = unlimited) like an allocation: memory
    /// the driver is about to take (a context) is counted before it is
    /// taken, so processes racing cannot pass the quota together. Fails
    /// with [`LedgerError::OverQuota`] (after giving back what dead
    /// processes held); nothing changes then.
    pub fn try_raise_overhead_under(
        &self,
        dev: usize,
        bytes: u64,
        quota: u64,
    ) -> Result<(), LedgerError> {
        let device = self.device(dev)?;
        let slot = self.my_slot()?;
        self.check_intact()?;
        let cell = &slot.overhead[dev];
        let mut old = cell.load(Ordering::Acquire);
        let mut reclaimed = false;
        while old < bytes {
            let rise = bytes - old;
            if let Err((quota, used)) = reserve_on(device, rise, quota) {
                if reclaimed {
                    return Err(LedgerError::OverQuota {
                        dev,
                        quota,
                        used,
                        requested: rise,
                    });
                }
                self.reclaim_dead();
                reclaimed = true;
                continue;
            }
            match cell.compare_exchange(old, bytes, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(current) => {
                    sub_saturating(&device.used, rise);
                    old = current;
                }
            }
        }
        self.check_intact()
    }

    /// What the next context on `dev` is reserved at: the largest first
    /// context a process of the pod was measured at there; 0 if none was.
    pub fn context_bytes(&self, dev: usize) -> Result<u64, LedgerError> {
        Ok(self.device(dev)?.context_bytes.load(Ordering::Acquire))
    }

    /// Records a first context's measured footprint on `dev` (kept if larger).
    pub fn learn_context_bytes(&self, dev: usize, bytes: u64) -> Result<(), LedgerError> {
        self.device(dev)?
            .context_bytes
            .fetch_max(bytes, Ordering::AcqRel);
        Ok(())
    }

    /// The pod's compute budget on `dev`, with the limits local mode sets.
    pub fn compute(&self, dev: usize) -> Result<Bucket<'_>, LedgerError> {
        let local = self.local_bucket(dev)?;
        Ok(Bucket::new(&local.state, &local.limits))
    }

    /// The shared state of the pod's compute budget on `dev`, to pair with
    /// limits from elsewhere (the hypervisor's read-only object).
    pub fn compute_state(&self, dev: usize) -> Result<&BucketState, LedgerError> {
        Ok(&self.local_bucket(dev)?.state)
    }

    pub(super) fn local_bucket(&self, dev: usize) -> Result<&LocalBucket, LedgerError> {
        self.region()
            .compute
            .get(dev)
            .ok_or(LedgerError::NoSuchDevice {
                dev,
                max: MAX_DEVICES,
            })
    }
}

/// CAS loop: adds `bytes` to the device's usage unless that would exceed a
/// non-zero `quota`; on refusal returns `(quota, used)`.
pub(super) fn reserve_on(device: &DeviceLedger, bytes: u64, quota: u64) -> Result<(), (u64, u64)> {
    reserve_cell(&device.used, &device.peak, bytes, quota)
}

/// Subtracts up to `bytes` from a process's `held` (saturating), then exactly
/// what it gave up from the pod's `pod` counter; returns that amount.
pub(super) fn release_from(held: &AtomicU64, pod: &AtomicU64, bytes: u64) -> u64 {
    let (Ok(prev) | Err(prev)) = held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
        Some(held.saturating_sub(bytes))
    });
    let released = prev.min(bytes);
    sub_saturating(pod, released);
    released
}

/// The CAS loop of [`reserve_on`] on any pod counter and its peak.
pub(super) fn reserve_cell(
    cell: &AtomicU64,
    peak: &AtomicU64,
    bytes: u64,
    quota: u64,
) -> Result<(), (u64, u64)> {
    let mut used = cell.load(Ordering::Acquire);
    loop {
        let Some(new) = used.checked_add(bytes) else {
            return Err((quota, used));
        };
        if quota != 0 && new > quota {
            return Err((quota, used));
        }
        match cell.compare_exchange_weak(used, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                peak.fetch_max(new, Ordering::Relaxed);
                return Ok(());
            }
            Err(current) => used = current,
        }
    }
}

pub(super) fn add_saturating(device: &DeviceLedger, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let (Ok(prev) | Err(prev)) =
        device
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_add(bytes))
            });
    device
        .peak
        .fetch_max(prev.saturating_add(bytes), Ordering::Relaxed);
}

pub(super) fn sub_saturating(cell: &AtomicU64, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let _previous = cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
        Some(value.saturating_sub(bytes))
    });
}

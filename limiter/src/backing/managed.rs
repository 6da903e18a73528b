//! Managed memory (`cuMemAllocManaged`) of a process that backs its
//! memory: the limiter cannot move it (the driver migrates its pages
//! between host and GPU as they are touched), and NVML does not count it
//! to the process (an H200, driver 580), so a fast swap-out would leave it
//! on the GPU unseen. It is listed here only so that such a swap-out is
//! declined and the driver's checkpoint decides.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::sys::CUdeviceptr;

/// The live managed allocations of the process, by address: their sizes.
#[derive(Debug, Default)]
pub(super) struct Managed {
    ranges: Mutex<BTreeMap<CUdeviceptr, u64>>,
    /// Entries of `ranges`, so that frees of other memory skip the lock.
    live: AtomicUsize,
}

impl Managed {
    /// The driver made `bytes` of managed memory at `address`.
    pub(super) fn made(&self, address: CUdeviceptr, bytes: u64) {
        let mut ranges = self.ranges.lock().unwrap_or_else(PoisonError::into_inner);
        if ranges.insert(address, bytes).is_none() {
            self.live.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// The driver freed the memory at `address`, if it was managed.
    pub(super) fn freed(&self, address: CUdeviceptr) {
        if self.live.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut ranges = self.ranges.lock().unwrap_or_else(PoisonError::into_inner);
        if ranges.remove(&address).is_some() {
            self.live.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The bytes of managed memory the process holds.
    pub(super) fn bytes(&self) -> u64 {
        if self.live.load(Ordering::Acquire) == 0 {
            return 0;
        }
        let ranges = self.ranges.lock().unwrap_or_else(PoisonError::into_inner);
        ranges
            .values()
            .fold(0, |sum, &bytes| sum.saturating_add(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn managed_memory_is_counted_from_its_allocation_to_its_free() {
        let managed = Managed::default();
        assert_eq!(managed.bytes(), 0);
        managed.made(0x1000, 64 << 20);
        managed.made(0x9000_0000, 1 << 30);
        assert_eq!(managed.bytes(), (64 << 20) + (1 << 30));
        managed.freed(0x5000);
        managed.freed(0x1000);
        assert_eq!(managed.bytes(), 1 << 30);
        managed.freed(0x9000_0000);
        assert_eq!(managed.bytes(), 0);
        assert_eq!(managed.live.load(Ordering::Acquire), 0);
    }
}

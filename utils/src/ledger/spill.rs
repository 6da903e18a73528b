//! Step 5b of the protocol: host memory served in place of device memory
//! past the quota (oversubscription), capped pod-wide per GPU.
//!
//! The spill has its own counters (`DeviceLedger::spilled`, the slot's
//! `spilled[dev]`) and never touches `used`: what the pod holds on the device
//! stays within its quota, and reports of free device memory ignore it.

use std::sync::atomic::Ordering;

use super::accounting::{release_from, reserve_cell};
use super::{LedgerError, PodLedger};

/// Pod-wide spill of one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SpillUsage {
    /// Bytes of host memory the pod's live processes hold in place of device memory.
    pub spilled: u64,
    /// Highest `spilled` since the region was created.
    pub peak: u64,
    /// The cap local mode recorded (0 = no spill); under a hypervisor the cap
    /// is in the pod's read-only limits.
    pub limit: u64,
}

impl PodLedger {
    /// Reserves `bytes` of spill on `dev` for this process, or fails with
    /// [`LedgerError::OverSpillCap`] if the pod's spill would pass `cap` (0 =
    /// no spill at all), after giving back what dead processes held.
    pub fn try_spill_under(&self, dev: usize, bytes: u64, cap: u64) -> Result<(), LedgerError> {
        let device = self.device(dev)?;
        if bytes == 0 {
            return Ok(());
        }
        let refused = |spilled: u64| LedgerError::OverSpillCap {
            dev,
            cap,
            spilled,
            requested: bytes,
        };
        if cap == 0 {
            return Err(refused(device.spilled.load(Ordering::Acquire)));
        }
        let slot = self.my_slot()?;
        self.check_intact()?;
        self.maybe_reclaim();
        let reserve = || reserve_cell(&device.spilled, &device.spill_peak, bytes, cap);
        if reserve().is_err() {
            self.reclaim_dead();
            reserve().map_err(|(_, spilled)| refused(spilled))?;
        }
        slot.spilled[dev].fetch_add(bytes, Ordering::AcqRel);
        self.check_intact()
    }

    /// Gives back up to `bytes` of spill on `dev`; returns how many this
    /// process actually held.
    pub fn release_spill(&self, dev: usize, bytes: u64) -> Result<u64, LedgerError> {
        let device = self.device(dev)?;
        let slot = self.my_slot()?;
        Ok(release_from(&slot.spilled[dev], &device.spilled, bytes))
    }

    /// Records local mode's spill cap on `dev`, for observers.
    pub fn set_spill_limit(&self, dev: usize, bytes: u64) -> Result<(), LedgerError> {
        self.device(dev)?
            .spill_limit
            .store(bytes, Ordering::Release);
        Ok(())
    }

    /// Pod-wide spill of `dev`.
    pub fn spill_usage(&self, dev: usize) -> Result<SpillUsage, LedgerError> {
        let device = self.device(dev)?;
        Ok(SpillUsage {
            spilled: device.spilled.load(Ordering::Acquire),
            peak: device.spill_peak.load(Ordering::Acquire),
            limit: device.spill_limit.load(Ordering::Acquire),
        })
    }

    /// Host memory this process has spilled on `dev`.
    pub fn process_spill(&self, dev: usize) -> Result<u64, LedgerError> {
        self.device(dev)?;
        Ok(self
            .registered_slot()
            .map_or(0, |slot| slot.spilled[dev].load(Ordering::Acquire)))
    }
}

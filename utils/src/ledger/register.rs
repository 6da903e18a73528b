//! Steps 2 and 7 of the protocol: a process takes a slot, and a forked child
//! takes its own.

use std::sync::atomic::Ordering;

use super::layout::*;
use super::reclaim::free_empty_slot;
use super::{LedgerError, MAX_DEVICES, NO_REG, PodLedger, pack, unpack};
use crate::process::{current_pid, own_pid_ns, read_proc_stat};

impl PodLedger {
    pub(super) fn device(&self, dev: usize) -> Result<&DeviceLedger, LedgerError> {
        self.region()
            .devices
            .get(dev)
            .ok_or(LedgerError::NoSuchDevice {
                dev,
                max: MAX_DEVICES,
            })
    }

    /// This process's slot if it is registered (not a forked copy's parent slot).
    pub(super) fn registered_slot(&self) -> Option<&ProcessSlot> {
        let (pid, slot) = unpack(self.reg.load(Ordering::Acquire));
        if pid != current_pid() {
            return None;
        }
        self.region().processes.get(slot)
    }

    /// This process's slot, registering a fresh one after a fork or if a
    /// reclaimer took ours.
    pub(super) fn my_slot(&self) -> Result<&ProcessSlot, LedgerError> {
        let pid = current_pid();
        loop {
            let reg = self.reg.load(Ordering::Acquire);
            let (reg_pid, idx) = unpack(reg);
            if reg != NO_REG
                && reg_pid == pid
                && let Some(slot) = self.region().processes.get(idx)
            {
                let owner = slot.pid.load(Ordering::Acquire);
                // Negative: a reclaimer is checking it and will put it back.
                if owner == pid || owner < 0 {
                    return Ok(slot);
                }
                tracing::warn!(
                    ledger = %self.name,
                    pid,
                    owner,
                    "this process's ledger slot was taken from it; registering again"
                );
            }
            let idx = self.claim_slot(pid)?;
            match self.reg.compare_exchange(
                reg,
                pack(pid, idx),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(&self.region().processes[idx]),
                Err(_) => {
                    // Another thread registered first: give ours back, use theirs.
                    free_empty_slot(&self.region().processes[idx]);
                }
            }
        }
    }

    /// Takes a free slot for `pid`, scanning for dead processes once if none is free.
    pub(super) fn claim_slot(&self, pid: i32) -> Result<usize, LedgerError> {
        let start_time = read_proc_stat("/proc/self/stat")
            .map(|stat| stat.start_time)
            .unwrap_or(0);
        let ns = own_pid_ns();
        for attempt in 0..2 {
            for (idx, slot) in self.region().processes.iter().enumerate() {
                if slot
                    .pid
                    .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    slot.pid_ns.store(ns, Ordering::Release);
                    slot.start_time.store(start_time, Ordering::Release);
                    return Ok(idx);
                }
            }
            if attempt == 0 {
                self.reclaim_dead();
            }
        }
        Err(LedgerError::TableFull {
            name: self.name.clone(),
            max: MAX_PROCESSES,
        })
    }
}

//! Step 6 of the protocol: give back what dead processes held.

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::accounting::sub_saturating;
use super::layout::*;
use super::{NO_REG, PodLedger, unpack};
use crate::clock::monotonic_ms;
use crate::process::{current_pid, own_pid_ns, process_is_gone};

impl PodLedger {
    /// Gives back what dead processes of this pid namespace held and frees
    /// their slots; returns the bytes given back.
    pub fn reclaim_dead(&self) -> u64 {
        let region = self.region();
        region
            .header
            .last_scan_ms
            .store(monotonic_ms(), Ordering::Relaxed);
        let me = current_pid();
        let my_ns = own_pid_ns();
        let mut total = 0u64;
        for slot in &region.processes {
            let pid = slot.pid.load(Ordering::Acquire);
            if pid == 0 || pid == me || pid == -me || pid == i32::MIN {
                continue;
            }
            if slot.pid_ns.load(Ordering::Acquire) != my_ns {
                continue;
            }
            if pid > 0 {
                if !process_is_gone(pid, slot.start_time.load(Ordering::Acquire)) {
                    continue;
                }
                if slot
                    .pid
                    .compare_exchange(pid, -me, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
                {
                    continue;
                }
                // Between the check and the mark the slot may have been freed
                // and taken by a new process that reuses the pid: check again.
                if !process_is_gone(pid, slot.start_time.load(Ordering::Acquire)) {
                    slot.pid.store(pid, Ordering::Release);
                    continue;
                }
            } else {
                // Marked by a reclaimer (or exiting owner) that died mid-drain.
                if !process_is_gone(-pid, 0)
                    || slot
                        .pid
                        .compare_exchange(pid, -me, Ordering::AcqRel, Ordering::Relaxed)
                        .is_err()
                {
                    continue;
                }
            }
            let bytes = drain(region, slot);
            tracing::debug!(pid, bytes, ledger = %self.name, "reclaimed a dead process's slot");
            total = total.saturating_add(bytes);
        }
        total
    }

    /// Pids of the processes registered in this region from this process's
    /// pid namespace (others' pids mean nothing here).
    pub fn pids_in_own_namespace(&self) -> Vec<i32> {
        let ns = own_pid_ns();
        self.region()
            .processes
            .iter()
            .filter(|slot| slot.pid_ns.load(Ordering::Acquire) == ns)
            .map(|slot| slot.pid.load(Ordering::Acquire))
            .filter(|pid| *pid > 0)
            .collect()
    }

    /// Gives back everything this process holds and frees its slot, at once
    /// (a process exiting normally; [`Drop`] does the same). Later operations
    /// register a fresh slot.
    pub fn release_own_slot(&self) {
        let reg = self.reg.swap(NO_REG, Ordering::AcqRel);
        let (pid, idx) = unpack(reg);
        if reg == NO_REG || pid != current_pid() {
            // Never registered, or a forked copy that never registered: the
            // slot is the parent's.
            return;
        }
        let region = self.region();
        let Some(slot) = region.processes.get(idx) else {
            return;
        };
        let deadline = Instant::now() + UNREGISTER_WAIT;
        loop {
            match slot
                .pid
                .compare_exchange(pid, -pid, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    drain(region, slot);
                    return;
                }
                // A reclaimer is checking our slot; it will see us alive and
                // put it back.
                Err(owner) if owner < 0 && Instant::now() < deadline => {
                    std::thread::yield_now();
                }
                Err(owner) => {
                    tracing::warn!(
                        ledger = %self.name,
                        pid,
                        owner,
                        "ledger slot no longer ours at exit; nothing given back"
                    );
                    return;
                }
            }
        }
    }

    /// Scans for dead processes if nobody has for [`RECLAIM_INTERVAL_MS`].
    pub(super) fn maybe_reclaim(&self) {
        let last_scan = &self.region().header.last_scan_ms;
        let now = monotonic_ms();
        let last = last_scan.load(Ordering::Relaxed);
        // `now < last`: a peer in another time namespace; scan rather than stall.
        let due = now < last || now - last >= RECLAIM_INTERVAL_MS;
        if due
            && last_scan
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.reclaim_dead();
        }
    }
}

impl Drop for PodLedger {
    /// Gives back everything this process still holds and frees its slot. The
    /// region itself stays.
    fn drop(&mut self) {
        self.release_own_slot();
    }
}

/// Gives back everything `slot` holds (device memory and spill) and frees it. The caller holds the slot
/// exclusively (its `pid` is the caller's negative mark). Counters are swapped
/// to zero before the device is debited, so a drain cut short and finished by
/// another process never debits twice.
pub(super) fn drain(region: &Region, slot: &ProcessSlot) -> u64 {
    let mut total = 0u64;
    for (dev, device) in region.devices.iter().enumerate() {
        let bytes = slot.used[dev]
            .swap(0, Ordering::AcqRel)
            .saturating_add(slot.overhead[dev].swap(0, Ordering::AcqRel));
        sub_saturating(&device.used, bytes);
        let spilled = slot.spilled[dev].swap(0, Ordering::AcqRel);
        sub_saturating(&device.spilled, spilled);
        total = total.saturating_add(bytes).saturating_add(spilled);
    }
    free_empty_slot(slot);
    total
}

/// Frees a slot whose counters are zero.
pub(super) fn free_empty_slot(slot: &ProcessSlot) {
    slot.start_time.store(0, Ordering::Relaxed);
    slot.pid_ns.store(0, Ordering::Relaxed);
    slot.pid.store(0, Ordering::Release);
}

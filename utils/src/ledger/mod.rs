//! The per-pod GPU memory ledger: one POSIX shared-memory region per pod,
//! mapped by every process of the pod (the limiter is preloaded into each) and,
//! later, by the node hypervisor.
//!
//! # Layout (version 5, 116,800 bytes, all little-endian atomics)
//!
//! | offset | size | what |
//! | --- | --- | --- |
//! | 0 | 64 | [`Header`]: `magic` u64 @0, `version` u32 @8, `state` u32 @12, `size` u64 @16, `last_scan_ms` u64 @24, `last_call_ms` u64 @32, reserved |
//! | 64 | 16 × 64 | [`DeviceLedger`] per GPU: `quota` u64 @0 (bytes, 0 = unlimited; local mode only), `used` u64 @8, `peak` u64 @16, `key` u64 @24 (the GPU's [`uuid_key`], 0 = unused), `spilled` u64 @32, `spill_peak` u64 @40, `spill_limit` u64 @48 (local mode; 0 = no spill), `context_bytes` u64 @56 (a context's measured footprint; 0 = unknown) |
//! | 1088 | 256 × 448 | [`ProcessSlot`]: `pid` i32 @0, `start_time` u64 @8, `pid_ns` u64 @16, `used[16]` @64, `overhead[16]` @192, `spilled[16]` @320 |
//! | 115776 | 16 × 64 | [`LocalBucket`] per GPU: [`BucketState`] @0, [`BucketLimits`] @48 (local mode) |
//!
//! Entries are found by GPU UUID ([`PodLedger::device_for`]), never by the
//! index a process sees: containers of one pod with different
//! `CUDA_VISIBLE_DEVICES` charge the same GPU's entry.
//!
//! Under a node hypervisor the limits are not read from here (the pod can
//! write this region) but from the read-only [`crate::limits`] object; the
//! quota is handed to [`PodLedger::try_reserve_under`].
//!
//! Every field is an atomic, so any process may read or write any word at any
//! time without undefined behaviour; the protocol below keeps the numbers right.
//! All-zero memory (what `ftruncate` gives a new region) is the valid empty
//! state: no quota, nothing used, every slot free. `magic`, `version`, `state`
//! and `size` keep their offsets in every future version, so an old or new
//! peer is recognised and named ([`LedgerError::VersionMismatch`]) rather than
//! misread. Reserved words are zero and may gain meaning without a version
//! bump only if zero keeps meaning "absent".
//!
//! # Protocol
//!
//! 1. **Open.** `shm_open(O_CREAT|O_EXCL|O_NOFOLLOW)` the name, owner and mode
//!    set on the descriptor; if it exists, open it only if a trusted uid owns
//!    it and neither group nor others may write it ([`crate::shm`]).
//!    A region of length 0 is one whose creator has not yet sized it: retry.
//!    Whoever maps a region whose `state` is 0 (empty) moves it 0 → 1
//!    (initialising) by compare-and-swap, writes `magic`, `version`, `size`, then
//!    stores 2 (ready); everyone else waits, bounded (1 s), for 2, then checks
//!    magic, version and size. Any process may initialise, not only the
//!    creator, so a creator that dies before initialising blocks nobody. No
//!    process ever unlinks the region: it outlives every process of the pod.
//! 2. **Register.** A process takes a free slot by CAS `pid` 0 → its pid, then
//!    stores its pid namespace (inode of `/proc/self/ns/pid`) and its start time
//!    (field 22 of `/proc/self/stat`), which together tell a dead process from a
//!    live one that reuses its pid.
//! 3. **Reserve.** CAS loop on the device's `used`: fail if the new value would
//!    exceed a non-zero `quota`, so concurrent reservers never overshoot it. Then
//!    add to the process's own `used[dev]`.
//! 4. **Release.** Subtract from the process's own `used[dev]` (saturating at 0),
//!    then subtract exactly what the slot gave up from the device. A double free
//!    therefore cannot take away bytes other processes hold.
//! 5. **Overhead.** Memory the driver takes through no allocation call (contexts,
//!    modules) is set, not added, per process and device; the device total moves
//!    by the difference and is not checked against the quota, because the memory
//!    is already taken: `used` may then exceed `quota`, and reservations fail
//!    until it falls below again.
//!
//!    **Spill (5b).** Host memory served in place of device memory past the
//!    quota (oversubscription, [`PodLedger::try_spill_under`]) is reserved
//!    like step 3 on the device's `spilled` against the pod's spill cap (0 =
//!    no spill), then on the slot's `spilled[dev]`; given back like step 4.
//!    It never counts in `used`: the device footprint stays within the quota.
//! 6. **Reclaim.** A slot whose process is gone (`kill(pid, 0)` says `ESRCH`, it
//!    is a zombie, or its start time differs) is taken exclusively by CAS `pid`
//!    → `-(reclaimer pid)`, checked once more under that mark, drained (each
//!    counter swapped to 0, then subtracted from the device, saturating) and
//!    freed (`pid` = 0). A process giving back its own slot on drop does the
//!    same with its own pid. A mark whose holder died mid-drain is taken over
//!    and the drain finished, which is safe because draining swaps before it
//!    subtracts. `try_reserve` scans at most every 250 ms (monotonic
//!    milliseconds kept in `last_scan_ms`) and always before it reports over
//!    quota, so a process killed with SIGKILL has its memory back within a
//!    quarter second of the next allocation anywhere in the pod.
//! 7. **Fork.** A child inherits the mapping and its parent's registration. Each
//!    operation compares the registered pid with `getpid()`; a child registers a
//!    fresh, empty slot (CUDA allocations do not survive fork) and never touches
//!    its parent's.
//!
//! Invariant: a device's `used` is at least the sum of its live slots' `used` +
//! `overhead` (increases hit the device first, decreases hit the slot first), and
//! equal when no operation is in flight. A process killed in the middle of an
//! operation can leave the device over-counted by that one operation, never
//! under-counted: the failure mode is a slightly smaller pod, never a quota
//! overshoot.
//!
//! Only slots of the reclaimer's own pid namespace are judged: containers of
//! one pod do not share pid namespaces by default, and a pid means nothing
//! outside its namespace. A process is therefore reclaimed by a peer in its own
//! container (or, later, by the hypervisor through host `/proc`).

//!
//! The code follows the protocol: [`layout`] (the bytes), [`open`] (step 1),
//! [`register`] (steps 2 and 7), [`accounting`] (steps 3 to 5), [`spill`] (5b), [`reclaim`]
//! (step 6); `/proc` parsing and the pid-liveness check are in
//! [`crate::process`], the clock in [`crate::clock`].

mod accounting;
mod error;
mod layout;
mod open;
mod reclaim;
mod register;
mod spill;
#[cfg(test)]
mod tests;

pub use crate::MAX_DEVICES;
pub use crate::limits::uuid_key;
pub use accounting::DeviceUsage;
pub use error::LedgerError;
pub use layout::{
    DeviceLedger, Header, LAYOUT_VERSION, LocalBucket, MAGIC, MAX_PROCESSES, POD_REGION_PREFIX,
    ProcessSlot, REGION_SIZE, Region,
};
pub use spill::SpillUsage;

use std::sync::atomic::{AtomicU64, Ordering};

use open::Mapping;

/// No registration: the `reg` word of a ledger that holds no slot.
const NO_REG: u64 = u64::MAX;

/// This process's handle on a pod's ledger: the mapping plus its own slot.
pub struct PodLedger {
    name: String,
    /// `pid << 32 | slot` of the registration; [`NO_REG`] if none.
    reg: AtomicU64,
    map: Mapping,
}

impl std::fmt::Debug for PodLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (pid, slot) = unpack(self.reg.load(Ordering::Relaxed));
        f.debug_struct("PodLedger")
            .field("name", &self.name)
            .field("pid", &pid)
            .field("slot", &slot)
            .finish()
    }
}

fn pack(pid: i32, slot: usize) -> u64 {
    (u64::from(pid as u32) << 32) | (slot as u64 & 0xffff_ffff)
}

fn unpack(reg: u64) -> (i32, usize) {
    ((reg >> 32) as u32 as i32, (reg & 0xffff_ffff) as usize)
}

impl PodLedger {
    /// The shared-memory name of `pod`'s region.
    pub fn name_of(pod: &str) -> String {
        format!("{POD_REGION_PREFIX}{pod}")
    }

    /// The region's shared-memory name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The region's file, as `/proc/<pid>/maps` lists it: every process of
    /// the pod maps this very file, which is how another process is proven
    /// one of them ([`crate::process::mapped_files`]); `None` where `/proc`
    /// cannot tell.
    pub fn file(&self) -> Option<crate::process::FileId> {
        self.map._map.file()
    }

    /// Whether the region was shrunk under this process ([`crate::shm`]):
    /// then nothing it reads can be trusted.
    pub fn is_shrunk(&self) -> bool {
        self.map._map.is_broken()
    }

    /// `Err(Shrunk)` once the region was shrunk under this process.
    pub(super) fn check_intact(&self) -> Result<(), LedgerError> {
        if self.is_shrunk() {
            return Err(LedgerError::Shrunk {
                name: self.name.clone(),
            });
        }
        Ok(())
    }

    /// Stamps a CUDA call of the pod at `now_ms` (`CLOCK_MONOTONIC`
    /// milliseconds) when the stamp is older: one load in the common case,
    /// a sequentially consistent store at most once a millisecond. Read the
    /// pod's residency after this ([`crate::limits::PodLimits::residency`]).
    #[inline]
    pub fn touch(&self, now_ms: u64) {
        let stamp = &self.region().header.last_call_ms;
        if stamp.load(Ordering::Relaxed) < now_ms {
            stamp.store(now_ms, Ordering::SeqCst);
        }
    }

    /// The pod's last stamped CUDA call ([`Self::touch`]); 0: none.
    pub fn last_call_ms(&self) -> u64 {
        self.region().header.last_call_ms.load(Ordering::SeqCst)
    }

    /// The raw shared region, for observers (the hypervisor) and tests. Every
    /// field is an atomic, so reading is always sound; writing outside the
    /// protocol in the module documentation corrupts the accounting.
    pub fn region(&self) -> &Region {
        // SAFETY: `region` points at a live mapping of at least `REGION_SIZE`
        // bytes (checked in `ready_region`), page-aligned, kept alive by
        // `self.map._map` for as long as `self`; every field is an atomic, so
        // shared references stay sound while other threads and processes write.
        unsafe { self.map.region.as_ref() }
    }
}

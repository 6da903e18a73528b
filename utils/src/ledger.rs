//! The per-pod GPU memory ledger: one POSIX shared-memory region per pod,
//! mapped by every process of the pod (the limiter is preloaded into each) and,
//! later, by the node hypervisor.
//!
//! # Layout (version 4, 84,032 bytes, all little-endian atomics)
//!
//! | offset | size | what |
//! | --- | --- | --- |
//! | 0 | 64 | [`Header`]: `magic` u64 @0, `version` u32 @8, `state` u32 @12, `size` u64 @16, `last_scan_ms` u64 @24, reserved |
//! | 64 | 16 × 64 | [`DeviceLedger`] per GPU: `quota` u64 @0 (bytes, 0 = unlimited; local mode only), `used` u64 @8, `peak` u64 @16, `key` u64 @24 (the GPU's [`uuid_key`], 0 = unused) |
//! | 1088 | 256 × 320 | [`ProcessSlot`]: `pid` i32 @0, `start_time` u64 @8, `pid_ns` u64 @16, `used[16]` @64, `overhead[16]` @192 |
//! | 83008 | 16 × 64 | [`LocalBucket`] per GPU: [`BucketState`] @0, [`BucketLimits`] @48 (local mode) |
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

use crate::bucket::{Bucket, BucketLimits, BucketState};
pub use crate::limits::uuid_key;
use crate::shm::{self, Creation, ShmError, Trust};
use std::io;
use std::mem::{offset_of, size_of};
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Devices a ledger can account for (CUDA ordinals `0..MAX_DEVICES`).
pub const MAX_DEVICES: usize = 16;
/// Processes of one pod that can hold memory at the same time.
pub const MAX_PROCESSES: usize = 256;
/// First word of every ledger region: `b"GPUSHLDG"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GPUSHLDG");
/// Version of the layout described in the module documentation.
/// Version 2 added the compute buckets after the process slots; 3 their
/// suspend and managed flags; 4 keyed devices by GPU UUID and split each
/// bucket into state and (local) limits.
pub const LAYOUT_VERSION: u32 = 4;
/// Size in bytes of a ledger region.
pub const REGION_SIZE: usize = size_of::<Region>();
/// Prefix of the shared-memory name of a pod's region (`/dev/shm/gpushare-pod-<pod>`).
pub const POD_REGION_PREFIX: &str = "gpushare-pod-";

/// `Header::state`: all zero, nobody has initialised the header yet.
const STATE_EMPTY: u32 = 0;
/// `Header::state`: one process is writing the header.
const STATE_INITIALIZING: u32 = 1;
/// `Header::state`: the header is written; the region is in use.
const STATE_READY: u32 = 2;

/// Least interval between two automatic scans for dead processes.
const RECLAIM_INTERVAL_MS: u64 = 250;
/// How long `open` waits for a region another process is creating.
const OPEN_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a process dropping its ledger waits for a reclaimer that is
/// checking its slot to put it back.
const UNREGISTER_WAIT: Duration = Duration::from_millis(100);
/// `NAME_MAX` for a `/dev/shm` entry.
const MAX_NAME_LEN: usize = 255;

#[cfg(not(target_has_atomic = "64"))]
compile_error!("the ledger needs native 64-bit atomics: they are shared between processes");

/// Region header. See the module documentation for the protocol.
#[repr(C)]
#[derive(Debug)]
pub struct Header {
    /// [`MAGIC`] once initialised.
    pub magic: AtomicU64,
    /// [`LAYOUT_VERSION`] once initialised.
    pub version: AtomicU32,
    /// 0 empty, 1 initialising, 2 ready.
    pub state: AtomicU32,
    /// [`REGION_SIZE`] once initialised.
    pub size: AtomicU64,
    /// `CLOCK_MONOTONIC` milliseconds of the last scan for dead processes.
    pub last_scan_ms: AtomicU64,
    /// Zero; room for fields that default to zero.
    pub reserved: [AtomicU64; 4],
}

/// Memory accounting of one device for the whole pod.
#[repr(C)]
#[derive(Debug)]
pub struct DeviceLedger {
    /// Bytes the pod may hold; 0 means unlimited.
    pub quota: AtomicU64,
    /// Bytes held by live processes of the pod, driver overhead included.
    pub used: AtomicU64,
    /// Highest `used` seen since the region was created.
    pub peak: AtomicU64,
    /// [`uuid_key`] of the GPU this entry counts; 0 while unused.
    pub key: AtomicU64,
    /// Zero; room for fields that default to zero.
    pub reserved: [AtomicU64; 4],
}

/// A GPU's compute bucket in the pod's region: the state every process
/// updates, and the limits local mode sets from its configuration.
#[repr(C)]
#[derive(Debug, Default)]
pub struct LocalBucket {
    pub state: BucketState,
    pub limits: BucketLimits,
}

/// One process's share of the pod's usage.
#[repr(C)]
#[derive(Debug)]
pub struct ProcessSlot {
    /// 0: free; > 0: the owner's pid; < 0: held by `-pid` while it drains the slot.
    pub pid: AtomicI32,
    /// Zero; room for flags.
    pub flags: AtomicU32,
    /// Owner's start time, field 22 of `/proc/<pid>/stat` (clock ticks after
    /// boot); 0 while the owner is still registering.
    pub start_time: AtomicU64,
    /// Inode of the owner's `/proc/self/ns/pid`; 0 if unknown.
    pub pid_ns: AtomicU64,
    /// Zero; room for fields that default to zero.
    pub reserved: [AtomicU64; 5],
    /// Bytes the owner reserved, per device.
    pub used: [AtomicU64; MAX_DEVICES],
    /// Driver overhead charged to the owner, per device.
    pub overhead: [AtomicU64; MAX_DEVICES],
}

/// The whole shared region.
#[repr(C)]
#[derive(Debug)]
pub struct Region {
    /// Identification and initialisation state.
    pub header: Header,
    /// Pod-wide accounting, per device.
    pub devices: [DeviceLedger; MAX_DEVICES],
    /// Per-process accounting.
    pub processes: [ProcessSlot; MAX_PROCESSES],
    /// The pod's compute budget, per device.
    pub compute: [LocalBucket; MAX_DEVICES],
}

const _: () = {
    assert!(size_of::<Header>() == 64);
    assert!(size_of::<DeviceLedger>() == 64);
    assert!(size_of::<ProcessSlot>() == 320);
    assert!(size_of::<LocalBucket>() == 64);
    assert!(size_of::<Region>() == 64 + MAX_DEVICES * 64 + MAX_PROCESSES * 320 + MAX_DEVICES * 64);
    assert!(size_of::<Region>() == 84_032);
    assert!(offset_of!(Region, compute) == 83_008);
    assert!(align_of::<Region>() == 8);
    assert!(offset_of!(Header, magic) == 0);
    assert!(offset_of!(Header, version) == 8);
    assert!(offset_of!(Header, state) == 12);
    assert!(offset_of!(Header, size) == 16);
    assert!(offset_of!(Header, last_scan_ms) == 24);
    assert!(offset_of!(DeviceLedger, quota) == 0);
    assert!(offset_of!(DeviceLedger, used) == 8);
    assert!(offset_of!(DeviceLedger, peak) == 16);
    assert!(offset_of!(DeviceLedger, key) == 24);
    assert!(offset_of!(ProcessSlot, pid) == 0);
    assert!(offset_of!(ProcessSlot, start_time) == 8);
    assert!(offset_of!(ProcessSlot, pid_ns) == 16);
    assert!(offset_of!(ProcessSlot, used) == 64);
    assert!(offset_of!(ProcessSlot, overhead) == 192);
    assert!(offset_of!(Region, header) == 0);
    assert!(offset_of!(Region, devices) == 64);
    assert!(offset_of!(Region, processes) == 1088);
};

/// Errors of the ledger.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The name cannot be a `/dev/shm` entry.
    #[error("invalid shared-memory name {name:?}: {reason}")]
    InvalidName {
        /// The name asked for.
        name: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// Creating, opening or mapping the region failed, or it belongs to an
    /// untrusted user or is writable by group or others.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// Every device entry holds another GPU.
    #[error("ledger {name} has no free device entry for GPU {uuid} ({max} GPUs)")]
    DevicesFull {
        /// The region's name.
        name: String,
        /// The GPU asked for.
        uuid: String,
        /// [`MAX_DEVICES`].
        max: usize,
    },
    /// The region is not a ledger.
    #[error("shared-memory region {name} is not a GPU memory ledger (magic {found:#018x})")]
    BadMagic {
        /// The region's name.
        name: String,
        /// The first word found.
        found: u64,
    },
    /// The region was written by another version of this code.
    #[error("ledger {name} has layout version {found}, this build expects {expected}")]
    VersionMismatch {
        /// The region's name.
        name: String,
        /// Version in the region.
        found: u32,
        /// [`LAYOUT_VERSION`].
        expected: u32,
    },
    /// The region's length (or recorded size) is not [`REGION_SIZE`].
    #[error("ledger {name} is {found} bytes, this build expects {expected}")]
    SizeMismatch {
        /// The region's name.
        name: String,
        /// Size found.
        found: u64,
        /// [`REGION_SIZE`].
        expected: u64,
    },
    /// The header's state word holds a value no version defines.
    #[error("ledger {name} has an unknown state word {found}")]
    BadState {
        /// The region's name.
        name: String,
        /// The state word.
        found: u32,
    },
    /// The region was being created or initialised by a process that did not
    /// finish in time (it may have died half-way; removing
    /// `/dev/shm/<name>` while no process uses it recovers).
    #[error("ledger {name} was not ready after {waited_ms} ms (a creator may have died half-way)")]
    Timeout {
        /// The region's name.
        name: String,
        /// How long was waited.
        waited_ms: u64,
    },
    /// Every process slot is held by a live process.
    #[error("ledger {name} has no free process slot ({max} live processes)")]
    TableFull {
        /// The region's name.
        name: String,
        /// [`MAX_PROCESSES`].
        max: usize,
    },
    /// The device ordinal is beyond [`MAX_DEVICES`].
    #[error("device {dev} is beyond the ledger's {max} devices")]
    NoSuchDevice {
        /// The ordinal asked for.
        dev: usize,
        /// [`MAX_DEVICES`].
        max: usize,
    },
    /// The reservation would take the pod over its quota.
    #[error(
        "device {dev}: reserving {requested} bytes would exceed the quota ({used} of {quota} bytes used)"
    )]
    OverQuota {
        /// The device ordinal.
        dev: usize,
        /// The pod's quota in bytes.
        quota: u64,
        /// Bytes the pod held when the reservation failed.
        used: u64,
        /// Bytes asked for.
        requested: u64,
    },
}

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

/// The mapping, kept alive for as long as the pointer into it is used.
struct Mapping {
    region: NonNull<Region>,
    /// Unmaps (never unlinks) when dropped.
    _map: shm::Mapping,
}

// SAFETY: the mapping is process-wide, every byte of it is an atomic, and
// `shm::Mapping` is only ever dropped (munmap), which any thread may do.
unsafe impl Send for Mapping {}
// SAFETY: as above: all access goes through `&Region`, whose fields are atomics.
unsafe impl Sync for Mapping {}

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
    /// Creates or opens the ledger of `pod` (`/dev/shm/gpushare-pod-<pod>`) and
    /// registers this process in it.
    pub fn open(pod: &str) -> Result<Self, LedgerError> {
        Self::open_named(&format!("{POD_REGION_PREFIX}{pod}"))
    }

    /// Creates or opens the ledger region `os_id` (a `/dev/shm` entry name,
    /// without `/`) and registers this process in it.
    pub fn open_named(os_id: &str) -> Result<Self, LedgerError> {
        Self::open_with(
            os_id,
            &Trust::own_or_root(None),
            &Creation::default(),
            OPEN_TIMEOUT,
        )
    }

    /// Creates (owner and mode from `creation`) or opens the ledger region
    /// `os_id` if its owner is `trust`ed, and registers this process in it.
    pub fn open_with(
        os_id: &str,
        trust: &Trust,
        creation: &Creation,
        timeout: Duration,
    ) -> Result<Self, LedgerError> {
        validate_name(os_id)?;
        let deadline = Instant::now() + timeout;
        let map = map_region(os_id, trust, creation, deadline, timeout)?;
        let region = ready_region(os_id, &map, deadline, timeout)?;
        let ledger = PodLedger {
            name: os_id.to_owned(),
            reg: AtomicU64::new(NO_REG),
            map: Mapping { region, _map: map },
        };
        let pid = current_pid();
        let slot = ledger.claim_slot(pid)?;
        ledger.reg.store(pack(pid, slot), Ordering::Release);
        Ok(ledger)
    }

    /// The region's shared-memory name.
    pub fn name(&self) -> &str {
        &self.name
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
        Ok(())
    }

    /// Gives back up to `bytes` on `dev` and returns how many this process
    /// actually held (less than `bytes` on a double free; never below zero).
    pub fn release(&self, dev: usize, bytes: u64) -> Result<u64, LedgerError> {
        let device = self.device(dev)?;
        if bytes == 0 {
            return Ok(0);
        }
        let slot = self.my_slot()?;
        let (Ok(prev) | Err(prev)) =
            slot.used[dev].fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(bytes))
            });
        let released = prev.min(bytes);
        sub_saturating(&device.used, released);
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

    fn local_bucket(&self, dev: usize) -> Result<&LocalBucket, LedgerError> {
        self.region()
            .compute
            .get(dev)
            .ok_or(LedgerError::NoSuchDevice {
                dev,
                max: MAX_DEVICES,
            })
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

    fn device(&self, dev: usize) -> Result<&DeviceLedger, LedgerError> {
        self.region()
            .devices
            .get(dev)
            .ok_or(LedgerError::NoSuchDevice {
                dev,
                max: MAX_DEVICES,
            })
    }

    /// This process's slot if it is registered (not a forked copy's parent slot).
    fn registered_slot(&self) -> Option<&ProcessSlot> {
        let (pid, slot) = unpack(self.reg.load(Ordering::Acquire));
        if pid != current_pid() {
            return None;
        }
        self.region().processes.get(slot)
    }

    /// This process's slot, registering a fresh one after a fork or if a
    /// reclaimer took ours.
    fn my_slot(&self) -> Result<&ProcessSlot, LedgerError> {
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
    fn claim_slot(&self, pid: i32) -> Result<usize, LedgerError> {
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

    /// Scans for dead processes if nobody has for [`RECLAIM_INTERVAL_MS`].
    fn maybe_reclaim(&self) {
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

/// CAS loop: adds `bytes` to the device's usage unless that would exceed a
/// non-zero `quota`; on refusal returns `(quota, used)`.
fn reserve_on(device: &DeviceLedger, bytes: u64, quota: u64) -> Result<(), (u64, u64)> {
    let mut used = device.used.load(Ordering::Acquire);
    loop {
        let Some(new) = used.checked_add(bytes) else {
            return Err((quota, used));
        };
        if quota != 0 && new > quota {
            return Err((quota, used));
        }
        match device
            .used
            .compare_exchange_weak(used, new, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => {
                device.peak.fetch_max(new, Ordering::Relaxed);
                return Ok(());
            }
            Err(current) => used = current,
        }
    }
}

fn add_saturating(device: &DeviceLedger, bytes: u64) {
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

fn sub_saturating(cell: &AtomicU64, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let _previous = cell.fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
        Some(value.saturating_sub(bytes))
    });
}

/// Gives back everything `slot` holds and frees it. The caller holds the slot
/// exclusively (its `pid` is the caller's negative mark). Counters are swapped
/// to zero before the device is debited, so a drain cut short and finished by
/// another process never debits twice.
fn drain(region: &Region, slot: &ProcessSlot) -> u64 {
    let mut total = 0u64;
    for (dev, device) in region.devices.iter().enumerate() {
        let bytes = slot.used[dev]
            .swap(0, Ordering::AcqRel)
            .saturating_add(slot.overhead[dev].swap(0, Ordering::AcqRel));
        sub_saturating(&device.used, bytes);
        total = total.saturating_add(bytes);
    }
    free_empty_slot(slot);
    total
}

/// Frees a slot whose counters are zero.
fn free_empty_slot(slot: &ProcessSlot) {
    slot.start_time.store(0, Ordering::Relaxed);
    slot.pid_ns.store(0, Ordering::Relaxed);
    slot.pid.store(0, Ordering::Release);
}

fn validate_name(name: &str) -> Result<(), LedgerError> {
    let reason = if name.is_empty() {
        "empty"
    } else if name.contains('/') {
        "contains '/'"
    } else if name.contains('\0') {
        "contains NUL"
    } else if name == "." || name == ".." {
        "is a directory name"
    } else if name.len() > MAX_NAME_LEN {
        "longer than 255 bytes"
    } else {
        return Ok(());
    };
    Err(LedgerError::InvalidName {
        name: name.to_owned(),
        reason,
    })
}

/// Creates the region, or opens it if it exists (and is trusted), riding
/// out the races with processes creating it at the same moment.
fn map_region(
    name: &str,
    trust: &Trust,
    creation: &Creation,
    deadline: Instant,
    timeout: Duration,
) -> Result<shm::Mapping, LedgerError> {
    loop {
        if let Some(map) = shm::create(name, REGION_SIZE, creation)? {
            return Ok(map);
        }
        // Exists; `None`: unlinked since, or not sized yet by its creator.
        if let Some(map) = shm::open(name, REGION_SIZE, true, trust)? {
            return Ok(map);
        }
        if Instant::now() >= deadline {
            return Err(timeout_error(name, timeout));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn timeout_error(name: &str, timeout: Duration) -> LedgerError {
    LedgerError::Timeout {
        name: name.to_owned(),
        waited_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    }
}

/// Initialises the header if nobody has, waits for it to be ready, and checks
/// that the region is a ledger of this layout.
fn ready_region(
    name: &str,
    map: &shm::Mapping,
    deadline: Instant,
    timeout: Duration,
) -> Result<NonNull<Region>, LedgerError> {
    let len = map.len();
    let size_mismatch = |found: u64| LedgerError::SizeMismatch {
        name: name.to_owned(),
        found,
        expected: REGION_SIZE as u64,
    };
    if len < size_of::<Header>() {
        return Err(size_mismatch(len as u64));
    }
    let base = map.base();
    // SAFETY: the mapping is at least `size_of::<Header>()` bytes (checked
    // above), page-aligned, and lives as long as `map`, which outlives this
    // borrow; `Header` is all atomics, so concurrent writers are fine.
    let header = unsafe { base.cast::<Header>().as_ref() };
    loop {
        match header.state.load(Ordering::Acquire) {
            STATE_READY => break,
            STATE_EMPTY if len == REGION_SIZE => {
                if header
                    .state
                    .compare_exchange(
                        STATE_EMPTY,
                        STATE_INITIALIZING,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    header.magic.store(MAGIC, Ordering::Relaxed);
                    header.version.store(LAYOUT_VERSION, Ordering::Relaxed);
                    header.size.store(REGION_SIZE as u64, Ordering::Relaxed);
                    header.state.store(STATE_READY, Ordering::Release);
                    break;
                }
            }
            STATE_EMPTY => return Err(size_mismatch(len as u64)),
            STATE_INITIALIZING => {
                if Instant::now() >= deadline {
                    return Err(timeout_error(name, timeout));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // Unknown: let the checks below name what is wrong.
            _ => break,
        }
    }
    let magic = header.magic.load(Ordering::Acquire);
    if magic != MAGIC {
        return Err(LedgerError::BadMagic {
            name: name.to_owned(),
            found: magic,
        });
    }
    let version = header.version.load(Ordering::Acquire);
    if version != LAYOUT_VERSION {
        return Err(LedgerError::VersionMismatch {
            name: name.to_owned(),
            found: version,
            expected: LAYOUT_VERSION,
        });
    }
    let size = header.size.load(Ordering::Acquire);
    if size != REGION_SIZE as u64 {
        return Err(size_mismatch(size));
    }
    if len != REGION_SIZE {
        return Err(size_mismatch(len as u64));
    }
    let state = header.state.load(Ordering::Acquire);
    if state != STATE_READY {
        return Err(LedgerError::BadState {
            name: name.to_owned(),
            found: state,
        });
    }
    Ok(base.cast::<Region>())
}

fn current_pid() -> i32 {
    // SAFETY: getpid has no preconditions and cannot fail.
    unsafe { libc::getpid() }
}

/// Milliseconds of `CLOCK_MONOTONIC`, the same clock in every process of a
/// time namespace.
fn monotonic_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1000)
        .saturating_add(ts.tv_nsec as u64 / 1_000_000)
}

/// Inode of this process's pid namespace, 0 if `/proc` cannot tell.
fn own_pid_ns() -> u64 {
    std::fs::metadata("/proc/self/ns/pid").map_or(0, |meta| meta.ino())
}

/// The two fields of `/proc/<pid>/stat` the ledger needs.
struct ProcStat {
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X` (dead), ...
    state: char,
    /// Field 22: start time in clock ticks after boot.
    start_time: u64,
}

fn read_proc_stat(path: &str) -> io::Result<ProcStat> {
    let text = std::fs::read_to_string(path)?;
    let malformed = || io::Error::new(io::ErrorKind::InvalidData, "malformed /proc stat");
    // Field 2 (comm) is parenthesised and may contain spaces and ')'.
    let (_, rest) = text.rsplit_once(')').ok_or_else(malformed)?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields
        .next()
        .and_then(|field| field.chars().next())
        .ok_or_else(malformed)?;
    let start_time = fields
        .nth(22 - 4)
        .and_then(|field| field.parse().ok())
        .ok_or_else(malformed)?;
    Ok(ProcStat { state, start_time })
}

/// Whether the process registered as (`pid`, `start_time`) has exited: no such
/// pid, a zombie (the driver has freed its memory), or a different process
/// that reuses the pid. `start_time` 0 (unknown) checks only existence.
/// Anything `/proc` cannot tell counts as alive.
fn process_is_gone(pid: i32, start_time: u64) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: signal 0 sends nothing; kill only checks that the pid exists.
    let rc = unsafe { libc::kill(pid, 0) };
    if rc == -1 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return true;
    }
    match read_proc_stat(&format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            stat.state == 'Z'
                || stat.state == 'X'
                || (start_time != 0 && stat.start_time != start_time)
        }
        Err(err) => err.kind() == io::ErrorKind::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    const DEV: usize = 0;
    /// Far above any pid_max (2^22): never a live process.
    const DEAD_PID: i32 = 0x7fff_0000;

    /// A unique region name, unlinked when dropped.
    struct TestRegion(String);

    impl TestRegion {
        fn new() -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            TestRegion(format!("gpushare-test-ledger-{}-{n}", std::process::id()))
        }
        fn open(&self) -> PodLedger {
            PodLedger::open_named(&self.0).expect("open ledger")
        }
        /// A raw region of `size` bytes under this name, to forge headers.
        fn raw(&self, size: usize) -> shm::Mapping {
            shm::create(&self.0, size, &Creation::default())
                .expect("create raw region")
                .expect("a fresh name")
        }
    }

    impl Drop for TestRegion {
        fn drop(&mut self) {
            let name = std::ffi::CString::new(self.0.clone()).expect("name without NUL");
            // SAFETY: `name` is a valid NUL-terminated string.
            unsafe { libc::shm_unlink(name.as_ptr()) };
        }
    }

    /// Forges a slot for a process that is not us.
    fn forge_slot(ledger: &PodLedger, pid: i32, start_time: u64, ns: u64, dev: usize, bytes: u64) {
        let region = ledger.region();
        let slot = region
            .processes
            .iter()
            .find(|slot| {
                slot.pid
                    .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
            .expect("a free slot");
        slot.start_time.store(start_time, Ordering::Release);
        slot.pid_ns.store(ns, Ordering::Release);
        slot.used[dev].store(bytes, Ordering::Release);
        region.devices[dev].used.fetch_add(bytes, Ordering::AcqRel);
    }

    fn parent() -> (i32, u64) {
        // SAFETY: getppid has no preconditions.
        let ppid = unsafe { libc::getppid() };
        let start = read_proc_stat(&format!("/proc/{ppid}/stat"))
            .expect("parent stat")
            .start_time;
        (ppid, start)
    }

    #[test]
    fn reserve_and_release_add_up() {
        let region = TestRegion::new();
        let ledger = region.open();
        ledger.set_quota(DEV, 100).unwrap();
        assert_eq!(ledger.quota(DEV).unwrap(), 100);
        ledger.try_reserve(DEV, 60).unwrap();
        match ledger.try_reserve(DEV, 50) {
            Err(LedgerError::OverQuota {
                dev,
                quota,
                used,
                requested,
            }) => {
                assert_eq!((dev, quota, used, requested), (DEV, 100, 60, 50));
            }
            other => panic!("expected OverQuota, got {other:?}"),
        }
        ledger.try_reserve(DEV, 40).unwrap();
        assert_eq!(
            ledger.usage(DEV).unwrap(),
            DeviceUsage {
                quota: 100,
                used: 100,
                peak: 100
            }
        );
        assert_eq!(ledger.release(DEV, 30).unwrap(), 30);
        assert_eq!(ledger.usage(DEV).unwrap().used, 70);
        assert_eq!(ledger.process_usage(DEV).unwrap(), 70);
        // Other devices are untouched.
        assert_eq!(
            ledger.usage(1).unwrap(),
            DeviceUsage {
                quota: 0,
                used: 0,
                peak: 0
            }
        );
        ledger.try_reserve(DEV, 0).unwrap();
        assert_eq!(ledger.release(DEV, 0).unwrap(), 0);
    }

    #[test]
    fn zero_quota_is_unlimited_until_overflow() {
        let region = TestRegion::new();
        let ledger = region.open();
        let half = u64::MAX / 2;
        ledger.try_reserve(DEV, half).unwrap();
        ledger.try_reserve(DEV, half).unwrap();
        assert!(matches!(
            ledger.try_reserve(DEV, 2),
            Err(LedgerError::OverQuota { quota: 0, .. })
        ));
        assert_eq!(ledger.usage(DEV).unwrap().used, half * 2);
    }

    #[test]
    fn release_saturates_and_never_takes_others_bytes() {
        let region = TestRegion::new();
        let a = region.open();
        let b = region.open();
        a.try_reserve(DEV, 50).unwrap();
        b.try_reserve(DEV, 10).unwrap();
        assert_eq!(b.release(DEV, 25).unwrap(), 10);
        assert_eq!(b.release(DEV, 5).unwrap(), 0);
        assert_eq!(b.process_usage(DEV).unwrap(), 0);
        assert_eq!(a.process_usage(DEV).unwrap(), 50);
        assert_eq!(a.usage(DEV).unwrap().used, 50);
    }

    #[test]
    fn overhead_is_set_not_added_and_may_exceed_quota() {
        let region = TestRegion::new();
        let ledger = region.open();
        ledger.set_quota(DEV, 100).unwrap();
        ledger.try_reserve(DEV, 90).unwrap();
        ledger.set_overhead(DEV, 30).unwrap();
        assert_eq!(ledger.usage(DEV).unwrap().used, 120);
        assert_eq!(ledger.usage(DEV).unwrap().peak, 120);
        assert!(matches!(
            ledger.try_reserve(DEV, 1),
            Err(LedgerError::OverQuota { used: 120, .. })
        ));
        ledger.set_overhead(DEV, 5).unwrap();
        assert_eq!(ledger.usage(DEV).unwrap().used, 95);
        assert_eq!(ledger.process_overhead(DEV).unwrap(), 5);
        assert_eq!(ledger.process_usage(DEV).unwrap(), 90);
        ledger.try_reserve(DEV, 5).unwrap();
        assert!(ledger.try_reserve(DEV, 1).is_err());
        ledger.set_overhead(DEV, 0).unwrap();
        assert_eq!(ledger.usage(DEV).unwrap().used, 95);
    }

    #[test]
    fn drop_gives_back_and_region_persists() {
        let region = TestRegion::new();
        let keeper = region.open();
        {
            let ledger = region.open();
            ledger.set_quota(3, 1000).unwrap();
            ledger.try_reserve(3, 400).unwrap();
            ledger.set_overhead(3, 100).unwrap();
            assert_eq!(keeper.usage(3).unwrap().used, 500);
        }
        assert_eq!(
            keeper.usage(3).unwrap(),
            DeviceUsage {
                quota: 1000,
                used: 0,
                peak: 500
            }
        );
        drop(keeper);
        let again = region.open();
        assert_eq!(again.quota(3).unwrap(), 1000);
        let live = again
            .region()
            .processes
            .iter()
            .filter(|s| s.pid.load(Ordering::Relaxed) != 0)
            .count();
        assert_eq!(live, 1);
    }

    #[test]
    fn device_beyond_max_is_an_error() {
        let region = TestRegion::new();
        let ledger = region.open();
        for result in [
            ledger.try_reserve(MAX_DEVICES, 1).map(|_| 0),
            ledger.release(MAX_DEVICES, 1),
            ledger.quota(MAX_DEVICES),
            ledger.set_quota(MAX_DEVICES, 1).map(|_| 0),
            ledger.set_overhead(MAX_DEVICES, 1).map(|_| 0),
            ledger.process_usage(MAX_DEVICES),
        ] {
            assert!(matches!(
                result,
                Err(LedgerError::NoSuchDevice {
                    dev: MAX_DEVICES,
                    max: MAX_DEVICES
                })
            ));
        }
        assert!(ledger.usage(usize::MAX).is_err());
    }

    #[test]
    fn invalid_names_are_refused() {
        for name in ["", "a/b", "a\0b", ".", ".."] {
            assert!(
                matches!(
                    PodLedger::open_named(name),
                    Err(LedgerError::InvalidName { .. })
                ),
                "{name:?}"
            );
        }
        assert!(matches!(
            PodLedger::open(&"x".repeat(250)),
            Err(LedgerError::InvalidName { .. })
        ));
    }

    #[test]
    fn foreign_regions_are_named() {
        let region = TestRegion::new();
        let raw = region.raw(REGION_SIZE);
        // SAFETY: the mapping is REGION_SIZE bytes, page-aligned, all atomics.
        let header = unsafe { &*(raw.base().as_ptr() as *const Header) };
        header.magic.store(0xdead_beef, Ordering::Relaxed);
        header.state.store(STATE_READY, Ordering::Release);
        assert!(matches!(
            region.open_err(),
            LedgerError::BadMagic {
                found: 0xdead_beef,
                ..
            }
        ));
        header.magic.store(MAGIC, Ordering::Relaxed);
        header.version.store(99, Ordering::Relaxed);
        assert!(matches!(
            region.open_err(),
            LedgerError::VersionMismatch {
                found: 99,
                expected: LAYOUT_VERSION,
                ..
            }
        ));
        header.version.store(LAYOUT_VERSION, Ordering::Relaxed);
        header.size.store(12, Ordering::Relaxed);
        assert!(matches!(
            region.open_err(),
            LedgerError::SizeMismatch { found: 12, .. }
        ));
        header.size.store(REGION_SIZE as u64, Ordering::Relaxed);
        header.state.store(7, Ordering::Relaxed);
        assert!(matches!(
            region.open_err(),
            LedgerError::BadState { found: 7, .. }
        ));
        header.state.store(STATE_READY, Ordering::Relaxed);
        region.open();
    }

    impl TestRegion {
        fn open_err(&self) -> LedgerError {
            PodLedger::open_with(
                &self.0,
                &Trust::own_or_root(None),
                &Creation::default(),
                Duration::from_millis(50),
            )
            .expect_err("open must fail")
        }
    }

    #[test]
    fn wrong_length_region_is_a_size_mismatch() {
        let region = TestRegion::new();
        let _raw = region.raw(4096);
        assert!(matches!(
            region.open_err(),
            LedgerError::Shm(ShmError::Size { found: 4096, expected, .. }) if expected == REGION_SIZE as u64
        ));
    }

    #[test]
    fn stuck_initialisation_times_out() {
        let region = TestRegion::new();
        let raw = region.raw(REGION_SIZE);
        // SAFETY: the mapping is REGION_SIZE bytes, page-aligned, all atomics.
        let header = unsafe { &*(raw.base().as_ptr() as *const Header) };
        header.state.store(STATE_INITIALIZING, Ordering::Release);
        assert!(matches!(
            region.open_err(),
            LedgerError::Timeout { waited_ms: 50, .. }
        ));
    }

    #[test]
    fn zeroed_region_is_initialised_by_an_opener() {
        let region = TestRegion::new();
        let _raw = region.raw(REGION_SIZE);
        let ledger = region.open();
        assert_eq!(ledger.region().header.magic.load(Ordering::Relaxed), MAGIC);
        assert_eq!(
            ledger.usage(DEV).unwrap(),
            DeviceUsage {
                quota: 0,
                used: 0,
                peak: 0
            }
        );
    }

    #[test]
    fn dead_process_is_reclaimed() {
        let region = TestRegion::new();
        let ledger = region.open();
        forge_slot(&ledger, DEAD_PID, 12345, own_pid_ns(), 2, 30);
        assert_eq!(ledger.usage(2).unwrap().used, 30);
        assert_eq!(ledger.reclaim_dead(), 30);
        assert_eq!(ledger.usage(2).unwrap().used, 0);
        let held = ledger
            .region()
            .processes
            .iter()
            .filter(|s| s.pid.load(Ordering::Relaxed) != 0)
            .count();
        assert_eq!(held, 1);
        assert_eq!(ledger.reclaim_dead(), 0);
    }

    #[test]
    fn live_process_is_kept_and_reused_pid_is_reclaimed() {
        let region = TestRegion::new();
        let ledger = region.open();
        let (ppid, start) = parent();
        forge_slot(&ledger, ppid, start, own_pid_ns(), DEV, 10);
        assert_eq!(ledger.reclaim_dead(), 0);
        // Same pid, another start time: the pid was reused.
        forge_slot(&ledger, ppid, start + 1, own_pid_ns(), DEV, 7);
        assert_eq!(ledger.reclaim_dead(), 7);
        assert_eq!(ledger.usage(DEV).unwrap().used, 10);
    }

    #[test]
    fn other_pid_namespace_is_left_alone() {
        let region = TestRegion::new();
        let ledger = region.open();
        forge_slot(&ledger, DEAD_PID, 1, own_pid_ns().wrapping_add(1), DEV, 9);
        assert_eq!(ledger.reclaim_dead(), 0);
        assert_eq!(ledger.usage(DEV).unwrap().used, 9);
    }

    #[test]
    fn mark_of_a_dead_reclaimer_is_taken_over() {
        let region = TestRegion::new();
        let ledger = region.open();
        forge_slot(&ledger, -DEAD_PID, 0, own_pid_ns(), DEV, 11);
        assert_eq!(ledger.reclaim_dead(), 11);
        assert_eq!(ledger.usage(DEV).unwrap().used, 0);
    }

    #[test]
    fn over_quota_reserve_reclaims_first() {
        let region = TestRegion::new();
        let ledger = region.open();
        ledger.set_quota(DEV, 100).unwrap();
        ledger.try_reserve(DEV, 1).unwrap(); // spends the periodic scan
        forge_slot(&ledger, DEAD_PID, 0, own_pid_ns(), DEV, 80);
        ledger.try_reserve(DEV, 90).unwrap();
        assert_eq!(ledger.usage(DEV).unwrap().used, 91);
    }

    #[test]
    fn full_table_reclaims_then_errors() {
        let region = TestRegion::new();
        let ledger = region.open();
        let (ppid, start) = parent();
        for _ in 1..MAX_PROCESSES {
            forge_slot(&ledger, ppid, start, own_pid_ns(), DEV, 0);
        }
        assert!(matches!(
            PodLedger::open_named(&region.0),
            Err(LedgerError::TableFull {
                max: MAX_PROCESSES,
                ..
            })
        ));
        // One dead among them: its slot is reclaimed and reused.
        ledger.region().processes[7]
            .start_time
            .store(start + 1, Ordering::Release);
        let second = region.open();
        assert_eq!(unpack(second.reg.load(Ordering::Relaxed)).1, 7);
    }

    #[test]
    fn slot_taken_from_us_is_registered_again() {
        let region = TestRegion::new();
        let ledger = region.open();
        let (_, first) = unpack(ledger.reg.load(Ordering::Relaxed));
        // A peer wrongly judged us dead and the slot went to another process.
        let (ppid, start) = parent();
        let slot = &ledger.region().processes[first];
        slot.start_time.store(start, Ordering::Release);
        slot.pid.store(ppid, Ordering::Release);
        ledger.try_reserve(DEV, 5).unwrap();
        let (_, second) = unpack(ledger.reg.load(Ordering::Relaxed));
        assert_ne!(first, second);
        assert_eq!(ledger.process_usage(DEV).unwrap(), 5);
    }

    #[test]
    fn proc_stat_parses_awkward_comm() {
        let (_, start) = parent();
        assert!(start > 0);
        let own = read_proc_stat("/proc/self/stat").unwrap();
        assert!(own.start_time > 0 && own.state != 'Z');
        let dir = std::env::temp_dir().join(format!("ledger-stat-{}", std::process::id()));
        let fake = "42 (a) b ) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21\n";
        std::fs::write(&dir, fake).unwrap();
        let stat = read_proc_stat(dir.to_str().unwrap()).unwrap();
        std::fs::remove_file(&dir).unwrap();
        assert_eq!((stat.state, stat.start_time), ('S', 987654));
    }

    #[test]
    fn concurrent_reservers_never_overshoot() {
        const THREADS: usize = 8;
        const ROUNDS: usize = 10_000;
        const UNIT: u64 = 1 << 20;
        const QUOTA: u64 = 3 * UNIT;
        let region = TestRegion::new();
        let ledger = Arc::new(region.open());
        ledger.set_quota(DEV, QUOTA).unwrap();
        let granted = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                let ledger = Arc::clone(&ledger);
                let granted = Arc::clone(&granted);
                std::thread::spawn(move || {
                    for _ in 0..ROUNDS {
                        if ledger.try_reserve(DEV, UNIT).is_ok() {
                            granted.fetch_add(1, Ordering::Relaxed);
                            assert!(ledger.usage(DEV).unwrap().used <= QUOTA);
                            assert_eq!(ledger.release(DEV, UNIT).unwrap(), UNIT);
                        }
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        let usage = ledger.usage(DEV).unwrap();
        assert_eq!(usage.used, 0);
        assert_eq!(ledger.process_usage(DEV).unwrap(), 0);
        assert!(usage.peak <= QUOTA, "peak {} over quota", usage.peak);
        assert!(granted.load(Ordering::Relaxed) > 0);
    }
}

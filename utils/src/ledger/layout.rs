//! The bytes of a ledger region; see the [module documentation](super).

use std::mem::{offset_of, size_of};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};
use std::time::Duration;

use super::MAX_DEVICES;
use crate::bucket::{BucketLimits, BucketState};

/// Processes of one pod that can hold memory at the same time.
pub const MAX_PROCESSES: usize = 256;
/// First word of every ledger region: `b"GPUSHLDG"` read as a little-endian u64.
pub const MAGIC: u64 = u64::from_le_bytes(*b"GPUSHLDG");
/// Version of the layout described in the module documentation.
/// Version 2 added the compute buckets after the process slots; 3 their
/// suspend and managed flags; 4 keyed devices by GPU UUID and split each
/// bucket into state and (local) limits; 5 added host-memory spill
/// (oversubscription): per device `spilled`, `spill_peak`, `spill_limit`, and
/// per process `spilled[16]`.
pub const LAYOUT_VERSION: u32 = 5;
/// Size in bytes of a ledger region.
pub const REGION_SIZE: usize = size_of::<Region>();
/// Prefix of the shared-memory name of a pod's region (`/dev/shm/gpushare-pod-<pod>`).
pub const POD_REGION_PREFIX: &str = "gpushare-pod-";

/// `Header::state`: all zero, nobody has initialised the header yet.
pub(super) const STATE_EMPTY: u32 = 0;
/// `Header::state`: one process is writing the header.
pub(super) const STATE_INITIALIZING: u32 = 1;
/// `Header::state`: the header is written; the region is in use.
pub(super) const STATE_READY: u32 = 2;

/// Least interval between two automatic scans for dead processes.
pub(super) const RECLAIM_INTERVAL_MS: u64 = 250;
/// How long `open` waits for a region another process is creating.
pub(super) const OPEN_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a process dropping its ledger waits for a reclaimer that is
/// checking its slot to put it back.
pub(super) const UNREGISTER_WAIT: Duration = Duration::from_millis(100);
/// `NAME_MAX` for a `/dev/shm` entry.
pub(super) const MAX_NAME_LEN: usize = 255;

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
    /// `CLOCK_MONOTONIC` milliseconds of the pod's last CUDA call that
    /// needs its GPU, as its processes stamp it (at most once a
    /// millisecond each); 0: none since the region was made. The
    /// hypervisor swaps out only pods idle by this stamp.
    pub last_call_ms: AtomicU64,
    /// Zero; room for fields that default to zero.
    pub reserved: [AtomicU64; 3],
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
    /// Bytes of host memory live processes of the pod hold in place of
    /// device memory (oversubscription); never part of `used`.
    pub spilled: AtomicU64,
    /// Highest `spilled` seen since the region was created.
    pub spill_peak: AtomicU64,
    /// Local mode: the pod's cap on `spilled` (0 = no spill), for observers.
    pub spill_limit: AtomicU64,
    /// The largest driver memory a process of the pod was measured to hold
    /// on this GPU right after creating its first context: what the next
    /// context is reserved at. 0: none measured yet (a word that was
    /// reserved, zero in regions of older writers).
    pub context_bytes: AtomicU64,
}

/// A GPU's compute bucket in the pod's region: the state every process
/// updates, and the limits local mode sets from its configuration.
#[repr(C)]
#[derive(Debug, Default)]
pub struct LocalBucket {
    /// Tokens and counters, updated by every process of the pod.
    pub state: BucketState,
    /// Share, ceiling and suspension; set here only in local mode (under a
    /// hypervisor they live in the limits object).
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
    /// Host memory the owner spilled to, per device.
    pub spilled: [AtomicU64; MAX_DEVICES],
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
    assert!(size_of::<ProcessSlot>() == 448);
    assert!(size_of::<LocalBucket>() == 64);
    assert!(size_of::<Region>() == 64 + MAX_DEVICES * 64 + MAX_PROCESSES * 448 + MAX_DEVICES * 64);
    assert!(size_of::<Region>() == 116_800);
    assert!(offset_of!(Region, compute) == 115_776);
    assert!(align_of::<Region>() == 8);
    assert!(offset_of!(Header, magic) == 0);
    assert!(offset_of!(Header, version) == 8);
    assert!(offset_of!(Header, last_call_ms) == 32);
    assert!(offset_of!(Header, state) == 12);
    assert!(offset_of!(Header, size) == 16);
    assert!(offset_of!(Header, last_scan_ms) == 24);
    assert!(offset_of!(DeviceLedger, quota) == 0);
    assert!(offset_of!(DeviceLedger, used) == 8);
    assert!(offset_of!(DeviceLedger, peak) == 16);
    assert!(offset_of!(DeviceLedger, key) == 24);
    assert!(offset_of!(DeviceLedger, spilled) == 32);
    assert!(offset_of!(DeviceLedger, spill_peak) == 40);
    assert!(offset_of!(DeviceLedger, spill_limit) == 48);
    assert!(offset_of!(ProcessSlot, pid) == 0);
    assert!(offset_of!(ProcessSlot, start_time) == 8);
    assert!(offset_of!(ProcessSlot, pid_ns) == 16);
    assert!(offset_of!(ProcessSlot, used) == 64);
    assert!(offset_of!(ProcessSlot, overhead) == 192);
    assert!(offset_of!(ProcessSlot, spilled) == 320);
    assert!(offset_of!(Region, header) == 0);
    assert!(offset_of!(Region, devices) == 64);
    assert!(offset_of!(Region, processes) == 1088);
};

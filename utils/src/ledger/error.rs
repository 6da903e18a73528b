//! Errors of the ledger.

use crate::shm::ShmError;

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
    /// The pod still holds memory on the GPU a device entry was to move to.
    #[error("ledger {name} still counts memory on GPU {uuid}")]
    DeviceInUse {
        /// The region's name.
        name: String,
        /// The GPU the entry was to move to.
        uuid: String,
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
    /// The host-memory spill would take the pod past its spill cap on `dev`.
    #[error(
        "device {dev}: spilling {requested} bytes to host memory would exceed the pod's cap ({spilled} of {cap} spilled)"
    )]
    OverSpillCap {
        /// The device ordinal.
        dev: usize,
        /// The pod's spill cap in bytes (0: no spill).
        cap: u64,
        /// Bytes the pod had spilled when the reservation failed.
        spilled: u64,
        /// Bytes asked for.
        requested: u64,
    },
    /// The region was shrunk under this process (by a process of the pod,
    /// or anyone who may write it): what it reads now is not the pod's
    /// ledger, so every reservation is refused (fail closed).
    #[error(
        "ledger {name} was shrunk while mapped; its counts are lost and reservations are refused"
    )]
    Shrunk {
        /// The region's name.
        name: String,
    },
}

//! What the node's two shared tables, the activity table
//! ([`crate::activity`]) and the priority table ([`crate::priority`]), have in
//! common: where they live in `/dev/shm` ([`NodeTableNames`]), the header
//! that says what a table is and how it is laid out ([`TableHeader`],
//! [`TableLayout`]), how a process gets one ([`TableAccess`]) and the
//! [`NodeTable`] view the hypervisor checks and repairs both through, and the
//! conventions of their slots: [`PODS_PER_DEVICE`] pods per device, each
//! under its [`pod_key`], and which stamps a reader may believe
//! ([`plausible_stamp`]).
//!
//! Every limited process may write a whole table, so readers trust none of
//! it blindly: a table whose header is not exactly its layout's reads as no
//! table at all, and a stamp later than the reader's clock by more than
//! [`FUTURE_SLACK_NS`] (no clock of this node wrote it) is no stamp.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::shm::{self, Creation, ShmError, Trust};

/// The activity table's name in `/dev/shm`: the version of its layout is in
/// the name.
pub const NODE_REGION: &str = "gpushare-node-v2";
/// The priority table's name in `/dev/shm`, versioned as [`NODE_REGION`] is.
pub const PRIORITY_REGION: &str = "gpushare-priority-v3";
/// Names the node's activity table in `/dev/shm` (an operator setting; a
/// daemon and the limiters it serves must agree).
pub const NODE_REGION_VARIABLE: &str = "GPUSHARE_NODE_REGION";
/// Names the node's priority table, as [`NODE_REGION_VARIABLE`] does the
/// activity table.
pub const PRIORITY_REGION_VARIABLE: &str = "GPUSHARE_PRIORITY_REGION";

/// Where the node tables live in `/dev/shm` (tests name their own).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeTableNames {
    /// The activity table ([`NODE_REGION`] by default).
    pub activity: String,
    /// The priority table ([`PRIORITY_REGION`] by default).
    pub priority: String,
}

impl Default for NodeTableNames {
    fn default() -> Self {
        Self {
            activity: NODE_REGION.to_owned(),
            priority: PRIORITY_REGION.to_owned(),
        }
    }
}

impl NodeTableNames {
    /// The default names, or those of [`NODE_REGION_VARIABLE`] and
    /// [`PRIORITY_REGION_VARIABLE`].
    pub fn from_env() -> Self {
        let default = Self::default();
        Self {
            activity: std::env::var(NODE_REGION_VARIABLE).unwrap_or(default.activity),
            priority: std::env::var(PRIORITY_REGION_VARIABLE).unwrap_or(default.priority),
        }
    }
}

/// Pods tracked per device.
pub const PODS_PER_DEVICE: usize = 64;

/// How far past a reader's clock a stamp in a node table may lie: every
/// process reads the same `CLOCK_MONOTONIC`, but a reader's reading may be
/// a coarse tick old (10 ms at `HZ=100`) or taken before it was descheduled.
/// A stamp later than this was not written by a clock of this node, and is
/// ignored (writers replace it).
pub const FUTURE_SLACK_NS: u64 = 50_000_000;

/// Whether a stamp `at_ns` may have been written by this node's clock by
/// `now_ns` (0, never stamped, is plausible).
#[inline]
pub fn plausible_stamp(at_ns: u64, now_ns: u64) -> bool {
    at_ns <= now_ns.saturating_add(FUTURE_SLACK_NS)
}

/// The index of `pod`'s slot among `slots`, and whether this call claimed
/// it: the slot whose key (the first of `words`) is `pod`, else the first
/// that is free, or whose stamp (the second) is older than `stale_ns` or
/// from the future, claimed by a compare-and-swap of its key. `None` when
/// every slot is a live pod's. `pod` is never 0 (a free slot's key).
pub(crate) fn pod_slot<T>(
    slots: &[T],
    pod: u64,
    now_ns: u64,
    stale_ns: u64,
    words: impl Fn(&T) -> (&AtomicU64, &AtomicU64),
) -> Option<(usize, bool)> {
    let pod = pod.max(1);
    if let Some(found) = slots
        .iter()
        .position(|slot| words(slot).0.load(Ordering::Acquire) == pod)
    {
        return Some((found, false));
    }
    let free = slots.iter().position(|slot| {
        let (key, stamp) = words(slot);
        let owner = key.load(Ordering::Acquire);
        let seen_at = stamp.load(Ordering::Acquire);
        (owner == 0
            || now_ns.saturating_sub(seen_at) > stale_ns
            || !plausible_stamp(seen_at, now_ns))
            && key
                .compare_exchange(owner, pod, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    })?;
    Some((free, true))
}

/// What a node table's header must say: which table, which layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableLayout {
    /// First word: which table.
    pub magic: u64,
    /// Version of the table's layout (also in its name).
    pub version: u32,
    /// Size of the whole table in bytes, header included.
    pub size: u64,
    /// Devices, slots per device and slot size, packed
    /// (`devices << 48 | slots << 32 | slot bytes`).
    pub shape: u64,
}

impl TableLayout {
    /// The layout of a table of `size` bytes whose `devices` have `slots`
    /// slots of `slot_bytes` each.
    pub const fn new(
        magic: u64,
        version: u32,
        size: usize,
        devices: usize,
        slots: usize,
        slot_bytes: usize,
    ) -> Self {
        Self {
            magic,
            version,
            size: size as u64,
            shape: (devices as u64) << 48 | (slots as u64) << 32 | slot_bytes as u64,
        }
    }
}

/// The first 64 bytes of a node table: what the table is and how it is laid
/// out. Readers check it before every use ([`TableHeader::holds`]).
#[repr(C)]
#[derive(Debug, Default)]
pub struct TableHeader {
    /// [`TableLayout::magic`].
    pub magic: AtomicU64,
    /// [`TableLayout::version`].
    pub version: AtomicU32,
    /// Size of this header, 64.
    pub header_bytes: AtomicU32,
    /// [`TableLayout::size`].
    pub size: AtomicU64,
    /// [`TableLayout::shape`].
    pub shape: AtomicU64,
    /// Zero.
    pub reserved: [AtomicU64; 4],
}

const _: () = assert!(size_of::<TableHeader>() == 64);

impl TableHeader {
    /// Whether the header says `layout` (the launch path's check: loads of
    /// one cache line that nobody writes while the table is sound).
    #[inline]
    pub fn holds(&self, layout: &TableLayout) -> bool {
        self.magic.load(Ordering::Acquire) == layout.magic
            && self.version.load(Ordering::Relaxed) == layout.version
            && self.header_bytes.load(Ordering::Relaxed) == HEADER_BYTES
            && self.size.load(Ordering::Relaxed) == layout.size
            && self.shape.load(Ordering::Relaxed) == layout.shape
    }

    /// Whether every byte of the header is what its creator wrote for
    /// `layout` (the hypervisor's periodic check).
    pub fn is_exactly(&self, layout: &TableLayout) -> bool {
        self.holds(layout)
            && self
                .reserved
                .iter()
                .all(|word| word.load(Ordering::Relaxed) == 0)
    }

    /// Writes the header of `layout`, the magic last: a reader that sees it
    /// sees the rest.
    pub fn write(&self, layout: &TableLayout) {
        for word in &self.reserved {
            word.store(0, Ordering::Relaxed);
        }
        self.version.store(layout.version, Ordering::Relaxed);
        self.header_bytes.store(HEADER_BYTES, Ordering::Relaxed);
        self.size.store(layout.size, Ordering::Relaxed);
        self.shape.store(layout.shape, Ordering::Relaxed);
        self.magic.store(layout.magic, Ordering::Release);
    }
}

const HEADER_BYTES: u32 = size_of::<TableHeader>() as u32;

/// How long a table's creator may take to size it.
const READY_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a node table could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum ActivityError {
    /// Creating or opening the shared-memory object failed.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The table does not exist, or its creator did not size it in time.
    #[error("/dev/shm/{name} does not exist (or its creator never sized it)")]
    Absent {
        /// Table name in `/dev/shm`.
        name: String,
    },
    /// [`TableAccess::Fresh`] found the name taken.
    #[error("/dev/shm/{name} exists already")]
    Exists {
        /// Table name in `/dev/shm`.
        name: String,
    },
}

/// A node table as its owner sees it: the hypervisor checks and repairs
/// both tables through this.
pub trait NodeTable: Sized {
    /// What the table's header must say.
    const LAYOUT: TableLayout;

    /// Maps the table named `name` in `/dev/shm` as `access` says.
    fn open_named(name: &str, access: &TableAccess) -> Result<Self, ActivityError>;

    /// The table's header.
    fn header(&self) -> &TableHeader;

    /// Whether the table was shrunk under this process (it then reads
    /// zeros of this process's own, which nobody else sees).
    fn is_broken(&self) -> bool;

    /// Whether readers use the table: its header says its layout.
    #[inline]
    fn is_sound(&self) -> bool {
        self.header().holds(&Self::LAYOUT)
    }

    /// Whether every byte of the header is right (the hypervisor's check).
    fn header_is_exact(&self) -> bool {
        self.header().is_exactly(&Self::LAYOUT)
    }
}

/// How a process gets a node table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableAccess {
    /// The node's one creator (the limiter in local mode): creates the
    /// table when absent (`O_EXCL`, owner and mode from `creation`), else
    /// opens it if `trust` allows its owner.
    Create {
        /// Owner and mode of the table if we create it.
        creation: Creation,
        /// Who may own the table if it already exists.
        trust: Trust,
    },
    /// The hypervisor: creates the table (`O_EXCL`, owner and mode from the
    /// creation), never opens one that exists ([`ActivityError::Exists`]):
    /// nobody can tell a table it made from one planted under its name.
    Fresh(Creation),
    /// Everyone else: opens an existing table whose owner `trust` allows.
    Open(Trust),
}

impl TableAccess {
    /// A limiter without a hypervisor: creates the table (owner: this uid,
    /// mode 0600), or opens one that this uid, root or `region_owner` owns.
    pub fn local(region_owner: Option<u32>) -> Self {
        Self::Create {
            creation: Creation::default(),
            trust: Trust::own_or_root(region_owner),
        }
    }

    /// A limiter under a hypervisor: opens the table the hypervisor made
    /// (owned by it or by the pods' configured `region_owner`), never
    /// creates one.
    pub fn managed(region_owner: Option<u32>) -> Self {
        Self::Open(Trust::own_or_root(region_owner))
    }
}

/// Maps the node-wide table of `layout` named `name` read-write, never
/// unmapped: created or opened as `access` says, checked like every shared
/// object ([`shm`]: regular file, trusted owner, nobody else may write it,
/// exact size), and guarded against being shrunk under us. A table this
/// call creates gets its header (zero-filled slots are the empty table);
/// one it opens is taken as it is: readers check its header at each use.
pub(crate) fn map_node_table(
    name: &str,
    layout: &TableLayout,
    access: &TableAccess,
) -> Result<&'static shm::Mapping, ActivityError> {
    let size = usize::try_from(layout.size).unwrap_or(usize::MAX);
    let absent = || ActivityError::Absent {
        name: name.to_owned(),
    };
    let created = |mapping: shm::Mapping| {
        // SAFETY: a fresh shared mapping of `size` bytes (at least the
        // header's 64), page-aligned, whose header fields are all atomics.
        let header = unsafe { mapping.base().cast::<TableHeader>().as_ref() };
        header.write(layout);
        mapping
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let mapped = match access {
            TableAccess::Create { creation, trust } => match shm::create(name, size, creation)? {
                Some(mapping) => Some(created(mapping)),
                None => shm::open(name, size, true, trust)?,
            },
            TableAccess::Fresh(creation) => match shm::create(name, size, creation)? {
                Some(mapping) => Some(created(mapping)),
                None => {
                    return Err(ActivityError::Exists {
                        name: name.to_owned(),
                    });
                }
            },
            TableAccess::Open(trust) => shm::open(name, size, true, trust)?,
        };
        if let Some(mapping) = mapped {
            return Ok(Box::leak(Box::new(mapping)));
        }
        // Absent, or its creator has not sized it yet.
        if matches!(access, TableAccess::Open(_)) || Instant::now() >= deadline {
            return Err(absent());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A stable 64-bit key for a pod identity (FNV-1a), never 0.
pub fn pod_key(pod: &str) -> u64 {
    crate::fnv::fnv1a(pod.bytes()).max(1)
}

//! Which pods are using each GPU of the node right now, so that an elastic
//! pod can take idle time and give it back as soon as another pod needs it.
//!
//! A small node-wide shared-memory table (`/dev/shm/gpushare-node-v2`): a
//! [`TableHeader`], then per device slots of `{pod key, last launch time}`.
//! Every limited process stamps its pod's slot when it launches (at most
//! every [`MARK_INTERVAL_NS`]); a pod is contended on a device when another
//! pod stamped it within [`ACTIVE_WINDOW_NS`]. Zero-filled slots are the
//! empty table; the header is written by the table's creator right after it
//! sized the table (and rewritten by the hypervisor when it finds it wrong).
//!
//! Every limited process may write the whole table, so readers trust none
//! of it blindly: a table whose header is not exactly this layout's reads as
//! no table at all, and a stamp later than the reader's clock by more than
//! [`FUTURE_SLACK_NS`] (no clock of this node wrote it) is no stamp. The
//! slots say which pod they are for, but nothing can say who wrote them: a
//! process may write any pod's slot with plausible values.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::MAX_DEVICES;
use crate::shm::{self, Creation, ShmError, Trust};

/// The table's name in `/dev/shm`: the version is in the name.
pub const NODE_REGION: &str = "gpushare-node-v2";
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
    /// The priority table ([`crate::priority::PRIORITY_REGION`] by default).
    pub priority: String,
}

impl Default for NodeTableNames {
    fn default() -> Self {
        Self {
            activity: NODE_REGION.to_owned(),
            priority: crate::priority::PRIORITY_REGION.to_owned(),
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
/// A process stamps its pod at most this often.
pub const MARK_INTERVAL_NS: u64 = 10_000_000;
/// A pod that launched within this window needs the GPU.
pub const ACTIVE_WINDOW_NS: u64 = 200_000_000;
/// A slot idle this long may be taken by another pod.
const STALE_NS: u64 = 10_000_000_000;
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

/// First word of the activity table: `b"GPUSHACT"` read as a little-endian u64.
pub const ACTIVITY_MAGIC: u64 = u64::from_le_bytes(*b"GPUSHACT");
/// Version of the activity table's layout: 2 added the header (1 had none).
pub const ACTIVITY_VERSION: u32 = 2;

/// One pod's stamp on one device.
#[repr(C)]
#[derive(Debug, Default)]
pub struct PodActivity {
    /// Hash of the pod identity; 0 = free.
    pub pod: AtomicU64,
    /// Monotonic time of its last launch.
    pub active_at_ns: AtomicU64,
}

/// The whole table.
#[repr(C)]
pub struct ActivityTable {
    /// What the table is; checked by every reader.
    pub header: TableHeader,
    /// Per device, the stamps of up to [`PODS_PER_DEVICE`] pods.
    pub devices: [[PodActivity; PODS_PER_DEVICE]; MAX_DEVICES],
}

const _: () = assert!(size_of::<PodActivity>() == 16);
const _: () = assert!(std::mem::offset_of!(ActivityTable, devices) == 64);
const _: () = assert!(size_of::<ActivityTable>() == 64 + 16 * PODS_PER_DEVICE * MAX_DEVICES);

/// The activity table's header.
pub const ACTIVITY_LAYOUT: TableLayout = TableLayout::new(
    ACTIVITY_MAGIC,
    ACTIVITY_VERSION,
    size_of::<ActivityTable>(),
    MAX_DEVICES,
    PODS_PER_DEVICE,
    size_of::<PodActivity>(),
);

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

/// The node's activity table, mapped.
pub struct NodeActivity {
    table: &'static ActivityTable,
    mapping: &'static shm::Mapping,
}

impl NodeTable for NodeActivity {
    const LAYOUT: TableLayout = ACTIVITY_LAYOUT;

    fn open_named(name: &str, access: &TableAccess) -> Result<Self, ActivityError> {
        Self::open_named(name, access)
    }

    fn header(&self) -> &TableHeader {
        &self.table.header
    }

    fn is_broken(&self) -> bool {
        self.is_broken()
    }
}

impl NodeActivity {
    /// Maps the table named `name` in `/dev/shm` (the node's is
    /// [`NODE_REGION`]; tests use their own), as `access` says.
    pub fn open_named(name: &str, access: &TableAccess) -> Result<Self, ActivityError> {
        let mapping = map_node_table(name, &ACTIVITY_LAYOUT, access)?;
        // SAFETY: a shared mapping of the table's size, never unmapped, whose
        // fields are all atomics (valid for any bit pattern written by peers).
        let table = unsafe { mapping.base().cast::<ActivityTable>().as_ref() };
        Ok(Self { table, mapping })
    }

    /// Whether the table was shrunk under this process (it then reads
    /// zeros: no pod seen, which only costs elastic pods their idle time).
    pub fn is_broken(&self) -> bool {
        self.mapping.is_broken()
    }

    /// Stamps `pod` as launching on `device` at `now_ns`. A slot may be
    /// taken when free, idle for 10 s, or stamped in the future
    /// (beyond [`FUTURE_SLACK_NS`]: garbage, which would otherwise hold the
    /// slot for ever).
    pub fn mark(&self, device: usize, pod: u64, now_ns: u64) {
        let Some(slots) = self.table.devices.get(device) else {
            return;
        };
        let pod = pod.max(1);
        let mut stale = None;
        for slot in slots {
            let owner = slot.pod.load(Ordering::Acquire);
            if owner == pod {
                slot.active_at_ns.store(now_ns, Ordering::Release);
                return;
            }
            let at = slot.active_at_ns.load(Ordering::Acquire);
            if owner == 0 || now_ns.saturating_sub(at) > STALE_NS || !plausible_stamp(at, now_ns) {
                stale.get_or_insert((slot, owner));
            }
        }
        if let Some((slot, owner)) = stale
            && slot
                .pod
                .compare_exchange(owner, pod, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            slot.active_at_ns.store(now_ns, Ordering::Release);
        }
        // Table full of active pods: this pod goes unseen; elastic pods then
        // cannot see it (documented limit of 64 pods per GPU).
    }

    /// Whether a pod other than `pod` launched on `device` within the window;
    /// false while the header is wrong, and a stamp in the future (beyond
    /// [`FUTURE_SLACK_NS`]) counts as none.
    pub fn contended(&self, device: usize, pod: u64, now_ns: u64) -> bool {
        if !self.is_sound() {
            return false;
        }
        let Some(slots) = self.table.devices.get(device) else {
            return false;
        };
        let pod = pod.max(1);
        slots.iter().any(|slot| {
            let owner = slot.pod.load(Ordering::Acquire);
            let at = slot.active_at_ns.load(Ordering::Acquire);
            owner != 0
                && owner != pod
                && plausible_stamp(at, now_ns)
                && now_ns.saturating_sub(at) < ACTIVE_WINDOW_NS
        })
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

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn local() -> TableAccess {
        TableAccess::local(None)
    }

    struct Table(String, NodeActivity);

    impl Table {
        fn new(test: &str) -> Self {
            let name = format!("gpushare-activity-test-{}-{test}", std::process::id());
            let table = NodeActivity::open_named(&name, &local()).expect("map");
            Self(name, table)
        }
    }

    impl Drop for Table {
        fn drop(&mut self) {
            let _ignored = std::fs::remove_file(format!("/dev/shm/{}", self.0));
        }
    }

    #[test]
    fn other_recent_pods_contend_and_old_ones_do_not() {
        let table = Table::new("contend");
        let (a, b) = (pod_key("a"), pod_key("b"));
        let now = 100_000 * MS;
        table.1.mark(0, a, now);
        assert!(
            !table.1.contended(0, a, now),
            "a pod never contends with itself"
        );
        table.1.mark(0, b, now);
        assert!(table.1.contended(0, a, now + 10 * MS));
        assert!(!table.1.contended(1, a, now), "other devices are separate");
        assert!(!table.1.contended(0, a, now + ACTIVE_WINDOW_NS + 1));
    }

    #[test]
    fn two_mappings_see_the_same_table() {
        let table = Table::new("shared");
        let other =
            NodeActivity::open_named(&table.0, &TableAccess::managed(None)).expect("second map");
        other.mark(3, pod_key("x"), 5 * MS);
        assert!(table.1.contended(3, pod_key("y"), 6 * MS));
    }

    #[test]
    fn stale_slots_are_reused() {
        let table = Table::new("stale");
        for pod in 0..PODS_PER_DEVICE as u64 {
            table.1.mark(0, pod + 10, MS);
        }
        let late = 20_000_000 * MS;
        table.1.mark(0, 999, late);
        assert!(table.1.contended(0, 1, late));
    }

    #[test]
    fn the_creator_writes_the_header_and_a_wrong_one_makes_the_table_unread() {
        let table = Table::new("header");
        assert!(table.1.is_sound() && table.1.header_is_exact());
        let (a, b) = (pod_key("a"), pod_key("b"));
        let now = 100_000 * MS;
        table.1.mark(0, b, now);
        assert!(table.1.contended(0, a, now));
        // Any word of the header wrong: the table reads as empty.
        let header = table.1.header();
        header
            .shape
            .store(ACTIVITY_LAYOUT.shape + 1, Ordering::Relaxed);
        assert!(!table.1.is_sound() && !table.1.contended(0, a, now));
        header.write(&ACTIVITY_LAYOUT);
        assert!(table.1.contended(0, a, now));
        header.reserved[3].store(1, Ordering::Relaxed);
        assert!(
            table.1.is_sound(),
            "reserved words are not the launch's check"
        );
        assert!(!table.1.header_is_exact(), "but the hypervisor's");
        // Random bytes: any magic but the right one.
        header.magic.store(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        assert!(!table.1.contended(0, a, now));
        // Another process opening the table takes it as it is.
        let other = NodeActivity::open_named(&table.0, &TableAccess::managed(None)).expect("map");
        assert!(!other.is_sound());
    }

    #[test]
    fn stamps_from_the_future_are_ignored_and_their_slots_taken() {
        let table = Table::new("future");
        let slots = &table.1.table.devices[0];
        let now = 100_000 * MS;
        // Garbage in every slot: pod keys with stamps far past any clock.
        for (n, slot) in slots.iter().enumerate() {
            slot.pod.store(0xdead_0000 + n as u64, Ordering::Relaxed);
            slot.active_at_ns
                .store(u64::MAX - n as u64, Ordering::Relaxed);
        }
        assert!(!table.1.contended(0, pod_key("a"), now));
        // Within the slack, a stamp is a peer's clock read a little later.
        slots[0]
            .active_at_ns
            .store(now + FUTURE_SLACK_NS, Ordering::Relaxed);
        assert!(table.1.contended(0, pod_key("a"), now));
        slots[0]
            .active_at_ns
            .store(now + FUTURE_SLACK_NS + 1, Ordering::Relaxed);
        assert!(!table.1.contended(0, pod_key("a"), now));
        // A pod finds a slot among them: the garbage held none for ever.
        table.1.mark(0, pod_key("b"), now);
        assert!(table.1.contended(0, pod_key("a"), now + MS));
    }

    #[test]
    fn fresh_access_never_opens_a_table_that_exists() {
        let table = Table::new("fresh");
        let error = NodeActivity::open_named(&table.0, &TableAccess::Fresh(Creation::default()))
            .err()
            .expect("refused");
        assert!(matches!(error, ActivityError::Exists { .. }), "{error}");
        let name = format!("gpushare-activity-test-{}-fresh-new", std::process::id());
        let fresh = Table(
            name.clone(),
            NodeActivity::open_named(&name, &TableAccess::Fresh(Creation::default()))
                .expect("made"),
        );
        assert!(fresh.1.header_is_exact());
    }

    #[test]
    fn a_table_someone_else_made_is_refused_not_adopted() {
        let name = format!("gpushare-activity-test-{}-squat", std::process::id());
        let _cleanup = Table(
            name.clone(),
            NodeActivity::open_named(&name, &local()).expect("map"),
        );
        // Owned by a uid the opener does not trust (as if another user had
        // created it first): neither the creator nor an opener maps it.
        let path = format!("/dev/shm/{name}");
        std::os::unix::fs::chown(&path, Some(65533), None).expect("chown (tests run as root)");
        let trust = Trust::only(&[crate::shm::effective_uid()]);
        for access in [
            TableAccess::Open(trust.clone()),
            TableAccess::Create {
                creation: Creation::default(),
                trust,
            },
        ] {
            let error = NodeActivity::open_named(&name, &access)
                .err()
                .expect("refused");
            assert!(
                matches!(
                    error,
                    ActivityError::Shm(ShmError::UntrustedOwner { uid: 65533, .. })
                ),
                "{error}"
            );
        }
        // Writable by others: refused even from a trusted owner.
        std::os::unix::fs::chown(&path, Some(crate::shm::effective_uid()), None).expect("chown");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .expect("chmod");
        let error = NodeActivity::open_named(&name, &local())
            .err()
            .expect("refused");
        assert!(
            matches!(error, ActivityError::Shm(ShmError::Writable { .. })),
            "{error}"
        );
    }

    #[test]
    fn a_link_or_a_wrong_size_is_refused_and_absent_is_said() {
        let base = format!("gpushare-activity-test-{}-", std::process::id());
        let real = Table::new("link-target");
        let link = format!("{base}link");
        std::os::unix::fs::symlink(format!("/dev/shm/{}", real.0), format!("/dev/shm/{link}"))
            .expect("symlink");
        let through_link = NodeActivity::open_named(&link, &local()).err();
        let _ = std::fs::remove_file(format!("/dev/shm/{link}"));
        assert!(
            matches!(
                through_link,
                Some(ActivityError::Shm(ShmError::Open { .. }))
            ),
            "{through_link:?}"
        );
        let short = format!("{base}short");
        std::fs::write(format!("/dev/shm/{short}"), [0u8; 4096]).expect("write");
        let error = NodeActivity::open_named(&short, &local()).err();
        let _ = std::fs::remove_file(format!("/dev/shm/{short}"));
        assert!(
            matches!(
                error,
                Some(ActivityError::Shm(ShmError::Size { found: 4096, .. }))
            ),
            "{error:?}"
        );
        let missing = format!("{base}missing");
        let error = NodeActivity::open_named(&missing, &TableAccess::managed(None)).err();
        assert!(
            matches!(error, Some(ActivityError::Absent { .. })),
            "{error:?}"
        );
        assert!(!std::path::Path::new(&format!("/dev/shm/{missing}")).exists());
    }
}

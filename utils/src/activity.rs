//! Which pods are using each GPU of the node right now, so that an elastic
//! pod can take idle time and give it back as soon as another pod needs it.
//!
//! A small node-wide shared-memory table (`/dev/shm/gpushare-node-v1`): per
//! device, slots of `{pod key, last launch time}`. Every limited process
//! stamps its pod's slot when it launches (at most every [`MARK_INTERVAL_NS`]);
//! a pod is contended on a device when another pod stamped it within
//! [`ACTIVE_WINDOW_NS`]. Zero-filled memory is the empty table, so opening
//! needs no initialisation protocol: every process maps the same file of the
//! same size, and the version is in the name.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::MAX_DEVICES;
use crate::shm::{self, Creation, ShmError, Trust};

/// The table's name in `/dev/shm`.
pub const NODE_REGION: &str = "gpushare-node-v1";
/// Pods tracked per device.
pub const PODS_PER_DEVICE: usize = 64;
/// A process stamps its pod at most this often.
pub const MARK_INTERVAL_NS: u64 = 10_000_000;
/// A pod that launched within this window needs the GPU.
pub const ACTIVE_WINDOW_NS: u64 = 200_000_000;
/// A slot idle this long may be taken by another pod.
const STALE_NS: u64 = 10_000_000_000;

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
    /// Per device, the stamps of up to [`PODS_PER_DEVICE`] pods.
    pub devices: [[PodActivity; PODS_PER_DEVICE]; MAX_DEVICES],
}

const _: () = assert!(size_of::<PodActivity>() == 16);
const _: () = assert!(size_of::<ActivityTable>() == 16 * PODS_PER_DEVICE * MAX_DEVICES);

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
}

/// The node's activity table, mapped.
pub struct NodeActivity {
    table: &'static ActivityTable,
    mapping: &'static shm::Mapping,
}

impl NodeActivity {
    /// Maps the table named `name` in `/dev/shm` (the node's is
    /// [`NODE_REGION`]; tests use their own), as `access` says.
    pub fn open_named(name: &str, access: &TableAccess) -> Result<Self, ActivityError> {
        let mapping = map_node_table(name, size_of::<ActivityTable>(), access)?;
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

    /// Stamps `pod` as launching on `device` at `now_ns`.
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
            if owner == 0
                || now_ns.saturating_sub(slot.active_at_ns.load(Ordering::Acquire)) > STALE_NS
            {
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

    /// Whether a pod other than `pod` launched on `device` within the window.
    pub fn contended(&self, device: usize, pod: u64, now_ns: u64) -> bool {
        let Some(slots) = self.table.devices.get(device) else {
            return false;
        };
        let pod = pod.max(1);
        slots.iter().any(|slot| {
            let owner = slot.pod.load(Ordering::Acquire);
            owner != 0
                && owner != pod
                && now_ns.saturating_sub(slot.active_at_ns.load(Ordering::Acquire))
                    < ACTIVE_WINDOW_NS
        })
    }
}

/// How a process gets a node table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableAccess {
    /// The node's one creator (the hypervisor; the limiter in local mode):
    /// creates the table when absent (`O_EXCL`, owner and mode from
    /// `creation`), else opens it if `trust` allows its owner.
    Create {
        /// Owner and mode of the table if we create it.
        creation: Creation,
        /// Who may own the table if it already exists.
        trust: Trust,
    },
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

/// Maps the node-wide table `name` of `size` bytes read-write (zero-filled
/// is the empty state of every node table), never unmapped: created or
/// opened as `access` says, checked like every shared object ([`shm`]:
/// regular file, trusted owner, nobody else may write it, exact size), and
/// guarded against being shrunk under us.
pub(crate) fn map_node_table(
    name: &str,
    size: usize,
    access: &TableAccess,
) -> Result<&'static shm::Mapping, ActivityError> {
    let absent = || ActivityError::Absent {
        name: name.to_owned(),
    };
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let mapped = match access {
            TableAccess::Create { creation, trust } => match shm::create(name, size, creation)? {
                Some(mapping) => Some(mapping),
                None => shm::open(name, size, true, trust)?,
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

/// A stable 64-bit key for a pod identity (FNV-1a).
pub fn pod_key(pod: &str) -> u64 {
    pod.bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
        .max(1)
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

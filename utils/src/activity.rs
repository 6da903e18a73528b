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

use std::ffi::CString;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::MAX_DEVICES;

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
    pub devices: [[PodActivity; PODS_PER_DEVICE]; MAX_DEVICES],
}

const _: () = assert!(size_of::<PodActivity>() == 16);
const _: () = assert!(size_of::<ActivityTable>() == 16 * PODS_PER_DEVICE * MAX_DEVICES);

/// Why the table could not be mapped.
#[derive(Debug, thiserror::Error)]
#[error("cannot map /dev/shm/{name}: {source}")]
pub struct ActivityError {
    name: String,
    #[source]
    source: std::io::Error,
}

/// The node's activity table, mapped.
pub struct NodeActivity {
    table: &'static ActivityTable,
}

impl NodeActivity {
    /// Maps the node's table, creating it when absent.
    pub fn open() -> Result<Self, ActivityError> {
        Self::open_named(NODE_REGION)
    }

    /// Maps the table named `name` in `/dev/shm` (tests use their own).
    pub fn open_named(name: &str) -> Result<Self, ActivityError> {
        let mapped = map_node_object(name, size_of::<ActivityTable>(), true)?;
        // SAFETY: a shared mapping of the table's size, never unmapped, whose
        // fields are all atomics (valid for any bit pattern written by peers).
        let table = unsafe { &*(mapped as *const ActivityTable) };
        Ok(Self { table })
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

/// Maps the node-wide object `name` of `size` bytes read-write, creating it
/// zero-filled (the empty state of every node table) when absent and
/// `create`; never unmapped.
pub(crate) fn map_node_object(
    name: &str,
    size: usize,
    create: bool,
) -> Result<*mut libc::c_void, ActivityError> {
    let error = |source| ActivityError {
        name: name.to_owned(),
        source,
    };
    let path = CString::new(format!("/{name}"))
        .map_err(|_| error(std::io::Error::from(std::io::ErrorKind::InvalidInput)))?;
    let flags = if create {
        libc::O_RDWR | libc::O_CREAT
    } else {
        libc::O_RDWR
    };
    // SAFETY: a NUL-terminated name; the descriptor is closed below.
    let fd = unsafe { libc::shm_open(path.as_ptr(), flags, 0o666) };
    if fd < 0 {
        return Err(error(std::io::Error::last_os_error()));
    }
    // SAFETY: fd is ours; growing to the same size from several processes
    // is idempotent and the new bytes are zero (the empty table).
    unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        let ok = libc::fstat(fd, &mut stat) == 0
            && (stat.st_size as usize >= size || libc::ftruncate(fd, size as libc::off_t) == 0);
        let address = if ok {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        } else {
            libc::MAP_FAILED
        };
        let failure = std::io::Error::last_os_error();
        libc::close(fd);
        if address == libc::MAP_FAILED {
            return Err(error(failure));
        }
        Ok(address)
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

    struct Table(String, NodeActivity);

    impl Table {
        fn new(test: &str) -> Self {
            let name = format!("gpushare-activity-test-{}-{test}", std::process::id());
            let table = NodeActivity::open_named(&name).expect("map");
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
        let other = NodeActivity::open_named(&table.0).expect("second map");
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
}

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
//! of it blindly ([`crate::node_table`], what both node tables share): a
//! table whose header is not exactly this layout's reads as no table at all,
//! and a stamp later than the reader's clock by more than
//! [`FUTURE_SLACK_NS`] (no clock of this node wrote it) is no stamp. The
//! slots say which pod they are for, but nothing can say who wrote them: a
//! process may write any pod's slot with plausible values.
//!
//! [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS

use std::sync::atomic::{AtomicU64, Ordering};

use crate::MAX_DEVICES;
use crate::node_table::{
    ActivityError, NodeTable, PODS_PER_DEVICE, TableAccess, TableHeader, TableLayout,
    map_node_table, plausible_stamp,
};
use crate::shm;

/// A process stamps its pod at most this often.
pub const MARK_INTERVAL_NS: u64 = 10_000_000;
/// A pod that launched within this window needs the GPU.
pub const ACTIVE_WINDOW_NS: u64 = 200_000_000;
/// A slot idle this long may be taken by another pod.
const STALE_NS: u64 = 10_000_000_000;

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
    ///
    /// [`NODE_REGION`]: crate::node_table::NODE_REGION
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
    ///
    /// [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS
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
    ///
    /// [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS
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

#[cfg(test)]
mod tests;

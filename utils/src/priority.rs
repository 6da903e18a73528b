//! Priority classes across the pods of a node: which GPUs have a latency pod
//! with work in flight, and what the classes cost each pod.
//!
//! A node-wide shared-memory table (`/dev/shm/gpushare-priority-v1`),
//! zero-filled when empty like the activity table ([`crate::activity`]):
//! - per device, one [`LatencyDevice`] line: when a latency pod last
//!   launched there or was seen with work in flight (`active_at_ns`), and its
//!   heartbeat (`present_at_ns`). A batch pod reads the line with one load per
//!   launch and decides with [`gate`];
//! - per device and pod, a [`PodPriority`] slot of counters: how long the
//!   pod's launches were held (batch) and its queueing delay (latency), which
//!   the hypervisor reports.
//!
//! The table is writable by every limited process, like the activity table: a
//! pod that writes it directly can hold batch pods (at most
//! [`STARVATION_NS`] per launch) or spoil the counters, never raise a limit.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::MAX_DEVICES;
use crate::activity::{ActivityError, PODS_PER_DEVICE, map_node_object};
use crate::config::PodClass;

/// The table's name in `/dev/shm`.
pub const PRIORITY_REGION: &str = "gpushare-priority-v1";
/// Default of how long after a latency pod's last launch, or its last work
/// seen in flight, batch launches on its GPU are held: longer than the host
/// gaps between the launches of one request (tens of µs in PyTorch).
pub const DEFAULT_HOLD_NS: u64 = 100_000;
/// A latency pod whose heartbeat is this recent is on the GPU: batch pods
/// there keep their in-flight work bounded even while it is idle, so that its
/// next request finds at most that much in front of it.
pub const PRESENT_WINDOW_NS: u64 = 100_000_000;
/// A latency pod's processes stamp their heartbeat this often.
pub const HEARTBEAT_NS: u64 = 20_000_000;
/// A batch launch held this long goes through anyway: a latency pod that is
/// never idle slows batch pods to a trickle but never stops them.
pub const STARVATION_NS: u64 = 100_000_000;
/// While a latency pod counts itself in flight, its watcher refreshes
/// `active_at_ns` every few µs; a count not refreshed for this long is stale
/// (its process died, or its watcher did not run: batch pods then go on).
pub const STALL_NS: u64 = 50_000_000;
/// A slot idle this long may be taken by another pod.
const STALE_NS: u64 = 600_000_000_000;

/// Latency work on one device.
#[repr(C)]
#[derive(Debug, Default)]
pub struct LatencyDevice {
    /// Monotonic time of the latest latency launch, or of latency work seen
    /// in flight; 0: never.
    pub active_at_ns: AtomicU64,
    /// Latest heartbeat of a latency pod's process on the device.
    pub present_at_ns: AtomicU64,
    /// Latency launches on the device.
    pub launches: AtomicU64,
    /// Latency processes with work in flight on the device (each counts
    /// itself once while its work is pending); trusted only while
    /// `active_at_ns` is within [`STALL_NS`], so a process that died busy
    /// holds nobody for long.
    pub in_flight: AtomicU64,
    pub reserved: [AtomicU64; 4],
}

/// One pod's priority counters on one device.
#[repr(C)]
#[derive(Debug, Default)]
pub struct PodPriority {
    /// [`crate::activity::pod_key`] of the pod; 0 = free.
    pub pod: AtomicU64,
    /// [`PodClass::code`].
    pub class: AtomicU32,
    pub reserved32: AtomicU32,
    /// When the pod last used the slot.
    pub seen_at_ns: AtomicU64,
    /// Total time its launches were held for latency pods.
    pub held_ns: AtomicU64,
    /// Launches that were held.
    pub held_launches: AtomicU64,
    /// Sum, count and maximum of the queueing delay of its sampled launches:
    /// from the launch call until the GPU reached it.
    pub queue_ns: AtomicU64,
    pub queue_samples: AtomicU64,
    pub queue_max_ns: AtomicU64,
}

/// The whole table.
#[repr(C)]
pub struct PriorityTable {
    pub devices: [LatencyDevice; MAX_DEVICES],
    pub pods: [[PodPriority; PODS_PER_DEVICE]; MAX_DEVICES],
}

const _: () = assert!(size_of::<LatencyDevice>() == 64);
const _: () = assert!(size_of::<PodPriority>() == 64);
const _: () = assert!(size_of::<PriorityTable>() == 64 * MAX_DEVICES * (1 + PODS_PER_DEVICE));

/// What a batch launch does, from its device's [`LatencyDevice`] line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    /// No latency pod on the device: launch as usual.
    Free,
    /// A latency pod is on the device but idle: launch, keeping the pod's
    /// work in flight bounded.
    Bounded,
    /// A latency pod is active: wait.
    Hold,
}

/// A device's latency line as a batch launch sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyView {
    pub active_at_ns: u64,
    pub in_flight: u64,
    pub present_at_ns: u64,
}

/// The gate for a batch launch at `now` given its device's latency line,
/// with hold window `hold_ns`.
pub fn gate(line: LatencyView, now_ns: u64, hold_ns: u64) -> Gate {
    let LatencyView {
        active_at_ns,
        in_flight,
        present_at_ns,
    } = line;
    // A stamp a little ahead of `now` (another process read the clock later)
    // counts as now.
    let since = now_ns.saturating_sub(active_at_ns);
    if active_at_ns != 0 && (since < hold_ns || (in_flight > 0 && since < STALL_NS)) {
        Gate::Hold
    } else if present_at_ns != 0 && now_ns.saturating_sub(present_at_ns) < PRESENT_WINDOW_NS {
        Gate::Bounded
    } else {
        Gate::Free
    }
}

/// A pod's counters, summed over devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PriorityStats {
    pub class: PodClass,
    pub held_ns: u64,
    pub held_launches: u64,
    pub queue_ns: u64,
    pub queue_samples: u64,
    pub queue_max_ns: u64,
}

/// The node's priority table, mapped.
pub struct NodePriority {
    table: &'static PriorityTable,
}

impl NodePriority {
    /// Maps the table named `name` in `/dev/shm` (the node's is
    /// [`PRIORITY_REGION`]), creating it when absent and `create` (latency
    /// pods create it; batch pods and the hypervisor only look).
    pub fn open_named(name: &str, create: bool) -> Result<Self, ActivityError> {
        let mapped = map_node_object(name, size_of::<PriorityTable>(), create)?;
        // SAFETY: a shared mapping of the table's size, never unmapped, whose
        // fields are all atomics (valid for any bit pattern written by peers).
        let table = unsafe { &*(mapped as *const PriorityTable) };
        Ok(Self { table })
    }

    /// The latency line of `device`.
    pub fn device(&self, device: usize) -> Option<&'static LatencyDevice> {
        self.table.devices.get(device)
    }

    /// The gate of a batch launch on `device` at `now_ns`: three loads of
    /// one cache line.
    pub fn gate(&self, device: usize, now_ns: u64, hold_ns: u64) -> Gate {
        self.device(device).map_or(Gate::Free, |line| {
            let view = LatencyView {
                active_at_ns: line.active_at_ns.load(Ordering::Acquire),
                in_flight: line.in_flight.load(Ordering::Acquire),
                present_at_ns: line.present_at_ns.load(Ordering::Relaxed),
            };
            gate(view, now_ns, hold_ns)
        })
    }

    /// `pod`'s slot on `device`, claimed (for `class`) when it has none;
    /// `None` when the device's slots are all taken by live pods.
    pub fn slot(
        &self,
        device: usize,
        pod: u64,
        class: PodClass,
        now_ns: u64,
    ) -> Option<&'static PodPriority> {
        let slots = self.table.pods.get(device)?;
        let pod = pod.max(1);
        if let Some(slot) = slots
            .iter()
            .find(|slot| slot.pod.load(Ordering::Acquire) == pod)
        {
            slot.class.store(class.code(), Ordering::Relaxed);
            slot.seen_at_ns.store(now_ns, Ordering::Relaxed);
            return Some(slot);
        }
        let free = slots.iter().find(|slot| {
            let owner = slot.pod.load(Ordering::Acquire);
            (owner == 0
                || now_ns.saturating_sub(slot.seen_at_ns.load(Ordering::Acquire)) > STALE_NS)
                && slot
                    .pod
                    .compare_exchange(owner, pod, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
        })?;
        for counter in [
            &free.held_ns,
            &free.held_launches,
            &free.queue_ns,
            &free.queue_samples,
            &free.queue_max_ns,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        free.class.store(class.code(), Ordering::Relaxed);
        free.seen_at_ns.store(now_ns, Ordering::Release);
        Some(free)
    }

    /// The counters of `pod` over every device (the hypervisor's view).
    pub fn stats(&self, pod: u64) -> Option<PriorityStats> {
        let pod = pod.max(1);
        let mut found = None;
        for slot in self.table.pods.iter().flatten() {
            if slot.pod.load(Ordering::Acquire) != pod {
                continue;
            }
            let stats = found.get_or_insert_with(PriorityStats::default);
            let class = PodClass::from_code(slot.class.load(Ordering::Relaxed));
            if class == PodClass::Latency {
                stats.class = class;
            }
            stats.held_ns += slot.held_ns.load(Ordering::Relaxed);
            stats.held_launches += slot.held_launches.load(Ordering::Relaxed);
            stats.queue_ns += slot.queue_ns.load(Ordering::Relaxed);
            stats.queue_samples += slot.queue_samples.load(Ordering::Relaxed);
            stats.queue_max_ns = stats
                .queue_max_ns
                .max(slot.queue_max_ns.load(Ordering::Relaxed));
        }
        found
    }
}

impl LatencyDevice {
    /// Marks latency work at `now_ns` (never moves the stamp back).
    pub fn stamp_active(&self, now_ns: u64) {
        if self.active_at_ns.load(Ordering::Relaxed) < now_ns {
            self.active_at_ns.store(now_ns, Ordering::Release);
        }
    }

    /// One more latency process has work in flight.
    pub fn enter_flight(&self, now_ns: u64) {
        self.stamp_active(now_ns);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
    }

    /// One latency process has no more work in flight (never below 0).
    pub fn leave_flight(&self, now_ns: u64) {
        self.stamp_active(now_ns);
        let _ = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
    }
}

impl PodPriority {
    /// Adds a hold of `ns` to the pod's counters.
    pub fn add_hold(&self, ns: u64) {
        self.held_ns.fetch_add(ns, Ordering::Relaxed);
        self.held_launches.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds one sampled queueing delay of `ns`.
    pub fn add_queue_delay(&self, ns: u64) {
        self.queue_ns.fetch_add(ns, Ordering::Relaxed);
        self.queue_samples.fetch_add(1, Ordering::Relaxed);
        self.queue_max_ns.fetch_max(ns, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activity::pod_key;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;

    struct Table(String, NodePriority);

    impl Table {
        fn new(test: &str) -> Self {
            let name = format!("gpushare-priority-test-{}-{test}", std::process::id());
            let table = NodePriority::open_named(&name, true).expect("map");
            Self(name, table)
        }
    }

    impl Drop for Table {
        fn drop(&mut self) {
            let _ignored = std::fs::remove_file(format!("/dev/shm/{}", self.0));
        }
    }

    #[test]
    fn the_gate_holds_within_the_window_and_bounds_while_present() {
        let hold = DEFAULT_HOLD_NS;
        let now = 10_000 * MS;
        // (active_at, in_flight, present_at, expected)
        let table: &[(u64, u64, u64, Gate)] = &[
            (0, 0, 0, Gate::Free),
            (0, 1, now, Gate::Bounded),
            (now - 50 * US, 0, now - MS, Gate::Hold),
            (now + 5 * US, 0, 0, Gate::Hold),
            (now - hold, 0, now - MS, Gate::Bounded),
            (now - hold - 1, 0, 0, Gate::Free),
            (now - 10 * MS, 1, now, Gate::Hold),
            (now - STALL_NS + 1, 2, now, Gate::Hold),
            (now - STALL_NS, 1, now, Gate::Bounded),
            (now - 10 * MS, 0, now - PRESENT_WINDOW_NS + 1, Gate::Bounded),
            (now - 10 * MS, 0, now - PRESENT_WINDOW_NS, Gate::Free),
        ];
        for &(active_at_ns, in_flight, present_at_ns, want) in table {
            let view = LatencyView {
                active_at_ns,
                in_flight,
                present_at_ns,
            };
            assert_eq!(gate(view, now, hold), want, "{view:?}");
        }
    }

    #[test]
    fn two_mappings_share_lines_and_counters() {
        let table = Table::new("shared");
        let other = NodePriority::open_named(&table.0, false).expect("second map");
        let now = 5_000 * MS;
        let line = other.device(2).expect("line");
        line.stamp_active(now);
        line.stamp_active(now - MS);
        line.present_at_ns.store(now, Ordering::Relaxed);
        assert_eq!(table.1.gate(2, now + 50 * US, DEFAULT_HOLD_NS), Gate::Hold);
        assert_eq!(table.1.gate(2, now + MS, DEFAULT_HOLD_NS), Gate::Bounded);
        assert_eq!(table.1.gate(1, now, DEFAULT_HOLD_NS), Gate::Free);
        assert_eq!(table.1.gate(MAX_DEVICES, now, DEFAULT_HOLD_NS), Gate::Free);
        line.enter_flight(now);
        assert_eq!(table.1.gate(2, now + 10 * MS, DEFAULT_HOLD_NS), Gate::Hold);
        line.leave_flight(now + 20 * MS);
        line.leave_flight(now + 20 * MS);
        assert_eq!(line.in_flight.load(Ordering::Relaxed), 0);
        assert_eq!(
            table.1.gate(2, now + 21 * MS, DEFAULT_HOLD_NS),
            Gate::Bounded
        );

        let (batch, latency) = (pod_key("batch"), pod_key("latency"));
        let slot = other.slot(0, batch, PodClass::Batch, now).expect("slot");
        slot.add_hold(3 * MS);
        other
            .slot(1, batch, PodClass::Batch, now)
            .expect("slot")
            .add_hold(MS);
        let slot = other
            .slot(0, latency, PodClass::Latency, now)
            .expect("slot");
        slot.add_queue_delay(40 * US);
        slot.add_queue_delay(10 * US);
        let stats = table.1.stats(batch).expect("batch stats");
        assert_eq!(
            (stats.class, stats.held_ns, stats.held_launches),
            (PodClass::Batch, 4 * MS, 2)
        );
        let stats = table.1.stats(latency).expect("latency stats");
        assert_eq!(stats.class, PodClass::Latency);
        assert_eq!(
            (stats.queue_ns, stats.queue_samples, stats.queue_max_ns),
            (50 * US, 2, 40 * US)
        );
        assert_eq!(table.1.stats(pod_key("nobody")), None);
    }

    #[test]
    fn full_devices_refuse_and_stale_slots_are_reused() {
        let table = Table::new("full");
        for pod in 0..PODS_PER_DEVICE as u64 {
            assert!(table.1.slot(0, pod + 10, PodClass::Batch, MS).is_some());
        }
        assert!(table.1.slot(0, 999, PodClass::Batch, 2 * MS).is_none());
        let slot = table.1.slot(0, 999, PodClass::Batch, STALE_NS + 2 * MS);
        assert_eq!(slot.map(|s| s.held_ns.load(Ordering::Relaxed)), Some(0));
    }
}

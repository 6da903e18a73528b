//! Priority classes across the pods of a node: which GPUs have a latency pod
//! with work in flight, and what the classes cost each pod.
//!
//! A node-wide shared-memory table (`/dev/shm/gpushare-priority-v3`): a
//! [`TableHeader`], then zero-filled when empty like the activity table
//! ([`crate::activity`]):
//! - per device, one [`LatencyDevice`] line: when a latency pod last
//!   launched there or was seen with work in flight (`active_at_ns`), and its
//!   heartbeat (`present_at_ns`), and when its next request is expected
//!   (`next_arrival_ns`, `period_ns`). A batch pod reads the line (loads of
//!   one cache line) per launch and decides whether to wait (the limiter's
//!   policy);
//! - per device and pod, a [`PodPriority`] slot of counters: how long the
//!   pod's launches were held (batch) and its queueing delay (latency), which
//!   the hypervisor reports;
//! - per GPU (by UUID), a [`TurnLine`]: which pod's turn it is on a GPU
//!   whose batch pods take turns, and each pod's stamp ([`turns`]);
//! - per device, when a batch pod that latency work can wait behind last
//!   launched there (`contended_at_ns`): an MPS client kept off the SMs
//!   reserved for latency pods never waits for them and never stamps it, so
//!   a co-run latency pod with no other neighbour skips tracking its work.
//!
//! The table is writable by every limited process, like the activity table,
//! so readers check what they read: a table whose header is not exactly this
//! layout's reads as no table (no latency pod anywhere: batch launches go
//! unheld), and values no writer of this node could have written are
//! ignored ([`LatencyView::plausible`]: stamps past the reader's clock by
//! more than [`FUTURE_SLACK_NS`], counts past [`MAX_IN_FLIGHT`],
//! predictions further ahead than their period or with a period past
//! [`MAX_PERIOD_NS`]; counters that contradict each other). A pod that writes plausible values
//! can still hold batch pods (as a latency pod that is never idle would: a
//! bounded time per launch), spoil the counters, or keep a co-run latency
//! pod from tracking its work for batch pods (which then go unheld); the
//! device's line says nothing of who wrote it. It never raises a limit.
//!
//! [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::MAX_DEVICES;
use crate::ledger::MAX_PROCESSES;
use crate::node_table::{
    ActivityError, NodeTable, PODS_PER_DEVICE, TableAccess, TableHeader, TableLayout,
    map_node_table, plausible_stamp, pod_slot,
};
use crate::pod::PodClass;
use crate::shm;

/// First word of the priority table: `b"GPUSHPRI"` read as a little-endian u64.
pub const PRIORITY_MAGIC: u64 = u64::from_le_bytes(*b"GPUSHPRI");
/// Version of the priority table's layout: 2 added the header (1 had none),
/// 3 the turn lines.
pub const PRIORITY_VERSION: u32 = 3;
/// Latency processes a device's line can count in flight: each counts
/// itself once, and a node holds at most this many pods' processes.
pub const MAX_IN_FLIGHT: u64 = (PODS_PER_DEVICE * MAX_PROCESSES) as u64;
/// The longest period of requests a prediction may have: a schedule slower
/// than this is no schedule a batch pod should wait for.
pub const MAX_PERIOD_NS: u64 = 60_000_000_000;
/// A latency pod's processes stamp their heartbeat this often.
pub const HEARTBEAT_NS: u64 = 20_000_000;
/// While a latency pod counts itself in flight, its watcher refreshes
/// `active_at_ns` every few µs; a count not refreshed for this long is stale
/// (its process died, or its watcher did not run: batch pods then go on).
pub const STALL_NS: u64 = 50_000_000;
/// A process counted in flight refreshes `active_at_ns` every ~10 µs; counts
/// met with no refresh for this long belong to processes that died in flight
/// and are dropped (a live process whose watcher was starved that long loses
/// only its count: its stamps still hold batch pods).
pub const FLIGHT_GRACE_NS: u64 = 1_000_000;
/// A slot idle this long may be taken by another pod.
const STALE_NS: u64 = 600_000_000_000;
/// A batch pod refreshes `contended_at_ns` at most this often, so that its
/// launches do not keep taking the line's cache line from latency pods.
pub const CONTENDED_REFRESH_NS: u64 = 1_000_000;
/// A batch pod whose launch stamped `contended_at_ns` this recently is on
/// the device: longer than the longest hold of one of its launches, so a
/// held batch pod never drops out of view.
pub const CONTENDED_WINDOW_NS: u64 = 1_000_000_000;

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
    /// When the latency pod's next request is expected to launch (the
    /// median of its recent request starts, each extrapolated by whole
    /// periods to the next request). Written by a latency process
    /// at each request start; zero in tables of older writers (the words
    /// were reserved, zero-filled), which readers take as no prediction.
    pub next_arrival_ns: AtomicU64,
    /// The period of its requests; 0: no prediction.
    pub period_ns: AtomicU64,
    /// Latest launch, refreshed every [`CONTENDED_REFRESH_NS`], of a batch
    /// pod whose launches are held for latency pods; 0: none yet (and in
    /// tables of older writers, whose reserved word this was).
    pub contended_at_ns: AtomicU64,
    /// Unused; zero.
    pub reserved: [AtomicU64; 1],
}

/// One pod's priority counters on one device.
#[repr(C)]
#[derive(Debug, Default)]
pub struct PodPriority {
    /// [`crate::node_table::pod_key`] of the pod; 0 = free.
    pub pod: AtomicU64,
    /// [`PodClass::code`].
    pub class: AtomicU32,
    /// Unused; zero.
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
    /// Number of sampled launches summed in `queue_ns`.
    pub queue_samples: AtomicU64,
    /// Longest queueing delay of a sampled launch.
    pub queue_max_ns: AtomicU64,
}

/// The whole table.
#[repr(C)]
pub struct PriorityTable {
    /// What the table is; checked by every reader.
    pub header: TableHeader,
    /// Latency work per device, indexed by device.
    pub devices: [LatencyDevice; MAX_DEVICES],
    /// Per device, the counters of up to [`PODS_PER_DEVICE`] pods.
    pub pods: [[PodPriority; PODS_PER_DEVICE]; MAX_DEVICES],
    /// Turns, one line per GPU that takes them (claimed by its UUID's key).
    pub turns: [TurnLine; MAX_DEVICES],
}

const _: () = assert!(size_of::<LatencyDevice>() == 64);
const _: () = assert!(size_of::<PodPriority>() == 64);
const _: () = assert!(std::mem::offset_of!(PriorityTable, devices) == 64);
const _: () = assert!(
    size_of::<PriorityTable>()
        == 64 + 64 * MAX_DEVICES * (1 + PODS_PER_DEVICE) + size_of::<TurnLine>() * MAX_DEVICES
);

/// The priority table's header.
pub const PRIORITY_LAYOUT: TableLayout = TableLayout::new(
    PRIORITY_MAGIC,
    PRIORITY_VERSION,
    size_of::<PriorityTable>(),
    MAX_DEVICES,
    PODS_PER_DEVICE,
    size_of::<PodPriority>(),
);

/// A device's latency line as a batch launch sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LatencyView {
    /// [`LatencyDevice::active_at_ns`]; 0: never.
    pub active_at_ns: u64,
    /// [`LatencyDevice::in_flight`]: latency processes with work in flight.
    pub in_flight: u64,
    /// [`LatencyDevice::present_at_ns`]: latest latency heartbeat.
    pub present_at_ns: u64,
    /// [`LatencyDevice::next_arrival_ns`]; 0: no prediction.
    pub next_arrival_ns: u64,
    /// [`LatencyDevice::period_ns`]; 0: no prediction.
    pub period_ns: u64,
}

impl LatencyView {
    /// The line as a reader at `now_ns` may believe it: each value no
    /// writer of this node could have written reads as "none". A stamp past
    /// `now_ns` by more than [`FUTURE_SLACK_NS`] is 0; a count in flight
    /// past [`MAX_IN_FLIGHT`] is 0; a prediction whose period is past
    /// [`MAX_PERIOD_NS`], or whose arrival lies further ahead than one
    /// period (it is published at a request's start, a period before the
    /// next), is none.
    ///
    /// [`FUTURE_SLACK_NS`]: crate::node_table::FUTURE_SLACK_NS
    #[inline]
    pub fn plausible(self, now_ns: u64) -> Self {
        let stamp = |at: u64| if plausible_stamp(at, now_ns) { at } else { 0 };
        let predicted = self.period_ns != 0
            && self.period_ns <= MAX_PERIOD_NS
            && plausible_stamp(self.next_arrival_ns, now_ns.saturating_add(self.period_ns));
        Self {
            active_at_ns: stamp(self.active_at_ns),
            in_flight: if self.in_flight <= MAX_IN_FLIGHT {
                self.in_flight
            } else {
                0
            },
            present_at_ns: stamp(self.present_at_ns),
            next_arrival_ns: if predicted { self.next_arrival_ns } else { 0 },
            period_ns: if predicted { self.period_ns } else { 0 },
        }
    }
}

/// A pod's counters, summed over devices.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PriorityStats {
    /// Latency if the pod is latency on any device, else batch.
    pub class: PodClass,
    /// Total time its launches were held for latency pods.
    pub held_ns: u64,
    /// Launches that were held.
    pub held_launches: u64,
    /// Sum of the queueing delay of its sampled launches.
    pub queue_ns: u64,
    /// Number of sampled launches summed in `queue_ns`.
    pub queue_samples: u64,
    /// Longest queueing delay of a sampled launch, over all devices.
    pub queue_max_ns: u64,
}

/// The node's priority table, mapped.
pub struct NodePriority {
    table: &'static PriorityTable,
    mapping: &'static shm::Mapping,
}

impl NodeTable for NodePriority {
    const LAYOUT: TableLayout = PRIORITY_LAYOUT;

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

impl NodePriority {
    /// Maps the table named `name` in `/dev/shm` (the node's is
    /// [`PRIORITY_REGION`]) as `access` says.
    ///
    /// [`PRIORITY_REGION`]: crate::node_table::PRIORITY_REGION
    pub fn open_named(name: &str, access: &TableAccess) -> Result<Self, ActivityError> {
        let mapping = map_node_table(name, &PRIORITY_LAYOUT, access)?;
        // SAFETY: a shared mapping of the table's size, never unmapped, whose
        // fields are all atomics (valid for any bit pattern written by peers).
        let table = unsafe { mapping.base().cast::<PriorityTable>().as_ref() };
        Ok(Self { table, mapping })
    }

    /// Whether the table was shrunk under this process (it then reads zeros:
    /// no latency pod seen, so batch launches go on unheld).
    pub fn is_broken(&self) -> bool {
        self.mapping.is_broken()
    }

    /// The latency line of `device`, to write (readers go through
    /// [`latency`](Self::latency) and [`contended`](Self::contended), which
    /// check what they read).
    pub fn device(&self, device: usize) -> Option<&'static LatencyDevice> {
        self.table.devices.get(device)
    }

    /// `device`'s latency line as a batch launch at `now_ns` reads it: loads
    /// of the header's and the line's cache lines, and only what may be
    /// believed ([`LatencyView::plausible`]). All zero (no latency pod) for
    /// a device past the table, or while the header is wrong.
    #[inline]
    pub fn latency(&self, device: usize, now_ns: u64) -> LatencyView {
        if !self.is_sound() {
            return LatencyView::default();
        }
        self.device(device).map_or(LatencyView::default(), |line| {
            LatencyView {
                active_at_ns: line.active_at_ns.load(Ordering::Acquire),
                in_flight: line.in_flight.load(Ordering::Acquire),
                present_at_ns: line.present_at_ns.load(Ordering::Relaxed),
                next_arrival_ns: line.next_arrival_ns.load(Ordering::Acquire),
                period_ns: line.period_ns.load(Ordering::Relaxed),
            }
            .plausible(now_ns)
        })
    }

    /// Whether a batch pod that latency pods hold launched on `device`
    /// within [`CONTENDED_WINDOW_NS`] of `now_ns` ([`LatencyDevice::contended`]);
    /// false while the header is wrong.
    pub fn contended(&self, device: usize, now_ns: u64) -> bool {
        self.is_sound()
            && self
                .device(device)
                .is_some_and(|line| line.contended(now_ns))
    }

    /// The turn line of the GPU whose [`uuid_key`] is `gpu`; `None` when no
    /// line is the GPU's, or while the header is wrong.
    ///
    /// [`uuid_key`]: crate::limits::uuid_key
    pub fn turn_line(&self, gpu: u64) -> Option<&'static TurnLine> {
        if gpu == 0 || !self.is_sound() {
            return None;
        }
        self.table
            .turns
            .iter()
            .find(|line| line.gpu.load(Ordering::Acquire) == gpu)
    }

    /// The turn line of `gpu`, claimed when it has none; `None` when every
    /// line is another GPU's (lines are never given back: a node has at
    /// most [`MAX_DEVICES`] GPUs), or while the header is wrong.
    pub fn claim_turn_line(&self, gpu: u64) -> Option<&'static TurnLine> {
        if let Some(line) = self.turn_line(gpu) {
            return Some(line);
        }
        if gpu == 0 || !self.is_sound() {
            return None;
        }
        let claimed = self.table.turns.iter().find(|line| {
            line.gpu
                .compare_exchange(0, gpu, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        });
        // Two claimers of one GPU: the first line that is its wins.
        claimed.and_then(|_| self.turn_line(gpu))
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
        let (index, claimed) = pod_slot(slots, pod, now_ns, STALE_NS, |slot| {
            (&slot.pod, &slot.seen_at_ns)
        })?;
        let slot = &slots[index];
        if !claimed {
            slot.class.store(class.code(), Ordering::Relaxed);
            slot.seen_at_ns.store(now_ns, Ordering::Relaxed);
            return Some(slot);
        }
        for counter in [
            &slot.held_ns,
            &slot.held_launches,
            &slot.queue_ns,
            &slot.queue_samples,
            &slot.queue_max_ns,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        slot.class.store(class.code(), Ordering::Relaxed);
        slot.seen_at_ns.store(now_ns, Ordering::Release);
        Some(slot)
    }

    /// The counters of `pod` over every device (the hypervisor's view):
    /// none while the header is wrong; slots whose counters contradict each
    /// other are left out, and sums saturate.
    pub fn stats(&self, pod: u64) -> Option<PriorityStats> {
        if !self.is_sound() {
            return None;
        }
        let pod = pod.max(1);
        let mut found = None;
        for slot in self.table.pods.iter().flatten() {
            if slot.pod.load(Ordering::Acquire) != pod {
                continue;
            }
            let Some(counts) = SlotCounts::read(slot) else {
                continue;
            };
            let stats = found.get_or_insert_with(PriorityStats::default);
            let class = PodClass::from_code(slot.class.load(Ordering::Relaxed));
            if class == PodClass::Latency {
                stats.class = class;
            }
            stats.held_ns = stats.held_ns.saturating_add(counts.held_ns);
            stats.held_launches = stats.held_launches.saturating_add(counts.held_launches);
            stats.queue_ns = stats.queue_ns.saturating_add(counts.queue_ns);
            stats.queue_samples = stats.queue_samples.saturating_add(counts.queue_samples);
            stats.queue_max_ns = stats.queue_max_ns.max(counts.queue_max_ns);
        }
        found
    }
}

/// One slot's counters, read once.
struct SlotCounts {
    held_ns: u64,
    held_launches: u64,
    queue_ns: u64,
    queue_samples: u64,
    queue_max_ns: u64,
}

impl SlotCounts {
    /// `slot`'s counters, unless they contradict each other (time without
    /// launches or samples, a maximum above the sum): no writer of the
    /// table adds them that way.
    fn read(slot: &PodPriority) -> Option<Self> {
        // Loaded in the reverse of the order they are added in.
        let held_ns = slot.held_ns.load(Ordering::Acquire);
        let queue_max_ns = slot.queue_max_ns.load(Ordering::Acquire);
        let queue_ns = slot.queue_ns.load(Ordering::Acquire);
        let counts = Self {
            held_ns,
            held_launches: slot.held_launches.load(Ordering::Acquire),
            queue_ns,
            queue_samples: slot.queue_samples.load(Ordering::Acquire),
            queue_max_ns,
        };
        let consistent = (counts.held_launches != 0 || counts.held_ns == 0)
            && (counts.queue_samples != 0 || counts.queue_ns == 0)
            && counts.queue_max_ns <= counts.queue_ns;
        consistent.then_some(counts)
    }
}

impl PodPriority {
    /// Adds a hold of `ns` to the pod's counters (the count first: a
    /// reader never sees time held by no launch, which it would drop).
    pub fn add_hold(&self, ns: u64) {
        self.held_launches.fetch_add(1, Ordering::Release);
        self.held_ns.fetch_add(ns, Ordering::Release);
    }

    /// Adds one sampled queueing delay of `ns` (the count, then the sum,
    /// then the maximum, for the same reason).
    pub fn add_queue_delay(&self, ns: u64) {
        self.queue_samples.fetch_add(1, Ordering::Release);
        self.queue_ns.fetch_add(ns, Ordering::Release);
        self.queue_max_ns.fetch_max(ns, Ordering::Release);
    }
}

mod latency;
#[cfg(test)]
mod tests;
mod turns;

pub use turns::{
    IDLE_NS, MAX_QUANTUM_US, TurnLine, TurnSlot, TurnStep, TurnView, WAIT_SLICE_NS, WANT_NS,
};

//! Priority classes at the launch: a `latency` pod keeps its latency next to
//! `batch` pods (the default) that would fill the GPU.
//!
//! 1. A latency pod's launch stamps "latency work at t" on its device's line
//!    of the node's priority table ([`NodePriority`]): a load and a store.
//!    After the launch it re-records its thread's tracker event on the
//!    stream; a watcher thread polls the trackers every ~10 µs and keeps the
//!    stamp fresh while any is pending, so work queued behind other pods'
//!    kernels counts as active however long it waits. The watcher also
//!    stamps a heartbeat while the process lives (`latency`, `watcher`).
//! 2. A launch that finds the process with no work in flight on the device
//!    starts a request: from the last nine starts the process predicts the
//!    next one (`predict`) and publishes it on the line, unless
//!    [`tuning::PREDICT_VARIABLE`] is `0`.
//! 3. A batch pod's launch loads the line ([`gate::gate`]):
//!    no latency pod on the device costs those loads (and those of the
//!    table's header: every process may write the table, so a wrong header
//!    reads as no latency pod, and so do values no writer could have written:
//!    `LatencyView::plausible`). While a latency pod is
//!    present, the batch thread keeps at most [`tuning::WINDOW_VARIABLE`] launches in
//!    flight (an event after each, waited for before the next), so a latency
//!    kernel finds at most that much batch work in front of it (the GPU
//!    time-slices between processes' contexts, so queued batch work would
//!    otherwise cost it up to a timeslice). While the latency pod is active
//!    (stamped within [`tuning::HOLD_VARIABLE`]), or its next request is due before
//!    the batch thread's launch would be done, the batch launch waits
//!    (trap-and-wait), spinning then sleeping briefly (`batch`).
//! 4. Held time (batch) and the queueing delay of sampled launches (latency:
//!    an event recorded before the launch, polled by the watcher: from the
//!    launch call until the GPU reached it) are added to the pod's counters
//!    in the table, which the hypervisor reports.
//! 5. On a co-run GPU (MPS clients), a batch client kept off the SMs reserved
//!    for latency pods is never held (`CorunSms::OffReserve`); one that took
//!    the whole GPU is, and its launches stamp the line's `contended_at_ns`.
//!    A co-run latency pod does steps 1, 2 and 4 only while that stamp is
//!    recent: with no batch pod waiting for it, its event records and its
//!    watcher's polling would only add to its own latency.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::bucket::monotonic_ns;
use gpushare_utils::limits::GpuLimits;
use gpushare_utils::node_table::TableAccess;
use gpushare_utils::pod::PodClass;
use gpushare_utils::priority::{NodePriority, PodPriority};

use crate::config::DeviceClasses;
use crate::context::Context;
use crate::driver::Timing;
use crate::mps::CorunSms;
use crate::sys::{CUevent, CUresult, CUstream};
use predict::{Arrivals, Spans};

mod batch;
mod gate;
mod latency;
mod predict;
mod tuning;
mod turns;
mod watcher;

use tuning::MAX_WINDOW;
pub(crate) use tuning::Tuning;

/// Latency threads tracked at once (further ones are covered by their stamps).
const TRACKERS: usize = 64;
/// A latency thread measures its queueing delay at most this often.
const QUEUE_SAMPLE_INTERVAL_NS: u64 = 1_000_000;
/// Queueing probes waiting for the GPU, at most.
const MAX_PROBES: usize = 64;
/// How often the watcher polls pending work.
const WATCH_POLL: Duration = Duration::from_micros(10);
/// A waiting batch thread spins (yielding) this long, then sleeps.
const SPIN_NS: u64 = 2_000_000;
const WAIT_SLEEP: Duration = Duration::from_micros(20);
/// A batch pod looks for the table (created by the first latency pod) at
/// most this often.
const LOOK_AGAIN_NS: u64 = 100_000_000;

/// Tracker events of latency threads, polled by the watcher: the event and
/// the device plus one. A module static, not a field: a thread's exit hands
/// its slot back from a thread-local destructor, which no context reaches.
static TRACKED: [(AtomicUsize, AtomicUsize); TRACKERS] =
    [const { (AtomicUsize::new(0), AtomicUsize::new(0)) }; TRACKERS];

/// This thread's tracker slot (latency) and in-flight ring (batch).
struct ThreadState {
    tracker: Cell<Option<(usize, usize)>>,
    probed_at_ns: Cell<u64>,
    /// Events after this thread's batch launches, and when each returned.
    ring: [Cell<usize>; MAX_WINDOW],
    launched_at: [Cell<u64>; MAX_WINDOW],
    head: Cell<usize>,
    /// How long its batch launches took to complete.
    spans: Spans,
}

impl Drop for ThreadState {
    fn drop(&mut self) {
        // The event is left to its context: destroying it needs the driver.
        if let Some((slot, _)) = self.tracker.get()
            && let Some((event, _)) = TRACKED.get(slot)
        {
            event.store(0, Ordering::Release);
        }
    }
}

thread_local! {
    static THREAD: ThreadState = const {
        ThreadState {
            tracker: Cell::new(None),
            probed_at_ns: Cell::new(0),
            ring: [const { Cell::new(0) }; MAX_WINDOW],
            launched_at: [const { Cell::new(0) }; MAX_WINDOW],
            head: Cell::new(0),
            spans: Spans::new(),
        }
    };
}

/// A launch as the classes see it: on `device`, into `stream`, at `now`
/// (the caller's clock read).
#[derive(Clone, Copy)]
pub(super) struct Launch<'t> {
    pub(super) device: usize,
    pub(super) stream: CUstream,
    pub(super) timing: Option<&'t Timing>,
    pub(super) now: u64,
}

/// What [`Priority::before`] decided for one launch.
#[derive(Debug, Clone, Copy)]
pub(super) enum Ticket {
    /// Nothing to do after the launch.
    Free,
    /// A batch launch in a bounded window: record its event after.
    Bounded,
    /// A latency launch on `device`: re-record the tracker after.
    Latency { device: usize },
}

/// A queueing probe: an event recorded just before a latency launch.
struct Probe {
    event: usize,
    device: usize,
    submitted_at: u64,
}

/// The pod's classes and the priority state of this process.
pub(crate) struct Priority {
    /// The pod's key in the node tables.
    pod_key: u64,
    classes: DeviceClasses,
    tuning: Tuning,
    /// How the node's table is mapped (created only by the node's creator).
    tables: TableAccess,
    /// The priority table's name in `/dev/shm`.
    name: String,
    table: OnceLock<NodePriority>,
    look_again_at_ns: AtomicU64,
    /// Under a hypervisor: the GPU's limits, where the class is.
    hypervisor_gpus: [OnceLock<Option<&'static GpuLimits>>; MAX_DEVICES],
    slots: [OnceLock<Option<&'static PodPriority>>; MAX_DEVICES],
    /// Devices this process launched on as a latency pod (bit per device).
    latency_devices: AtomicU32,
    /// Devices where this process counts itself in flight (bit per device).
    in_flight: AtomicU32,
    probes: ArrayQueue<Probe>,
    watcher: Once,
    watcher_thread: OnceLock<Thread>,
    watcher_parked: AtomicBool,
    /// Bumped by every latency launch, so the watcher never parks past one.
    generation: AtomicU64,
    /// Some device's configured class is latency.
    latency_configured: bool,
    /// Request starts per device (latency).
    arrivals: [Arrivals; MAX_DEVICES],
    /// This process's latest latency launch per device.
    launched_at: [AtomicU64; MAX_DEVICES],
    /// Set where this process is an MPS client of a co-run GPU: its latency
    /// launches are tracked only while a batch pod that waits for them is
    /// there (one that took the whole GPU); next to batch clients kept off
    /// the reserve its kernels already run beside theirs, and tracking
    /// would only cost it time.
    corun: OnceLock<CorunSms>,
    /// Per device, this pod's seat where its GPU takes turns.
    seats: turns::Seats,
}

impl Priority {
    /// `pod_key`: the pod's key in node tables ([`gpushare_utils::node_table::pod_key`]).
    /// `tables`: how the node's priority table is mapped, `name`: its name.
    pub(crate) fn new(
        classes: DeviceClasses,
        tuning: Tuning,
        pod_key: u64,
        tables: TableAccess,
        name: String,
    ) -> Self {
        Self {
            tables,
            name,
            latency_configured: classes.any_latency(),
            classes,
            tuning,
            pod_key,
            table: OnceLock::new(),
            look_again_at_ns: AtomicU64::new(0),
            hypervisor_gpus: [const { OnceLock::new() }; MAX_DEVICES],
            slots: [const { OnceLock::new() }; MAX_DEVICES],
            latency_devices: AtomicU32::new(0),
            in_flight: AtomicU32::new(0),
            probes: ArrayQueue::new(MAX_PROBES),
            watcher: Once::new(),
            watcher_thread: OnceLock::new(),
            watcher_parked: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            arrivals: [const { Arrivals::new() }; MAX_DEVICES],
            launched_at: [const { AtomicU64::new(0) }; MAX_DEVICES],
            corun: OnceLock::new(),
            seats: turns::Seats::new(),
        }
    }

    /// Marks this process an MPS client of a co-run GPU running on `sms`;
    /// set once, before the driver starts (a second call changes nothing).
    pub(super) fn join_corun(&self, sms: CorunSms) {
        let _ = self.corun.set(sms);
    }

    /// Whether this process is an MPS client of a co-run GPU.
    pub(super) fn is_corun(&self) -> bool {
        self.corun.get().is_some()
    }

    /// Whether launches on a device without a compute limit still take part
    /// in classes: a class is configured, or the hypervisor gives them
    /// (`hypervised`: its limits are in force).
    pub(super) fn engaged(&self, hypervised: bool) -> bool {
        !self.classes.is_empty() || hypervised || self.tuning.turn_us > 0
    }

    /// Whether classes cannot matter to a launch at `now`, for a pod that is
    /// [`classless_locally`](Self::classless_locally) without a hypervisor
    /// (no latency pod's table found): until it is time to look for one
    /// again (every [`LOOK_AGAIN_NS`]). The launch path of a pod without
    /// classes then costs one load here.
    #[inline]
    pub(super) fn dormant_at(&self, now: u64) -> bool {
        now < self.look_again_at_ns.load(Ordering::Relaxed)
    }

    /// Whether no class can matter unless a latency pod's table turns up,
    /// for a launch that knows no hypervisor's limits are in force: this pod
    /// is batch everywhere by its own configuration. Class holds are timed in
    /// microseconds, so where this is false launches read the precise clock.
    #[inline]
    pub(super) fn classless_locally(&self) -> bool {
        self.table.get().is_none() && !self.latency_configured && self.tuning.turn_us == 0
    }

    /// The pod's class on `device`: the hypervisor's when it sets the
    /// limits (read at every launch: it changes live), else the local one.
    fn class(&self, ctx: &'static Context, device: usize) -> PodClass {
        if ctx.hypervisor_limits().is_none() {
            return self.classes.resolve(device as u32);
        }
        let Some(cell) = self.hypervisor_gpus.get(device) else {
            return PodClass::Batch;
        };
        let gpu = cell.get_or_init(|| {
            let uuid = ctx.driver()?.device_uuid(device as i32)?;
            ctx.hypervisor_limits()?.find(&uuid)
        });
        gpu.map_or(PodClass::Batch, gpushare_utils::limits::GpuLimits::class)
    }

    /// The node's table: created by a latency pod, looked for by batch pods
    /// (at most every [`LOOK_AGAIN_NS`] while there is none).
    fn table(&self, now: u64, create: bool) -> Option<&NodePriority> {
        if let Some(table) = self.table.get() {
            return Some(table);
        }
        if !create && now < self.look_again_at_ns.load(Ordering::Relaxed) {
            return None;
        }
        self.look_again_at_ns
            .store(now.saturating_add(LOOK_AGAIN_NS), Ordering::Relaxed);
        let name = self.name.as_str();
        // Batch pods only look; latency pods create the table when this
        // process may create node tables at all.
        let access = match &self.tables {
            TableAccess::Create { trust, .. } if !create => TableAccess::Open(trust.clone()),
            access => access.clone(),
        };
        match NodePriority::open_named(name, &access) {
            Ok(table) => {
                tracing::debug!(name, create, "priority table mapped");
                // Two threads may both map it; the second mapping is dropped
                // unused (a table is never unmapped).
                let _ = self.table.set(table);
                self.table.get()
            }
            Err(error) => {
                if create {
                    tracing::warn!(%error, "no priority table: this latency pod goes unseen");
                }
                None
            }
        }
    }

    /// This pod's counters on `device`.
    fn slot(
        &self,
        table: &NodePriority,
        device: usize,
        class: PodClass,
    ) -> Option<&'static PodPriority> {
        *self
            .slots
            .get(device)?
            .get_or_init(|| table.slot(device, self.pod_key, class, monotonic_ns()))
    }

    /// Before `launch`: a latency launch stamps its device; a batch launch
    /// waits while a latency pod is active and for its own launches beyond
    /// the window.
    pub(super) fn before(&'static self, ctx: &'static Context, launch: Launch<'_>) -> Ticket {
        match self.class(ctx, launch.device) {
            PodClass::Latency => self.before_latency(ctx, launch),
            PodClass::Batch if self.corun.get() == Some(&CorunSms::OffReserve) => Ticket::Free,
            PodClass::Batch => self.before_batch(ctx, launch.device, launch.timing, launch.now),
        }
    }

    /// After the launch of `ticket` into `stream` returned `result`.
    #[inline]
    pub(super) fn after(
        &'static self,
        ticket: Ticket,
        stream: CUstream,
        timing: Option<&Timing>,
        result: CUresult,
    ) {
        let Some(timing) = timing.filter(|_| result.is_success()) else {
            return;
        };
        match ticket {
            Ticket::Free => {}
            Ticket::Bounded => self.after_batch(timing, stream),
            Ticket::Latency { device } => self.after_latency(timing, device, stream),
        }
    }
}

/// `event` (0: a new one) recorded on `stream`; a failed record (another
/// context) drops the event and tries once with a new one. The events are
/// only queried: no timing, which makes records cheaper on real drivers.
fn recorded(timing: &Timing, event: usize, stream: CUstream) -> Option<usize> {
    if event != 0 && event != usize::MAX {
        if timing.record(event as CUevent, stream) {
            return Some(event);
        }
        timing.destroy(event as CUevent);
    }
    let fresh = timing.create_sync_event()?;
    if timing.record(fresh, stream) {
        Some(fresh as usize)
    } else {
        timing.destroy(fresh);
        None
    }
}

/// Waits until `done`, or until `deadline`: spinning (yielding) for
/// [`SPIN_NS`], then in short sleeps.
fn wait_until(deadline: u64, mut done: impl FnMut() -> bool) {
    let start = monotonic_ns();
    while !done() {
        let now = monotonic_ns();
        if now >= deadline {
            return;
        }
        if now.saturating_sub(start) < SPIN_NS {
            std::thread::yield_now();
        } else {
            std::thread::sleep(WAIT_SLEEP);
        }
    }
}

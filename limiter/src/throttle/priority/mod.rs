//! Priority classes at the launch: a `latency` pod keeps its latency next to
//! `batch` pods (the default) that would fill the GPU.
//!
//! 1. A latency pod's launch stamps "latency work at t" on its device's line
//!    of the node's priority table ([`NodePriority`]): a load and a store.
//!    After the launch it re-records its thread's tracker event on the
//!    stream; a watcher thread polls the trackers every ~10 µs and keeps the
//!    stamp fresh while any is pending, so work queued behind other pods'
//!    kernels counts as active however long it waits. The watcher also
//!    stamps a heartbeat while the process lives.
//! 2. A batch pod's launch loads the line ([`gate`]): no latency pod on the
//!    device costs those two loads. While a latency pod is present, the batch
//!    thread keeps at most [`WINDOW_VARIABLE`] launches in flight (an event
//!    after each, waited for before the next), so a latency kernel finds at
//!    most that much batch work in front of it (the GPU time-slices between
//!    processes' contexts, so queued batch work would otherwise cost it up to
//!    a timeslice). While the latency pod is active (stamped within
//!    [`HOLD_VARIABLE`]), the batch launch waits (trap-and-wait), spinning
//!    then sleeping briefly, and goes as soon as the stamp ages out: the
//!    batch pod gets the whole GPU back at once.
//! 3. Held time (batch) and the queueing delay of sampled launches (latency:
//!    an event recorded before the launch, polled by the watcher: from the
//!    launch call until the GPU reached it) are added to the pod's counters
//!    in the table, which the hypervisor reports.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};
use std::thread::Thread;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use gpushare_utils::bucket::monotonic_ns;
use gpushare_utils::config::{DeviceClasses, MAX_DEVICES, PodClass};
use gpushare_utils::limits::GpuLimits;
use gpushare_utils::priority::{
    DEFAULT_HOLD_NS, Gate, NodePriority, PRIORITY_REGION, PodPriority, STARVATION_NS,
};

use crate::context::Context;
use crate::driver::Timing;
use crate::sys::{CUevent, CUresult, CUstream};

mod watcher;

/// Names another priority table (tests: one per test).
pub const PRIORITY_REGION_VARIABLE: &str = "GPUSHARE_PRIORITY_REGION";
/// Microseconds a batch launch is held after a latency pod's last launch or
/// last work seen in flight; default [`DEFAULT_HOLD_NS`].
pub const HOLD_VARIABLE: &str = "CUDA_LIMITER_PRIORITY_HOLD_US";
/// Launches a batch thread keeps in flight while a latency pod is on its
/// device, 1 to [`MAX_WINDOW`]; default 1.
pub const WINDOW_VARIABLE: &str = "CUDA_LIMITER_PRIORITY_WINDOW";
/// Most launches a batch thread may keep in flight next to a latency pod.
pub const MAX_WINDOW: usize = 8;
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
/// Longest a batch launch waits for its own earlier one (its stream may wait
/// on something this thread has yet to do).
const IN_FLIGHT_WAIT_MAX_NS: u64 = 50_000_000;
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
    ring: [Cell<usize>; MAX_WINDOW],
    head: Cell<usize>,
    probed_at_ns: Cell<u64>,
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
            ring: [const { Cell::new(0) }; MAX_WINDOW],
            head: Cell::new(0),
            probed_at_ns: Cell::new(0),
        }
    };
}

/// How the classes are tuned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tuning {
    pub hold_ns: u64,
    pub window: usize,
}

impl Tuning {
    /// From [`HOLD_VARIABLE`] and [`WINDOW_VARIABLE`]; a bad value is a
    /// configuration error.
    pub fn from_env() -> Result<Self, String> {
        Self::from_values(
            std::env::var(HOLD_VARIABLE).ok().as_deref(),
            std::env::var(WINDOW_VARIABLE).ok().as_deref(),
        )
    }

    fn from_values(hold_us: Option<&str>, window: Option<&str>) -> Result<Self, String> {
        let bad = |name: &str, text: &str, expected: &str| {
            format!("cuda-limiter: configuration error: {name}={text:?} is not {expected}")
        };
        let hold_ns = match hold_us {
            None => DEFAULT_HOLD_NS,
            Some(text) => text
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|us| (1..=100_000).contains(us))
                .ok_or_else(|| bad(HOLD_VARIABLE, text, "a number of µs from 1 to 100000"))?
                .saturating_mul(1_000),
        };
        let window = match window {
            None => 1,
            Some(text) => text
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_WINDOW).contains(n))
                .ok_or_else(|| bad(WINDOW_VARIABLE, text, "a number of launches from 1 to 8"))?,
        };
        Ok(Self { hold_ns, window })
    }
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
pub struct Priority {
    /// The pod's key in the node tables.
    pod_key: u64,
    classes: DeviceClasses,
    tuning: Tuning,
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
}

// SAFETY: the event handles queued are driver handles, usable from any
// thread; everything else is atomics and locks.
unsafe impl Sync for Priority {}
// SAFETY: as above.
unsafe impl Send for Priority {}

impl Priority {
    /// `pod_key`: the pod's key in node tables ([`gpushare_utils::activity::pod_key`]).
    pub fn new(classes: DeviceClasses, tuning: Tuning, pod_key: u64) -> Self {
        Self {
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
        }
    }

    /// Whether launches on a device without a compute limit still take part
    /// in classes: a class is configured, or the hypervisor gives them.
    pub(super) fn engaged(&self, ctx: &'static Context) -> bool {
        !self.classes.is_empty() || ctx.hypervisor().is_some()
    }

    /// Whether classes cannot matter to a launch at `now`: this pod is batch
    /// everywhere by its own configuration, and no latency pod's table has
    /// been found (it is looked for again every [`LOOK_AGAIN_NS`]). The
    /// launch path of a pod without classes then costs two loads here.
    #[inline]
    pub(super) fn dormant(&self, ctx: &'static Context, now: u64) -> bool {
        self.table.get().is_none()
            && now < self.look_again_at_ns.load(Ordering::Relaxed)
            && !self.latency_configured
            && ctx.hypervisor().is_none()
    }

    /// The pod's class on `device`: the hypervisor's when it sets the
    /// limits (read at every launch: it changes live), else the local one.
    fn class(&self, ctx: &'static Context, device: usize) -> PodClass {
        if ctx.hypervisor().is_none() {
            return self.classes.resolve(device as u32);
        }
        let Some(cell) = self.hypervisor_gpus.get(device) else {
            return PodClass::Batch;
        };
        let gpu = cell.get_or_init(|| {
            let uuid = ctx.driver()?.device_uuid(device as i32)?;
            ctx.hypervisor_limits()?.find(&uuid)
        });
        gpu.map_or(PodClass::Batch, |gpu| gpu.class())
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
        let name =
            std::env::var(PRIORITY_REGION_VARIABLE).unwrap_or_else(|_| PRIORITY_REGION.to_owned());
        match NodePriority::open_named(&name, create) {
            Ok(table) => {
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

    /// Before a launch on `device` into `stream` at `now` (the caller's
    /// clock read): a latency launch stamps its device; a batch launch waits
    /// while a latency pod is active and for its own launches beyond the
    /// window.
    pub(super) fn before(
        &'static self,
        ctx: &'static Context,
        device: usize,
        stream: CUstream,
        timing: Option<&Timing>,
        now: u64,
    ) -> Ticket {
        match self.class(ctx, device) {
            PodClass::Latency => {
                let Some(table) = self.table(now, true) else {
                    return Ticket::Free;
                };
                if let Some(line) = table.device(device) {
                    let bit = 1 << (device % 32);
                    if self.in_flight.load(Ordering::Relaxed) & bit == 0
                        && self.in_flight.fetch_or(bit, Ordering::AcqRel) & bit == 0
                    {
                        line.enter_flight(now);
                    } else {
                        line.stamp_active(now);
                    }
                    line.launches.fetch_add(1, Ordering::Relaxed);
                }
                if let Some(timing) = timing {
                    self.probe_queue(timing, table, device, stream, now);
                }
                self.latency_devices
                    .fetch_or(1 << (device % 32), Ordering::Relaxed);
                self.start_watcher(ctx);
                Ticket::Latency { device }
            }
            PodClass::Batch => {
                let Some(table) = self.table(now, false) else {
                    return Ticket::Free;
                };
                match table.gate(device, now, self.tuning.hold_ns) {
                    Gate::Free => Ticket::Free,
                    gate => {
                        if let Some(timing) = timing {
                            self.wait_in_flight(timing);
                        }
                        if gate == Gate::Hold {
                            self.hold(table, device, now);
                        }
                        Ticket::Bounded
                    }
                }
            }
        }
    }

    /// After the launch of `ticket` into `stream` returned `result`.
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
            Ticket::Bounded => THREAD.with(|thread| {
                let head = thread.head.get() % self.tuning.window;
                let slot = &thread.ring[head];
                if let Some(event) = recorded(timing, slot.get(), stream) {
                    slot.set(event);
                    thread.head.set(head + 1);
                }
            }),
            Ticket::Latency { device } => {
                THREAD.with(|thread| self.track(timing, thread, device, stream));
                self.generation.fetch_add(1, Ordering::SeqCst);
                if self.watcher_parked.load(Ordering::SeqCst)
                    && let Some(watcher) = self.watcher_thread.get()
                {
                    watcher.unpark();
                }
            }
        }
    }

    /// Re-records this thread's tracker event after its latency launch.
    fn track(&self, timing: &Timing, thread: &ThreadState, device: usize, stream: CUstream) {
        let (slot, event) = match thread.tracker.get() {
            Some(tracker) => tracker,
            None => {
                let Some(slot) = TRACKED.iter().position(|(event, _)| {
                    event
                        .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
                        .is_ok()
                }) else {
                    return; // every slot taken: the launch stamps cover this thread
                };
                (slot, 0)
            }
        };
        let Some(event) = recorded(timing, event, stream) else {
            TRACKED[slot].0.store(0, Ordering::Release);
            thread.tracker.set(None);
            return;
        };
        TRACKED[slot].1.store(device + 1, Ordering::Relaxed);
        TRACKED[slot].0.store(event, Ordering::Release);
        thread.tracker.set(Some((slot, event)));
    }

    /// Records an event before a latency launch, at most every
    /// [`QUEUE_SAMPLE_INTERVAL_NS`] per thread, for the watcher to time.
    fn probe_queue(
        &self,
        timing: &Timing,
        table: &NodePriority,
        device: usize,
        stream: CUstream,
        now: u64,
    ) {
        let due = THREAD.with(|thread| {
            let due = now.saturating_sub(thread.probed_at_ns.get()) >= QUEUE_SAMPLE_INTERVAL_NS;
            if due {
                thread.probed_at_ns.set(now);
            }
            due
        });
        if !due || self.probes.is_full() || self.slot(table, device, PodClass::Latency).is_none() {
            return;
        }
        if let Some(event) = recorded(timing, 0, stream) {
            let probe = Probe {
                event,
                device,
                submitted_at: monotonic_ns(),
            };
            if let Err(probe) = self.probes.push(probe) {
                timing.destroy(probe.event as CUevent);
            }
        }
    }

    /// Waits until this thread has fewer than the window's launches in
    /// flight: the oldest of its ring is done.
    fn wait_in_flight(&self, timing: &Timing) {
        let oldest =
            THREAD.with(|thread| thread.ring[thread.head.get() % self.tuning.window].get());
        if oldest == 0 {
            return;
        }
        let done = || !matches!(timing.query(oldest as CUevent), Ok(false));
        wait_until(monotonic_ns().saturating_add(IN_FLIGHT_WAIT_MAX_NS), done);
    }

    /// Holds a batch launch while a latency pod on `device` is active (at
    /// most [`STARVATION_NS`]); counts the time held.
    fn hold(&self, table: &NodePriority, device: usize, since: u64) {
        let hold_ns = self.tuning.hold_ns;
        wait_until(since.saturating_add(STARVATION_NS), || {
            table.gate(device, monotonic_ns(), hold_ns) != Gate::Hold
        });
        let held = monotonic_ns().saturating_sub(since);
        if let Some(slot) = self.slot(table, device, PodClass::Batch) {
            slot.add_hold(held);
        }
        tracing::trace!(device, held, "batch launch held");
    }
}

/// `event` (0: a new one) recorded on `stream`; a failed record (another
/// context) drops the event and tries once with a new one.
fn recorded(timing: &Timing, event: usize, stream: CUstream) -> Option<usize> {
    if event != 0 && event != usize::MAX {
        if timing.record(event as CUevent, stream) {
            return Some(event);
        }
        timing.destroy(event as CUevent);
    }
    let fresh = timing.create_event()?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_defaults_and_bounds() {
        assert_eq!(
            Tuning::from_values(None, None),
            Ok(Tuning {
                hold_ns: DEFAULT_HOLD_NS,
                window: 1
            })
        );
        assert_eq!(
            Tuning::from_values(Some(" 50 "), Some("2")),
            Ok(Tuning {
                hold_ns: 50_000,
                window: 2
            })
        );
        for (hold, window) in [
            (Some("0"), None),
            (Some("x"), None),
            (None, Some("0")),
            (None, Some("9")),
        ] {
            assert!(
                Tuning::from_values(hold, window).is_err(),
                "{hold:?} {window:?}"
            );
        }
        assert_eq!(
            Tuning::from_values(None, Some("many")),
            Err("cuda-limiter: configuration error: CUDA_LIMITER_PRIORITY_WINDOW=\"many\" is not a number of launches from 1 to 8".to_owned())
        );
    }
}

//! Swap: the hypervisor may checkpoint an idle pod's processes to host
//! memory (NVIDIA's `cuCheckpointProcess*`, called from its own process)
//! and restore them later. While its pod is anywhere but on its GPUs, a
//! process's calls that need the GPU are held here, before the driver
//! (which would hold them too, where nobody asks for the pod back).
//!
//! 1. Every such call (launches, allocations and frees, contexts, module
//!    loads, copies, sets, synchronisations and queries) passes the
//!    [`SwapGate`]: it stamps the pod's last call in its ledger
//!    ([`PodLedger::touch`]: a load, a store at most once a millisecond),
//!    then reads the pod's residency from its read-only limits. On the
//!    coarse clock: the hypervisor only compares the stamp with an idle
//!    time of seconds. It writes the residency before it reads the stamp,
//!    and both sides' accesses are sequentially consistent, so it either
//!    sees the call and leaves the pod resident, or the call sees the swap.
//! 2. A call that finds the pod elsewhere waits (one line per episode): one
//!    thread of the process at a time asks the hypervisor for the pod
//!    (`POST /api/v1/swap-in`, answered once it is back), and asks again,
//!    backing off from [`ASK_BACKOFF_MIN`] to [`ASK_BACKOFF_MAX`], while
//!    the hypervisor cannot be reached or says the pod is not back; the
//!    process's other waiting threads watch the residency. Every thread
//!    goes on once the residency says resident, never before, and none
//!    holds a lock of the limiter's while it waits.
//! 3. Without the hypervisor's limits (local mode) there is no swap: the
//!    gate is a load and a branch.
//!
//! The waits are counted and printed at exit (`CUDA_LIMITER_LOG=info`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use gpushare_utils::clock::{monotonic_coarse_ns, monotonic_ns};
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::{PodLimits, Residency};
use http_bidir_comm::Backoff;
use tracing::level_filters::LevelFilter;

use crate::context::{AtExit, Context, register_at_exit};
use crate::hypervisor::Link;

/// A thread asking for the pod back asks again after this, doubling...
const ASK_BACKOFF_MIN: Duration = Duration::from_millis(1);
/// ...up to this, while the hypervisor cannot be reached or says no.
const ASK_BACKOFF_MAX: Duration = Duration::from_millis(100);
/// A thread that waits while another asks looks at the residency again
/// after [`ASK_BACKOFF_MIN`], doubling up to this: it goes on within this
/// of the pod's return.
const WATCH_MAX: Duration = Duration::from_millis(10);
const NS_PER_MS: u64 = 1_000_000;

/// The pod the gate watches: its limits (the residency), its ledger (the
/// stamp) and the hypervisor that brings it back (`None`: limits published
/// without a hypervisor configured here, so the residency is only watched).
struct Watched {
    limits: &'static PodLimits,
    /// The residency in `limits`, as [`PodLimits::residency`] loads it (and
    /// the code that means resident): read here without a call into
    /// `gpushare-utils`, which the compiler does not inline.
    residency: &'static AtomicU32,
    resident_code: u32,
    ledger: Option<&'static PodLedger>,
    link: Option<&'static Link>,
}

impl Watched {
    fn new(
        limits: &'static PodLimits,
        ledger: Option<&'static PodLedger>,
        link: Option<&'static Link>,
    ) -> Self {
        Self {
            limits,
            residency: &limits.region().header.residency,
            resident_code: Residency::Resident.code(),
            ledger,
            link,
        }
    }

    /// Stamps a call of the pod, then says whether the pod is on its GPUs.
    #[inline(always)]
    fn resident(&self) -> bool {
        if let Some(ledger) = self.ledger {
            ledger.touch(monotonic_coarse_ns() / NS_PER_MS);
        }
        self.residency.load(Ordering::SeqCst) == self.resident_code
    }
}

/// Where calls wait for a swapped-out pod; see the module documentation.
#[derive(Default)]
pub(crate) struct SwapGate {
    /// The pod, once known to be under the hypervisor's limits (`None`
    /// inside: no swap here).
    watched: OnceLock<Option<Watched>>,
    /// A thread of this process is asking the hypervisor for the pod.
    asking: AtomicBool,
    /// Threads waiting now: the first of an episode says so.
    waiting: AtomicU32,
    waits: SwapWaits,
    /// The exit summary is registered.
    summary: AtomicBool,
}

/// What swaps cost this process, for the exit summary.
#[derive(Default)]
struct SwapWaits {
    /// Calls that waited.
    calls: AtomicU64,
    /// Their time waited, summed.
    waited_ns: AtomicU64,
    /// `POST /api/v1/swap-in` sent, and those that failed or were answered
    /// with the pod not back.
    requests: AtomicU64,
    failed_requests: AtomicU64,
}

impl SwapGate {
    /// Returns once the pod is resident (at once, but for a stamp and a
    /// load, when it is); waits while it is not. The launch path's cost.
    #[inline(always)]
    pub(crate) fn enter(&'static self, ctx: &'static Context) {
        let watched = match self.watched.get() {
            Some(watched) => watched,
            None => self.watch(ctx),
        };
        if let Some(pod) = watched
            && !pod.resident()
        {
            self.wait(pod);
        }
    }

    /// What to watch, decided once the grant is: the pod under the
    /// hypervisor's limits, or nothing. Nothing yet before the grant is
    /// decided (before `cuInit`, whose driver call comes first).
    #[cold]
    #[inline(never)]
    fn watch(&'static self, ctx: &'static Context) -> &'static Option<Watched> {
        if !ctx.grant_decided() {
            return &None;
        }
        self.watched.get_or_init(|| {
            let limits = ctx.hypervisor_limits()?;
            Some(Watched::new(limits, ctx.ledger(), ctx.hypervisor()))
        })
    }

    /// Holds the calling thread until the pod is resident again.
    #[cold]
    #[inline(never)]
    fn wait(&'static self, pod: &Watched) {
        let start = monotonic_ns();
        if self.waiting.fetch_add(1, Ordering::Relaxed) == 0 {
            let residency = pod.limits.residency().as_str();
            tracing::info!(
                residency,
                "the pod is not on its GPUs; CUDA calls wait for the hypervisor to bring it back"
            );
        }
        let mut asks = Backoff::new(ASK_BACKOFF_MIN, ASK_BACKOFF_MAX, start);
        let mut watches = Backoff::new(ASK_BACKOFF_MIN, WATCH_MAX, start);
        let mut failed = false;
        while !pod.resident() {
            let pause = match pod
                .link
                .and_then(|link| self.try_ask().map(|turn| (link, turn)))
            {
                Some((link, _turn)) => {
                    self.waits.requests.fetch_add(1, Ordering::Relaxed);
                    match link.swap_in() {
                        Ok(()) if pod.resident() => break,
                        // Back, but gone again (or this process's view of
                        // the limits is stale): asked again, not at once.
                        Ok(()) => asks.next_delay(),
                        Err(error) => {
                            self.waits.failed_requests.fetch_add(1, Ordering::Relaxed);
                            if failed {
                                tracing::debug!(%error, "the hypervisor did not bring the pod back, again");
                            } else {
                                tracing::warn!(%error, "the hypervisor did not bring the pod back; asking again");
                                failed = true;
                            }
                            asks.next_delay()
                        }
                    }
                }
                // Another thread asks, or there is no one to ask.
                None if pod.link.is_some() => watches.next_delay(),
                None => asks.next_delay(),
            };
            std::thread::sleep(pause);
        }
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        let waited = monotonic_ns().saturating_sub(start);
        self.waits.calls.fetch_add(1, Ordering::Relaxed);
        self.waits.waited_ns.fetch_add(waited, Ordering::Relaxed);
        tracing::debug!(waited_ns = waited, "the pod is back; the call goes on");
        if !self.summary.swap(true, Ordering::Relaxed)
            && LevelFilter::current() >= LevelFilter::INFO
            && !register_at_exit(self)
        {
            tracing::debug!("cannot register the exit handler: no swap summary");
        }
    }

    /// This thread's turn to ask the hypervisor, if no other thread of the
    /// process has it.
    fn try_ask(&self) -> Option<Turn<'_>> {
        self.asking
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Turn(&self.asking))
    }
}

/// The turn to ask the hypervisor for the pod, given up on drop.
struct Turn<'a>(&'a AtomicBool);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl AtExit for SwapGate {
    const WHAT: &'static str = "while printing the swap summary";

    /// Prints how often and how long this process's calls waited for its
    /// pod to come back. Printed directly: at exit, `tracing`'s
    /// thread-locals are gone.
    fn at_exit(&'static self) {
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        eprintln!(
            "[cuda-limiter pid={}] swap summary: waits={} waited_ns={} swap_in_requests={} failed_requests={}",
            std::process::id(),
            load(&self.waits.calls),
            load(&self.waits.waited_ns),
            load(&self.waits.requests),
            load(&self.waits.failed_requests),
        );
    }
}

#[cfg(test)]
mod tests {
    use gpushare_utils::shm::{self, Creation};

    use super::*;

    /// A pod's limits and ledger in `/dev/shm`, removed on drop.
    struct Pod {
        name: String,
        limits: &'static PodLimits,
        ledger: &'static PodLedger,
    }

    impl Pod {
        fn new(test: &str) -> Self {
            let name = format!("swap-gate-{test}-{}", std::process::id());
            let limits = PodLimits::create_or_adopt(&name, &Creation::default()).unwrap();
            let ledger = PodLedger::open(&name).unwrap();
            Self {
                name,
                limits: Box::leak(Box::new(limits)),
                ledger: Box::leak(Box::new(ledger)),
            }
        }

        fn watched(&self) -> Watched {
            Watched::new(self.limits, Some(self.ledger), None)
        }
    }

    impl Drop for Pod {
        fn drop(&mut self) {
            let _ = shm::unlink(&PodLimits::name_of(&self.name));
            let _ = shm::unlink(&PodLedger::name_of(&self.name));
        }
    }

    fn gate() -> &'static SwapGate {
        Box::leak(Box::default())
    }

    #[test]
    fn a_call_stamps_the_pod_and_passes_while_it_is_resident() {
        let pod = Pod::new("resident");
        assert_eq!(pod.ledger.last_call_ms(), 0);
        assert!(pod.watched().resident());
        let stamped = pod.ledger.last_call_ms();
        assert!(stamped > 0, "stamped");
        assert!(
            stamped <= monotonic_ns() / NS_PER_MS,
            "on the coarse clock, never ahead"
        );
        for residency in [
            Residency::SwappingOut,
            Residency::Swapped,
            Residency::SwappingIn,
            Residency::Resident,
        ] {
            pod.limits.set_residency(residency);
            assert_eq!(
                pod.watched().resident(),
                pod.limits.residency() == Residency::Resident,
                "the gate reads what PodLimits::residency says: {residency:?}"
            );
        }
        pod.limits.set_residency(Residency::SwappingOut);
        assert!(
            !pod.watched().resident(),
            "stamped, and told the pod is leaving"
        );
    }

    #[test]
    fn a_call_waits_until_the_pod_is_back_and_is_counted() {
        let pod = Pod::new("wait");
        let gate = gate();
        pod.limits.set_residency(Residency::Swapped);
        let watched = pod.watched();
        let waiter = std::thread::spawn(move || gate.wait(&watched));
        // The wait's clock starts in the waiter thread, which a loaded
        // machine may run late: measured from when it is seen waiting.
        while gate.waiting.load(Ordering::Relaxed) == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let seen_waiting = monotonic_ns();
        std::thread::sleep(Duration::from_millis(30));
        assert!(!waiter.is_finished(), "held while swapped");
        assert_eq!(gate.waiting.load(Ordering::Relaxed), 1);
        pod.limits.set_residency(Residency::SwappingIn);
        std::thread::sleep(Duration::from_millis(30));
        assert!(!waiter.is_finished(), "held while swapping in");
        let before = pod.ledger.last_call_ms();
        let held_for = monotonic_ns() - seen_waiting;
        pod.limits.set_residency(Residency::Resident);
        waiter.join().unwrap();
        assert_eq!(gate.waiting.load(Ordering::Relaxed), 0);
        assert_eq!(gate.waits.calls.load(Ordering::Relaxed), 1);
        assert!(held_for >= 60_000_000);
        let waited = gate.waits.waited_ns.load(Ordering::Relaxed);
        assert!(
            waited >= held_for,
            "counted {waited} ns, held at least {held_for} ns"
        );
        assert_eq!(
            gate.waits.requests.load(Ordering::Relaxed),
            0,
            "no hypervisor to ask"
        );
        assert!(
            pod.ledger.last_call_ms() >= before,
            "a waiting call keeps the pod stamped"
        );
    }

    #[test]
    fn one_thread_at_a_time_has_the_turn_to_ask() {
        let gate = gate();
        let turn = gate.try_ask();
        assert!(turn.is_some());
        assert!(gate.try_ask().is_none(), "taken");
        drop(turn);
        assert!(gate.try_ask().is_some(), "given up on drop");
    }

    #[test]
    fn local_mode_watches_nothing() {
        let gate = gate();
        gate.watched.get_or_init(|| None);
        let context: &'static Context = Box::leak(Box::new(Context::new(
            gpushare_utils::pod::PodId::new("swap-gate-local").unwrap(),
            None,
            crate::context::LocalLimits::None,
            Duration::ZERO,
            None,
        )));
        gate.enter(context);
        assert_eq!(gate.waits.calls.load(Ordering::Relaxed), 0);
    }
}

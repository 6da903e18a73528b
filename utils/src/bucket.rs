//! A pod's compute budget on one GPU: a token bucket of GPU-busy nanoseconds
//! refilled at the pod's share of wall time, made of atomics so that it can
//! live in shared memory and serve every process of the pod.
//!
//! Why GPU time and not launch counts: kernels differ by orders of magnitude
//! in length, so only time makes "L% of the GPU" mean the same for a loop of
//! 50 µs kernels and one of 2 ms kernels. Each launch is charged its price
//! in GPU time when it is admitted (the caller measures kernels and keeps
//! the prices); when a measurement settles it, the difference is
//! [corrected](ComputeBucket::correct). The bucket holds at most its depth
//! (the burst a pod may take after idling: [`CAPACITY_NS`], or up to
//! [`MAX_CAPACITY_NS`] where its view [says so](Bucket::with_capacity)) and
//! never falls below [`DEBT_FLOOR_NS`].
//!
//! Admission is lock-free: a load and a subtraction when budget is there,
//! plus a compare-and-swap every [`REFILL_BATCH_NS`] to refill. A launch that
//! finds none is told how long to wait for it.

pub use crate::clock::monotonic_ns;
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

/// Parts per million of wall time in 100%.
pub const PPM: u64 = 1_000_000;
/// Most GPU time a pod may bank while it does not launch: a bucket's depth,
/// unless its view is given a deeper one.
pub const CAPACITY_NS: i64 = 5_000_000;
/// The deepest a bucket's view may be given (a GPU's longest turn).
pub const MAX_CAPACITY_NS: i64 = 100_000_000;
/// Least the bucket may hold: corrections beyond this are forgiven.
pub const DEBT_FLOOR_NS: i64 = -500_000_000;
/// Refills happen at most this often, so that admission rarely writes the clock.
pub const REFILL_BATCH_NS: u64 = 20_000;
/// A bucket with tokens to spare is refilled at least this often.
pub const REFILL_MAX_AGE_NS: u64 = 1_000_000;
/// Longest single wait before the bucket is looked at again (limits can change).
pub const MAX_WAIT: Duration = Duration::from_millis(2);

/// What the pod's processes update in a bucket: its tokens and counters.
/// Lives in the pod's writable region. Zeroed memory is a valid, empty state.
#[repr(C)]
#[derive(Debug, Default)]
pub struct BucketState {
    /// Local elastic mode only: non-zero while no other pod needs the GPU.
    /// Ignored while the limits are managed by a hypervisor.
    pub uncontended: AtomicU32,
    /// Threads currently waiting for budget.
    pub waiting: AtomicU32,
    /// GPU nanoseconds available; negative is debt.
    pub tokens_ns: AtomicI64,
    /// Monotonic time of the last refill.
    pub refilled_at_ns: AtomicU64,
    /// GPU nanoseconds charged so far (prices plus corrections).
    pub charged_ns: AtomicU64,
    /// Launches admitted so far.
    pub launches: AtomicU64,
    /// GPU nanoseconds earned or credited beyond the bucket's depth, dropped:
    /// what a pod idle (or between bursts longer than the bucket) did not
    /// use. A stretch in which nothing refilled the bucket because the pod
    /// was suspended or unlimited counts too, at the next refill. Zero in
    /// buckets made before it was counted.
    pub forfeited_ns: AtomicU64,
}

/// What decides a bucket: the share, the elastic ceiling, suspension. In
/// hypervisor mode these live in the pod's read-only limits object
/// ([`crate::limits`]), so the pod cannot raise them; in local mode, next to
/// the state, set from each process's configuration.
#[repr(C)]
#[derive(Debug, Default)]
pub struct BucketLimits {
    /// The pod's share in parts per million of wall time; 0 = unlimited.
    pub rate_ppm: AtomicU32,
    /// Elastic ceiling in ppm (≥ rate); equal to the rate for a fixed share.
    pub ceiling_ppm: AtomicU32,
    /// Non-zero while the pod is suspended: every launch waits.
    pub suspended: AtomicU32,
    /// Non-zero while a node hypervisor sets the rate.
    pub managed: AtomicU32,
}

const _: () = assert!(size_of::<BucketState>() == 48);
const _: () = assert!(size_of::<BucketLimits>() == 16);

impl BucketLimits {
    /// Sets the share and the elastic ceiling, in percent (0 or 100 = unlimited).
    pub fn configure(&self, percent: u8, ceiling_percent: u8) {
        let rate = percent_to_ppm(percent);
        // A ceiling of 100% is kept as such: while uncontended, no limit.
        let ceiling = match ceiling_percent.max(percent) {
            100.. => PPM as u32,
            ceiling => percent_to_ppm(ceiling).max(rate),
        };
        self.rate_ppm.store(rate, Ordering::Release);
        self.ceiling_ppm.store(ceiling, Ordering::Release);
    }
}

/// One pod's compute budget on one GPU: its state (written by the pod) and
/// its limits (read-only to the pod under a hypervisor), which may sit in two
/// mappings, seen with a depth. Derefs to the state, so `bucket.waiting` is
/// the shared counter.
#[derive(Debug, Clone, Copy)]
pub struct Bucket<'a> {
    state: &'a BucketState,
    limits: &'a BucketLimits,
    /// The most the bucket holds, as this view adds to it.
    capacity_ns: i64,
}

/// A bucket over mappings that live as long as the process (the limiter's).
pub type ComputeBucket = Bucket<'static>;

impl<'a> std::ops::Deref for Bucket<'a> {
    type Target = BucketState;

    fn deref(&self) -> &BucketState {
        self.state
    }
}

/// What a launch may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Go: its cost has been charged.
    Pass,
    /// No budget: look again after this long.
    Wait(Duration),
}

impl<'a> Bucket<'a> {
    /// The bucket made of `state` and `limits`, [`CAPACITY_NS`] deep.
    pub fn new(state: &'a BucketState, limits: &'a BucketLimits) -> Self {
        Self {
            state,
            limits,
            capacity_ns: CAPACITY_NS,
        }
    }

    /// The same bucket seen `capacity_ns` deep, from [`CAPACITY_NS`] to
    /// [`MAX_CAPACITY_NS`]: what refills and credits through this view add
    /// up to. A pod whose GPU takes turns banks a turn's worth while others
    /// hold it, so that it can use its turn; every process of the pod
    /// should see one depth (a refill by a shallower view drops the rest).
    #[must_use]
    pub fn with_capacity(self, capacity_ns: i64) -> Self {
        Self {
            capacity_ns: capacity_ns.clamp(CAPACITY_NS, MAX_CAPACITY_NS),
            ..self
        }
    }

    /// The most this view lets the bucket hold.
    pub fn capacity_ns(&self) -> i64 {
        self.capacity_ns
    }

    /// The limits in force.
    pub fn limits(&self) -> &'a BucketLimits {
        self.limits
    }

    /// The shared state.
    pub fn state(&self) -> &'a BucketState {
        self.state
    }

    /// Sets the share and the elastic ceiling, in percent (0 or 100 =
    /// unlimited); see [`BucketLimits::configure`].
    pub fn configure(&self, percent: u8, ceiling_percent: u8) {
        self.limits.configure(percent, ceiling_percent);
    }

    /// Whether launches are metered at all: a rate, or suspension.
    pub fn is_limited(&self) -> bool {
        self.limits.rate_ppm.load(Ordering::Relaxed) != 0
            || self.limits.suspended.load(Ordering::Relaxed) != 0
    }

    /// The rate in force: the ceiling while uncontended (local elastic mode
    /// only: under a hypervisor the pod's own flag counts for nothing), else
    /// the share.
    pub fn effective_rate_ppm(&self) -> u32 {
        let limits = self.limits;
        let rate = limits.rate_ppm.load(Ordering::Relaxed);
        if limits.managed.load(Ordering::Relaxed) == 0
            && self.state.uncontended.load(Ordering::Relaxed) != 0
        {
            let ceiling = limits.ceiling_ppm.load(Ordering::Relaxed);
            if ceiling > rate {
                // Even a 100% ceiling is metered, so the pod never queues
                // more than the capacity ahead and yields within
                // milliseconds once contended.
                return ceiling;
            }
        }
        rate
    }

    /// Admits a launch estimated at `cost_ns` at monotonic time `now_ns`
    /// while the bucket holds anything.
    #[inline]
    pub fn admit(&self, now_ns: u64, cost_ns: u64) -> Admission {
        self.admit_above(now_ns, cost_ns, 0)
    }

    /// Admits a launch estimated at `cost_ns` at monotonic time `now_ns`
    /// once the bucket holds more than `floor_ns`. A launch that had to wait
    /// resumes above a floor of a few launches' worth, so that a throttled
    /// loop runs in short back-to-back bursts: a kernel queued behind the
    /// previous one takes its back-to-back time, one launched alone into an
    /// idle GPU takes longer, and the pod would pay for that difference.
    #[inline]
    pub fn admit_above(&self, now_ns: u64, cost_ns: u64, floor_ns: i64) -> Admission {
        // Reachable: the bucket never holds more than its capacity.
        let floor_ns = floor_ns.clamp(0, CAPACITY_NS / 2);
        if self.limits.suspended.load(Ordering::Relaxed) != 0 {
            return Admission::Wait(MAX_WAIT);
        }
        let rate = self.effective_rate_ppm();
        if rate == 0 {
            self.launches.fetch_add(1, Ordering::Relaxed);
            return Admission::Pass;
        }
        // Refill only when the tokens could run short, or at least every
        // REFILL_MAX_AGE_NS: a launch that finds plenty costs no compare-
        // and-swap (the elapsed time is banked at the next refill anyway).
        let mut tokens = self.tokens_ns.load(Ordering::Acquire);
        let stale =
            now_ns.saturating_sub(self.refilled_at_ns.load(Ordering::Relaxed)) >= REFILL_MAX_AGE_NS;
        let cost = i64::try_from(cost_ns).unwrap_or(i64::MAX);
        if stale || tokens <= cost.saturating_add(floor_ns) {
            self.refill(now_ns, rate);
            tokens = self.tokens_ns.load(Ordering::Acquire);
        }
        if tokens > floor_ns {
            self.charge(cost_ns);
            self.launches.fetch_add(1, Ordering::Relaxed);
            return Admission::Pass;
        }
        // Time until the bucket is above the floor again at this rate.
        let deficit = floor_ns.saturating_sub(tokens).unsigned_abs() + 1;
        let wait_ns = (u128::from(deficit) * u128::from(PPM) / u128::from(rate)) as u64;
        Admission::Wait(Duration::from_nanos(wait_ns).min(MAX_WAIT))
    }

    /// Counts `launches` admitted without an admission of their own (paid
    /// from time charged ahead).
    pub fn count_launches(&self, launches: u64) {
        if launches > 0 {
            self.launches.fetch_add(launches, Ordering::Relaxed);
        }
    }

    /// Adds `delta_ns` (measured minus charged) to what the pod has used.
    pub fn correct(&self, delta_ns: i64) {
        if delta_ns >= 0 {
            self.charge(delta_ns as u64);
        } else {
            let credit = delta_ns.unsigned_abs();
            self.charged_ns
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |charged| {
                    Some(charged.saturating_sub(credit))
                })
                .ok();
            self.add_tokens(credit as i64, true);
        }
    }

    fn charge(&self, cost_ns: u64) {
        let cost = i64::try_from(cost_ns).unwrap_or(i64::MAX);
        let before = self.tokens_ns.fetch_sub(cost, Ordering::AcqRel);
        if before.saturating_sub(cost) < DEBT_FLOOR_NS {
            // Rare: forgive what lies beyond the floor.
            self.tokens_ns.fetch_max(DEBT_FLOOR_NS, Ordering::AcqRel);
        }
        self.charged_ns.fetch_add(cost_ns, Ordering::Relaxed);
    }

    /// Adds `amount`, up to the capacity; counts what lies beyond it as
    /// forfeited where `count` says so.
    fn add_tokens(&self, amount: i64, count: bool) {
        // Saturating at the capacity; fetch_update retries on contention. A
        // bucket fuller than this view's depth (a deeper view filled it) is
        // not emptied by it, nor filled further.
        let capacity = self.capacity_ns;
        let before = self
            .tokens_ns
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |tokens| {
                Some(tokens.saturating_add(amount).min(capacity.max(tokens)))
            })
            .unwrap_or_else(|tokens| tokens);
        let beyond = before
            .saturating_add(amount)
            .saturating_sub(capacity.max(before));
        if count && beyond > 0 {
            self.forfeited_ns
                .fetch_add(beyond.unsigned_abs(), Ordering::Relaxed);
        }
    }

    /// Adds what the bucket earned since its last refill at the rate in
    /// force, without admitting anything; returns the tokens after. For a
    /// node hypervisor answering a trapped launch, whose thread waits on it.
    pub fn refill_now(&self, now_ns: u64) -> i64 {
        let rate = self.effective_rate_ppm();
        if rate != 0 {
            self.refill(now_ns, rate);
        }
        self.tokens_ns.load(Ordering::Acquire)
    }

    fn refill(&self, now_ns: u64, rate_ppm: u32) {
        let last = self.refilled_at_ns.load(Ordering::Acquire);
        if now_ns < last.saturating_add(REFILL_BATCH_NS) {
            return;
        }
        if self
            .refilled_at_ns
            .compare_exchange(last, now_ns, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return; // another thread or process refilled
        }
        let elapsed = now_ns - last;
        let earned = u128::from(elapsed) * u128::from(rate_ppm) / u128::from(PPM);
        // A bucket's first refill counts from the clock's origin: nothing
        // was earned before it, so nothing is forfeited.
        self.add_tokens(i64::try_from(earned).unwrap_or(i64::MAX), last != 0);
    }
}

fn percent_to_ppm(percent: u8) -> u32 {
    if percent == 0 || percent >= 100 {
        0
    } else {
        u32::from(percent) * 10_000
    }
}

#[cfg(test)]
mod tests;

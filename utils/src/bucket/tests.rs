//! The bucket's tests: admission, refills, depth, debt, forfeits, threads.

use super::*;

const MS: u64 = 1_000_000;

/// A bucket's two halves, owned by the test.
#[derive(Default)]
struct Owned {
    state: BucketState,
    limits: BucketLimits,
}

impl Owned {
    fn bucket(&self) -> Bucket<'_> {
        Bucket::new(&self.state, &self.limits)
    }
}

/// Runs a simulated GPU-bound loop of `kernel_ns` kernels through the
/// bucket for `duration_ns` and returns the share of time admitted.
fn simulate(bucket: &Bucket<'_>, kernel_ns: u64, duration_ns: u64) -> f64 {
    simulate_bursts(bucket, kernel_ns, duration_ns, 0).0
}

/// [`simulate`], where a launch that had to wait resumes above
/// `floor_ns`; also returns the longest run of launches admitted
/// between two waits in steady state.
fn simulate_bursts(
    bucket: &Bucket<'_>,
    kernel_ns: u64,
    duration_ns: u64,
    floor_ns: i64,
) -> (f64, u64) {
    let start = 1_000 * MS;
    let mut now = start;
    let mut admitted = 0u64;
    let (mut waited, mut burst, mut longest) = (false, 0, 0);
    while now < start + duration_ns {
        let floor = if waited { floor_ns } else { 0 };
        match bucket.admit_above(now, kernel_ns, floor) {
            Admission::Pass => {
                admitted += kernel_ns;
                // The launch returns at once; the next one follows.
                now += 1_000;
                waited = false;
                burst += 1;
            }
            Admission::Wait(wait) => {
                // In steady state, once the first capacity is spent.
                if now > start + 100 * MS {
                    longest = longest.max(burst);
                }
                now += wait.as_nanos() as u64;
                waited = true;
                burst = 0;
            }
        }
    }
    (admitted as f64 / duration_ns as f64, longest)
}

#[test]
fn admitted_time_converges_to_the_share() {
    for percent in [10u8, 25, 50, 75] {
        for kernel in [50_000u64, 2 * MS] {
            let owned = Owned::default();
            let bucket = owned.bucket();
            bucket.configure(percent, percent);
            let share = simulate(&bucket, kernel, 2_000 * MS);
            let target = f64::from(percent) / 100.0;
            assert!(
                (share - target).abs() < 0.01,
                "{percent}% with {kernel} ns kernels gave {share}"
            );
        }
    }
}

#[test]
fn a_throttled_loop_resumes_in_bursts_at_the_same_share() {
    let kernel = 40_000;
    for percent in [10u8, 25, 75] {
        let owned = Owned::default();
        let bucket = owned.bucket();
        bucket.configure(percent, percent);
        let (share, longest) = simulate_bursts(&bucket, kernel, 2_000 * MS, 8 * kernel as i64);
        let target = f64::from(percent) / 100.0;
        assert!((share - target).abs() < 0.01, "{percent}%: {share}");
        // Above a floor of 8 launches, 9 pass before the next wait
        // (plus what refills meanwhile); without one, a single launch.
        assert!(
            (9..=12).contains(&longest),
            "{percent}%: bursts of {longest}"
        );
        let owned = Owned::default();
        let bucket = owned.bucket();
        bucket.configure(percent, percent);
        assert_eq!(simulate_bursts(&bucket, kernel, 2_000 * MS, 0).1, 1);
    }
}

#[test]
fn unlimited_and_full_shares_always_pass() {
    for percent in [0u8, 100] {
        let owned = Owned::default();
        let bucket = owned.bucket();
        bucket.configure(percent, percent);
        for step in 0..1000 {
            assert_eq!(bucket.admit(step, 10 * MS), Admission::Pass);
        }
        assert_eq!(bucket.tokens_ns.load(Ordering::Relaxed), 0);
    }
}

#[test]
fn waits_are_precise_and_bounded() {
    let owned = Owned::default();
    let bucket = owned.bucket();
    bucket.configure(50, 50);
    let now = 10 * MS;
    assert_eq!(bucket.admit(now, MS), Admission::Pass);
    // Capacity (5 ms) minus 1 ms leaves budget; drain it.
    for _ in 0..4 {
        assert_eq!(bucket.admit(now, MS), Admission::Pass);
    }
    // Empty now: at 50% a 1 ns deficit is 2 ns away.
    assert_eq!(
        bucket.admit(now, MS),
        Admission::Wait(Duration::from_nanos(2))
    );
    bucket.correct(10 * MS as i64);
    assert_eq!(bucket.admit(now, MS), Admission::Wait(MAX_WAIT));
}

#[test]
fn a_clock_up_to_a_tick_behind_neither_earns_nor_loses_time() {
    // Launches admitted on the coarse clock (the limiter's, while the
    // bucket holds plenty: up to a tick behind) mixed with precise
    // ones. A refill ignores a clock behind the last one, so the time is
    // credited once: the share converges as with one clock.
    for percent in [25u8, 50, 75] {
        let owned = Owned::default();
        let bucket = owned.bucket();
        bucket.configure(percent, percent);
        let (kernel, start) = (50_000u64, 1_000 * MS);
        let (mut now, mut admitted) = (start, 0u64);
        for launch in 0u64.. {
            if now >= start + 2_000 * MS {
                break;
            }
            let lag = (launch % 5) * MS;
            match bucket.admit(now - lag, kernel) {
                Admission::Pass => {
                    admitted += kernel;
                    now += 1_000;
                }
                Admission::Wait(wait) => now += wait.as_nanos() as u64,
            }
        }
        let share = admitted as f64 / (now - start) as f64;
        let target = f64::from(percent) / 100.0;
        assert!(
            (share - target).abs() < 0.01,
            "{percent}% with a lagging clock gave {share}"
        );
    }
}

#[test]
fn debt_is_bounded_and_credit_is_capped() {
    let owned = Owned::default();
    let bucket = owned.bucket();
    bucket.configure(10, 10);
    bucket.correct(i64::MAX / 2);
    assert_eq!(bucket.tokens_ns.load(Ordering::Relaxed), DEBT_FLOOR_NS);
    bucket.correct(-(i64::MAX / 2));
    assert_eq!(bucket.tokens_ns.load(Ordering::Relaxed), CAPACITY_NS);
}

#[test]
fn a_deeper_view_banks_up_to_its_depth_and_a_shallower_one_takes_nothing_away() {
    let owned = Owned::default();
    let deep = owned.bucket().with_capacity(10 * MS as i64);
    assert_eq!(deep.capacity_ns(), 10 * MS as i64);
    deep.configure(25, 25);
    // Full from its first refill (10 ms), then emptied.
    assert_eq!(deep.admit(1_000 * MS, 10 * MS), Admission::Pass);
    assert_eq!(deep.tokens_ns.load(Ordering::Relaxed), 0);
    // 60 ms of waiting at 25% earns 15 ms: 10 banked, 5 forfeited, where
    // the default depth would have banked 5.
    assert_eq!(deep.admit(1_060 * MS, MS), Admission::Pass);
    assert_eq!(deep.tokens_ns.load(Ordering::Relaxed), 9 * MS as i64);
    assert_eq!(deep.forfeited_ns.load(Ordering::Relaxed), 5 * MS);
    // A process that sees the default depth neither clips what was
    // banked nor adds past its own depth: it forfeits what it earns.
    let shallow = owned.bucket();
    assert_eq!(shallow.refill_now(1_064 * MS), 9 * MS as i64);
    assert_eq!(deep.forfeited_ns.load(Ordering::Relaxed), 6 * MS);
    shallow.correct(-(MS as i64));
    assert_eq!(deep.tokens_ns.load(Ordering::Relaxed), 9 * MS as i64);
    deep.correct(-(MS as i64));
    assert_eq!(deep.tokens_ns.load(Ordering::Relaxed), 10 * MS as i64);
    // Depths outside the bounds are clamped.
    assert_eq!(owned.bucket().with_capacity(0).capacity_ns(), CAPACITY_NS);
    assert_eq!(
        owned.bucket().with_capacity(i64::MAX).capacity_ns(),
        MAX_CAPACITY_NS
    );
}

#[test]
fn time_beyond_the_capacity_is_counted_as_forfeited() {
    let owned = Owned::default();
    let bucket = owned.bucket();
    bucket.configure(50, 50);
    // The first refill fills the bucket from the clock's origin: no
    // time was earned before it, none is forfeited.
    assert_eq!(bucket.admit(1_000 * MS, MS), Admission::Pass);
    assert_eq!(bucket.forfeited_ns.load(Ordering::Relaxed), 0);
    // 4 ms held; 10 ms idle at 50% earns 5: 4 of them forfeited.
    assert_eq!(bucket.admit(1_010 * MS, MS), Admission::Pass);
    assert_eq!(bucket.forfeited_ns.load(Ordering::Relaxed), 4 * MS);
    // A credit beyond the capacity too: 4 ms held, 2 credited.
    bucket.correct(-2 * MS as i64);
    assert_eq!(bucket.forfeited_ns.load(Ordering::Relaxed), 5 * MS);
    assert_eq!(bucket.tokens_ns.load(Ordering::Relaxed), CAPACITY_NS);
}

#[test]
fn elastic_ceiling_applies_only_while_uncontended() {
    let owned = Owned::default();
    let bucket = owned.bucket();
    bucket.configure(30, 100);
    assert_eq!(bucket.effective_rate_ppm(), 300_000);
    bucket.uncontended.store(1, Ordering::Relaxed);
    assert_eq!(
        bucket.effective_rate_ppm(),
        PPM as u32,
        "a 100% ceiling is metered too"
    );
    bucket.configure(30, 60);
    assert_eq!(bucket.effective_rate_ppm(), 600_000);
    let share = simulate(&bucket, MS, 1_000 * MS);
    assert!((share - 0.6).abs() < 0.01, "{share}");
}

#[test]
fn a_managed_bucket_ignores_the_pods_own_uncontended_flag() {
    let owned = Owned::default();
    let bucket = owned.bucket();
    bucket.configure(30, 100);
    owned.state.uncontended.store(1, Ordering::Relaxed);
    assert_eq!(bucket.effective_rate_ppm(), PPM as u32);
    owned.limits.managed.store(1, Ordering::Relaxed);
    assert_eq!(bucket.effective_rate_ppm(), 300_000);
}

#[test]
fn a_suspended_pod_waits_whatever_its_budget() {
    let owned = Owned::default();
    let bucket = owned.bucket();
    bucket.configure(0, 0);
    owned.limits.suspended.store(1, Ordering::Relaxed);
    assert_eq!(bucket.admit(MS, 1), Admission::Wait(MAX_WAIT));
    owned.limits.suspended.store(0, Ordering::Relaxed);
    assert_eq!(bucket.admit(MS, 1), Admission::Pass);
}

#[test]
fn concurrent_admitters_share_one_rate() {
    // Four threads admit against one bucket at once, on a clock they
    // share and advance by 10 µs an attempt: the races on the bucket are
    // real, the time is not, so how the machine schedules the threads
    // does not change how much time passed.
    let owned = std::sync::Arc::new(Owned::default());
    owned.bucket().configure(25, 25);
    let start = monotonic_ns();
    let clock = std::sync::Arc::new(AtomicU64::new(start));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (owned, clock) = (std::sync::Arc::clone(&owned), std::sync::Arc::clone(&clock));
            std::thread::spawn(move || {
                let bucket = owned.bucket();
                let mut admitted = 0u64;
                loop {
                    let now = clock.fetch_add(10_000, Ordering::Relaxed);
                    if now >= start + 300 * MS {
                        break admitted;
                    }
                    if bucket.admit(now, 100_000) == Admission::Pass {
                        admitted += 100_000;
                    }
                }
            })
        })
        .collect();
    let admitted: u64 = threads.into_iter().map(|t| t.join().expect("thread")).sum();
    let share = admitted as f64 / (300 * MS) as f64;
    // Burst capacity and per-thread overshoot allow a little above 25%;
    // a refill lost to a race shows below it.
    assert!((0.22..0.30).contains(&share), "{share}");
}

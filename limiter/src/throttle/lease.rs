//! Prepaid budget: a thread whose pod is far from its limit pays the pod's
//! shared bucket for [`LEASE_NS`] of GPU time at once, then pays its
//! launches from that lease without touching the bucket.
//!
//! Why: the bucket lives in shared memory, written by every process of the
//! pod. Admitting a launch there is three atomic read-modify-writes on one
//! line (tokens, time charged, launches), which moves between the cores of
//! a pod's processes at every launch: on the driver double, two processes of
//! one pod launching every ~1 µs spent 201–211 ns in each launch call
//! against 138–142 for one process alone; with leases 125–129 ns, both ways.
//! A process alone gains less (the line stays in its core): 13 ns on the
//! double, about 10 on the H100 machine. From a lease a launch costs a few
//! loads and stores in the thread's own memory.
//!
//! What stays exact: the pod is charged the lease before any launch uses it,
//! so no launch runs unpaid. A lease is bought only while the bucket holds
//! at least [`COARSE_TOKENS_NS`](super::COARSE_TOKENS_NS) (4 of its 5 ms: the
//! limit does not bind) and only in pods without classes (no hypervisor, no
//! latency pod to yield to; those need every launch seen). Once a launch
//! finds the bucket below that, its thread gives its lease back (the rest
//! credited, its launches counted), so a binding limit meters every launch,
//! as before. A thread that stops launching while its pod is far from the
//! limit keeps its lease: the pod has paid up to [`LEASE_NS`] ahead for it,
//! never behind. Launches paid from a lease reach the bucket's launch count
//! when the lease is renewed or given back.

use gpushare_hook::thread_local::ZeroInit;
use gpushare_utils::bucket::{Admission, ComputeBucket};

/// GPU time a thread buys at once: 4% of the bucket, a few dozen short
/// launches.
pub(super) const LEASE_NS: u64 = 200_000;
/// Launches priced above this are admitted one by one.
const MAX_LEASED_COST_NS: u64 = LEASE_NS / 4;

gpushare_hook::initial_exec_thread_local! {
    /// This thread's lease (initial-exec: read on every launch).
    static LEASE: Lease;
}

/// A thread's prepaid GPU time in one bucket.
#[derive(Clone, Copy)]
struct Lease {
    bucket: Option<ComputeBucket>,
    /// Paid for, not used yet.
    ns: u64,
    /// Launches paid from it since the bucket last counted them.
    launches: u64,
}

// SAFETY: all zero is `none()`: no bucket (a null reference is `None`: the
// only niche of the bucket is its references), no time, no launches.
unsafe impl ZeroInit for Lease {}

impl Lease {
    const fn none() -> Self {
        Self {
            bucket: None,
            ns: 0,
            launches: 0,
        }
    }

    fn holds(&self, bucket: &ComputeBucket) -> bool {
        self.bucket
            .is_some_and(|held| std::ptr::eq(held.state(), bucket.state()))
    }

    /// Credits the unused time back to its bucket and counts its launches.
    fn give_back(&mut self) {
        if let Some(bucket) = self.bucket.take() {
            if self.ns > 0 {
                bucket.correct(-(self.ns as i64));
            }
            bucket.count_launches(self.launches);
        }
        *self = Self::none();
    }
}

/// Pays `cost_ns` from this thread's lease in `bucket`, if it holds enough.
#[inline]
pub(super) fn pay(bucket: &ComputeBucket, cost_ns: u64) -> bool {
    LEASE.with(|cell| {
        let mut lease = cell.get();
        if !lease.holds(bucket) || lease.ns < cost_ns {
            return false;
        }
        lease.ns -= cost_ns;
        lease.launches += 1;
        cell.set(lease);
        true
    })
}

/// Admits a launch of `cost_ns` at `now` by buying a new lease in `bucket`
/// (the old one given back first); false, nothing bought, when the launch
/// is too long to lease or the bucket turned it down.
#[cold]
#[inline(never)]
pub(super) fn renew(bucket: &'static ComputeBucket, now: u64, cost_ns: u64) -> bool {
    if cost_ns > MAX_LEASED_COST_NS {
        give_back();
        return false;
    }
    LEASE.with(|cell| {
        let mut lease = cell.get();
        lease.give_back();
        // The bucket counts this launch with the purchase.
        if bucket.admit(now, LEASE_NS) == Admission::Pass {
            lease = Lease {
                bucket: Some(*bucket),
                ns: LEASE_NS - cost_ns,
                launches: 0,
            };
        }
        cell.set(lease);
        lease.bucket.is_some()
    })
}

/// Gives this thread's lease back, if it holds one.
#[inline]
pub(super) fn give_back() {
    LEASE.with(|cell| {
        let mut lease = cell.get();
        if lease.bucket.is_some() {
            lease.give_back();
            cell.set(lease);
        }
    });
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::atomic::Ordering;

    use gpushare_utils::bucket::{BucketLimits, BucketState, CAPACITY_NS};

    use super::*;

    fn bucket() -> &'static ComputeBucket {
        let state: &'static BucketState = Box::leak(Box::default());
        let limits: &'static BucketLimits = Box::leak(Box::default());
        let bucket = Box::leak(Box::new(ComputeBucket::new(state, limits)));
        bucket.configure(50, 50);
        state.tokens_ns.store(CAPACITY_NS, Ordering::Relaxed);
        bucket
    }

    fn tokens(bucket: &ComputeBucket) -> i64 {
        bucket.tokens_ns.load(Ordering::Relaxed)
    }

    #[test]
    fn a_threads_zeroed_lease_is_none() {
        let zeroed: Lease = gpushare_hook::thread_local::zeroed();
        assert!(zeroed.bucket.is_none() && zeroed.ns == 0 && zeroed.launches == 0);
        std::thread::spawn(|| {
            let lease = LEASE.with(Cell::get);
            assert!(lease.bucket.is_none() && lease.ns == 0 && lease.launches == 0);
            assert!(!pay(bucket(), 1), "a new thread holds no lease");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn launches_are_paid_from_the_lease_and_counted_when_it_is_given_back() {
        let bucket = bucket();
        let now = 1_000_000_000;
        assert!(!pay(bucket, 1_000), "no lease yet");
        assert!(renew(bucket, now, 1_000));
        assert_eq!(tokens(bucket), CAPACITY_NS - LEASE_NS as i64);
        for _ in 0..199 {
            assert!(pay(bucket, 1_000));
        }
        assert!(!pay(bucket, 1_000), "the lease is spent");
        assert_eq!(
            tokens(bucket),
            CAPACITY_NS - LEASE_NS as i64,
            "the bucket was not touched"
        );
        give_back();
        let state = bucket.state();
        assert_eq!(
            state.launches.load(Ordering::Relaxed),
            200,
            "every launch counted"
        );
        assert_eq!(
            state.charged_ns.load(Ordering::Relaxed),
            LEASE_NS,
            "what 200 launches of 1 us cost"
        );
    }

    #[test]
    fn the_unused_rest_is_credited_back() {
        let bucket = bucket();
        assert!(renew(bucket, 1_000_000_000, 10_000));
        assert!(pay(bucket, 10_000));
        give_back();
        let state = bucket.state();
        assert_eq!(state.charged_ns.load(Ordering::Relaxed), 20_000);
        assert_eq!(tokens(bucket), CAPACITY_NS - 20_000);
        assert!(!pay(bucket, 1), "nothing held after giving back");
    }

    #[test]
    fn a_long_launch_is_not_leased_and_gives_the_lease_back() {
        let bucket = bucket();
        assert!(renew(bucket, 1_000_000_000, 1_000));
        assert!(!renew(bucket, 1_000_000_000, MAX_LEASED_COST_NS + 1));
        assert!(!pay(bucket, 1), "given back");
        assert_eq!(bucket.state().charged_ns.load(Ordering::Relaxed), 1_000);
    }

    #[test]
    fn a_lease_serves_only_its_own_bucket() {
        let (first, second) = (bucket(), bucket());
        assert!(renew(first, 1_000_000_000, 1_000));
        assert!(!pay(second, 1_000));
        assert!(renew(second, 1_000_000_000, 1_000));
        assert_eq!(
            first.state().charged_ns.load(Ordering::Relaxed),
            1_000,
            "the first lease was given back when the second was bought"
        );
        give_back();
    }
}

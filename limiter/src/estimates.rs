//! How long each kind of launch keeps the GPU busy, learned from samples.
//!
//! A launch is charged before it runs, so its cost must be known in advance:
//! kernels of one function and grid size take about the same time, so the
//! table keeps, per key, a moving average of measured durations. Lookups and
//! updates are lock-free (the launch path takes no lock); a key the table has
//! no room for is charged the default and never sampled into it.

use std::sync::atomic::{AtomicU64, Ordering};

/// What an unknown launch is charged until its first sample returns. On the
/// high side on purpose: an overcharge is credited back as soon as the sample
/// completes (a waiting thread looks again every 2 ms), while an undercharge
/// lets a loop of long kernels queue a burst that must then be paid for.
pub const DEFAULT_ESTIMATE_NS: u64 = 10_000_000;

const SLOTS: usize = 4096;
const PROBES: usize = 16;

/// Identifies launches expected to last alike; the low bit tells graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchKey(u64);

impl LaunchKey {
    /// A kernel launch of `function` with `blocks` blocks of `threads` threads.
    pub fn kernel(function: usize, blocks: u64, threads: u64) -> Self {
        Self(mix(function as u64 ^ blocks.rotate_left(40) ^ threads.rotate_left(20)) & !1 | 2)
    }

    /// A launch of an instantiated graph.
    pub fn graph(exec: usize) -> Self {
        Self(mix(exec as u64 ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// Whether this is a graph launch.
    pub fn is_graph(self) -> bool {
        self.0 & 1 == 1
    }
}

/// splitmix64's finaliser.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Moving averages of launch durations, by key (0 marks an empty slot; keys
/// are never 0).
pub struct Estimates {
    keys: Box<[AtomicU64]>,
    nanos: Box<[AtomicU64]>,
}

impl Default for Estimates {
    fn default() -> Self {
        Self {
            keys: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            nanos: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl Estimates {
    fn find(&self, key: LaunchKey) -> Option<usize> {
        let start = key.0 as usize % SLOTS;
        (0..PROBES)
            .map(|probe| (start + probe) % SLOTS)
            .take_while(|&slot| self.keys[slot].load(Ordering::Acquire) != 0)
            .find(|&slot| self.keys[slot].load(Ordering::Acquire) == key.0)
    }

    /// The estimated duration of `key`, if one was measured.
    #[inline]
    pub fn get(&self, key: LaunchKey) -> Option<u64> {
        let slot = self.find(key)?;
        match self.nanos[slot].load(Ordering::Relaxed) {
            0 => None,
            nanos => Some(nanos),
        }
    }

    /// Folds a measured duration into `key`'s estimate and returns the new
    /// estimate. Down quickly (weight 1/2), up slowly (1/8): a sample can only
    /// be inflated, never shortened, by other contexts time-slicing the GPU
    /// while the events bracket the kernel, so low samples are the truer ones.
    pub fn record(&self, key: LaunchKey, measured_ns: u64) -> Option<u64> {
        let measured = measured_ns.max(1);
        let start = key.0 as usize % SLOTS;
        for probe in 0..PROBES {
            let slot = (start + probe) % SLOTS;
            let owner = match self.keys[slot].compare_exchange(
                0,
                key.0,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => key.0,
                Err(existing) => existing,
            };
            if owner != key.0 {
                continue;
            }
            let update = |old: u64| match old {
                0 => measured,
                old if measured < old => old - (old - measured) / 2,
                old => old + (measured - old) / 8,
            };
            let previous =
                self.nanos[slot].fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                    Some(update(old))
                });
            return previous.ok().map(update);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_follow_measurements() {
        let estimates = Estimates::default();
        let key = LaunchKey::kernel(0x1000, 264, 512);
        assert_eq!(estimates.get(key), None);
        estimates.record(key, 2_000_000);
        assert_eq!(estimates.get(key), Some(2_000_000));
        for _ in 0..20 {
            estimates.record(key, 50_000);
        }
        let settled = estimates.get(key).expect("estimate");
        assert!((50_000..51_000).contains(&settled), "{settled}");
        // One inflated sample (another context ran meanwhile) moves it little.
        assert_eq!(
            estimates.record(key, 450_000),
            Some(settled + (450_000 - settled) / 8)
        );
    }

    #[test]
    fn keys_are_distinct_and_the_table_fills_gracefully() {
        let estimates = Estimates::default();
        assert_ne!(LaunchKey::kernel(1, 2, 3), LaunchKey::kernel(1, 3, 2));
        assert_ne!(LaunchKey::kernel(7, 1, 1), LaunchKey::graph(7));
        assert!(LaunchKey::graph(7).is_graph() && !LaunchKey::kernel(7, 1, 1).is_graph());
        for function in 0..(SLOTS * 2) {
            estimates.record(LaunchKey::kernel(function, 1, 1), 1000 + function as u64);
        }
        let known = (0..SLOTS * 2)
            .filter(|&f| estimates.get(LaunchKey::kernel(f, 1, 1)) == Some(1000 + f as u64))
            .count();
        assert!(known >= SLOTS * 3 / 4, "only {known} kept");
    }
}

//! What a launch costs, in GPU nanoseconds: priced before it runs, for any
//! grid shape, seen before or not, in bounded memory, without a lock; then
//! settled at the measured rate.
//!
//! Inference servers change grid sizes with every batch and sequence length,
//! so no table of shapes can hold them, and a shape never seen must not be
//! charged a guess. What stays fixed is the function: a kernel takes about
//! its time per *wave* (see [`crate::waves`]) times its waves.
//!
//! 1. Per function (or graph), a moving average of measured ns per wave, in
//!    a lock-free open-addressed table of [`SLOTS`] entries. A launch is
//!    priced per-wave × waves and charged that at once.
//! 2. Every charge is provisional until the function's next measurement
//!    settles it: the entry sums the waves and the nanoseconds charged since,
//!    and a measurement turns them into waves × the measured rate, so the
//!    pod pays what its launches really took even where the price lagged
//!    (the caller debits or credits the difference).
//! 3. A function not measured yet is priced at the process's average per
//!    wave ([`INITIAL_PER_WAVE_NS`] before any measurement). Its first launch
//!    is measured, and at most [`UNMEASURED_AHEAD`] more run ahead of that
//!    measurement; the caller holds the next until it comes.
//! 4. A function the table has no room for is priced at the process average
//!    and settled with the other such launches: no entry, no per-launch
//!    sampling, no slowdown.
//! 5. The average moves by a quarter of each measurement's difference both
//!    ways, so a function whose shapes vary is priced at its mean. While
//!    another pod launches on the device (its time slices can inflate a
//!    measurement, never shorten it) the average falls faster than it rises,
//!    and settles at the average rather than the inflated measurement.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::waves::mix;

/// Functions and graphs with their own average.
pub const SLOTS: usize = 4096;
const PROBES: usize = 16;
/// What a wave is charged before anything has been measured in the process:
/// a short kernel. A first launch is measured and settled, so this only sets
/// the size of the first burst, which [`UNMEASURED_AHEAD`] bounds.
pub const INITIAL_PER_WAVE_NS: u64 = 20_000;
/// Launches of an unmeasured function admitted ahead of its first measurement.
pub const UNMEASURED_AHEAD: u64 = 1;

/// Identifies a kernel's function or a graph exec; the low bit tells graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchKey(u64);

impl LaunchKey {
    /// Launches of `function`, whatever their grid.
    pub fn kernel(function: usize) -> Self {
        Self(mix(function as u64) & !1 | 2)
    }

    /// Launches of an instantiated graph.
    pub fn graph(exec: usize) -> Self {
        Self(mix(exec as u64 ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// Whether this is a graph launch.
    pub fn is_graph(self) -> bool {
        self.0 & 1 == 1
    }
}

/// What one launch was charged, and how to measure it.
#[derive(Debug, Clone, Copy)]
pub struct Charge {
    pub ns: u64,
    pub waves: u64,
    /// The function's table entry; `None` when the table is full.
    pub slot: Option<usize>,
    /// Priced before the function was ever measured.
    pub unmeasured: bool,
    /// This launch should be measured: its function's first measurement.
    pub first: bool,
    /// Unmeasured launches of the function admitted before this one.
    pub ahead: u64,
}

/// Charges awaiting a measurement's rate.
#[derive(Default)]
struct Unsettled {
    waves: AtomicU64,
    ns: AtomicU64,
}

impl Unsettled {
    fn add(&self, waves: u64, ns: u64) {
        self.waves.fetch_add(waves, Ordering::Relaxed);
        self.ns.fetch_add(ns, Ordering::Relaxed);
    }

    fn remove(&self, waves: u64, ns: u64) {
        for (counter, amount) in [(&self.waves, waves), (&self.ns, ns)] {
            counter
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |value| {
                    Some(value.saturating_sub(amount))
                })
                .ok();
        }
    }

    /// What the pod owes for everything unsettled at `per_wave_ns`.
    fn settle(&self, per_wave_ns: u64) -> i64 {
        let waves = self.waves.swap(0, Ordering::Relaxed);
        let charged = self.ns.swap(0, Ordering::Relaxed);
        signed(per_wave_ns.saturating_mul(waves)) - signed(charged)
    }
}

#[derive(Default)]
struct Slot {
    key: AtomicU64,
    /// Average GPU ns per wave; 0 until measured.
    per_wave_ns: AtomicU64,
    /// A first measurement of the function is in flight.
    measuring: AtomicBool,
    /// Launches priced before the first measurement.
    unmeasured_launches: AtomicU64,
    unsettled: Unsettled,
}

/// Per-function averages and the process-wide one.
pub struct CostModel {
    slots: Box<[Slot]>,
    /// Average GPU ns per wave over every measurement; 0 until one.
    average_ns: AtomicU64,
    /// Launches of functions without an entry.
    unslotted: Unsettled,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
            average_ns: AtomicU64::new(0),
            unslotted: Unsettled::default(),
        }
    }
}

impl CostModel {
    /// The entry of `key`, claimed if absent; `None` when there is no room.
    fn slot(&self, key: LaunchKey) -> Option<usize> {
        let start = key.0 as usize % SLOTS;
        for probe in 0..PROBES {
            let index = (start + probe) % SLOTS;
            let owner = &self.slots[index].key;
            match owner.load(Ordering::Acquire) {
                existing if existing == key.0 => return Some(index),
                0 => match owner.compare_exchange(0, key.0, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Some(index),
                    Err(existing) if existing == key.0 => return Some(index),
                    Err(_) => {}
                },
                _ => {}
            }
        }
        None
    }

    fn average(&self) -> u64 {
        match self.average_ns.load(Ordering::Relaxed) {
            0 => INITIAL_PER_WAVE_NS,
            average => average,
        }
    }

    fn unsettled(&self, slot: Option<usize>) -> &Unsettled {
        slot.map_or(&self.unslotted, |index| &self.slots[index].unsettled)
    }

    /// Charges one launch of `key` running in `waves` waves.
    #[inline]
    pub fn charge(&self, key: LaunchKey, waves: u64) -> Charge {
        let waves = waves.max(1);
        let mut charge = Charge {
            ns: 0,
            waves,
            slot: self.slot(key),
            unmeasured: false,
            first: false,
            ahead: 0,
        };
        let per_wave = match charge.slot {
            Some(index) => {
                let slot = &self.slots[index];
                match slot.per_wave_ns.load(Ordering::Relaxed) {
                    0 => {
                        charge.unmeasured = true;
                        charge.ahead = slot.unmeasured_launches.fetch_add(1, Ordering::Relaxed);
                        charge.first = !slot.measuring.swap(true, Ordering::AcqRel);
                        self.average()
                    }
                    per_wave => per_wave,
                }
            }
            None => self.average(),
        };
        charge.ns = per_wave.saturating_mul(waves);
        self.unsettled(charge.slot).add(waves, charge.ns);
        charge
    }

    /// Whether the function of `charge` has been measured.
    pub fn measured(&self, charge: &Charge) -> bool {
        charge
            .slot
            .is_none_or(|index| self.slots[index].per_wave_ns.load(Ordering::Relaxed) != 0)
    }

    /// Takes back a charge whose launch did not run.
    pub fn refund(&self, charge: &Charge) {
        self.unsettled(charge.slot).remove(charge.waves, charge.ns);
        if let (true, Some(index)) = (charge.unmeasured, charge.slot) {
            self.slots[index]
                .unmeasured_launches
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    Some(n.saturating_sub(1))
                })
                .ok();
        }
    }

    /// The measurement `charge`'s launch was to give will not come: another
    /// launch of the function may take it.
    pub fn abandon(&self, charge: &Charge) {
        if let (true, Some(index)) = (charge.first, charge.slot) {
            self.slots[index].measuring.store(false, Ordering::Release);
        }
    }

    /// Folds in that `charge`'s launch kept the GPU busy `measured_ns`, and
    /// returns what the pod owes on top of its charges (negative: is owed)
    /// for every launch of the function charged since its last measurement.
    /// `contended`: another pod launched on the device meanwhile.
    pub fn record(&self, charge: &Charge, measured_ns: u64, contended: bool) -> i64 {
        let measured = (measured_ns / charge.waves).max(1);
        let previous = self
            .average_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(ema(old, measured, contended))
            })
            .unwrap_or(0);
        let Some(index) = charge.slot else {
            let rate = if contended {
                ema(previous, measured, true)
            } else {
                measured
            };
            return self.unslotted.settle(rate);
        };
        let slot = &self.slots[index];
        let previous = slot
            .per_wave_ns
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(ema(old, measured, contended))
            })
            .unwrap_or(0);
        if charge.first {
            slot.measuring.store(false, Ordering::Release);
        }
        let rate = if contended {
            ema(previous, measured, true)
        } else {
            measured
        };
        slot.unsettled.settle(rate)
    }
}

/// The moving average `old` after a measurement of `measured` (0: none yet).
fn ema(old: u64, measured: u64, contended: bool) -> u64 {
    let new = match old {
        0 => measured,
        old if contended && measured < old => old / 2 + measured / 2,
        old if contended => old - old / 8 + measured / 8,
        old => old - old / 4 + measured / 4,
    };
    new.max(1)
}

fn signed(ns: u64) -> i64 {
    i64::try_from(ns).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    #[test]
    fn a_measured_function_prices_every_grid_by_its_waves() {
        let model = CostModel::default();
        let key = LaunchKey::kernel(0x1000);
        let first = model.charge(key, 1);
        assert!(first.first && first.unmeasured);
        assert_eq!(first.ns, INITIAL_PER_WAVE_NS);
        // Measured at 50 µs: its charge is settled at that.
        assert_eq!(model.record(&first, 50 * US, false), signed(30 * US));
        for waves in [1, 3, 10, 777] {
            let charge = model.charge(key, waves);
            assert!(!charge.unmeasured && !charge.first);
            assert_eq!(charge.ns, 50 * US * waves);
        }
    }

    #[test]
    fn a_measurement_settles_every_launch_since_the_last() {
        let model = CostModel::default();
        let key = LaunchKey::kernel(7);
        let charges: Vec<Charge> = (0..6).map(|i| model.charge(key, 1 + i % 2)).collect();
        assert!(charges[0].first);
        assert!(charges[1..].iter().all(|charge| !charge.first));
        assert_eq!(
            charges.iter().map(|c| c.ahead).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5]
        );
        let charged: u64 = charges.iter().map(|c| c.ns).sum();
        let waves: u64 = charges.iter().map(|c| c.waves).sum();
        // 2 ms per wave: the pod owes what 9 waves cost, less what it paid.
        let owed = model.record(&charges[0], 2_000 * US, false);
        assert_eq!(owed, signed(2_000 * US * waves) - signed(charged));
        assert!(model.measured(&charges[5]));
        // The function slows down (a longer KV cache, say): the launches
        // priced at the old average are settled at the new rate.
        let slower: Vec<Charge> = (0..10).map(|_| model.charge(key, 1)).collect();
        assert!(slower.iter().all(|charge| charge.ns == 2_000 * US));
        assert_eq!(
            model.record(&slower[3], 3_000 * US, false),
            signed(10 * 1_000 * US)
        );
        // Settled once: nothing is left for a later measurement.
        let later = model.charge(key, 1);
        let price = later.ns;
        assert_eq!(model.record(&later, price, false), 0);
    }

    #[test]
    fn prices_follow_the_mean_of_varying_measurements() {
        let model = CostModel::default();
        let key = LaunchKey::kernel(9);
        let first = model.charge(key, 1);
        model.record(&first, 100 * US, false);
        // Alternating 100 and 200 µs per wave: settles near the mean.
        for round in 0..200 {
            let charge = model.charge(key, 1);
            model.record(
                &charge,
                if round % 2 == 0 { 100 * US } else { 200 * US },
                false,
            );
        }
        let price = model.charge(key, 1).ns;
        assert!((130 * US..=170 * US).contains(&price), "{price}");
        // Under contention an inflated measurement moves it by an eighth,
        // and settles at that, not at the measurement.
        let inflated = price + 800 * US;
        let charge = model.charge(key, 1);
        let owed = model.record(&charge, inflated, true);
        let moved = price - price / 8 + inflated / 8;
        assert_eq!(model.charge(key, 1).ns, moved);
        assert_eq!(owed, signed(moved) * 2 - signed(price) * 2);
    }

    #[test]
    fn unknown_functions_cost_the_process_average_and_a_full_table_stays_cheap() {
        let model = CostModel::default();
        let seed = model.charge(LaunchKey::kernel(1), 1);
        model.record(&seed, 30 * US, false);
        // Ten times more functions than slots, each launched once with a
        // different grid: no charge is a default of milliseconds, and past the
        // table's room, nothing asks for a measurement.
        let mut firsts = 0;
        let mut unslotted = Vec::new();
        for function in 2..(SLOTS * 10) {
            let charge = model.charge(LaunchKey::kernel(function), 1 + (function as u64 % 3));
            assert!(charge.ns <= 3 * 30 * US, "charged {} ns", charge.ns);
            firsts += usize::from(charge.first);
            if charge.slot.is_none() {
                unslotted.push(charge);
            }
        }
        assert!(firsts <= SLOTS, "{firsts} measurements asked for");
        assert!(
            unslotted.len() >= SLOTS * 8,
            "{} without a slot",
            unslotted.len()
        );
        // One measurement of a launch without a slot settles them all.
        let waves: u64 = unslotted.iter().map(|charge| charge.waves).sum();
        let charged: u64 = unslotted.iter().map(|charge| charge.ns).sum();
        let owed = model.record(&unslotted[0], 40 * US * unslotted[0].waves, false);
        assert_eq!(owed, signed(40 * US * waves) - signed(charged));
    }

    #[test]
    fn a_lost_or_failed_launch_is_neither_measured_nor_settled() {
        let model = CostModel::default();
        let key = LaunchKey::graph(3);
        assert!(key.is_graph() && !LaunchKey::kernel(3).is_graph());
        let first = model.charge(key, 1);
        model.abandon(&first);
        model.refund(&first);
        let retry = model.charge(key, 1);
        assert!(retry.first, "another launch takes the measurement");
        assert_eq!(retry.ahead, 0, "the failed launch is not counted ahead");
        assert_eq!(model.record(&retry, 40 * US, false), signed(20 * US));
    }
}

//! What a launch costs, in GPU nanoseconds: priced before it runs, for any
//! grid shape, seen before or not, in bounded memory, without a lock; then
//! settled at the measured price.
//!
//! Inference servers change grid sizes with every batch and sequence length,
//! so no table of shapes can hold them, and a shape never seen must not be
//! charged a guess. What stays fixed is the function: a kernel takes a fixed
//! time (launch, first blocks, tail) plus a time per *wave* of blocks (see
//! [`crate::waves`]) times its waves.
//!
//! 1. Per function (or graph), a [`Fit`] of measured time against waves:
//!    least squares over the recent measurements (each weighs 7/8 of the one
//!    after it), in a lock-free open-addressed table of [`SLOTS`] entries. A
//!    launch is priced fixed + per-wave × waves and charged that at once.
//! 2. Every charge is provisional until the function's next measurement
//!    settles it: the entry sums the launches, waves and nanoseconds charged
//!    since, and the measurement's updated price turns them into what they
//!    cost, so the pod pays for what its launches took even where the price
//!    lagged (the caller debits or credits the difference).
//! 3. A function not measured yet is priced by the fit over all of the
//!    process's measurements (before any, [`INITIAL_PER_WAVE_NS`] a wave).
//!    Its first launch is measured (the caller bounds how often a new
//!    function's first launch is), and while that measurement is in flight at
//!    most [`UNMEASURED_AHEAD`] more run ahead of it; the caller holds the
//!    next until it comes.
//! 4. A function measured at one grid size only cannot tell its fixed part
//!    from its time per wave: its first launch at another size is measured
//!    too (as a first launch is), so that a loop of shapes is not priced,
//!    and settled, for long at a split of one size's time into fixed and
//!    per-wave parts that nothing measured (a kernel of one short wave is
//!    all fixed part by that split: its ten-wave launches would pay for one).
//! 5. A function the table has no room for is priced and settled by the
//!    process-wide fit: no entry, no per-launch sampling, no slowdown.
//! 6. While another pod launches on the device (its time slices can inflate
//!    a measurement by milliseconds, never shorten it) a measurement counts
//!    as the median of the kernel's recent ones, and above the price weighs
//!    a quarter, so a slice now and then does not raise the price; on a
//!    co-run GPU, MPS clients' kernels share the SMs, which stretches a
//!    kernel's time but not the SM time it takes: a measurement counts as
//!    the lower quartile of the kernel's recent ones, and above the price
//!    weighs a sixty-fourth, so a kernel is priced near the least it took
//!    (see [`Contention`]).
//! 7. A thread's charges to one entry in a row add up in its own [`Batch`]
//!    and reach the entry together (at most [`BATCH_LAUNCHES`] launches or
//!    [`BATCH_NS`] charged), so a loop of one kernel makes three atomic
//!    additions a batch, not a launch. A batch not yet added is settled by
//!    the entry's next measurement after it is; a thread that takes a
//!    measurement adds its batch first. A launch priced before its function
//!    was measured goes to the entry at once: its charge is a guess, which
//!    the first measurement must settle (batched, the guess's error came a
//!    measurement late, and the double's stalls at L = 25 grew 9 -> 14 ms).
//!
//! Only the monitor thread records measurements, so each fit has a single
//! writer; launches read its price, two relaxed loads.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::hash::mix;
use floor::Floor;

mod floor;

/// Functions and graphs with their own price.
pub(crate) const SLOTS: usize = 4096;
const PROBES: usize = 16;
/// What a wave costs before anything has been measured in the process: a
/// short kernel. A first launch is measured and settled, so this only sets
/// the size of the first burst, which [`UNMEASURED_AHEAD`] bounds.
pub(crate) const INITIAL_PER_WAVE_NS: u64 = 20_000;
/// Launches of an unmeasured function admitted ahead of its first measurement.
pub(crate) const UNMEASURED_AHEAD: u64 = 1;
/// A thread's launches of one function added to its entry at once, at most.
pub(crate) const BATCH_LAUNCHES: u64 = 64;
/// GPU time a thread's batch holds, at most, before it is added: what a
/// thread that stops launching leaves unsettled (its price error times this).
pub(crate) const BATCH_NS: u64 = 1_000_000;
/// How much an older measurement weighs relative to the next one.
const DECAY: f64 = 7.0 / 8.0;
/// With measurements at one grid size only, the fixed part is taken as the
/// smaller of this and the whole (a launch's own latency and ramp), the rest
/// per wave; measurements at other sizes then fit both.
const FIXED_PRIOR_NS: f64 = 3_000.0;

/// What else ran on the device while a measured launch did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contention {
    /// No other pod launched there.
    Alone,
    /// Another pod launched on a time-sliced GPU: one of its time slices
    /// (milliseconds) may have held the launch up, which would charge a
    /// short kernel many times over. A measurement is taken as the median
    /// of the kernel's recent ones (see [`Floor`]), which such a slice now
    /// and then does not move, and one still above the price weighs a
    /// quarter. A kernel that really takes longer now moves the median
    /// within a few measurements.
    TimeSliced,
    /// Another MPS client of the co-run GPU launched: its kernels ran beside
    /// this one on the SMs, which stretches this one's time, not the SM time
    /// it takes (a kernel that fills the GPU takes as many SM-seconds as it
    /// does alone). Where contention never ends, every measurement can be
    /// stretched: a measurement is taken as the lower quartile of the
    /// kernel's recent ones (its [`Floor`]), and one still above the
    /// price weighs a sixty-fourth. The price settles near the least the
    /// kernel took, and still follows a kernel that really takes longer now
    /// (within about a hundred measurements), so no pod keeps an old, short
    /// price by launching beside others.
    SharedSms,
}

impl Contention {
    /// What a measurement above the price weighs against one at or below it.
    fn weight_above_price(self) -> f64 {
        match self {
            Self::Alone => 1.0,
            Self::TimeSliced => 0.25,
            Self::SharedSms => 1.0 / 64.0,
        }
    }
}

/// Identifies a kernel's function or a graph exec; the low bit tells graphs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaunchKey(u64);

impl LaunchKey {
    /// Launches of `function`, whatever their grid.
    pub(crate) fn kernel(function: usize) -> Self {
        Self(mix(function as u64) & !1 | 2)
    }

    /// Launches of an instantiated graph.
    pub(crate) fn graph(exec: usize) -> Self {
        Self(mix(exec as u64 ^ 0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// Whether this is a graph launch.
    pub(crate) fn is_graph(self) -> bool {
        self.0 & 1 == 1
    }
}

/// What one launch was charged, and how to measure it (the default: nothing).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Charge {
    pub ns: u64,
    pub waves: u64,
    /// The function's table entry; `None` when the table is full.
    pub slot: Option<usize>,
    /// Priced before the function was ever measured.
    pub unmeasured: bool,
    /// This launch should be measured: its function's first measurement,
    /// or its first at another grid size than the one it was measured at.
    pub wanted: bool,
    /// Unmeasured launches of the function admitted before this one.
    pub ahead: u64,
}

/// A price: `fixed_ns` + `per_wave_ns` × waves; both 0 until measured.
#[derive(Default)]
struct Price {
    fixed_ns: AtomicU64,
    per_wave_ns: AtomicU64,
}

impl Price {
    fn get(&self) -> Option<(u64, u64)> {
        let fixed = self.fixed_ns.load(Ordering::Relaxed);
        let per_wave = self.per_wave_ns.load(Ordering::Relaxed);
        (fixed != 0 || per_wave != 0).then_some((fixed, per_wave))
    }

    fn of(price: (u64, u64), launches: u64, waves: u64) -> u64 {
        price
            .0
            .saturating_mul(launches)
            .saturating_add(price.1.saturating_mul(waves))
    }
}

/// Decayed least squares of measured time against waves, which sets a
/// [`Price`]. Written by the monitor thread only (f64 bits in atomics).
#[derive(Default)]
struct Fit {
    sums: [AtomicU64; 5],
    floor: Floor,
}

impl Fit {
    /// Adds a measurement of `ns` for `waves` waves with weight `weight`,
    /// and sets `price` to the updated fit. Returns whether the fit holds
    /// one grid size only, and so split its time by [`FIXED_PRIOR_NS`].
    fn add(&self, price: &Price, waves: u64, ns: u64, weight: f64) -> bool {
        let (x, y) = (waves as f64, ns as f64);
        let terms = [1.0, x, x * x, y, x * y];
        let mut sums = [0.0; 5];
        for ((sum, slot), term) in sums.iter_mut().zip(&self.sums).zip(terms) {
            *sum = f64::from_bits(slot.load(Ordering::Relaxed)) * DECAY + weight * term;
            slot.store(sum.to_bits(), Ordering::Relaxed);
        }
        let [n, sx, sxx, sy, sxy] = sums;
        let (mean_x, mean_y) = (sx / n, sy / n);
        let var = sxx / n - mean_x * mean_x;
        let one_size = var <= 0.01 * mean_x * mean_x;
        let (mut fixed, mut per_wave) = if !one_size {
            let slope = ((sxy / n - mean_x * mean_y) / var).max(0.0);
            (mean_y - slope * mean_x, slope)
        } else {
            let fixed = mean_y.min(FIXED_PRIOR_NS);
            (fixed, (mean_y - fixed) / mean_x)
        };
        if fixed < 0.0 {
            (fixed, per_wave) = (0.0, mean_y / mean_x);
        }
        price
            .fixed_ns
            .store(fixed.round() as u64, Ordering::Relaxed);
        // Never (0, 0), which means "not measured".
        let per_wave = (per_wave.round() as u64).max(u64::from(fixed < 1.0));
        price.per_wave_ns.store(per_wave, Ordering::Relaxed);
        one_size
    }
}

/// Charges awaiting a measurement's price.
#[derive(Default)]
struct Unsettled {
    launches: AtomicU64,
    waves: AtomicU64,
    ns: AtomicU64,
}

impl Unsettled {
    fn add(&self, batch: &Batch) {
        self.launches.fetch_add(batch.launches, Ordering::Relaxed);
        self.waves.fetch_add(batch.waves, Ordering::Relaxed);
        self.ns.fetch_add(batch.ns, Ordering::Relaxed);
    }

    fn remove(&self, waves: u64, ns: u64) {
        for (counter, amount) in [(&self.launches, 1), (&self.waves, waves), (&self.ns, ns)] {
            counter
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |value| {
                    Some(value.saturating_sub(amount))
                })
                .ok();
        }
    }

    /// What the pod owes for everything unsettled at `price`.
    fn settle(&self, price: (u64, u64)) -> i64 {
        let launches = self.launches.swap(0, Ordering::Relaxed);
        let waves = self.waves.swap(0, Ordering::Relaxed);
        let charged = self.ns.swap(0, Ordering::Relaxed);
        signed(Price::of(price, launches, waves)) - signed(charged)
    }
}

/// A thread's charges to one entry not added to it yet (see the module's
/// docs, 6). All zero is an empty batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Batch {
    /// The entry's index + 1, or [`UNSLOTTED`]; 0 while empty.
    entry: usize,
    launches: u64,
    waves: u64,
    ns: u64,
}

// SAFETY: integers only; all zero is the empty batch.
unsafe impl gpushare_hook::thread_local::ZeroInit for Batch {}

/// A batch's `entry` for launches of functions without an entry.
const UNSLOTTED: usize = usize::MAX;

impl Batch {
    fn entry_of(slot: Option<usize>) -> usize {
        slot.map_or(UNSLOTTED, |index| index + 1)
    }

    fn is_empty(&self) -> bool {
        self.launches == 0
    }
}

/// One function's entry. What a launch touches (the key, the price, the
/// unsettled sums) shares one cache line; the fit's sums, which only the
/// monitor reads, sit on the next: a launch after a stretch of application
/// work takes one cache miss here, not three.
#[derive(Default)]
#[repr(C, align(64))]
struct Slot {
    key: AtomicU64,
    price: Price,
    unsettled: Unsettled,
    /// Launches priced before the first measurement.
    unmeasured_launches: AtomicU64,
    /// A wanted measurement of the function (see [`Charge::wanted`]) is
    /// in flight.
    measuring: AtomicBool,
    /// The grid size, in waves, of every measurement the fit holds; 0 once
    /// it holds several sizes (or none).
    lone_waves: AtomicU32,
    fit: Fit,
}

const _: () = assert!(std::mem::offset_of!(Slot, fit) == 64);
const _: () = assert!(size_of::<Slot>() == 128);

/// Per-function fits and the process-wide one.
pub(crate) struct CostModel {
    slots: Box<[Slot]>,
    /// Over every measurement: prices functions not measured yet.
    process: Fit,
    process_price: Price,
    /// Launches of functions without an entry.
    unslotted: Unsettled,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            slots: (0..SLOTS).map(|_| Slot::default()).collect(),
            process: Fit::default(),
            process_price: Price::default(),
            unslotted: Unsettled::default(),
        }
    }
}

impl CostModel {
    /// The entry of `key`, claimed if absent; `None` when there is no room.
    /// Most launches find their function at its home entry: that is the
    /// inlined path, the probing the out-of-line one.
    #[inline]
    fn slot(&self, key: LaunchKey) -> Option<usize> {
        let home = key.0 as usize % SLOTS;
        if self.slots[home].key.load(Ordering::Acquire) == key.0 {
            return Some(home);
        }
        self.probe(key)
    }

    #[cold]
    #[inline(never)]
    fn probe(&self, key: LaunchKey) -> Option<usize> {
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

    fn process_price(&self) -> (u64, u64) {
        self.process_price.get().unwrap_or((0, INITIAL_PER_WAVE_NS))
    }

    fn unsettled(&self, slot: Option<usize>) -> &Unsettled {
        slot.map_or(&self.unslotted, |index| &self.slots[index].unsettled)
    }

    /// Charges one launch of `key` running in `waves` waves, in the calling
    /// thread's `batch`.
    #[inline]
    pub(crate) fn charge(&self, key: LaunchKey, waves: u64, batch: &mut Batch) -> Charge {
        let waves = waves.max(1);
        let mut charge = Charge {
            ns: 0,
            waves,
            slot: self.slot(key),
            unmeasured: false,
            wanted: false,
            ahead: 0,
        };
        let price = match charge.slot {
            Some(index) => {
                let slot = &self.slots[index];
                match slot.price.get() {
                    Some(price) => {
                        let lone = slot.lone_waves.load(Ordering::Relaxed);
                        if lone != 0 && u64::from(lone) != waves {
                            charge.wanted = !slot.measuring.swap(true, Ordering::AcqRel);
                        }
                        price
                    }
                    None => {
                        charge.unmeasured = true;
                        charge.ahead = slot.unmeasured_launches.fetch_add(1, Ordering::Relaxed);
                        charge.wanted = !slot.measuring.swap(true, Ordering::AcqRel);
                        self.process_price()
                    }
                }
            }
            None => self.process_price(),
        };
        charge.ns = Price::of(price, 1, waves).max(1);
        let entry = Batch::entry_of(charge.slot);
        if charge.unmeasured {
            // Priced at a guess: its first measurement settles it, at once.
            let one = Batch {
                entry,
                launches: 1,
                waves,
                ns: charge.ns,
            };
            self.unsettled(charge.slot).add(&one);
            return charge;
        }
        if batch.entry != entry || batch.launches >= BATCH_LAUNCHES || batch.ns >= BATCH_NS {
            self.flush(batch);
            batch.entry = entry;
        }
        batch.launches += 1;
        batch.waves += waves;
        batch.ns += charge.ns;
        charge
    }

    /// Adds a thread's `batch` to its entry, and empties it.
    #[inline(never)]
    pub(crate) fn flush(&self, batch: &mut Batch) {
        if !batch.is_empty() {
            let slot = (batch.entry != UNSLOTTED).then(|| batch.entry - 1);
            self.unsettled(slot).add(batch);
        }
        *batch = Batch::default();
    }

    /// Whether the function of `charge` is still unmeasured with its first
    /// measurement in flight.
    pub(crate) fn awaiting_measurement(&self, charge: &Charge) -> bool {
        charge.slot.is_some_and(|index| {
            let slot = &self.slots[index];
            slot.price.get().is_none() && slot.measuring.load(Ordering::Acquire)
        })
    }

    /// Takes back a charge whose launch did not run, made by the calling
    /// thread, whose `batch` holds it unless it was added since.
    pub(crate) fn refund(&self, charge: &Charge, batch: &mut Batch) {
        if batch.entry == Batch::entry_of(charge.slot) && !batch.is_empty() {
            batch.launches -= 1;
            batch.waves = batch.waves.saturating_sub(charge.waves);
            batch.ns = batch.ns.saturating_sub(charge.ns);
        } else {
            self.unsettled(charge.slot).remove(charge.waves, charge.ns);
        }
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
    pub(crate) fn abandon(&self, charge: &Charge) {
        if let (true, Some(index)) = (charge.wanted, charge.slot) {
            self.slots[index].measuring.store(false, Ordering::Release);
        }
    }

    /// Folds in that `charge`'s launch kept the GPU busy `measured_ns`, and
    /// returns what the pod owes on top of its charges (negative: is owed)
    /// for every launch of the function charged since its last measurement.
    /// `contention`: what else launched on the device meanwhile. Called by
    /// the monitor thread only.
    pub(crate) fn record(&self, charge: &Charge, measured_ns: u64, contention: Contention) -> i64 {
        let measured = measured_ns.max(1);
        let (fit, price) = charge
            .slot
            .map_or((&self.process, &self.process_price), |index| {
                (&self.slots[index].fit, &self.slots[index].price)
            });
        let expected = price
            .get()
            .map(|price| Price::of(price, 1, charge.waves).max(1));
        let measured = match expected {
            Some(expected) => {
                let recent = fit.floor.note(measured as f32 / expected as f32);
                let at = |ratio: f32| ((expected as f64 * f64::from(ratio)).round() as u64).max(1);
                match contention {
                    // Stretched by the other clients' blocks, or read short
                    // now and then: taken as the lower quartile of what the
                    // kernel took lately.
                    Contention::SharedSms => at(recent.lower_quartile),
                    // Held up now and then by another context's time slice:
                    // taken as the median of what the kernel took lately.
                    Contention::TimeSliced => at(recent.median),
                    Contention::Alone => measured,
                }
            }
            None => measured,
        };
        let weight = match expected {
            Some(expected) if measured > expected => contention.weight_above_price(),
            _ => 1.0,
        };
        if charge.slot.is_some() {
            self.process
                .add(&self.process_price, charge.waves, measured, weight);
        }
        let one_size = fit.add(price, charge.waves, measured, weight);
        let Some(index) = charge.slot else {
            return self.unslotted.settle(self.process_price());
        };
        let slot = &self.slots[index];
        // Waves beyond u32 are as good as several sizes: never wanted.
        let lone = u32::try_from(charge.waves).ok().filter(|_| one_size);
        slot.lone_waves.store(lone.unwrap_or(0), Ordering::Relaxed);
        if charge.wanted {
            slot.measuring.store(false, Ordering::Release);
        }
        slot.unsettled
            .settle(slot.price.get().unwrap_or((0, measured)))
    }
}

fn signed(ns: u64) -> i64 {
    i64::try_from(ns).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests;

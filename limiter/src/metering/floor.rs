//! A function's recent measurements, as ratios to their prices: the floor
//! that prices a kernel beside other MPS clients, and the median that
//! prices one beside time-sliced pods.

use std::sync::atomic::{AtomicU8, AtomicU16, Ordering};

/// What a function's recent measurements took, as ratios to the price each
/// was measured against (so launches of any grid size compare): the last
/// [`FLOOR_RING`], read at their lower quartile and their median (see
/// [`Recent`]). Beside other MPS clients every measurement of a kernel can
/// be stretched, never shortened, so the least it took is the best evidence
/// of what it takes: the floor is the second least, so that one measurement
/// read short (a bracket less its estimated overhead) does not set it.
/// Beside time-sliced pods most measurements are what the kernel takes and
/// a few hold another context's slice: the median is not moved by those
/// few. A kernel that really takes longer now raises both within
/// [`FLOOR_RING`] measurements. Written by the monitor thread only (ratios
/// in 1/[`RATIO_ONE`]; 0: none yet).
#[derive(Default)]
pub(super) struct Floor {
    ratios: [AtomicU16; FLOOR_RING],
    next: AtomicU8,
}

/// Measurements a [`Floor`] keeps.
pub(super) const FLOOR_RING: usize = 8;
/// A ratio of 1 in a [`Floor`]: ratios up to 16 are kept as they are.
const RATIO_ONE: f32 = 4096.0;

/// The ratios a [`Floor`] keeps, read after a measurement is noted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Recent {
    /// The second least (the least while only one is kept).
    pub(super) lower_quartile: f32,
    /// The middle one; of an even count, the lower of the two middle ones,
    /// so that one ratio above them never moves it.
    pub(super) median: f32,
}

impl Floor {
    /// Notes a measurement of `ratio` times its price; returns the ratios
    /// kept, this one included, at their lower quartile and median.
    pub(super) fn note(&self, ratio: f32) -> Recent {
        let kept = (ratio * RATIO_ONE).round().clamp(1.0, f32::from(u16::MAX)) as u16;
        let next = usize::from(self.next.load(Ordering::Relaxed)) % FLOOR_RING;
        self.ratios[next].store(kept, Ordering::Relaxed);
        self.next
            .store(((next + 1) % FLOOR_RING) as u8, Ordering::Relaxed);
        let mut sorted = [0u16; FLOOR_RING];
        let mut count = 0;
        let noted = self
            .ratios
            .iter()
            .map(|ratio| ratio.load(Ordering::Relaxed));
        for (to, ratio) in sorted.iter_mut().zip(noted.filter(|&ratio| ratio != 0)) {
            *to = ratio;
            count += 1;
        }
        let kept = &mut sorted[..count];
        kept.sort_unstable();
        // Never empty (it holds the ratio just noted): past its end is its last.
        let at = |index: usize| {
            kept.get(index)
                .or(kept.last())
                .map_or(0.0, |&ratio| f32::from(ratio) / RATIO_ONE)
        };
        Recent {
            lower_quartile: at(1),
            median: at(count.saturating_sub(1) / 2),
        }
    }
}

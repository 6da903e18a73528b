//! How many waves a kernel's grid runs in.
//!
//! A GPU runs at once as many blocks as its SMs hold: SMs × the function's
//! occupancy at that block size and shared memory. A grid of more blocks runs
//! in waves, and its time grows with their number, not with the grid's exact
//! size: that is what lets one measurement of a function price every other
//! grid size of it (see [`crate::metering`]). The SM count is asked once per
//! device, the occupancy once per (function, block size, shared memory), in a
//! small direct-mapped cache of atomics: a miss costs one driver call.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use gpushare_utils::MAX_DEVICES;

use crate::hash::mix;

/// Dynamic shared memory is looked up in steps of this many bytes.
const SHARED_STEP: u32 = 8 * 1024;
/// Occupancy cache entries (a power of two).
const OCCUPANCY_SLOTS: usize = 1024;
/// Resident blocks per SM when the driver cannot say: Hopper's and Ampere's
/// limits of 2048 threads and 32 blocks per SM.
const MAX_THREADS_PER_SM: u32 = 2048;
const MAX_BLOCKS_PER_SM: u32 = 32;

/// What the GPU says about itself; the driver in production, a table in tests.
pub(crate) trait GpuShape {
    fn sm_count(&self, device: usize) -> Option<u32>;
    fn blocks_per_sm(&self, function: usize, threads: u32, shared_bytes: u32) -> Option<u32>;
}

/// One kernel launch's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Grid {
    pub function: usize,
    pub blocks: u64,
    pub threads: u32,
    pub shared_bytes: u32,
}

/// SM counts per device and occupancies per launch configuration.
pub(crate) struct Waves {
    sm_count: [AtomicU32; MAX_DEVICES],
    /// Tag (hash with the low byte cleared) | blocks per SM; 0 = empty.
    occupancy: Box<[AtomicU64]>,
}

impl Default for Waves {
    fn default() -> Self {
        Self {
            sm_count: [const { AtomicU32::new(0) }; MAX_DEVICES],
            occupancy: (0..OCCUPANCY_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }
}

impl Waves {
    /// The number of waves `grid` runs in on `device` (at least 1).
    #[inline]
    pub(crate) fn count(&self, device: usize, grid: Grid, gpu: &impl GpuShape) -> u64 {
        let Some(sms) = self.sms(device, gpu) else {
            return 1;
        };
        // Every SM holds at least one block of a launchable kernel: a grid
        // of at most one block per SM (most small launches) is one wave
        // without looking its occupancy up.
        if grid.blocks <= u64::from(sms) {
            return 1;
        }
        let per_wave = u64::from(sms) * u64::from(self.blocks_per_sm(grid, gpu));
        if grid.blocks <= per_wave {
            return 1; // most launches: no division on the launch path
        }
        grid.blocks.div_ceil(per_wave.max(1))
    }

    #[inline]
    fn sms(&self, device: usize, gpu: &impl GpuShape) -> Option<u32> {
        let slot = self.sm_count.get(device)?;
        match slot.load(Ordering::Relaxed) {
            0 => {
                let sms = gpu.sm_count(device)?;
                slot.store(sms, Ordering::Relaxed);
                Some(sms)
            }
            sms => Some(sms),
        }
    }

    #[inline]
    fn blocks_per_sm(&self, grid: Grid, gpu: &impl GpuShape) -> u32 {
        // Kernels whose dynamic shared memory follows the data (softmax over
        // a growing sequence) would miss the cache at every launch: asked in
        // steps of SHARED_STEP, rounded up (a bound on occupancy, which only
        // changes in allocation steps anyway).
        let shared_bytes = grid
            .shared_bytes
            .div_ceil(SHARED_STEP)
            .saturating_mul(SHARED_STEP);
        let hash = mix(grid.function as u64
            ^ u64::from(grid.threads).rotate_left(48)
            ^ u64::from(shared_bytes).rotate_left(24));
        let tag = hash & !0xff;
        let slot = &self.occupancy[hash as usize % OCCUPANCY_SLOTS];
        let cached = slot.load(Ordering::Relaxed);
        if cached != 0 && cached & !0xff == tag {
            return (cached & 0xff) as u32;
        }
        Self::ask_occupancy(slot, tag, grid, shared_bytes, gpu)
    }

    /// Asks the driver for an occupancy the cache lacks, and caches it.
    #[cold]
    #[inline(never)]
    fn ask_occupancy(
        slot: &AtomicU64,
        tag: u64,
        grid: Grid,
        shared_bytes: u32,
        gpu: &impl GpuShape,
    ) -> u32 {
        let blocks = gpu
            .blocks_per_sm(grid.function, grid.threads, shared_bytes)
            .unwrap_or_else(|| fallback_blocks_per_sm(grid.threads))
            .clamp(1, 255);
        slot.store(tag | u64::from(blocks), Ordering::Relaxed);
        blocks
    }
}

/// Resident blocks per SM from the thread and block limits alone.
fn fallback_blocks_per_sm(threads: u32) -> u32 {
    (MAX_THREADS_PER_SM / threads.max(1)).clamp(1, MAX_BLOCKS_PER_SM)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// 132 SMs; occupancy 8 for function 1, unknown for others; counts asks.
    struct H100 {
        asked: Cell<u32>,
    }

    impl GpuShape for H100 {
        fn sm_count(&self, _device: usize) -> Option<u32> {
            Some(132)
        }
        fn blocks_per_sm(&self, function: usize, _threads: u32, _shared: u32) -> Option<u32> {
            self.asked.set(self.asked.get() + 1);
            (function == 1).then_some(8)
        }
    }

    fn grid(function: usize, blocks: u64, threads: u32) -> Grid {
        Grid {
            function,
            blocks,
            threads,
            shared_bytes: 0,
        }
    }

    #[test]
    fn grids_run_in_waves_of_what_the_sms_hold() {
        let gpu = H100 {
            asked: Cell::new(0),
        };
        let waves = Waves::default();
        // One block per SM at most: one wave, no occupancy asked.
        assert_eq!(waves.count(0, grid(1, 1, 256), &gpu), 1);
        assert_eq!(waves.count(0, grid(1, 132, 256), &gpu), 1);
        assert_eq!(gpu.asked.get(), 0, "a grid the SMs hold at one block each");
        assert_eq!(waves.count(0, grid(1, 133, 256), &gpu), 1);
        assert_eq!(waves.count(0, grid(1, 1056, 256), &gpu), 1);
        assert_eq!(waves.count(0, grid(1, 1057, 256), &gpu), 2);
        assert_eq!(waves.count(0, grid(1, 10_560, 256), &gpu), 10);
        assert_eq!(gpu.asked.get(), 1, "the occupancy is asked once");
        // Unknown occupancy: 2048 / 128 = 16 blocks per SM.
        assert_eq!(waves.count(0, grid(2, 2112, 128), &gpu), 1);
        assert_eq!(waves.count(0, grid(2, 2113, 128), &gpu), 2);
        // Tiny blocks are capped at 32 per SM.
        assert_eq!(waves.count(0, grid(2, 132 * 32 + 1, 32), &gpu), 2);
        // Shared memory that grows with the data is asked in steps.
        let asked = gpu.asked.get();
        for shared_bytes in (0..8192).step_by(64) {
            let grid = Grid {
                shared_bytes,
                ..grid(1, 1000, 256)
            };
            waves.count(0, grid, &gpu);
        }
        assert_eq!(
            gpu.asked.get() - asked,
            1,
            "1 to 8 KiB asked once (0 was before)"
        );
        // A device beyond the table: one wave, whatever the grid.
        assert_eq!(waves.count(MAX_DEVICES, grid(1, 1 << 40, 256), &gpu), 1);
    }
}

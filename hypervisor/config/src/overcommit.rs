//! Memory overcommit as placement sees it: how much memory each GPU offers
//! to pods' quotas. A GPU that overcommits (`[swap] overcommit`) offers its
//! memory times `[swap] overcommit_ratio`, since the daemon makes room there
//! by swapping idle pods to host memory; any other GPU offers its own
//! memory. Kubernetes places pods by this figure (the ResourceSlice's and the
//! device plugin's capacity, the provisioner's count); one pod's quota on a
//! GPU never exceeds the GPU's own memory, which no swapping can enlarge.

use std::fmt;

/// How far the quotas on a GPU that overcommits may add up past its memory,
/// kept in thousandths so that capacities are exact integers (`1.5` is
/// 1,500): at least 1, at most [`OvercommitRatio::MAX`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct OvercommitRatio(u32);

impl OvercommitRatio {
    /// No overcommit: the GPU's own memory.
    pub const ONE: Self = Self(1_000);
    /// Where `overcommit` is on and no ratio is given: twice the memory.
    pub const DEFAULT: Self = Self(2_000);
    /// The largest ratio taken. Past it, the value is far more likely a
    /// percentage written as a ratio (`150` for 1.5) than a wish to promise
    /// pods ten times a GPU, most of it in host memory.
    pub const MAX: Self = Self(10_000);

    /// `ratio`, rounded down to thousandths; `None` unless it is finite
    /// and between 1 and [`Self::MAX`].
    pub fn new(ratio: f64) -> Option<Self> {
        if !ratio.is_finite() || !(1.0..=f64::from(Self::MAX.0) / 1_000.0).contains(&ratio) {
            return None;
        }
        // In range, so the product fits a u32; `as` floors a positive value.
        Some(Self((ratio * 1_000.0) as u32))
    }

    /// `bytes` times the ratio, rounded down.
    pub fn times(self, bytes: u64) -> u64 {
        let product = u128::from(bytes) * u128::from(self.0) / 1_000;
        u64::try_from(product).unwrap_or(u64::MAX)
    }
}

impl fmt::Display for OvercommitRatio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (whole, thousandths) = (self.0 / 1_000, self.0 % 1_000);
        if thousandths == 0 {
            write!(f, "{whole}")
        } else {
            let digits = format!("{thousandths:03}");
            write!(f, "{whole}.{}", digits.trim_end_matches('0'))
        }
    }
}

/// The memory each GPU of the node offers to pods' quotas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCapacity {
    /// The GPUs that overcommit, by NVML index; `None`: every GPU.
    overcommit: Option<Vec<u32>>,
    ratio: OvercommitRatio,
}

impl MemoryCapacity {
    /// No GPU overcommits: each offers its own memory.
    pub const NONE: Self = Self {
        overcommit: Some(Vec::new()),
        ratio: OvercommitRatio::ONE,
    };

    /// `ratio` on the GPUs of `overcommit` (NVML indexes; `None`: every GPU).
    pub fn new(overcommit: Option<Vec<u32>>, ratio: OvercommitRatio) -> Self {
        Self { overcommit, ratio }
    }

    /// Whether the GPU of NVML index `index` overcommits.
    pub fn overcommits(&self, index: u32) -> bool {
        self.ratio > OvercommitRatio::ONE
            && self
                .overcommit
                .as_ref()
                .is_none_or(|gpus| gpus.contains(&index))
    }

    /// What the GPU of NVML index `index` with `memory` bytes offers to
    /// quotas, all pods together: `memory`, or `memory` times the ratio
    /// where it overcommits.
    pub fn of(&self, index: u32, memory: u64) -> u64 {
        if self.overcommits(index) {
            self.ratio.times(memory)
        } else {
            memory
        }
    }
}

impl Default for MemoryCapacity {
    /// [`MemoryCapacity::NONE`].
    fn default() -> Self {
        Self::NONE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn ratios_are_taken_in_thousandths_between_one_and_ten() {
        for (given, kept, shown) in [
            (1.0, 1_000, "1"),
            (1.5, 1_500, "1.5"),
            (1.25, 1_250, "1.25"),
            (1.0005, 1_000, "1"),
            (2.0, 2_000, "2"),
            (10.0, 10_000, "10"),
        ] {
            let ratio = OvercommitRatio::new(given).unwrap();
            assert_eq!(ratio.0, kept, "{given}");
            assert_eq!(ratio.to_string(), shown, "{given}");
        }
        for refused in [0.0, 0.999, -1.5, 10.001, 150.0, f64::NAN, f64::INFINITY] {
            assert_eq!(OvercommitRatio::new(refused), None, "{refused}");
        }
    }

    #[test]
    fn only_gpus_that_overcommit_offer_more_than_their_memory() {
        let ratio = OvercommitRatio::new(1.5).unwrap();
        let some = MemoryCapacity::new(Some(vec![1]), ratio);
        assert_eq!(some.of(0, 16 * GIB), 16 * GIB);
        assert_eq!(some.of(1, 16 * GIB), 24 * GIB);
        let every = MemoryCapacity::new(None, ratio);
        assert_eq!(every.of(7, 80 * GIB), 120 * GIB);
        // Rounded down to the byte.
        assert_eq!(every.of(0, 3), 4);
        assert_eq!(MemoryCapacity::default().of(0, 16 * GIB), 16 * GIB);
        // A ratio of one is no overcommit, whichever GPUs are named.
        let one = MemoryCapacity::new(None, OvercommitRatio::ONE);
        assert!(!one.overcommits(0));
        assert_eq!(OvercommitRatio::MAX.times(u64::MAX), u64::MAX);
    }
}

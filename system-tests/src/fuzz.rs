//! The fuzz tests' random numbers: a seeded xorshift64* generator, so a
//! failing run is the same run again. Not for anything but tests.

/// A seeded generator of random numbers.
pub struct Rng(u64);

impl Rng {
    /// A generator started at `seed` (not zero: xorshift stays at zero).
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The next number.
    pub fn number(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n` (which is not zero).
    pub fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.number() % n as u64).unwrap_or(0)
    }

    /// True `percent` times in a hundred.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.number() % 100 < percent
    }

    /// One of `items` (which are not none).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    /// Up to `max - 1` random bytes.
    pub fn bytes(&mut self, max: usize) -> Vec<u8> {
        let len = self.below(max);
        (0..len).map(|_| self.number().to_le_bytes()[0]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_gives_one_sequence_and_every_value_is_in_range() {
        let (mut a, mut b) = (Rng::new(7), Rng::new(7));
        let first: Vec<u64> = (0..8).map(|_| a.number()).collect();
        assert_eq!(first, (0..8).map(|_| b.number()).collect::<Vec<_>>());
        assert_ne!(first[0], first[1]);
        assert!((0..1000).all(|_| a.below(3) < 3));
        assert!((0..1000).all(|_| a.bytes(4).len() < 4));
        let picked: std::collections::BTreeSet<_> = (0..100).map(|_| *a.pick(&[1, 2])).collect();
        assert_eq!(picked.len(), 2, "both items come up");
        assert_ne!(
            Rng::new(0).number(),
            0,
            "a zero seed does not stick at zero"
        );
    }
}

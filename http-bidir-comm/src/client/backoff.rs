//! Retry delays.

use std::time::Duration;

/// Jittered exponential backoff ("equal jitter": half fixed, half random), so
/// that many clients of a restarted hub do not come back in one burst.
#[derive(Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
    rng: u64,
}

impl Backoff {
    /// Delays from `min` doubling up to `max`; `seed` drives the jitter (any
    /// value; differing per process spreads the retries).
    pub fn new(min: Duration, max: Duration, seed: u64) -> Self {
        let min = min.max(Duration::from_millis(1));
        let max = max.max(min);
        Self {
            min,
            max,
            current: min,
            rng: seed | 1,
        }
    }

    /// Back to `min`, after a success.
    pub fn reset(&mut self) {
        self.current = self.min;
    }

    /// The next delay: between half and all of the current step, which then doubles.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.current;
        self.current = self.current.saturating_mul(2).min(self.max);
        // xorshift64: plenty for jitter.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let half = base / 2;
        let span = u64::try_from(half.as_micros()).unwrap_or(u64::MAX).max(1);
        half + Duration::from_micros(self.rng % (span + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_and_caps() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800), 42);
        let bases = [100, 200, 400, 800, 800, 800];
        for base in bases {
            let d = b.next_delay();
            let base = Duration::from_millis(base);
            assert!(
                d >= base / 2 && d <= base,
                "{d:?} not in [{:?}, {base:?}]",
                base / 2
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn backoff_tolerates_zero_and_inverted_bounds() {
        let mut b = Backoff::new(Duration::ZERO, Duration::ZERO, 0);
        assert!(b.next_delay() <= Duration::from_millis(1));
        let mut b = Backoff::new(Duration::from_secs(2), Duration::from_secs(1), 7);
        assert!(b.next_delay() <= Duration::from_secs(2));
    }
}

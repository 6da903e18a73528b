//! The one clock of the workspace: `CLOCK_MONOTONIC`, the same in every process
//! of a time namespace, so timestamps written to shared memory by one process
//! mean the same to another.

/// The monotonic clock every process of the node shares, in nanoseconds.
/// Inlined: it is on the launch path, which runs cold.
#[inline]
pub fn monotonic_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC)
}

/// [`monotonic_ns`] as of the kernel's last timer tick: never ahead of it,
/// behind by at most a tick (1 to 4 ms). It reads a value the kernel keeps,
/// without the clock source: 9 ns on the H100 machine's host, where
/// [`monotonic_ns`] takes 41. For decisions a tick's lag cannot change.
#[inline]
pub fn monotonic_coarse_ns() -> u64 {
    read(libc::CLOCK_MONOTONIC_COARSE)
}

/// Reads `clock` in nanoseconds.
#[inline]
fn read(clock: libc::clockid_t) -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; both clocks read here exist on every
    // Linux since 2.6.32 and are answered by the vDSO without a system call.
    unsafe { libc::clock_gettime(clock, &mut now) };
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}

/// [`monotonic_ns`] in whole milliseconds.
pub fn monotonic_ms() -> u64 {
    monotonic_ns() / 1_000_000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn milliseconds_follow_nanoseconds() {
        let before = monotonic_ns() / 1_000_000;
        let ms = monotonic_ms();
        let after = monotonic_ns() / 1_000_000;
        assert!(before <= ms && ms <= after);
    }

    #[test]
    fn the_coarse_clock_is_the_same_clock_never_ahead_and_at_most_a_tick_behind() {
        for _ in 0..1_000 {
            let coarse = monotonic_coarse_ns();
            let fine = monotonic_ns();
            assert!(coarse <= fine, "coarse {coarse} ahead of {fine}");
            // A tick is at most 10 ms (HZ >= 100); allow for preemption.
            assert!(
                fine - coarse < 50_000_000,
                "coarse {coarse} behind {fine} by more than 50 ms"
            );
        }
    }
}

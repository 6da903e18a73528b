//! The one clock of the workspace: `CLOCK_MONOTONIC`, the same in every process
//! of a time namespace, so timestamps written to shared memory by one process
//! mean the same to another.

/// The monotonic clock every process of the node shares, in nanoseconds.
/// Inlined: it is on the launch path, which runs cold.
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC always exists on Linux,
    // and is answered by the vDSO without a system call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
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
}

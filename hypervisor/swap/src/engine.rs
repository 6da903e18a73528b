//! Swapping a pod's processes together: every process is locked before any
//! is checkpointed, and every one restored before any is unlocked, so the
//! pod's processes never run while some of them are away (they may share
//! memory through the pod's own means, and a process that ran alone would
//! wait on its partners anyway).
//!
//! Each step looks at the driver's state of each process first, so a step
//! is safe to repeat: after a failure, and after a daemon restart, the same
//! call finishes what is left.

use std::time::{Duration, Instant};

use crate::driver::{CheckpointDriver, DriverError, ProcessState, RawUuid};

/// How long a lock waits for a process's submitted work.
pub const LOCK_TIMEOUT_MS: u32 = 10_000;
/// Tries of a restore the driver refused, and the pause before each retry.
pub const RESTORE_TRIES: u32 = 3;
const RESTORE_PAUSE: Duration = Duration::from_millis(200);

/// Why a pod could not be swapped; the pod is left as the variant says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SwapError {
    /// Nothing to swap: no process of the pod runs (none was proven its,
    /// or all exited).
    #[error("the pod has no running process")]
    NoProcess,
    /// A swap-out failed; every process is running again, nothing moved.
    #[error("swap-out refused, the pod runs on: {0}")]
    Refused(DriverError),
    /// The pod called CUDA as the swap began; it runs on.
    #[error("the pod is active (it called CUDA as the swap-out began)")]
    Active,
    /// A swap-in failed after every try; the pod stays in host memory (its
    /// processes locked) and may be tried again.
    #[error("swap-in failed, the pod stays in host memory: {0}")]
    Restore(DriverError),
}

/// What a finished swap took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Locking (out) or restoring (in) every process.
    pub first: Duration,
    /// Checkpointing (out) or unlocking (in) every process.
    pub second: Duration,
}

impl Timing {
    /// Both steps.
    pub fn total(&self) -> Duration {
        self.first + self.second
    }
}

/// Locks every process of `pids`, asks `still_idle` whether the pod may
/// go (it reads the pod's last call, which a call that slipped in before
/// the lock has stamped), then checkpoints every process. Any failure
/// undoes what was done: the processes checkpointed are restored, all are
/// unlocked, and the pod runs on. A process that exits on the way is done
/// with: its device memory went with it, and it blocks nothing.
pub fn swap_out(
    driver: &CheckpointDriver,
    pids: &[u32],
    still_idle: impl FnOnce() -> bool,
) -> Result<Timing, SwapError> {
    let start = Instant::now();
    let mut locked = Vec::with_capacity(pids.len());
    for &pid in pids {
        match driver.state(pid) {
            Ok(ProcessState::Running) => {}
            Ok(_) => {
                locked.push(pid);
                continue;
            }
            Err(_) if gone(pid) => continue,
            Err(error) => {
                undo(driver, &locked, &[]);
                return Err(SwapError::Refused(error));
            }
        }
        match driver.lock(pid, LOCK_TIMEOUT_MS) {
            Ok(()) => locked.push(pid),
            Err(_) if gone(pid) => {}
            Err(error) => {
                undo(driver, &locked, &[]);
                return Err(SwapError::Refused(error));
            }
        }
    }
    if locked.is_empty() {
        return Err(SwapError::NoProcess);
    }
    if !still_idle() {
        undo(driver, &locked, &[]);
        return Err(SwapError::Active);
    }
    let locking = start.elapsed();
    let mut checkpointed = Vec::with_capacity(locked.len());
    for &pid in &locked {
        if driver.state(pid) == Ok(ProcessState::Checkpointed) {
            checkpointed.push(pid);
            continue;
        }
        match driver.checkpoint(pid) {
            Ok(()) => checkpointed.push(pid),
            Err(_) if gone(pid) => {}
            Err(error) => {
                undo(driver, &locked, &checkpointed);
                return Err(SwapError::Refused(error));
            }
        }
    }
    Ok(Timing {
        first: locking,
        second: start.elapsed() - locking,
    })
}

/// Restores every checkpointed process of `pids` (each GPU of `pairs` onto
/// its partner), retrying a refused restore, then unlocks them all. A
/// process that is gone is skipped: its host memory went with it.
pub fn swap_in(
    driver: &CheckpointDriver,
    pids: &[u32],
    pairs: &[(RawUuid, RawUuid)],
) -> Result<Timing, SwapError> {
    let restoring = restore_all(driver, pids, pairs)?;
    let unlocking = unlock_all(driver, pids)?;
    Ok(Timing {
        first: restoring,
        second: unlocking,
    })
}

/// The first half of [`swap_in`]: every process restored (each GPU of
/// `pairs` onto its partner), still locked, so that what must follow the
/// pod to its GPUs can be done before any of its processes runs.
pub fn restore_all(
    driver: &CheckpointDriver,
    pids: &[u32],
    pairs: &[(RawUuid, RawUuid)],
) -> Result<Duration, SwapError> {
    let start = Instant::now();
    for &pid in pids {
        let mut tries = 0;
        loop {
            match driver.state(pid) {
                Ok(ProcessState::Checkpointed | ProcessState::Failed) => {}
                Ok(ProcessState::Running | ProcessState::Locked) => break,
                // Gone, or not a CUDA process any more.
                Err(_) if gone(pid) => break,
                Err(error) => return Err(SwapError::Restore(error)),
            }
            tries += 1;
            match driver.restore(pid, pairs) {
                Ok(()) => break,
                Err(error) if tries >= RESTORE_TRIES => return Err(SwapError::Restore(error)),
                Err(error) => {
                    tracing::warn!(pid, tries, %error, "restore refused; trying again");
                    std::thread::sleep(RESTORE_PAUSE * tries);
                }
            }
        }
    }
    Ok(start.elapsed())
}

/// The second half of [`swap_in`]: every locked process of `pids` unlocked.
pub fn unlock_all(driver: &CheckpointDriver, pids: &[u32]) -> Result<Duration, SwapError> {
    let start = Instant::now();
    for &pid in pids {
        if driver.state(pid) == Ok(ProcessState::Locked)
            && let Err(error) = driver.unlock(pid)
            && !gone(pid)
        {
            return Err(SwapError::Restore(error));
        }
    }
    Ok(start.elapsed())
}

/// The GPU pairs that restore a pod's processes from the GPU `from` onto
/// `to`: the two exchanged, and every other GPU of the node (`others`)
/// onto itself. The driver takes a permutation: it refuses `from` onto `to`
/// alone (measured on a 580 driver), even for a process that sees only
/// `from`; a process's CUDA device that named `to` names `from` after.
pub fn move_pairs(from: RawUuid, to: RawUuid, others: &[RawUuid]) -> Vec<(RawUuid, RawUuid)> {
    let mut pairs = vec![(from, to), (to, from)];
    pairs.extend(
        others
            .iter()
            .filter(|&&gpu| gpu != from && gpu != to)
            .map(|&gpu| (gpu, gpu)),
    );
    pairs
}

/// Puts back what a failed swap-out did: restores `checkpointed`, then
/// unlocks `locked`. Failures are logged; the process is left to the next
/// swap-in, which looks at its state again.
fn undo(driver: &CheckpointDriver, locked: &[u32], checkpointed: &[u32]) {
    for &pid in checkpointed {
        if let Err(error) = driver.restore(pid, &[]) {
            tracing::error!(pid, %error, "cannot restore a process after a failed swap-out");
        }
    }
    for &pid in locked {
        if let Err(error) = driver.unlock(pid) {
            tracing::error!(pid, %error, "cannot unlock a process after a failed swap-out");
        }
    }
}

fn gone(pid: u32) -> bool {
    gpushare_utils::process::process_is_gone(i32::try_from(pid).unwrap_or(i32::MAX), 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_exchanges_two_gpus_and_keeps_the_others_in_place() {
        let gpu = |n: u8| [n; 16];
        assert_eq!(
            move_pairs(gpu(0), gpu(2), &[gpu(0), gpu(1), gpu(2), gpu(3)]),
            vec![
                (gpu(0), gpu(2)),
                (gpu(2), gpu(0)),
                (gpu(1), gpu(1)),
                (gpu(3), gpu(3))
            ]
        );
        assert_eq!(
            move_pairs(gpu(1), gpu(0), &[]),
            vec![(gpu(1), gpu(0)), (gpu(0), gpu(1))]
        );
    }
}

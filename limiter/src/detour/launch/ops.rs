//! Launch logic, in safe Rust on typed values: wait while the pod is
//! swapped out, say what the launch runs, then let the throttle admit it.
//! The detour makes the launch once it is admitted, and once more where
//! the GPU had no room for it and room was made.

use super::super::memory::driver_free;
use super::super::room::{made_room_saying, wants_room};
use crate::detour::held;
use crate::entry::{self, Limiter};
use crate::error::{LimiterError, Pass, Result};
use crate::sys::{CUfunction, CUgraphExec, CUresult, CUstream};
use crate::throttle::{Admitted, Work};
use crate::waves::Grid;

/// The limiter, once the pod is on its GPUs: a launch of a swapped-out pod
/// waits here, before anything is charged (one load, the coarse clock, the
/// pod's stamp and one more load when it is resident).
#[inline(always)]
fn resident() -> Result<&'static Limiter> {
    #[cfg(feature = "launch-ab")]
    if ab::bypassed() {
        return Err(LimiterError::Bypass(Pass::AbSwitchedOff));
    }
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    #[cfg(feature = "launch-ab")]
    let gate = !ab::swap_gate_bypassed();
    #[cfg(not(feature = "launch-ab"))]
    let gate = true;
    if gate {
        limiter.resident();
    }
    Ok(limiter)
}

/// Admits a launch of `work`; the one branch taken when no device has a
/// compute limit is the `Bypass` here.
#[inline(always)]
fn admit(
    limiter: &'static Limiter,
    work: impl FnOnce() -> Work,
    stream: CUstream,
    per_thread: bool,
) -> Result<Admitted> {
    let throttle = limiter
        .compute
        .as_ref()
        .ok_or(LimiterError::Bypass(Pass::NoComputeLimit))?;
    throttle.admit(&limiter.context, work(), stream, per_thread)
}

/// A kernel of `grid` blocks of `block` threads and `shared_bytes` dynamic
/// shared memory; `per_thread` when the API took stream 0 as the per-thread
/// default stream.
#[inline(always)]
pub(super) fn kernel(
    f: CUfunction,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    stream: CUstream,
    per_thread: bool,
) -> Result<Admitted> {
    let limiter = resident()?;
    #[cfg(feature = "launch-ab")]
    let check = !ab::first_launch_bypassed();
    #[cfg(not(feature = "launch-ab"))]
    let check = true;
    if check {
        first_launch(limiter, f)?;
    }
    let work = || {
        Work::Kernel(Grid {
            function: f as usize,
            blocks: grid.iter().map(|&d| u64::from(d)).product(),
            threads: block.iter().product::<u32>(),
            shared_bytes,
        })
    };
    admit(limiter, work, stream, per_thread)
}

/// Whether a kernel launch the driver answered `result` is made once more
/// (the detour asks after each try): one the GPU had no room for, other
/// pods filling it, as the driver loads a kernel's code at its first
/// launch, once the hypervisor made room. One compare on every launch.
#[inline(always)]
pub(super) fn again(result: CUresult, tries: u32) -> bool {
    result == CUresult::ERROR_OUT_OF_MEMORY && room_for_launch(tries)
}

#[cold]
#[inline(never)]
fn room_for_launch(tries: u32) -> bool {
    if !wants_room(CUresult::ERROR_OUT_OF_MEMORY, tries) {
        return false;
    }
    let Some(limiter) = entry::limiter() else {
        return false;
    };
    let ctx = &limiter.context;
    let device = ctx
        .driver()
        .and_then(|driver| driver.current_device().ok())
        .and_then(|device| usize::try_from(device).ok());
    // The launch's device is the current one: the driver's free memory is
    // that device's.
    device.is_some_and(|device| made_room_saying(ctx, device, 0, driver_free()))
}

/// A handle launched for the first time may load its library's globals
/// (lazy loading): checked once, off the fast path, which is a probe of the
/// checked handles.
#[inline(always)]
fn first_launch(limiter: &'static Limiter, f: CUfunction) -> Result<()> {
    if limiter.memory.lazy.unchecked(f as usize) {
        check_first_launch(f)
    } else {
        Ok(())
    }
}

/// Only a refusal for memory stops the launch; anything else lets it run.
#[cold]
#[inline(never)]
fn check_first_launch(f: CUfunction) -> Result<()> {
    match held::first_launch(f as usize, driver_free) {
        Err(error @ (LimiterError::OverQuota { .. } | LimiterError::LedgerUnavailable)) => {
            Err(error)
        }
        _ => Ok(()),
    }
}

/// An instantiated graph.
#[inline(always)]
pub(super) fn graph(exec: CUgraphExec, stream: CUstream, per_thread: bool) -> Result<Admitted> {
    let limiter = resident()?;
    admit(limiter, || Work::Graph(exec as usize), stream, per_thread)
}

/// A legacy launch of a `width` × `height` grid of one-thread blocks.
pub(super) fn legacy(f: CUfunction, width: i32, height: i32, stream: CUstream) -> Result<Admitted> {
    let grid = [width.max(0) as u32, height.max(0) as u32, 1];
    kernel(f, grid, [1, 1, 1], 0, stream, false)
}

/// The launch path's within-process A/B (feature `launch-ab`, benchmarks
/// only): a program switches the admission off and on between its launches,
/// so that both arms share its host's drift and its memory layout. With
/// `GPUSHARE_LAUNCH_AB_PART=first-launch` the switch takes out only the
/// first-launch check of libraries' globals, with `swap-gate` only the
/// residency gate (swap), and the rest of the admission stays.
#[cfg(feature = "launch-ab")]
mod ab {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, Ordering};

    static BYPASSED: AtomicBool = AtomicBool::new(false);
    static PART: OnceLock<Option<String>> = OnceLock::new();

    fn part() -> Option<&'static str> {
        PART.get_or_init(|| std::env::var("GPUSHARE_LAUNCH_AB_PART").ok())
            .as_deref()
    }

    /// The whole admission is switched off.
    pub(super) fn bypassed() -> bool {
        BYPASSED.load(Ordering::Relaxed) && part().is_none()
    }

    /// Only the first-launch check is switched off.
    pub(super) fn first_launch_bypassed() -> bool {
        BYPASSED.load(Ordering::Relaxed) && part() == Some("first-launch")
    }

    /// Only the residency gate is switched off.
    pub(super) fn swap_gate_bypassed() -> bool {
        BYPASSED.load(Ordering::Relaxed) && part() == Some("swap-gate")
    }

    /// Launches bypass the admission while `off` is nonzero.
    #[unsafe(no_mangle)]
    pub(super) extern "C" fn gpushare_launch_ab_bypass(off: i32) {
        BYPASSED.store(off != 0, Ordering::Relaxed);
    }
}

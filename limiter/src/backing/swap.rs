//! The swap of the memory the limiter backs, in the process itself, on the
//! hypervisor's word (`Command::SwapOut`, `Command::SwapIn` on the link's
//! thread, under the detour guard, while the pod's residency holds its
//! calls at the gate).
//!
//! **Out**: (1) every context that holds backed memory is made current in
//! turn and waited for, so no work of the program still uses the memory;
//! (2) each range without a host copy gets one, pinned; (3) every range is
//! copied there; (4) each is unmapped and its physical memory released: the
//! GPU's free memory rises by those bytes, the address range stays
//! reserved and the quota still charges it. A failure before (4) changes
//! nothing; one in (4) brings the ranges already released back (as a
//! swap-in does), so a swap-out that fails is undone.
//!
//! **In**: memory is created on each range's GPU, mapped at the same
//! address with the same access, and the bytes copied back. Host copies are
//! never given up: a swap-in that fails part-way gives back what it mapped,
//! leaves every byte in host memory and can be asked again.
//!
//! **Host memory: one pinned buffer per allocation**, made at its first
//! swap-out and kept until the program frees the allocation. Pinning costs
//! far more than copying (0.4–0.6 s a GiB with `cuMemHostAlloc`, against
//! about 50 GiB/s for the copy on an H200), so a buffer kept makes every
//! later swap run at the speed of the link; one per allocation (rather than
//! one arena) goes with its allocation when the program frees it, never
//! fragments, and never needs to grow while the pod waits.
//!
//! Each part is timed with the monotonic clock ([`SwapDurations`]), so a
//! run on a GPU can say where the time went.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::MutexGuard;
use std::time::{Duration, Instant};

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::protocol::{FastSwapReport, SwapDurations};

use super::{Backed, Backing};
use crate::context::Context;
use crate::driver::{Copies, DriverError, Vmm};
use crate::sys::CUdeviceptr;

/// Why a swap of the backed memory was not done.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SwapError {
    #[error("fast swap is off in this process (CUDA_LIMITER_FAST_SWAP is not set)")]
    Off,
    #[error("the driver lacks the functions a fast swap needs")]
    NoDriver,
    #[error("the book of backed memory is poisoned")]
    Poisoned,
    #[error("waiting for the process's work failed: {0}")]
    Sync(DriverError),
    #[error("pinning host memory failed: {0}")]
    Pin(DriverError),
    #[error("copying to host memory failed: {0}")]
    CopyOut(DriverError),
    #[error("unmapping device memory failed: {error}; {}", undo_outcome(.undone))]
    Unmap {
        error: DriverError,
        /// How bringing back the ranges already released ended.
        undone: Result<(), Box<SwapError>>,
    },
    #[error("creating device memory failed: {0}")]
    Create(DriverError),
    #[error("mapping device memory failed: {0}")]
    Map(DriverError),
    #[error("copying back to the device failed: {0}")]
    CopyBack(DriverError),
}

fn undo_outcome(undone: &Result<(), Box<SwapError>>) -> String {
    match undone {
        Ok(()) => "every range is resident again".to_owned(),
        Err(error) => format!("bringing back what was released failed too ({error})"),
    }
}

type Book<'a> = MutexGuard<'a, BTreeMap<CUdeviceptr, Backed>>;

impl Backing {
    /// Moves every backed range to pinned host memory and gives its device
    /// memory back; see the module documentation.
    pub(crate) fn swap_out(&self, ctx: &Context) -> Result<FastSwapReport, SwapError> {
        let (vmm, copies, mut book) = self.open(ctx)?;
        let _restore = CurrentContext::keep(copies)?;
        let mut durations = SwapDurations::default();

        let started = Instant::now();
        let contexts: BTreeSet<usize> = book.values().map(|b| b.context).collect();
        for context in contexts {
            copies
                .make_current(context)
                .and_then(|()| copies.synchronize())
                .map_err(SwapError::Sync)?;
        }
        durations.sync_us = micros(started.elapsed());

        let started = Instant::now();
        for backed in book.values_mut().filter(|b| b.host.is_none()) {
            copies
                .make_current(backed.context)
                .map_err(SwapError::Pin)?;
            backed.host = Some(copies.pin(backed.size).map_err(SwapError::Pin)?);
        }
        durations.pin_us = micros(started.elapsed());

        let out: Vec<CUdeviceptr> = book
            .iter()
            .filter(|(_, b)| b.memory.is_some())
            .map(|(&address, _)| address)
            .collect();
        let started = Instant::now();
        for address in &out {
            let backed = &book[address];
            let host = backed
                .host
                .as_ref()
                .ok_or(SwapError::Pin(DriverError::NOT_FOUND))?;
            copies
                .make_current(backed.context)
                .and_then(|()| copies.to_host(host, *address))
                .map_err(SwapError::CopyOut)?;
        }
        durations.copy_us = micros(started.elapsed());

        let started = Instant::now();
        for (done, address) in out.iter().enumerate() {
            let Some(backed) = book.get_mut(address) else {
                continue;
            };
            let Some(handle) = backed.memory else {
                continue;
            };
            if let Err(error) = vmm.unmap(*address, backed.size) {
                let mut undo = SwapDurations::default();
                let undone = bring_back(vmm, copies, &mut book, &out[..done], &mut undo);
                return Err(SwapError::Unmap {
                    error,
                    undone: undone.map_err(Box::new),
                });
            }
            // Unmapped, the memory is the limiter's alone: a refused release
            // keeps it on the GPU, nothing worse.
            if let Err(error) = vmm.release(handle) {
                tracing::warn!(address, %error, "swapped-out memory was unmapped but not released");
            }
            backed.memory = None;
        }
        durations.release_us = micros(started.elapsed());
        Ok(report(ctx, &book, &out, durations))
    }

    /// Brings every range in host memory back to its GPU at the same
    /// address; see the module documentation.
    pub(crate) fn swap_in(&self, ctx: &Context) -> Result<FastSwapReport, SwapError> {
        let (vmm, copies, mut book) = self.open(ctx)?;
        let _restore = CurrentContext::keep(copies)?;
        let away: Vec<CUdeviceptr> = book
            .iter()
            .filter(|(_, b)| b.memory.is_none())
            .map(|(&address, _)| address)
            .collect();
        let mut durations = SwapDurations::default();
        bring_back(vmm, copies, &mut book, &away, &mut durations)?;
        Ok(report(ctx, &book, &away, durations))
    }

    fn open<'a>(&'a self, ctx: &'a Context) -> Result<(&'a Vmm, &'a Copies, Book<'a>), SwapError> {
        if !self.enabled {
            return Err(SwapError::Off);
        }
        let driver = ctx.driver().ok_or(SwapError::NoDriver)?;
        let vmm = driver.vmm.as_ref().ok_or(SwapError::NoDriver)?;
        let copies = driver.copies.as_ref().ok_or(SwapError::NoDriver)?;
        let book = self.book.lock().map_err(|_| SwapError::Poisoned)?;
        Ok((vmm, copies, book))
    }
}

/// Creates and maps memory under each range of `addresses` (in host memory
/// now), then copies their bytes back. On a failure the ranges this call
/// mapped are given back again, so every byte stays in host memory and the
/// call can be made again.
fn bring_back(
    vmm: &Vmm,
    copies: &Copies,
    book: &mut Book<'_>,
    addresses: &[CUdeviceptr],
    durations: &mut SwapDurations,
) -> Result<(), SwapError> {
    let mut mapped = Vec::with_capacity(addresses.len());
    let started = Instant::now();
    let mapping = addresses.iter().try_for_each(|&address| {
        let Some(backed) = book.get_mut(&address) else {
            return Ok(());
        };
        let handle = vmm
            .create(backed.size, backed.device)
            .map_err(SwapError::Create)?;
        if let Err(error) = vmm.map(address, backed.size, handle, backed.device) {
            let _released = vmm.release(handle);
            return Err(SwapError::Map(error));
        }
        backed.memory = Some(handle);
        mapped.push(address);
        Ok(())
    });
    durations.map_us = micros(started.elapsed());

    let started = Instant::now();
    let copied = mapping.and_then(|()| {
        mapped.iter().try_for_each(|address| {
            let backed = &book[address];
            let host = backed
                .host
                .as_ref()
                .ok_or(SwapError::CopyBack(DriverError::NOT_FOUND))?;
            copies
                .make_current(backed.context)
                .and_then(|()| copies.to_device(*address, host))
                .map_err(SwapError::CopyBack)
        })
    });
    durations.copy_back_us = micros(started.elapsed());

    if copied.is_err() {
        for address in &mapped {
            let Some(backed) = book.get_mut(address) else {
                continue;
            };
            let Some(handle) = backed.memory else {
                continue;
            };
            // Nothing of the program ran on it: its bytes are the host copy's.
            if vmm.unmap(*address, backed.size).is_ok() {
                let _released = vmm.release(handle);
                backed.memory = None;
            }
        }
    }
    copied
}

/// What a swap that moved the ranges `moved` did.
fn report(
    ctx: &Context,
    book: &Book<'_>,
    moved: &[CUdeviceptr],
    durations: SwapDurations,
) -> FastSwapReport {
    let bytes = moved
        .iter()
        .filter_map(|address| book.get(address))
        .map(|b| b.size)
        .fold(0, u64::saturating_add);
    let pinned_bytes = book
        .values()
        .filter_map(|b| b.host.as_ref())
        .map(crate::driver::Pinned::bytes)
        .fold(0, u64::saturating_add);
    FastSwapReport {
        bytes,
        allocations: moved.len() as u64,
        unmoved_bytes: unmoved(ctx, book),
        pinned_bytes,
        durations,
    }
}

/// What the process holds on its GPUs beyond the backed memory mapped
/// there, by the driver's per-process figure (NVML); `None` where it says
/// nothing.
fn unmoved(ctx: &Context, book: &Book<'_>) -> Option<u64> {
    let driver = ctx.driver()?;
    let nvml = ctx.nvml()?;
    let pid = std::process::id();
    let devices = driver.device_count()?.min(MAX_DEVICES as u32);
    let held = (0..devices)
        .filter_map(|device| driver.device_uuid(device as i32))
        .filter_map(|uuid| nvml.process_used(&uuid, pid))
        .reduce(u64::saturating_add)?;
    let resident = book
        .values()
        .filter(|b| b.memory.is_some())
        .map(|b| b.size)
        .fold(0, u64::saturating_add);
    Some(held.saturating_sub(resident))
}

/// The calling thread's current context, made current again when dropped:
/// the swap makes each range's context current in turn.
struct CurrentContext<'a> {
    copies: &'a Copies,
    previous: usize,
}

impl<'a> CurrentContext<'a> {
    fn keep(copies: &'a Copies) -> Result<Self, SwapError> {
        let previous = copies.current().map_err(SwapError::Sync)?;
        Ok(Self { copies, previous })
    }
}

impl Drop for CurrentContext<'_> {
    fn drop(&mut self) {
        if let Err(error) = self.copies.make_current(self.previous) {
            tracing::warn!(%error, "the swapping thread's context was not restored");
        }
    }
}

fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

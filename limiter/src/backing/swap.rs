//! The swap of the memory the limiter backs, in the process itself, on the
//! hypervisor's word (`Command::SwapOut`, `Command::SwapIn` on the link's
//! thread, under the detour guard, while the pod's residency holds its
//! calls at the gate).
//!
//! **Out**: (1) every context that holds backed memory is made current in
//! turn and waited for, so no work of the program still uses the memory;
//! (2) every range is copied to its host buffer, on a stream of the
//! limiter's own per context, each chunk of a buffer pinned the first time
//! as the copy of the chunk before runs, and faulted in ahead of that by a
//! few threads of the limiter's (`driver::Faulting`); (3) each range is
//! unmapped and its physical memory released: the GPU's free memory rises
//! by those bytes, the address range stays reserved and the quota still
//! charges it; (4) each context's stack limit is set to nothing, which
//! gives back the memory the driver reserves for its threads' stacks (the
//! swap-in sets it again before anything else). A failure before (3)
//! changes nothing; one in (3) brings the ranges already released back (as
//! a swap-in does), so a swap-out that fails is undone.
//!
//! **In**: memory is created on each range's GPU, mapped at the same
//! address with the same access, and the bytes copied back, on a stream of
//! the limiter's own per context. Host copies are never given up by a
//! swap-in: one that fails part-way gives back what it mapped, leaves every
//! byte in host memory and can be asked again.
//!
//! **Host memory: one buffer per allocation** (`driver::HostBuffer`), made
//! at its first swap-out, or ahead of it on the hypervisor's word
//! (`super::prepare`), and kept, pinned, so that every later swap runs at
//! the speed of the link, until the program frees the allocation or the
//! hypervisor asks for the host memory back ([`Backing::release_host`],
//! `Command::ReleaseHost`) while the pod is on its GPU: its host memory
//! for swaps is bounded. One per allocation (rather than one arena) goes
//! with its allocation, never fragments, and never needs to grow while the
//! pod waits.
//!
//! Each part is timed with the monotonic clock ([`SwapDurations`]), so a
//! run on a GPU can say where the time went.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::protocol::{FastSwapReport, SwapDurations};

use super::{Backed, Backing};
use crate::context::Context;
use crate::driver::{Copies, DriverError, Faulting, HostBuffer, Span, Vmm};
use crate::sys::CUdeviceptr;

/// Why a swap of the backed memory was not done.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SwapError {
    #[error("fast swap is off in this process (CUDA_LIMITER_FAST_SWAP is not set)")]
    Off,
    #[error("the driver lacks the functions a fast swap needs")]
    NoDriver,
    #[error(
        "memory of this process is shared with another by CUDA IPC: its copies would not be the importers'"
    )]
    Shared,
    #[error(
        "the process holds {0} bytes of managed memory, which its limiter cannot move and NVML does not show"
    )]
    Managed(u64),
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

pub(super) type Book<'a> = MutexGuard<'a, BTreeMap<CUdeviceptr, Backed>>;

impl Backing {
    /// Moves every backed range to pinned host memory and gives its device
    /// memory back; see the module documentation.
    pub(crate) fn swap_out(&self, ctx: &Context) -> Result<FastSwapReport, SwapError> {
        let (vmm, copies, mut book) = self.open(ctx)?;
        self.movable(&book)?;
        let _restore = CurrentContext::keep(copies)?;
        let mut durations = SwapDurations::default();
        let pinned_before = host_bytes(&book);

        let started = Instant::now();
        let contexts: BTreeSet<usize> = book.values().map(|b| b.context).collect();
        for &context in &contexts {
            copies
                .make_current(context)
                .and_then(|()| copies.synchronize())
                .map_err(SwapError::Sync)?;
        }
        durations.sync_us = micros(started.elapsed());

        let out: Vec<CUdeviceptr> = book
            .iter()
            .filter(|(_, b)| b.memory.is_some())
            .map(|(&address, _)| address)
            .collect();
        let started = Instant::now();
        for address in &out {
            if let Some(backed) = book.get_mut(address)
                && backed.host.is_none()
            {
                backed.host = Some(copies.host_buffer(backed.size).map_err(SwapError::Pin)?);
            }
        }
        let order = by_context(&book, &out);
        let spans: Vec<Span> = order
            .values()
            .flatten()
            .filter_map(|address| book.get(address)?.host.as_ref())
            .flat_map(HostBuffer::unpinned_spans)
            .collect();
        let faulting = Faulting::new(&spans);
        let mut timed = CopyOutTimes::default();
        let copied = std::thread::scope(|scope| {
            // SAFETY: the spans are unpinned chunks of the book's host
            // buffers: private mappings that hold nothing yet, which only a
            // release frees, and this swap holds the book until the scope
            // has joined the threads.
            unsafe { faulting.start(scope) };
            let copied = copy_out(copies, &mut book, &order, &faulting, &mut timed);
            faulting.stop();
            copied
        });
        durations.pin_us = micros(timed.pinning);
        durations.fault_wait_us = micros(timed.fault_wait);
        durations.copy_us = micros(started.elapsed());
        copied?;

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
        self.shrink_stacks(copies, &contexts);
        durations.release_us = micros(started.elapsed());
        Ok(report(ctx, &book, &out, pinned_before, durations))
    }

    /// Gives back the memory the driver keeps for the threads' stacks of
    /// `contexts`, sized by their stack limit, while their memory is away:
    /// nothing of theirs runs until the swap-in sets each limit again. A
    /// driver that will not shrink one keeps it, as without this. Run once
    /// the memory is released, it cannot fail the swap-out.
    fn shrink_stacks(&self, copies: &Copies, contexts: &BTreeSet<usize>) {
        let mut stacks = self.stacks.lock().unwrap_or_else(PoisonError::into_inner);
        for &context in contexts {
            if stacks.iter().any(|&(shrunk, _)| shrunk == context) {
                continue;
            }
            let Ok(()) = copies.make_current(context) else {
                continue;
            };
            let Some(Ok(bytes)) = copies.stack_size() else {
                continue;
            };
            if bytes == 0 {
                continue;
            }
            match copies.set_stack_size(0) {
                Ok(()) => stacks.push((context, bytes)),
                Err(error) => {
                    tracing::debug!(context, %error, "a context's stacks were not shrunk while swapped");
                }
            }
        }
    }

    /// Sets the stack limits [`Self::shrink_stacks`] lowered as they were;
    /// one the driver refuses (no room for it yet) fails the swap-in, which
    /// is asked again, and those set stay set.
    fn restore_stacks(&self, copies: &Copies) -> Result<(), SwapError> {
        let mut stacks = self.stacks.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some(&(context, bytes)) = stacks.last() {
            copies
                .make_current(context)
                .and_then(|()| copies.set_stack_size(bytes))
                .map_err(SwapError::Create)?;
            stacks.pop();
        }
        Ok(())
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
        let pinned_before = host_bytes(&book);
        let mut durations = SwapDurations::default();
        let started = Instant::now();
        self.restore_stacks(copies)?;
        durations.map_us = micros(started.elapsed());
        bring_back(vmm, copies, &mut book, &away, &mut durations)?;
        Ok(report(ctx, &book, &away, pinned_before, durations))
    }

    /// Gives back the host copies of the ranges on their GPUs (those of
    /// ranges in host memory stay: they hold the only copy); what the
    /// process then still holds pinned is in the report. A copy the driver
    /// would not unpin stays, and is tried again at the next call.
    pub(crate) fn release_host(&self, ctx: &Context) -> Result<FastSwapReport, SwapError> {
        let (_, copies, mut book) = self.open(ctx)?;
        let started = Instant::now();
        let (mut bytes, mut allocations) = (0u64, 0u64);
        for (address, backed) in book.iter_mut().filter(|(_, b)| b.memory.is_some()) {
            let Some(host) = backed.host.take() else {
                continue;
            };
            let pinned = host.pinned();
            match copies.free_buffer(host) {
                Ok(()) => {
                    bytes = bytes.saturating_add(pinned);
                    allocations += 1;
                }
                Err((host, error)) => {
                    tracing::warn!(address, %error, "a host copy was not given back");
                    backed.host = Some(host);
                }
            }
        }
        let durations = SwapDurations {
            release_us: micros(started.elapsed()),
            ..SwapDurations::default()
        };
        Ok(FastSwapReport {
            bytes,
            allocations,
            unmoved_bytes: None,
            pinned_bytes: host_bytes(&book),
            pinned_new_bytes: 0,
            durations,
        })
    }

    /// Whether a swap of the backed memory moves all that the process's
    /// own swap must: not while any is shared, nor beside managed memory.
    pub(super) fn movable(&self, book: &Book<'_>) -> Result<(), SwapError> {
        if self.shared(book) {
            return Err(SwapError::Shared);
        }
        match self.managed.bytes() {
            0 => Ok(()),
            held => Err(SwapError::Managed(held)),
        }
    }

    pub(super) fn open<'a>(
        &'a self,
        ctx: &'a Context,
    ) -> Result<(&'a Vmm, &'a Copies, Book<'a>), SwapError> {
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

/// Where the time of a swap-out's copies went besides the copies.
#[derive(Default)]
struct CopyOutTimes {
    /// In the driver's pinning.
    pinning: Duration,
    /// Waiting for memory to be faulted in ahead of its pinning.
    fault_wait: Duration,
}

/// Copies the ranges `order` lists, context by context, to their host
/// buffers, pinning each chunk not pinned yet (once `faulting` has faulted
/// it in: its spans are those chunks, in this order) as the copy of the
/// one before runs.
fn copy_out(
    copies: &Copies,
    book: &mut Book<'_>,
    order: &BTreeMap<usize, Vec<CUdeviceptr>>,
    faulting: &Faulting<'_>,
    timed: &mut CopyOutTimes,
) -> Result<(), SwapError> {
    let mut span = 0;
    for (&context, ranges) in order {
        copies.make_current(context).map_err(SwapError::CopyOut)?;
        let stream = copies.stream().map_err(SwapError::CopyOut)?;
        let queued = ranges.iter().try_for_each(|&address| {
            let Some(host) = book.get_mut(&address).and_then(|b| b.host.as_mut()) else {
                return Ok(());
            };
            for (offset, len) in host.chunks() {
                if host.pinned() < offset + len {
                    timed.fault_wait += faulting.wait(span);
                    span += 1;
                    let began = Instant::now();
                    copies
                        .pin_through(host, offset + len)
                        .map_err(SwapError::Pin)?;
                    timed.pinning += began.elapsed();
                }
                copies
                    .to_host(host, offset, len, address + offset, &stream)
                    .map_err(SwapError::CopyOut)?;
            }
            Ok(())
        });
        // The copies queued are waited for whatever happened: none may
        // still write into a buffer once the book is let go.
        let finished = copies.finish(stream).map_err(SwapError::CopyOut);
        queued.and(finished)?;
    }
    Ok(())
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
    durations.map_us += micros(started.elapsed());

    let started = Instant::now();
    let copied = mapping.and_then(|()| {
        by_context(book, &mapped)
            .into_iter()
            .try_for_each(|(context, ranges)| {
                copies.make_current(context).map_err(SwapError::CopyBack)?;
                let stream = copies.stream().map_err(SwapError::CopyBack)?;
                let queued = ranges.iter().try_for_each(|address| {
                    let host = book[address]
                        .host
                        .as_ref()
                        .ok_or(SwapError::CopyBack(DriverError::NOT_FOUND))?;
                    host.chunks().try_for_each(|(offset, len)| {
                        copies
                            .to_device(address + offset, host, offset, len, &stream)
                            .map_err(SwapError::CopyBack)
                    })
                });
                let finished = copies.finish(stream).map_err(SwapError::CopyBack);
                queued.and(finished)
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

/// What a swap that moved the ranges `moved` did, the process holding
/// `pinned_before` bytes of host copies as it began.
fn report(
    ctx: &Context,
    book: &Book<'_>,
    moved: &[CUdeviceptr],
    pinned_before: u64,
    durations: SwapDurations,
) -> FastSwapReport {
    let bytes = moved
        .iter()
        .filter_map(|address| book.get(address))
        .map(|b| b.size)
        .fold(0, u64::saturating_add);
    let pinned_bytes = host_bytes(book);
    FastSwapReport {
        bytes,
        allocations: moved.len() as u64,
        unmoved_bytes: unmoved(ctx, book),
        pinned_bytes,
        pinned_new_bytes: pinned_bytes.saturating_sub(pinned_before),
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

/// The pinned bytes of the host copies the book holds.
pub(super) fn host_bytes(book: &Book<'_>) -> u64 {
    book.values()
        .filter_map(|b| b.host.as_ref())
        .map(HostBuffer::pinned)
        .fold(0, u64::saturating_add)
}

/// `addresses` grouped by the context each range's work runs in, in order.
fn by_context(book: &Book<'_>, addresses: &[CUdeviceptr]) -> BTreeMap<usize, Vec<CUdeviceptr>> {
    let mut groups: BTreeMap<usize, Vec<CUdeviceptr>> = BTreeMap::new();
    for address in addresses {
        if let Some(backed) = book.get(address) {
            groups.entry(backed.context).or_default().push(*address);
        }
    }
    groups
}

/// The calling thread's current context, made current again when dropped:
/// the swap makes each range's context current in turn.
pub(super) struct CurrentContext<'a> {
    copies: &'a Copies,
    previous: usize,
}

impl<'a> CurrentContext<'a> {
    pub(super) fn keep(copies: &'a Copies) -> Result<Self, SwapError> {
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

pub(super) fn micros(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
}

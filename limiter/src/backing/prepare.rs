//! Host copies made ahead of a swap-out, on the hypervisor's word
//! (`Command::PrepareHost`), while the program runs on.
//!
//! A range's first swap-out pins host memory nobody has touched: the
//! kernel finds and zeroes every page as the driver pins it, which for tens
//! of GiB takes seconds, against a fraction of one for the copy itself.
//! The hypervisor asks an idle pod it may swap out next to prepare: each
//! range on the GPU without a host copy gets one, faulted in by a few
//! threads (`driver::Faulting`) and pinned chunk by chunk, so that the
//! swap-out, when it comes, only copies.
//!
//! The book is held only to list the ranges and to hand them their copies:
//! the pinning runs without it, so the program's allocations and frees go
//! on meanwhile. A range freed meanwhile, or one whose address now holds a
//! range of another size, gets nothing: its copy is given back at once.
//! A failure gives back every copy this call made; the ranges stay as
//! they were (a swap-out pins their copies as it copies, as without this).

use std::time::Instant;

use gpushare_utils::protocol::{FastSwapReport, SwapDurations};

use super::Backing;
use super::swap::{CurrentContext, SwapError, host_bytes, micros};
use crate::context::Context;
use crate::driver::{Copies, DriverError, Faulting, HostBuffer, Span};
use crate::sys::CUdeviceptr;

/// A copy made for one range: the range's address, size and context when
/// listed, and its buffer.
struct Made {
    address: CUdeviceptr,
    size: u64,
    context: usize,
    host: HostBuffer,
}

impl Backing {
    /// Makes and pins the host copies the ranges on their GPUs lack; see
    /// the module documentation. The report's `bytes` and
    /// `pinned_new_bytes` are what was pinned and handed to ranges.
    pub(crate) fn prepare_host(&self, ctx: &Context) -> Result<FastSwapReport, SwapError> {
        let (_, copies, book) = self.open(ctx)?;
        // Its swap-out would be the checkpoint's: copies would go unused.
        self.movable(&book)?;
        let wanted: Vec<(CUdeviceptr, u64, usize)> = book
            .iter()
            .filter(|(_, b)| b.memory.is_some() && b.host.is_none())
            .map(|(&address, b)| (address, b.size, b.context))
            .collect();
        drop(book);
        let _restore = CurrentContext::keep(copies)?;
        let mut durations = SwapDurations::default();
        let started = Instant::now();

        let mut made = Vec::with_capacity(wanted.len());
        for (address, size, context) in wanted {
            match copies.host_buffer(size) {
                Ok(host) => made.push(Made {
                    address,
                    size,
                    context,
                    host,
                }),
                Err(error) => return Err(give_back(copies, made, SwapError::Pin(error))),
            }
        }
        let spans: Vec<Span> = made.iter().flat_map(|m| m.host.unpinned_spans()).collect();
        let faulting = Faulting::new(&spans);
        let pinned = std::thread::scope(|scope| {
            // SAFETY: the spans are chunks of the buffers just made, which
            // hold nothing and stay mapped (this call owns them) until the
            // scope has joined the threads.
            unsafe { faulting.start(scope) };
            let pinned = pin_all(copies, &mut made, &faulting, &mut durations);
            faulting.stop();
            pinned
        });
        if let Err(error) = pinned {
            return Err(give_back(copies, made, SwapError::Pin(error)));
        }
        durations.copy_us = micros(started.elapsed());

        let mut book = self.book.lock().map_err(|_| SwapError::Poisoned)?;
        let (mut bytes, mut allocations) = (0u64, 0u64);
        for one in made {
            match book.get_mut(&one.address) {
                Some(backed) if backed.host.is_none() && backed.size == one.size => {
                    bytes = bytes.saturating_add(one.host.pinned());
                    allocations += 1;
                    backed.host = Some(one.host);
                }
                _ => free(copies, one.host),
            }
        }
        Ok(FastSwapReport {
            bytes,
            allocations,
            unmoved_bytes: None,
            pinned_bytes: host_bytes(&book),
            pinned_new_bytes: bytes,
            durations,
        })
    }
}

/// Pins every chunk of the buffers `made`, each once `faulting` has
/// faulted it in (its spans are those chunks, in this order), in the
/// context of the buffer's range; the time spent pinning and waiting goes
/// into `durations`.
fn pin_all(
    copies: &Copies,
    made: &mut [Made],
    faulting: &Faulting<'_>,
    durations: &mut SwapDurations,
) -> Result<(), DriverError> {
    let mut span = 0;
    let (mut pinning, mut waiting) = (std::time::Duration::ZERO, std::time::Duration::ZERO);
    for one in made.iter_mut() {
        copies.make_current(one.context)?;
        for (offset, len) in one.host.chunks() {
            waiting += faulting.wait(span);
            span += 1;
            let began = Instant::now();
            copies.pin_through(&mut one.host, offset + len)?;
            pinning += began.elapsed();
        }
    }
    durations.pin_us = micros(pinning);
    durations.fault_wait_us = micros(waiting);
    Ok(())
}

/// Gives back every buffer of `made`, then hands back `error`.
fn give_back(copies: &Copies, made: Vec<Made>, error: SwapError) -> SwapError {
    for one in made {
        free(copies, one.host);
    }
    error
}

/// Unpins and unmaps a copy no range holds; one the driver will not unpin
/// is logged and left (it is host memory only, and pinned).
fn free(copies: &Copies, host: HostBuffer) {
    if let Err((_, error)) = copies.free_buffer(host) {
        tracing::warn!(%error, "a host copy made ahead was not given back");
    }
}

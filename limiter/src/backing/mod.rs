//! Device memory the limiter backs itself with the driver's virtual memory
//! management (VMM) API, so that it can later move it to host memory and
//! back at the same addresses (swap at the speed of the link). Opt-in
//! (`CUDA_LIMITER_FAST_SWAP`): a pod that never swaps pays nothing.
//!
//! 1. **Which allocations.** `cuMemAlloc_v2` and `cuMemAllocPitch_v2` (and
//!    the runtime's `cudaMalloc`/`cudaMallocPitch`, which reach them) of at
//!    least [`THRESHOLD`] bytes on a limited device, at least one granule of
//!    the device's VMM memory: below it every allocation would hold a whole
//!    granule and make four driver calls instead of one, so a program of
//!    many small allocations would pay in memory and time; from it on,
//!    rounding up to the granularity adds less than one granule, which
//!    frameworks' caching allocators (whose blocks are multiples of 2 MiB)
//!    never leave.
//! 2. **How.** An address range of the rounded size is reserved, physical
//!    memory of that size created on the calling context's device, mapped
//!    there and made readable and writable by that device; the program gets
//!    the range's address. The quota charges the rounded size (what the
//!    GPU holds). Any step failing undoes the others and the allocation is
//!    made by the driver as without this setting; but where the driver had
//!    no memory for it (the GPU full of other pods), room is asked of the
//!    hypervisor first, as for any allocation, and it is backed again:
//!    memory the driver made instead could leave the GPU only by the
//!    driver's checkpoint.
//! 3. **The book.** Each backed range, by address: the size asked for, the
//!    rounded size, the device and the physical memory. `cuMemFree_v2` (or
//!    `cuMemFreeAsync`) of one waits for the context, unmaps, releases and
//!    frees the range; the pointer queries answer with the base and size
//!    the program asked for, as for memory of `cuMemAlloc_v2`. Other
//!    pointers skip the book's lock while it is empty.
//! 4. **Swap** ([`swap`]): on the hypervisor's word, every backed range is
//!    copied to pinned host memory and its device memory given back, the
//!    range staying reserved; on the next word, memory is created and
//!    mapped at the same address and the bytes copied back. The host
//!    copies stay, so that the next swap-out runs at the speed of the
//!    link, until the hypervisor asks for them back (its host memory for
//!    swaps is bounded); it may also ask for them ahead of a first
//!    swap-out ([`prepare`]), which then only copies.
//! 5. **CUDA IPC** ([`ipc`]): the driver's legacy IPC cannot export VMM
//!    memory, so a backed range is shared as the VMM API shares memory (a
//!    file descriptor, handed over by the exporting process), behind the
//!    same calls; a process whose memory is shared declines the fast swap.
//! 6. **Managed memory** ([`managed`]) is the driver's to migrate: a
//!    process that holds any declines the fast swap, for the driver's
//!    checkpoint to decide.
//!
//! Policy on typed values: the memory policy (`detour/memory/ops.rs`) asks
//! here before it calls the driver; the driver's VMM functions are
//! [`Vmm`] in the driver table, reached through the [`Context`].

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::context::Context;
use crate::driver::{Copies, DriverError, HostBuffer, Vmm};
use crate::sys::{CUdevice, CUdeviceptr, CUmemGenericAllocationHandle, CUresult};

pub(crate) mod ipc;
mod managed;
mod prepare;
pub(crate) mod swap;

/// The smallest allocation that is backed: one granule of VMM memory on
/// every GPU the driver supports (a device with a larger granule backs
/// from its granule on).
pub(crate) const THRESHOLD: u64 = 2 << 20;

/// One backed range.
#[derive(Debug)]
struct Backed {
    /// What the program asked for.
    requested: u64,
    /// What is reserved, mapped and charged: `requested` rounded up to the granule.
    size: u64,
    /// The GPU the memory is on, and may access it.
    device: CUdevice,
    /// The context it was allocated in (0: unknown), whose work a swap
    /// waits for and in which it copies.
    context: usize,
    /// The physical memory mapped at the range; `None` while the range's
    /// bytes are in host memory (swapped out).
    memory: Option<CUmemGenericAllocationHandle>,
    /// The range's host copy, pinned as it is first copied into, from its
    /// first swap-out until the program frees the range or the hypervisor
    /// asks for the host memory back while the range is on the GPU.
    host: Option<HostBuffer>,
    /// Its export's id once exported for CUDA IPC ([`ipc`]).
    exported: Option<u64>,
}

/// What a backed allocation of some size takes on the calling context's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    pub device: CUdevice,
    /// The rounded size: what the quota charges.
    pub size: u64,
    granule: u64,
}

/// Why an allocation could not be backed; it is then made by the driver.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BackingError {
    #[error("cuMemAddressReserve failed: {0}")]
    Reserve(DriverError),
    #[error("cuMemCreate failed: {0}")]
    Create(DriverError),
    #[error("cuMemMap or cuMemSetAccess failed: {0}")]
    Map(DriverError),
    #[error("the book of backed memory is poisoned")]
    Poisoned,
}

/// This process's backed memory.
pub(crate) struct Backing {
    enabled: bool,
    book: Mutex<BTreeMap<CUdeviceptr, Backed>>,
    /// Entries of `book`, so that frees and queries of other memory skip the lock.
    live: AtomicUsize,
    /// The contexts whose threads' stacks a swap-out shrank, with the
    /// size each had, for the swap-in to set again (`backing::swap`).
    stacks: Mutex<Vec<(usize, usize)>>,
    /// Backed memory shared with other processes by CUDA IPC.
    ipc: ipc::Ipc,
    /// Managed memory, which a swap of the backed memory cannot move.
    managed: managed::Managed,
}

impl Backing {
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            book: Mutex::new(BTreeMap::new()),
            live: AtomicUsize::new(0),
            stacks: Mutex::new(Vec::new()),
            ipc: ipc::Ipc::default(),
            managed: managed::Managed::default(),
        }
    }

    /// Whether this process backs allocations (`CUDA_LIMITER_FAST_SWAP`).
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// What backing `bytes` would take on the calling context's device;
    /// `None` when it is not to be backed: the setting is off, the size is
    /// below the granule, or the driver cannot say.
    pub(crate) fn plan(&self, ctx: &Context, bytes: u64) -> Option<Plan> {
        if !self.enabled || bytes < THRESHOLD {
            return None;
        }
        let driver = ctx.driver()?;
        let vmm = driver.vmm.as_ref()?;
        let device = driver.current_device().ok()?;
        let granule = vmm.granularity(device).ok()?.max(1);
        let size = bytes.checked_next_multiple_of(granule)?;
        (bytes >= granule).then_some(Plan {
            device,
            size,
            granule,
        })
    }

    /// Backs `requested` bytes as `plan` says and returns the address the
    /// program gets; on failure nothing is left behind.
    pub(crate) fn back(
        &self,
        ctx: &Context,
        plan: Plan,
        requested: u64,
    ) -> Result<CUdeviceptr, BackingError> {
        let vmm = vmm(ctx).ok_or(BackingError::Reserve(DriverError::NOT_FOUND))?;
        let Plan {
            device,
            size,
            granule,
        } = plan;
        let address = vmm.reserve(size, granule).map_err(BackingError::Reserve)?;
        let handle = match vmm.create(size, device) {
            Ok(handle) => handle,
            Err(error) => {
                let _freed = vmm.free_address(address, size);
                return Err(BackingError::Create(error));
            }
        };
        if let Err(error) = vmm.map(address, size, handle, device) {
            let _released = vmm.release(handle);
            let _freed = vmm.free_address(address, size);
            return Err(BackingError::Map(error));
        }
        // Where its work runs: the context a swap waits for and copies in.
        let context = copies(ctx).and_then(|c| c.current().ok()).unwrap_or(0);
        let backed = Backed {
            requested,
            size,
            device,
            context,
            memory: Some(handle),
            host: None,
            exported: None,
        };
        match self.book.lock() {
            Ok(mut book) => {
                book.insert(address, backed);
                self.live.fetch_add(1, Ordering::AcqRel);
                Ok(address)
            }
            Err(_) => {
                // Ours, never handed out.
                let _undone = undo(vmm, address, &backed);
                Err(BackingError::Poisoned)
            }
        }
    }

    /// The driver made `bytes` of managed memory at `address`: listed
    /// where this process backs memory, whose own swap then declines.
    pub(crate) fn managed_made(&self, address: CUdeviceptr, bytes: u64) {
        if self.enabled {
            self.managed.made(address, bytes);
        }
    }

    /// The driver freed the memory at `address` (managed or not).
    pub(crate) fn freed(&self, address: CUdeviceptr) {
        self.managed.freed(address);
    }

    /// Bytes of managed memory this process holds.
    pub(crate) fn managed_bytes(&self) -> u64 {
        self.managed.bytes()
    }

    /// Whether `pointer` starts a backed range (a load while none is).
    pub(crate) fn holds(&self, pointer: CUdeviceptr) -> bool {
        self.live.load(Ordering::Acquire) > 0
            && self
                .book
                .lock()
                .is_ok_and(|book| book.contains_key(&pointer))
    }

    /// Frees the backed range at `pointer`: waits for the context, then
    /// unmaps, releases and frees it, and its host copy. The driver's
    /// answer; the range stays in the book when a step failed (nothing was
    /// freed, or the rest is tried again by the next free).
    pub(crate) fn free(&self, ctx: &Context, pointer: CUdeviceptr) -> CUresult {
        let Some(vmm) = vmm(ctx) else {
            return CUresult::ERROR_NOT_INITIALIZED;
        };
        let Ok(mut book) = self.book.lock() else {
            return CUresult::ERROR_INVALID_VALUE;
        };
        let Some(backed) = book.get(&pointer) else {
            return CUresult::ERROR_INVALID_VALUE;
        };
        if let Err(error) = vmm.synchronize().and_then(|()| undo(vmm, pointer, backed)) {
            return error.code();
        }
        let freed = book.remove(&pointer);
        self.live.fetch_sub(1, Ordering::AcqRel);
        if let Some(export) = freed.as_ref().and_then(|b| b.exported) {
            self.ipc.forget(export);
        }
        if let (Some(host), Some(copies)) = (freed.and_then(|b| b.host), copies(ctx))
            && let Err((_, error)) = copies.free_buffer(host)
        {
            tracing::warn!(address = pointer, %error, "a freed range's host copy was not given back");
        }
        CUresult::SUCCESS
    }

    /// The base and size the program asked for of the backed range that
    /// holds `pointer`, if one does.
    pub(crate) fn range(&self, pointer: CUdeviceptr) -> Option<(CUdeviceptr, u64)> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let book = self.book.lock().ok()?;
        let (&base, backed) = book.range(..=pointer).next_back()?;
        (pointer - base < backed.requested).then_some((base, backed.requested))
    }
}

/// Unmaps, releases and frees a backed range (only frees it while its
/// bytes are in host memory). Only the unmapping can fail it (the range
/// then stays the program's, to be freed again); once unmapped, the rest is
/// the limiter's to give back, and a refusal there is logged.
fn undo(vmm: &Vmm, address: CUdeviceptr, backed: &Backed) -> Result<(), DriverError> {
    let released = match backed.memory {
        Some(handle) => {
            vmm.unmap(address, backed.size)?;
            vmm.release(handle)
        }
        None => Ok(()),
    };
    let freed = vmm.free_address(address, backed.size);
    if let Err(error) = released.and(freed) {
        tracing::warn!(address, %error, "a backed range was unmapped but not all given back");
    }
    Ok(())
}

/// The driver's VMM functions, once libcuda has been seen.
fn vmm(ctx: &Context) -> Option<&Vmm> {
    ctx.driver()?.vmm.as_ref()
}

/// The driver's context and copy functions, once libcuda has been seen.
fn copies(ctx: &Context) -> Option<&Copies> {
    ctx.driver()?.copies.as_ref()
}

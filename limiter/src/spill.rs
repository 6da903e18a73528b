//! Oversubscription: an allocation that does not fit in the pod's quota is
//! served from host memory the GPU can address, when the pod opted in.
//!
//! 1. **Which memory.** Pinned, mapped host memory (`cuMemHostAlloc` with
//!    `DEVICEMAP | PORTABLE`, then `cuMemHostGetDevicePointer`). It never
//!    occupies device memory, so the pod's real footprint stays within its
//!    quota whatever the access pattern; kernels read it over the bus; on a
//!    64-bit UVA platform the device pointer is the host pointer, and the
//!    driver answers `cuPointerGetAttribute`/`cuMemGetAddressRange` for it
//!    truthfully (memory type host). Managed memory advised to stay on the
//!    host was not used: it migrates to the device under some access patterns
//!    (the footprint would pass the quota) and counts against the managed
//!    memory the card has free. Pinned memory is no managed memory at all,
//!    so the spill never asks the driver for any.
//! 2. **Which APIs.** Linear memory (`cuMemAlloc_v2`, `cuMemAllocPitch_v2`,
//!    `cuMemAllocAsync(_ptsz)`, `cuMemAllocFromPoolAsync(_ptsz)`; the
//!    stream-ordered ones are served at once, which is stronger ordering).
//!    Refused, with the reason logged: managed memory (`cuMemAdvise` and
//!    `cuMemPrefetchAsync` need a managed range), VMM physical memory
//!    (`cuMemCreate`: the caller maps it as device memory) and arrays (opaque
//!    device layouts).
//! 3. **Accounting.** The spill is reserved in the pod's ledger
//!    ([`PodLedger::try_spill_under`]) against the pod's cap before the host
//!    memory is taken, so processes of a pod cannot pass it together; past
//!    it, the allocation fails with `CUDA_ERROR_OUT_OF_MEMORY` as without
//!    oversubscription. It never counts in the device usage, so reports keep
//!    total = quota and free = what is left on the device.
//! 4. **Frees.** Every spilled range is kept in a table (device pointer →
//!    host pointer, bytes, ledger entry); `cuMemFree_v2` and
//!    `cuMemFreeAsync(_ptsz)` of such a pointer free it with `cuMemFreeHost`
//!    (a stream-ordered free waits for the context first) and give the spill
//!    back. Other pointers never take the table's lock while it is empty.
//!
//! Policy on typed values: the memory policy (`detour/memory/ops.rs`) asks
//! here once the quota refused; the driver's pinned-memory functions are
//! [`HostMemory`] in the driver table, reached through the [`Context`]; the
//! adapters write the pointer this returns.
//!
//! [`PodLedger::try_spill_under`]: gpushare_utils::ledger::PodLedger::try_spill_under
//! [`HostMemory`]: crate::driver::HostMemory

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use gpushare_utils::ledger::LedgerError;
use gpushare_utils::limits::default_spill_limit;

use crate::config::DeviceLimits;
use crate::context::Context;
use crate::driver::{HostMemory, MappedHost};
use crate::grant::Grant;
use crate::sys::{CUdeviceptr, CUresult};

/// One spilled range.
#[derive(Debug)]
struct Spilled {
    memory: MappedHost,
    bytes: u64,
    /// The pod ledger's entry of the GPU.
    entry: usize,
}

/// This process's oversubscription policy and its spilled ranges.
pub(crate) struct Spill {
    enabled: DeviceLimits<bool>,
    caps: DeviceLimits<u64>,
    default_cap: OnceLock<u64>,
    ranges: Mutex<HashMap<CUdeviceptr, Spilled>>,
    /// Entries of `ranges`, so that frees of device memory skip the lock.
    live: AtomicUsize,
}

impl Spill {
    pub(crate) fn new(enabled: DeviceLimits<bool>, caps: DeviceLimits<u64>) -> Self {
        Self {
            enabled,
            caps,
            default_cap: OnceLock::new(),
            ranges: Mutex::new(HashMap::new()),
            live: AtomicUsize::new(0),
        }
    }

    /// The pod's spill cap on CUDA device `device`, or `None` when it may not
    /// spill: under a hypervisor its read-only limits say; locally the
    /// switches and `CUDA_LIMITER_SPILL_LIMIT` (default: a quarter of the
    /// node's memory).
    pub(crate) fn cap(&self, ctx: &'static Context, device: usize) -> Option<u64> {
        let uuid = ctx.device_uuid(device);
        let cap = match ctx.grant() {
            Grant::Refused => return None,
            Grant::Hypervisor(limits) => limits
                .find(uuid.as_deref()?)?
                .spill_limit
                .load(Ordering::Acquire),
            Grant::Local => {
                self.enabled.resolve(device as u32, uuid.as_deref())?;
                let cap = self
                    .caps
                    .resolve(device as u32, uuid.as_deref())
                    .unwrap_or_else(|| *self.default_cap.get_or_init(default_spill_limit));
                if let (Some(ledger), Some(entry)) = (ctx.ledger(), ctx.ledger_entry(device))
                    && let Err(error) = ledger.set_spill_limit(entry, cap)
                {
                    tracing::debug!(device, %error, "spill cap not recorded in the pod ledger");
                }
                cap
            }
        };
        (cap > 0).then_some(cap)
    }

    /// Serves `bytes` on CUDA device `device` from pinned mapped host memory
    /// and returns its device pointer; why not, when it cannot.
    pub(crate) fn allocate(
        &self,
        ctx: &'static Context,
        device: usize,
        bytes: u64,
    ) -> Result<CUdeviceptr, String> {
        let cap = self.cap(ctx, device).ok_or("oversubscription is off")?;
        let host = host_memory(ctx).ok_or("the driver lacks pinned host memory")?;
        let ledger = ctx.ledger().ok_or("no pod ledger")?;
        let entry = ctx.ledger_entry(device).ok_or("no ledger entry")?;
        ledger
            .try_spill_under(entry, bytes, cap)
            .map_err(|error| match error {
                LedgerError::OverSpillCap { .. } => format!("spill cap reached: {error}"),
                error => format!("pod ledger refused the spill: {error}"),
            })?;
        let give_back = |why: String| {
            let _released = ledger.release_spill(entry, bytes);
            why
        };
        let size = usize::try_from(bytes).map_err(|_| give_back("size overflows".into()))?;
        let memory = host
            .allocate_mapped(size)
            .map_err(|error| give_back(error.to_string()))?;
        let pointer = memory.device_pointer();
        let spilled = Spilled {
            memory,
            bytes,
            entry,
        };
        match self.ranges.lock() {
            Ok(mut ranges) => {
                ranges.insert(pointer, spilled);
                self.live.fetch_add(1, Ordering::AcqRel);
            }
            Err(_) => {
                // Ours, never handed out.
                let _freed = host.free(spilled.memory);
                return Err(give_back("spill table poisoned".into()));
            }
        }
        tracing::debug!(device, bytes, pointer, "served from host memory");
        Ok(pointer)
    }

    /// Frees `dptr` if it was spilled: `None` when it was not (the caller
    /// frees it as device memory). `ordered`: a stream-ordered free, which
    /// waits for the context's work first.
    pub(crate) fn free(
        &self,
        ctx: &'static Context,
        dptr: CUdeviceptr,
        ordered: bool,
    ) -> Option<CUresult> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let spilled = self.ranges.lock().ok()?.remove(&dptr)?;
        let restore = |spilled: Spilled| {
            if let Ok(mut ranges) = self.ranges.lock() {
                ranges.insert(dptr, spilled);
            }
        };
        let Some(host) = host_memory(ctx) else {
            restore(spilled);
            return None;
        };
        if ordered && let Err(error) = host.synchronize() {
            restore(spilled);
            return Some(error.code());
        }
        let Spilled {
            memory,
            bytes,
            entry,
        } = spilled;
        if let Err((memory, error)) = host.free(memory) {
            restore(Spilled {
                memory,
                bytes,
                entry,
            });
            return Some(error.code());
        }
        self.live.fetch_sub(1, Ordering::AcqRel);
        if let Some(ledger) = ctx.ledger()
            && let Err(error) = ledger.release_spill(entry, bytes)
        {
            tracing::warn!(%error, "spill release refused by the pod ledger");
        }
        Some(CUresult::SUCCESS)
    }
}

/// The driver's pinned-host-memory functions, once libcuda has been seen.
fn host_memory(ctx: &Context) -> Option<&HostMemory> {
    ctx.driver()?.host.as_ref()
}

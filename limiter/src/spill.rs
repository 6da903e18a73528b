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
//! [`PodLedger::try_spill_under`]: gpushare_utils::ledger::PodLedger::try_spill_under

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use gpushare_utils::config::{DeviceLimits, default_spill_limit};
use gpushare_utils::ledger::LedgerError;

use crate::driver::{Driver, symbol};
use crate::error::{LimiterError, Result};
use crate::grant::Grant;
use crate::runtime;
use crate::sys::{
    CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE, CUdeviceptr, CUresult, CuCtxSynchronize,
    CuMemFreeHost, CuMemHostAlloc, CuMemHostGetDevicePointer,
};

/// The driver's pinned-host-memory functions (none of them is patched).
pub struct HostApi {
    alloc: CuMemHostAlloc,
    device_pointer: CuMemHostGetDevicePointer,
    free: CuMemFreeHost,
    synchronize: CuCtxSynchronize,
}

impl HostApi {
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub unsafe fn load(handle: *mut c_void) -> Option<Self> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            Some(Self {
                alloc: symbol(handle, c"cuMemHostAlloc")?,
                device_pointer: symbol(handle, c"cuMemHostGetDevicePointer_v2")?,
                free: symbol(handle, c"cuMemFreeHost")?,
                synchronize: symbol(handle, c"cuCtxSynchronize")?,
            })
        }
    }
}

/// One spilled range.
#[derive(Debug, Clone, Copy)]
struct Spilled {
    host: usize,
    bytes: u64,
    /// The pod ledger's entry of the GPU.
    entry: usize,
}

/// This process's oversubscription policy and its spilled ranges.
pub struct Spill {
    enabled: DeviceLimits<bool>,
    caps: DeviceLimits<u64>,
    default_cap: OnceLock<u64>,
    ranges: Mutex<HashMap<CUdeviceptr, Spilled>>,
    /// Entries of `ranges`, so that frees of device memory skip the lock.
    live: AtomicUsize,
}

impl Spill {
    pub fn new(enabled: DeviceLimits<bool>, caps: DeviceLimits<u64>) -> Self {
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
    pub fn cap(&self, device: usize) -> Option<u64> {
        let uuid = Driver::get().and_then(|driver| driver.device_uuid(device as i32));
        let cap = match runtime::grant()? {
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
                if let (Some(ledger), Some(entry)) =
                    (runtime::ledger(), runtime::ledger_entry(device))
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
    /// and returns its device pointer.
    fn allocate(&self, device: usize, bytes: u64) -> Result<CUdeviceptr, String> {
        let cap = self.cap(device).ok_or("oversubscription is off")?;
        let host = Driver::get()
            .and_then(|driver| driver.host.as_ref())
            .ok_or("the driver lacks pinned host memory")?;
        let ledger = runtime::ledger().ok_or("no pod ledger")?;
        let entry = runtime::ledger_entry(device).ok_or("no ledger entry")?;
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
        let mut pointer: *mut c_void = std::ptr::null_mut();
        let flags = CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a valid out-pointer; the driver's signature.
        let result = unsafe { (host.alloc)(&mut pointer, size, flags) };
        if !result.is_success() || pointer.is_null() {
            return Err(give_back(format!("cuMemHostAlloc failed ({})", result.0)));
        }
        let mut device_pointer: CUdeviceptr = 0;
        // SAFETY: `pointer` is the mapped pinned memory just allocated.
        let result = unsafe { (host.device_pointer)(&mut device_pointer, pointer, 0) };
        if !result.is_success() {
            // SAFETY: ours, unused.
            let _freed = unsafe { (host.free)(pointer) };
            return Err(give_back(format!(
                "cuMemHostGetDevicePointer failed ({})",
                result.0
            )));
        }
        let spilled = Spilled {
            host: pointer as usize,
            bytes,
            entry,
        };
        match self.ranges.lock() {
            Ok(mut ranges) => {
                ranges.insert(device_pointer, spilled);
                self.live.fetch_add(1, Ordering::AcqRel);
            }
            Err(_) => {
                // SAFETY: ours, never handed out.
                let _freed = unsafe { (host.free)(pointer) };
                return Err(give_back("spill table poisoned".into()));
            }
        }
        tracing::debug!(device, bytes, device_pointer, "served from host memory");
        Ok(device_pointer)
    }

    /// Frees `dptr` if it was spilled: `None` when it was not (the caller
    /// frees it as device memory). `ordered`: a stream-ordered free, which
    /// waits for the context's work first.
    pub fn free(&self, dptr: CUdeviceptr, ordered: bool) -> Option<CUresult> {
        if self.live.load(Ordering::Acquire) == 0 {
            return None;
        }
        let spilled = self.ranges.lock().ok()?.remove(&dptr)?;
        let restore = || {
            if let Ok(mut ranges) = self.ranges.lock() {
                ranges.insert(dptr, spilled);
            }
        };
        let Some(host) = Driver::get().and_then(|driver| driver.host.as_ref()) else {
            restore();
            return None;
        };
        if ordered {
            // SAFETY: no arguments; the caller's context is current.
            let result = unsafe { (host.synchronize)() };
            if !result.is_success() {
                restore();
                return Some(result);
            }
        }
        // SAFETY: a pointer cuMemHostAlloc returned, freed once (removed above).
        let result = unsafe { (host.free)(spilled.host as *mut c_void) };
        if !result.is_success() {
            restore();
            return Some(result);
        }
        self.live.fetch_sub(1, Ordering::AcqRel);
        if let Some(ledger) = runtime::ledger()
            && let Err(error) = ledger.release_spill(spilled.entry, spilled.bytes)
        {
            tracing::warn!(%error, "spill release refused by the pod ledger");
        }
        Some(result)
    }
}

/// The policy, when limits are enforced.
fn spill() -> Option<&'static Spill> {
    runtime::limiter().map(|limiter| &limiter.spill)
}

/// The outcome of a linear allocation: past the quota, and with
/// oversubscription on, served from host memory into `*dptr` instead.
pub fn or_spill(outcome: Result<CUresult>, dptr: *mut CUdeviceptr, bytes: u64) -> Result<CUresult> {
    let Err(LimiterError::OverQuota { device, .. }) = outcome else {
        return outcome;
    };
    let Some(policy) = spill() else {
        return outcome;
    };
    match policy.allocate(device, bytes) {
        Ok(pointer) => {
            // SAFETY: the caller checked `dptr` is non-null before reserving.
            match unsafe { dptr.as_mut() } {
                Some(out) => *out = pointer,
                None => return outcome,
            }
            Ok(CUresult::SUCCESS)
        }
        Err(why) => {
            if policy.cap(device).is_some() {
                tracing::info!(device, bytes, why, "past the quota; not spilled");
            }
            outcome
        }
    }
}

/// Like [`or_spill`] for a pitched allocation: rows of `width` bytes rounded
/// up to `alignment`, `height` of them; the pitch is written to `*pitch`.
pub fn or_spill_pitched(
    outcome: Result<CUresult>,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    row: usize,
    height: usize,
) -> Result<CUresult> {
    let bytes = (row as u64).saturating_mul(height as u64);
    let spilled = or_spill(outcome, dptr, bytes);
    if matches!(spilled, Ok(CUresult::SUCCESS)) {
        // SAFETY: the caller checked `pitch` is non-null.
        if let Some(out) = unsafe { pitch.as_mut() } {
            *out = row;
        }
    }
    spilled
}

/// The outcome of an allocation that cannot be served from host memory:
/// unchanged, with the reason logged when the pod opted in.
pub fn unspillable(
    outcome: Result<CUresult>,
    api: &'static str,
    why: &'static str,
) -> Result<CUresult> {
    if let Err(LimiterError::OverQuota { device, .. }) = &outcome
        && spill().and_then(|policy| policy.cap(*device)).is_some()
    {
        tracing::warn!(
            device,
            api,
            why,
            "past the quota; this API is not oversubscribed"
        );
    }
    outcome
}

/// Frees `dptr` if it was spilled; `None`: it is device memory.
pub fn free(dptr: CUdeviceptr, ordered: bool) -> Option<CUresult> {
    spill()?.free(dptr, ordered)
}

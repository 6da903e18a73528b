//! NVML detours and their adapters: the adapter calls the original, reads
//! the report it wrote through the caller's pointer, and writes the pod's
//! view (from `ops`) back in its place.

use super::ops;
use crate::entry;
use crate::error::{LimiterError, Pass, Result};
use crate::sys::{nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlReturn_t};

gpushare_macros::detours! {
    /// NVML's memory reports.
    pub static NVML_DETOURS;

    /// Total, free and used memory of a device, as the pod sees them.
    required fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t
        => memory_info;
    /// The versioned report, with reserved memory.
    optional fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t
        => memory_info;
}

/// A memory report NVML writes, of either version.
trait MemoryReport {
    /// `(free, total)` as NVML wrote them.
    fn real(&self) -> (u64, u64);
    /// Rewrites the report as the pod sees the device.
    fn show(&mut self, free: u64, total: u64, used: u64);
}

impl MemoryReport for nvmlMemory_t {
    fn real(&self) -> (u64, u64) {
        (self.free, self.total)
    }
    fn show(&mut self, free: u64, total: u64, used: u64) {
        *self = nvmlMemory_t { total, free, used };
    }
}

impl MemoryReport for nvmlMemory_v2_t {
    fn real(&self) -> (u64, u64) {
        (self.free, self.total)
    }
    fn show(&mut self, free: u64, total: u64, used: u64) {
        // The pod's usage includes what the driver reserves for it.
        self.total = total;
        self.reserved = 0;
        self.free = free;
        self.used = used;
    }
}

/// `nvmlDeviceGetMemoryInfo(_v2)`: the driver's report, rewritten for a
/// limited device.
fn memory_info<R: MemoryReport>(
    original: unsafe extern "C" fn(nvmlDevice_t, *mut R) -> nvmlReturn_t,
    device: nvmlDevice_t,
    memory: *mut R,
) -> Result<nvmlReturn_t> {
    // SAFETY: the caller's own arguments.
    let result = unsafe { original(device, memory) };
    if !result.is_success() {
        return Ok(result);
    }
    // SAFETY: null, or the caller's report, written by the call that succeeded.
    let report = unsafe { memory.as_mut() }.ok_or(LimiterError::NullArgument)?;
    let (real_free, real_total) = report.real();
    let view = entry::limiter()
        .ok_or(LimiterError::Bypass(Pass::LimitsOff))
        .and_then(|limiter| {
            ops::pod_view(
                &limiter.memory,
                &limiter.context,
                device,
                real_free,
                real_total,
            )
        });
    if let Ok((free, total, used)) = view {
        report.show(free, total, used);
    }
    Ok(result)
}

/// The free memory of the GPU `uuid` as NVML reports it to everyone (the
/// original's answer, not the pod's view); `None` where NVML or the
/// limiter cannot say.
pub(crate) fn gpu_free(uuid: &str) -> Option<u64> {
    let original = nvmlDeviceGetMemoryInfo::ORIGINAL.get()?;
    let device = entry::limiter()?.context.nvml()?.device_handle(uuid)?;
    let mut report = nvmlMemory_t::default();
    // SAFETY: a handle NVML gave and a valid out-pointer.
    let result = unsafe { original(device, &mut report) };
    result.is_success().then_some(report.free)
}

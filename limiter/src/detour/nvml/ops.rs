//! NVML report policy, in safe Rust: the pod's view of a device.
//!
//! NVML numbers devices its own way (PCI order); quotas are keyed by the CUDA
//! index the application sees and by UUID. A device's CUDA index is its
//! position in `CUDA_VISIBLE_DEVICES` (by index or UUID prefix) when that is
//! set, otherwise its NVML index (the two orders agree on nodes of one GPU
//! model, which is what pods are scheduled on).

use crate::context::Context;
use crate::error::{LimiterError, Pass, Result};
use crate::quota::{MemoryQuota, virtual_report};
use crate::sys::nvmlDevice_t;

/// The CUDA index of the device with NVML index `nvml_index` and `uuid`, given
/// the value of `CUDA_VISIBLE_DEVICES`.
pub(super) fn cuda_index(visible: Option<&str>, nvml_index: u32, uuid: &str) -> Option<usize> {
    let Some(visible) = visible else {
        return Some(nvml_index as usize);
    };
    visible
        .split(',')
        .map(str::trim)
        .take_while(|entry| !entry.is_empty())
        .position(|entry| match entry.parse::<u32>() {
            Ok(index) => index == nvml_index,
            Err(_) => {
                let entry = entry.to_ascii_lowercase();
                uuid.to_ascii_lowercase().starts_with(&entry)
            }
        })
}

/// `(free, total, used)` of a limited device as the pod sees it, from the
/// real free and total; `Bypass` when it is unlimited.
pub(super) fn pod_view(
    quota: &MemoryQuota,
    ctx: &'static Context,
    device: nvmlDevice_t,
    real_free: u64,
    real_total: u64,
) -> Result<(u64, u64, u64)> {
    let nvml = ctx
        .nvml()
        .ok_or(LimiterError::Bypass(Pass::NvmlUnresolved))?;
    let uuid = nvml
        .device_uuid(device)
        .ok_or(LimiterError::Bypass(Pass::NoUuid))?;
    let nvml_index = nvml
        .device_index(device)
        .ok_or(LimiterError::Bypass(Pass::NoIndex))?;
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let index = cuda_index(visible.as_deref(), nvml_index, &uuid);
    // Under a hypervisor, its quota for this UUID; locally, the configured one.
    let limit = quota
        .limit_for(ctx, index.unwrap_or(usize::MAX), Some(&uuid))
        .ok_or(LimiterError::Bypass(Pass::DeviceUnlimited))?;
    // Usage follows the GPU, whatever index this process sees it at.
    let used = ctx
        .ledger_entry_of(&uuid)
        .map_or(0, |entry| quota.pod_used(ctx, entry))
        .saturating_add(quota.unaccounted_of(ctx, &uuid));
    let (free, total) = virtual_report(limit, used, real_free, real_total);
    Ok((free, total, total - free))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_index_follows_visible_devices() {
        let uuid = "GPU-3430f778-7a25-704c-9090-8b0bb2478114";
        assert_eq!(cuda_index(None, 2, uuid), Some(2));
        assert_eq!(cuda_index(Some("2,0"), 0, uuid), Some(1));
        assert_eq!(cuda_index(Some("1"), 0, uuid), None);
        assert_eq!(cuda_index(Some("GPU-3430F778"), 5, uuid), Some(0));
        assert_eq!(cuda_index(Some("0,GPU-3430f778-7a25"), 5, uuid), Some(1));
        // CUDA stops at the first empty entry.
        assert_eq!(cuda_index(Some(",1"), 1, uuid), None);
    }
}

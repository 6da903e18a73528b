//! NVML detours: declarations only; the logic is in `ops`.

use super::ops;
use crate::sys::{nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlReturn_t};

gpushare_macros::detours! {
    /// NVML's memory reports.
    pub static NVML_DETOURS;

    /// Total, free and used memory of a device, as the pod sees them.
    required fn nvmlDeviceGetMemoryInfo(device: nvmlDevice_t, memory: *mut nvmlMemory_t) -> nvmlReturn_t
        => ops::memory_info;
    /// The versioned report, with reserved memory.
    optional fn nvmlDeviceGetMemoryInfo_v2(device: nvmlDevice_t, memory: *mut nvmlMemory_v2_t) -> nvmlReturn_t
        => ops::memory_info_v2;
}

//! The NVML types and functions the limiter calls, with the layouts of
//! `nvml.h` checked as the driver's are in [`super`].

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_uint, c_void};
use std::mem::offset_of;

use gpushare_hook::Unavailable;
use gpushare_hook::thread_local::ZeroInit;

/// `nvmlReturn_t`, a distinct type so that it has its own conversions.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct nvmlReturn_t(pub c_uint);

// SAFETY: a plain integer (0 is `NVML_SUCCESS`).
unsafe impl ZeroInit for nvmlReturn_t {}

impl nvmlReturn_t {
    pub(crate) const SUCCESS: Self = Self(0);
    pub(crate) const ERROR_UNINITIALIZED: Self = Self(1);
    pub(crate) const ERROR_INVALID_ARGUMENT: Self = Self(2);
    pub(crate) const ERROR_INSUFFICIENT_SIZE: Self = Self(7);

    pub(crate) fn is_success(self) -> bool {
        self == Self::SUCCESS
    }
}

impl Unavailable for nvmlReturn_t {
    const UNAVAILABLE: Self = Self::ERROR_UNINITIALIZED;
}

pub(crate) type nvmlDevice_t = *mut c_void;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct nvmlMemory_t {
    pub total: u64,
    pub free: u64,
    pub used: u64,
}

// `nvmlMemory_t` (`struct nvmlMemory_st`, nvml.h).
const _: () = {
    assert!(size_of::<nvmlMemory_t>() == 24 && align_of::<nvmlMemory_t>() == 8);
    assert!(offset_of!(nvmlMemory_t, free) == 8);
    assert!(offset_of!(nvmlMemory_t, used) == 16);
};

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct nvmlMemory_v2_t {
    pub version: c_uint,
    pub total: u64,
    pub reserved: u64,
    pub free: u64,
    pub used: u64,
}

// `nvmlMemory_v2_t` (`struct nvmlMemory_v2_st`, nvml.h): the version, then
// four counters from offset 8.
const _: () = {
    assert!(size_of::<nvmlMemory_v2_t>() == 40 && align_of::<nvmlMemory_v2_t>() == 8);
    assert!(offset_of!(nvmlMemory_v2_t, total) == 8);
    assert!(offset_of!(nvmlMemory_v2_t, reserved) == 16);
    assert!(offset_of!(nvmlMemory_v2_t, free) == 24);
    assert!(offset_of!(nvmlMemory_v2_t, used) == 32);
};

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct nvmlProcessInfo_t {
    pub pid: c_uint,
    pub usedGpuMemory: u64,
    pub gpuInstanceId: c_uint,
    pub computeInstanceId: c_uint,
}

// `nvmlProcessInfo_t` (`struct nvmlProcessInfo_st`, nvml.h; the layout of
// `nvmlProcessInfo_v2_t`, which the `_v2`/`_v3` process queries write).
const _: () = {
    assert!(size_of::<nvmlProcessInfo_t>() == 24 && align_of::<nvmlProcessInfo_t>() == 8);
    assert!(offset_of!(nvmlProcessInfo_t, usedGpuMemory) == 8);
    assert!(offset_of!(nvmlProcessInfo_t, gpuInstanceId) == 16);
    assert!(offset_of!(nvmlProcessInfo_t, computeInstanceId) == 20);
};

/// `nvmlProcessInfo_v1_t`, what the unversioned
/// `nvmlDeviceGetComputeRunningProcesses` writes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct nvmlProcessInfo_v1_t {
    pub pid: c_uint,
    pub usedGpuMemory: u64,
}

// `nvmlProcessInfo_v1_t` (`struct nvmlProcessInfo_v1_st`, nvml.h).
const _: () = {
    assert!(size_of::<nvmlProcessInfo_v1_t>() == 16 && align_of::<nvmlProcessInfo_v1_t>() == 8);
    assert!(offset_of!(nvmlProcessInfo_v1_t, usedGpuMemory) == 8);
};

/// `NVML_VALUE_NOT_AVAILABLE` for unsigned long long fields.
pub(crate) const NVML_VALUE_NOT_AVAILABLE: u64 = u64::MAX;

pub(crate) const NVML_DEVICE_UUID_V2_BUFFER_SIZE: usize = 96;

pub(crate) type NvmlInit = unsafe extern "C" fn() -> nvmlReturn_t;
pub(crate) type NvmlDeviceGetHandleByUUID =
    unsafe extern "C" fn(*const c_char, *mut nvmlDevice_t) -> nvmlReturn_t;
pub(crate) type NvmlDeviceGetHandleByIndex =
    unsafe extern "C" fn(c_uint, *mut nvmlDevice_t) -> nvmlReturn_t;
pub(crate) type NvmlDeviceGetCount = unsafe extern "C" fn(*mut c_uint) -> nvmlReturn_t;
pub(crate) type NvmlDeviceGetIndex =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint) -> nvmlReturn_t;
pub(crate) type NvmlDeviceGetUUID =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_char, c_uint) -> nvmlReturn_t;
pub(crate) type NvmlDeviceGetComputeRunningProcesses =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_t) -> nvmlReturn_t;
pub(crate) type NvmlDeviceGetComputeRunningProcessesV1 =
    unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut nvmlProcessInfo_v1_t) -> nvmlReturn_t;

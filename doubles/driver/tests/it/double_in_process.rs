//! The driver double called in this process: devices have the documented
//! identity, and NVML and libcuda agree on memory before and after cuInit.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

use crate::common;

use common::in_process::Lib;
use common::{CTX, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, GIB, MIB, in_fresh_process};
use gpushare_examples::uuid;

#[test]
fn devices_have_the_documented_identity() {
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type DeviceString = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    type DeviceUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;
    type ErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
    type NvmlInit = unsafe extern "C" fn() -> c_int;
    type NvmlByIndex = unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int;
    type NvmlByString = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
    type NvmlUuid = unsafe extern "C" fn(*mut c_void, *mut c_char, c_uint) -> c_int;
    type NvmlErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

    let cuda = Lib::open("libcuda.so.1");
    let nvml = Lib::open("libnvidia-ml.so.1");
    // SAFETY: for all transmutes and calls below: the signatures are those of
    // cuda.h / nvml.h, and every pointer passed is valid for the call.
    unsafe {
        let cu_init: Init = std::mem::transmute(cuda.sym("cuInit"));
        let bus_id: DeviceString = std::mem::transmute(cuda.sym("cuDeviceGetPCIBusId"));
        let cu_uuid: DeviceUuid = std::mem::transmute(cuda.sym("cuDeviceGetUuid_v2"));
        let error_name: ErrorName = std::mem::transmute(cuda.sym("cuGetErrorName"));
        assert_eq!(cu_init(0), CUDA_SUCCESS);
        let mut bytes = [0u8; 16];
        assert_eq!(cu_uuid(&mut bytes, 0), CUDA_SUCCESS);
        assert_eq!(
            bytes,
            [
                0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee,
                0xff, 0
            ]
        );
        let mut text = [0 as c_char; 64];
        assert_eq!(bus_id(text.as_mut_ptr(), 64, 0), CUDA_SUCCESS);
        assert_eq!(
            CStr::from_ptr(text.as_ptr()).to_str().unwrap(),
            "0000:18:00.0"
        );
        let mut name = std::ptr::null();
        assert_eq!(error_name(2, &mut name), CUDA_SUCCESS);
        assert_eq!(
            CStr::from_ptr(name).to_str().unwrap(),
            "CUDA_ERROR_OUT_OF_MEMORY"
        );

        let init: NvmlInit = std::mem::transmute(nvml.sym("nvmlInit_v2"));
        let by_index: NvmlByIndex = std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByIndex_v2"));
        let by_uuid: NvmlByString = std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByUUID"));
        let by_pci: NvmlByString =
            std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByPciBusId_v2"));
        let get_uuid: NvmlUuid = std::mem::transmute(nvml.sym("nvmlDeviceGetUUID"));
        let error_string: NvmlErrorString = std::mem::transmute(nvml.sym("nvmlErrorString"));
        assert_eq!(init(), 0);
        let mut handle = std::ptr::null_mut();
        assert_eq!(by_index(0, &mut handle), 0);
        assert_eq!(get_uuid(handle, text.as_mut_ptr(), 64), 0);
        assert_eq!(CStr::from_ptr(text.as_ptr()).to_str().unwrap(), uuid(0));
        assert_eq!(uuid(0), "GPU-11223344-5566-7788-99aa-bbccddeeff00");
        assert_eq!(get_uuid(handle, text.as_mut_ptr(), 40), 7, "needs 41 bytes");
        let mut other = std::ptr::null_mut();
        let wanted = CString::new(uuid(0)).unwrap();
        assert_eq!(by_uuid(wanted.as_ptr(), &mut other), 0);
        assert_eq!(other, handle);
        assert_eq!(by_uuid(c"GPU-nope".as_ptr(), &mut other), 6);
        other = std::ptr::null_mut();
        assert_eq!(by_pci(c"00000000:18:00.0".as_ptr(), &mut other), 0);
        assert_eq!(other, handle);
        assert_eq!(
            CStr::from_ptr(error_string(7)).to_str().unwrap(),
            "Insufficient Size"
        );
    }
}

#[repr(C)]
#[derive(Debug, Default, PartialEq)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Debug, Default)]
struct NvmlProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// Set in the copy of this test binary that runs a test in a fresh process.

#[test]
fn a_process_meets_nvml_first_then_cuda_before_and_after_init() {
    type Status = unsafe extern "C" fn() -> c_int;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Version = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type MemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
    type SetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
    type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
    type Release = unsafe extern "C" fn(c_int) -> c_int;
    type AddressRange = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_int;
    type NvmlByIndex = unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int;
    type NvmlMemInfo = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_int;
    type NvmlProcs = unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut NvmlProcessInfo) -> c_int;

    if !in_fresh_process(
        "a_process_meets_nvml_first_then_cuda_before_and_after_init",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
    ) {
        return;
    }
    let total = 4 * GIB;
    // SAFETY: for all transmutes and calls below: the signatures are those of
    // cuda.h / nvml.h, and every pointer passed is valid for the call.
    unsafe {
        // NVML alone: the device is there, and nothing is used.
        let nvml = Lib::open("libnvidia-ml.so.1");
        let nvml_init: Status = std::mem::transmute(nvml.sym("nvmlInit_v2"));
        let by_index: NvmlByIndex = std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByIndex_v2"));
        let nvml_mem: NvmlMemInfo = std::mem::transmute(nvml.sym("nvmlDeviceGetMemoryInfo"));
        let procs: NvmlProcs =
            std::mem::transmute(nvml.sym("nvmlDeviceGetComputeRunningProcesses_v3"));
        let memory = |handle| {
            let mut m = NvmlMemory::default();
            assert_eq!(nvml_mem(handle, &mut m), 0);
            m
        };
        let mut handle = std::ptr::null_mut();
        assert_eq!(by_index(0, &mut handle), 1, "NVML_ERROR_UNINITIALIZED");
        assert_eq!(nvml_init(), 0);
        assert_eq!(by_index(0, &mut handle), 0);
        assert_eq!(by_index(1, &mut handle), 2, "one device");
        let unused = NvmlMemory {
            total,
            free: total,
            used: 0,
        };
        assert_eq!(memory(handle), unused);
        let mut count: c_uint = 0;
        assert_eq!(procs(handle, &mut count, std::ptr::null_mut()), 0);
        assert_eq!(count, 0);

        // libcuda before cuInit: only the version calls work.
        let cuda = Lib::open("libcuda.so.1");
        let sym = |name| cuda.sym(name);
        let init: Init = std::mem::transmute(sym("cuInit"));
        let version: Version = std::mem::transmute(sym("cuDriverGetVersion"));
        let device_count: Count = std::mem::transmute(sym("cuDeviceGetCount"));
        let alloc: Alloc = std::mem::transmute(sym("cuMemAlloc_v2"));
        let mem_info: MemInfo = std::mem::transmute(sym("cuMemGetInfo_v2"));
        let set_current: SetCurrent = std::mem::transmute(sym("cuCtxSetCurrent"));
        let retain: Retain = std::mem::transmute(sym("cuDevicePrimaryCtxRetain"));
        let release: Release = std::mem::transmute(sym("cuDevicePrimaryCtxRelease_v2"));
        let range: AddressRange = std::mem::transmute(sym("cuMemGetAddressRange_v2"));
        let (mut n, mut ptr, mut free, mut size) = (0, 0u64, 0usize, 0usize);
        assert_eq!(version(&mut n), CUDA_SUCCESS);
        assert_eq!(n, 13000);
        assert_eq!(device_count(&mut n), 3);
        assert_eq!(alloc(&mut ptr, 1 << 20), 3);
        assert_eq!(mem_info(&mut free, &mut size), 3);
        assert_eq!(set_current(std::ptr::null_mut()), 3);

        // After cuInit, allocations need a context.
        assert_eq!(init(0), CUDA_SUCCESS);
        assert_eq!(device_count(&mut n), CUDA_SUCCESS);
        assert_eq!(n, 1);
        assert_eq!(alloc(&mut ptr, 1 << 20), 201, "CUDA_ERROR_INVALID_CONTEXT");
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(set_current(ctx), CUDA_SUCCESS);
        // NVML now finds libcuda, loaded after it, and sees the context.
        assert_eq!(memory(handle).used, CTX);
        assert_eq!(alloc(&mut ptr, 1 << 20), CUDA_SUCCESS);
        assert_eq!(ptr % 512, 0);
        let mut base = 0u64;
        assert_eq!(range(&mut base, &mut size, ptr + 5), CUDA_SUCCESS);
        assert_eq!((base, size), (ptr, 1 << 20));
        assert_eq!(
            range(&mut base, &mut size, ptr + (1 << 20)),
            CUDA_ERROR_NOT_FOUND
        );
        assert_eq!(memory(handle).used, CTX + MIB);
        let mut info = [NvmlProcessInfo::default(), NvmlProcessInfo::default()];
        count = 0;
        assert_eq!(
            procs(handle, &mut count, info.as_mut_ptr()),
            7,
            "INSUFFICIENT_SIZE"
        );
        assert_eq!(count, 1);
        count = 2;
        assert_eq!(procs(handle, &mut count, info.as_mut_ptr()), 0);
        assert_eq!(count, 1);
        assert_eq!(info[0].pid, std::process::id());
        assert_eq!(info[0].used_gpu_memory, CTX + MIB);

        // Releasing the primary context frees what was allocated in it.
        assert_eq!(release(0), CUDA_SUCCESS);
        assert_eq!(memory(handle), unused);
        assert_eq!(release(0), 201);
        assert_eq!(alloc(&mut ptr, 1 << 20), 201);
    }
}

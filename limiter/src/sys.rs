//! The few CUDA driver and NVML types the limiter needs, with the layouts of
//! `cuda.h` / `nvml.h` (CUDA 13). Kept minimal on purpose: everything else
//! passes through the detours untouched.
//!
//! Every struct is followed by compile-time checks of its size, alignment
//! and field offsets against the header it copies: the x86_64 figures that
//! `sizeof`, `_Alignof` and `offsetof` give for the header's type, compiled
//! with gcc against CUDA 13.0's `cuda.h` and `nvml.h` (driver 580).

#![allow(non_camel_case_types, non_snake_case, dead_code)]

use std::ffi::{c_int, c_uint, c_void};
use std::mem::offset_of;

use gpushare_hook::Unavailable;
use gpushare_hook::thread_local::ZeroInit;

mod nvml;
pub(crate) use nvml::*;

/// `CUresult`, a distinct type so that it has its own conversions.
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CUresult(pub c_uint);

// SAFETY: a plain integer (0 is `CUDA_SUCCESS`).
unsafe impl ZeroInit for CUresult {}

impl CUresult {
    pub(crate) const SUCCESS: Self = Self(0);
    pub(crate) const ERROR_INVALID_VALUE: Self = Self(1);
    pub(crate) const ERROR_OUT_OF_MEMORY: Self = Self(2);
    pub(crate) const ERROR_NOT_INITIALIZED: Self = Self(3);
    pub(crate) const ERROR_INVALID_CONTEXT: Self = Self(201);
    pub(crate) const ERROR_NOT_FOUND: Self = Self(500);
    pub(crate) const ERROR_NOT_READY: Self = Self(600);

    pub(crate) fn is_success(self) -> bool {
        self == Self::SUCCESS
    }
}

impl Unavailable for CUresult {
    const UNAVAILABLE: Self = Self::ERROR_NOT_INITIALIZED;
}

pub(crate) type CUdevice = c_int;
pub(crate) type CUcontext = *mut c_void;
pub(crate) type CUfunction = *mut c_void;
pub(crate) type CUevent = *mut c_void;
pub(crate) type CUgraphExec = *mut c_void;
pub(crate) type CUdeviceptr = u64;
pub(crate) type CUstream = *mut c_void;
pub(crate) type CUmemoryPool = *mut c_void;
pub(crate) type CUarray = *mut c_void;
pub(crate) type CUmipmappedArray = *mut c_void;
pub(crate) type CUmemGenericAllocationHandle = u64;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CUuuid {
    pub bytes: [u8; 16],
}

// `CUuuid` (`struct CUuuid_st`, cuda.h): `char bytes[16]`.
const _: () = assert!(size_of::<CUuuid>() == 16 && align_of::<CUuuid>() == 1);

/// `CUarray_format`.
pub(crate) type CUarray_format = c_uint;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUDA_ARRAY_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Format: CUarray_format,
    pub NumChannels: c_uint,
}

// `CUDA_ARRAY_DESCRIPTOR_v2` (cuda.h).
const _: () = {
    assert!(size_of::<CUDA_ARRAY_DESCRIPTOR>() == 24 && align_of::<CUDA_ARRAY_DESCRIPTOR>() == 8);
    assert!(offset_of!(CUDA_ARRAY_DESCRIPTOR, Height) == 8);
    assert!(offset_of!(CUDA_ARRAY_DESCRIPTOR, Format) == 16);
    assert!(offset_of!(CUDA_ARRAY_DESCRIPTOR, NumChannels) == 20);
};

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUDA_ARRAY3D_DESCRIPTOR {
    pub Width: usize,
    pub Height: usize,
    pub Depth: usize,
    pub Format: CUarray_format,
    pub NumChannels: c_uint,
    pub Flags: c_uint,
}

// `CUDA_ARRAY3D_DESCRIPTOR_v2` (cuda.h).
const _: () = {
    assert!(
        size_of::<CUDA_ARRAY3D_DESCRIPTOR>() == 40 && align_of::<CUDA_ARRAY3D_DESCRIPTOR>() == 8
    );
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, Depth) == 16);
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, Format) == 24);
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, NumChannels) == 28);
    assert!(offset_of!(CUDA_ARRAY3D_DESCRIPTOR, Flags) == 32);
};

/// The per-thread default stream handle (`CU_STREAM_PER_THREAD`).
pub(crate) const CU_STREAM_PER_THREAD: CUstream = 0x2 as CUstream;
/// `CU_STREAM_CAPTURE_STATUS_NONE`.
pub(crate) const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;

/// `CUlaunchConfig`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUlaunchConfig {
    pub gridDimX: c_uint,
    pub gridDimY: c_uint,
    pub gridDimZ: c_uint,
    pub blockDimX: c_uint,
    pub blockDimY: c_uint,
    pub blockDimZ: c_uint,
    pub sharedMemBytes: c_uint,
    pub hStream: CUstream,
    /// `CUlaunchAttribute *`: never read here, so its element type (72
    /// bytes, a 64-byte value union after the 4-byte id and padding) is
    /// not declared.
    pub attrs: *mut c_void,
    pub numAttrs: c_uint,
}

// `CUlaunchConfig` (`struct CUlaunchConfig_st`, cuda.h): seven `unsigned
// int`s, padding to 32, two pointers, `numAttrs`, tail padding to 56.
const _: () = {
    assert!(size_of::<CUlaunchConfig>() == 56 && align_of::<CUlaunchConfig>() == 8);
    assert!(offset_of!(CUlaunchConfig, gridDimX) == 0);
    assert!(offset_of!(CUlaunchConfig, gridDimY) == 4);
    assert!(offset_of!(CUlaunchConfig, gridDimZ) == 8);
    assert!(offset_of!(CUlaunchConfig, blockDimX) == 12);
    assert!(offset_of!(CUlaunchConfig, blockDimY) == 16);
    assert!(offset_of!(CUlaunchConfig, blockDimZ) == 20);
    assert!(offset_of!(CUlaunchConfig, sharedMemBytes) == 24);
    assert!(offset_of!(CUlaunchConfig, hStream) == 32);
    assert!(offset_of!(CUlaunchConfig, attrs) == 40);
    assert!(offset_of!(CUlaunchConfig, numAttrs) == 48);
};

/// `CUDA_ARRAY3D_LAYERED`: Depth counts layers.
pub(crate) const CUDA_ARRAY3D_LAYERED: c_uint = 0x01;
/// `CUDA_ARRAY3D_CUBEMAP`: six faces (times layers when layered).
pub(crate) const CUDA_ARRAY3D_CUBEMAP: c_uint = 0x04;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemLocation {
    pub type_: c_int,
    pub id: c_int,
}

// `CUmemLocation_v1` (cuda.h): an enum and an `int`.
const _: () = {
    assert!(size_of::<CUmemLocation>() == 8 && align_of::<CUmemLocation>() == 4);
    assert!(offset_of!(CUmemLocation, id) == 4);
};

pub(crate) const CU_MEM_LOCATION_TYPE_DEVICE: c_int = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemAllocationProp {
    pub type_: c_int,
    pub requestedHandleTypes: c_int,
    pub location: CUmemLocation,
    pub win32HandleMetaData: *mut c_void,
    pub allocFlags: [u8; 8],
}

// `CUmemAllocationProp_v1` (cuda.h), the VMM allocation's properties;
// `allocFlags` is a struct of 8 bytes (compression, RDMA, usage, reserved).
const _: () = {
    assert!(size_of::<CUmemAllocationProp>() == 32 && align_of::<CUmemAllocationProp>() == 8);
    assert!(offset_of!(CUmemAllocationProp, location) == 8);
    assert!(offset_of!(CUmemAllocationProp, win32HandleMetaData) == 16);
    assert!(offset_of!(CUmemAllocationProp, allocFlags) == 24);
};

/// `CUmemPoolProps` (CUDA 12.2+ layout; older drivers' is the same size).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemPoolProps {
    pub alloc_type: c_int,
    pub handle_types: c_int,
    pub location: CUmemLocation,
    pub win32_security_attributes: *mut c_void,
    pub max_size: usize,
    pub usage: u16,
    pub reserved: [u8; 54],
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (v1 and v2 are the same).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUDA_MEM_ALLOC_NODE_PARAMS {
    pub pool_props: CUmemPoolProps,
    pub access_descs: *const c_void,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: CUdeviceptr,
}

impl Default for CUDA_MEM_ALLOC_NODE_PARAMS {
    fn default() -> Self {
        Self {
            pool_props: CUmemPoolProps {
                alloc_type: 0,
                handle_types: 0,
                location: CUmemLocation { type_: 0, id: 0 },
                win32_security_attributes: std::ptr::null_mut(),
                max_size: 0,
                usage: 0,
                reserved: [0; 54],
            },
            access_descs: std::ptr::null(),
            access_desc_count: 0,
            bytesize: 0,
            dptr: 0,
        }
    }
}

// `CUmemPoolProps_v1` (cuda.h), a memory pool's properties.
const _: () = {
    assert!(size_of::<CUmemPoolProps>() == 88 && align_of::<CUmemPoolProps>() == 8);
    assert!(offset_of!(CUmemPoolProps, location) == 8);
    assert!(offset_of!(CUmemPoolProps, win32_security_attributes) == 16);
    assert!(offset_of!(CUmemPoolProps, max_size) == 24);
    assert!(offset_of!(CUmemPoolProps, usage) == 32);
    assert!(offset_of!(CUmemPoolProps, reserved) == 34);
};

// `CUDA_MEM_ALLOC_NODE_PARAMS_v1` (cuda.h; `_v2` has the same layout), a
// graph's allocation node: the limiter reads `poolProps.location` and
// `bytesize`.
const _: () = {
    assert!(
        size_of::<CUDA_MEM_ALLOC_NODE_PARAMS>() == 120
            && align_of::<CUDA_MEM_ALLOC_NODE_PARAMS>() == 8
    );
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, pool_props) == 0);
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, access_descs) == 88);
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, access_desc_count) == 96);
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, bytesize) == 104);
    assert!(offset_of!(CUDA_MEM_ALLOC_NODE_PARAMS, dptr) == 112);
};

/// `CUlimit`.
pub(crate) type CUlimit = c_int;
/// `CU_LIMIT_STACK_SIZE`: bytes of stack per thread.
pub(crate) const CU_LIMIT_STACK_SIZE: CUlimit = 0x00;
/// `CU_LIMIT_PRINTF_FIFO_SIZE`: bytes of the printf FIFO.
pub(crate) const CU_LIMIT_PRINTF_FIFO_SIZE: CUlimit = 0x01;
/// `CU_LIMIT_MALLOC_HEAP_SIZE`: bytes of the device malloc heap.
pub(crate) const CU_LIMIT_MALLOC_HEAP_SIZE: CUlimit = 0x02;
pub(crate) type CUlibrary = *mut c_void;
pub(crate) type CUgraphNode = *mut c_void;
/// `CU_GRAPH_NODE_TYPE_GRAPH`: a child graph.
pub(crate) const CU_GRAPH_NODE_TYPE_GRAPH: c_int = 4;
/// `CU_GRAPH_NODE_TYPE_MEM_ALLOC`: a memory allocation node.
pub(crate) const CU_GRAPH_NODE_TYPE_MEM_ALLOC: c_int = 10;
/// `CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`: what the device's graph pool holds.
pub(crate) const CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT: c_int = 2;
/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`: what a pool holds on the
/// device, what it keeps of freed memory included.
pub(crate) const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;
/// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR`.
pub(crate) const CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: c_int = 39;
pub(crate) type CuLibraryGetModule = unsafe extern "C" fn(*mut CUmodule, CUlibrary) -> CUresult;
/// A library's kernel, context-independent (`cuLibraryGetKernel`); the
/// runtime launches these as functions.
pub(crate) type CUkernel = *mut c_void;
pub(crate) type CuKernelGetLibrary = unsafe extern "C" fn(*mut CUlibrary, CUkernel) -> CUresult;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` (`_MINOR` is the next).
pub(crate) const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub(crate) const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub(crate) type CuCtxGetLimit = unsafe extern "C" fn(*mut usize, CUlimit) -> CUresult;
pub(crate) type CuCtxSetLimit = unsafe extern "C" fn(CUlimit, usize) -> CUresult;
pub(crate) type CuGraphGetNodes =
    unsafe extern "C" fn(CUgraph, *mut CUgraphNode, *mut usize) -> CUresult;
pub(crate) type CuGraphNodeGetType = unsafe extern "C" fn(CUgraphNode, *mut c_int) -> CUresult;
pub(crate) type CuGraphMemAllocNodeGetParams =
    unsafe extern "C" fn(CUgraphNode, *mut CUDA_MEM_ALLOC_NODE_PARAMS) -> CUresult;
pub(crate) type CuGraphChildGraphNodeGetGraph =
    unsafe extern "C" fn(CUgraphNode, *mut CUgraph) -> CUresult;
pub(crate) type CuMemPoolGetAttribute =
    unsafe extern "C" fn(CUmemoryPool, c_int, *mut c_void) -> CUresult;
pub(crate) type CuDeviceGetMemPool = unsafe extern "C" fn(*mut CUmemoryPool, CUdevice) -> CUresult;
pub(crate) type CuDeviceGetGraphMemAttribute =
    unsafe extern "C" fn(CUdevice, c_int, *mut c_void) -> CUresult;

pub(crate) type CuCtxGetCurrent = unsafe extern "C" fn(*mut CUcontext) -> CUresult;
pub(crate) type CuStreamGetCtx = unsafe extern "C" fn(CUstream, *mut CUcontext) -> CUresult;
pub(crate) type CuStreamIsCapturing = unsafe extern "C" fn(CUstream, *mut c_int) -> CUresult;
pub(crate) type CuThreadExchangeStreamCaptureMode = unsafe extern "C" fn(*mut c_int) -> CUresult;
/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
pub(crate) const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
pub(crate) type CUmodule = *mut c_void;
pub(crate) type CuModuleLoadData = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult;
pub(crate) type CuModuleGetFunction =
    unsafe extern "C" fn(*mut CUfunction, CUmodule, *const std::ffi::c_char) -> CUresult;
pub(crate) type CuStreamCreate = unsafe extern "C" fn(*mut CUstream, c_uint) -> CUresult;
pub(crate) type CuStreamSynchronize = unsafe extern "C" fn(CUstream) -> CUresult;
pub(crate) type CuStreamDestroy = unsafe extern "C" fn(CUstream) -> CUresult;
pub(crate) type CuEventSynchronize = unsafe extern "C" fn(CUevent) -> CUresult;
pub(crate) type CuLaunchKernel = unsafe extern "C" fn(
    CUfunction,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    CUstream,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CUresult;
pub(crate) type CUgraph = *mut c_void;
pub(crate) type CuStreamBeginCapture = unsafe extern "C" fn(CUstream, c_int) -> CUresult;
pub(crate) type CuStreamEndCapture = unsafe extern "C" fn(CUstream, *mut CUgraph) -> CUresult;
pub(crate) type CuGraphInstantiateWithFlags =
    unsafe extern "C" fn(*mut CUgraphExec, CUgraph, u64) -> CUresult;
pub(crate) type CuGraphLaunch = unsafe extern "C" fn(CUgraphExec, CUstream) -> CUresult;
/// `CU_STREAM_NON_BLOCKING`.
pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 0x1;
pub(crate) type CuEventCreate = unsafe extern "C" fn(*mut CUevent, c_uint) -> CUresult;
/// `CU_EVENT_DISABLE_TIMING`: an event that can be queried, not timed.
pub(crate) const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;
pub(crate) type CuEventRecord = unsafe extern "C" fn(CUevent, CUstream) -> CUresult;
pub(crate) type CuEventQuery = unsafe extern "C" fn(CUevent) -> CUresult;
pub(crate) type CuEventElapsedTime = unsafe extern "C" fn(*mut f32, CUevent, CUevent) -> CUresult;
pub(crate) type CuEventDestroy = unsafe extern "C" fn(CUevent) -> CUresult;
pub(crate) type CuCtxGetDevice = unsafe extern "C" fn(*mut CUdevice) -> CUresult;
pub(crate) type CuStreamQuery = unsafe extern "C" fn(CUstream) -> CUresult;
pub(crate) type CuDeviceGetAttribute =
    unsafe extern "C" fn(*mut c_int, c_int, CUdevice) -> CUresult;
pub(crate) type CuOccupancyMaxActiveBlocksPerMultiprocessor =
    unsafe extern "C" fn(*mut c_int, CUfunction, c_int, usize) -> CUresult;
/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`.
pub(crate) const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
/// `CU_DEVICE_ATTRIBUTE_MPS_ENABLED`: 1 when the device's contexts are
/// shared through MPS (this process is an MPS client), else 0.
pub(crate) const CU_DEVICE_ATTRIBUTE_MPS_ENABLED: c_int = 133;
pub(crate) type CuDeviceGet = unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult;
pub(crate) type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CUresult;
pub(crate) type CuDeviceGetUuid = unsafe extern "C" fn(*mut CUuuid, CUdevice) -> CUresult;
/// Formats a CUDA UUID the way NVML and `nvidia-smi -L` print it.
pub(crate) fn format_uuid(uuid: &CUuuid) -> String {
    let b = &uuid.bytes;
    format!(
        "GPU-{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        b[0],
        b[1],
        b[2],
        b[3],
        b[4],
        b[5],
        b[6],
        b[7],
        b[8],
        b[9],
        b[10],
        b[11],
        b[12],
        b[13],
        b[14],
        b[15]
    )
}

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned for every context.
pub(crate) const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x01;
/// `CU_MEMHOSTALLOC_DEVICEMAP`: mapped into the device's address space.
pub(crate) const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 0x02;
pub(crate) type CuMemHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> CUresult;
pub(crate) type CuMemHostGetDevicePointer =
    unsafe extern "C" fn(*mut CUdeviceptr, *mut c_void, c_uint) -> CUresult;
pub(crate) type CuMemFreeHost = unsafe extern "C" fn(*mut c_void) -> CUresult;
pub(crate) type CuCtxSynchronize = unsafe extern "C" fn() -> CUresult;
pub(crate) type CuCtxSetCurrent = unsafe extern "C" fn(CUcontext) -> CUresult;
/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context.
pub(crate) const CU_MEMHOSTREGISTER_PORTABLE: c_uint = 0x01;
pub(crate) type CuMemHostRegister = unsafe extern "C" fn(*mut c_void, usize, c_uint) -> CUresult;
pub(crate) type CuMemHostUnregister = unsafe extern "C" fn(*mut c_void) -> CUresult;
pub(crate) type CuMemcpyDtoHAsync =
    unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult;
pub(crate) type CuMemcpyHtoDAsync =
    unsafe extern "C" fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult;

/// `CUmemAccessDesc_v1` (cuda.h): which location may access a mapped range, and how.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct CUmemAccessDesc {
    pub location: CUmemLocation,
    pub flags: c_int,
}

const _: () = {
    assert!(size_of::<CUmemAccessDesc>() == 12 && align_of::<CUmemAccessDesc>() == 4);
    assert!(offset_of!(CUmemAccessDesc, flags) == 8);
};

/// `CU_MEM_ALLOCATION_TYPE_PINNED`: device memory that stays resident.
pub(crate) const CU_MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
pub(crate) const CU_MEM_ACCESS_FLAGS_PROT_READWRITE: c_int = 3;
/// `CU_MEM_ALLOC_GRANULARITY_MINIMUM`.
pub(crate) const CU_MEM_ALLOC_GRANULARITY_MINIMUM: c_int = 0;
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: the allocation's base (a `CUdeviceptr`).
pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: CUpointer_attribute = 11;
/// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`: the allocation's size (a `size_t`).
pub(crate) const CU_POINTER_ATTRIBUTE_RANGE_SIZE: CUpointer_attribute = 12;
pub(crate) type CUpointer_attribute = c_int;
pub(crate) type CuMemGetAllocationGranularity =
    unsafe extern "C" fn(*mut usize, *const CUmemAllocationProp, c_int) -> CUresult;
pub(crate) type CuMemAddressReserve =
    unsafe extern "C" fn(*mut CUdeviceptr, usize, usize, CUdeviceptr, u64) -> CUresult;
pub(crate) type CuMemAddressFree = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub(crate) type CuMemCreate = unsafe extern "C" fn(
    *mut CUmemGenericAllocationHandle,
    usize,
    *const CUmemAllocationProp,
    u64,
) -> CUresult;
pub(crate) type CuMemRelease = unsafe extern "C" fn(CUmemGenericAllocationHandle) -> CUresult;
pub(crate) type CuMemMap =
    unsafe extern "C" fn(CUdeviceptr, usize, usize, CUmemGenericAllocationHandle, u64) -> CUresult;
pub(crate) type CuMemUnmap = unsafe extern "C" fn(CUdeviceptr, usize) -> CUresult;
pub(crate) type CuMemSetAccess =
    unsafe extern "C" fn(CUdeviceptr, usize, *const CUmemAccessDesc, usize) -> CUresult;

/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`: VMM memory another process
/// can import from a file descriptor.
pub(crate) const CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR: c_int = 1;
pub(crate) type CuMemExportToShareableHandle =
    unsafe extern "C" fn(*mut c_void, CUmemGenericAllocationHandle, c_int, u64) -> CUresult;
pub(crate) type CuMemImportFromShareableHandle =
    unsafe extern "C" fn(*mut CUmemGenericAllocationHandle, *mut c_void, c_int) -> CUresult;

/// `CUipcMemHandle` (cuda.h): the 64 opaque bytes of a legacy CUDA IPC
/// handle, passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CUipcMemHandle {
    pub reserved: [u8; 64],
}

const _: () = {
    assert!(size_of::<CUipcMemHandle>() == 64 && align_of::<CUipcMemHandle>() == 1);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_is_formatted_like_nvml() {
        let uuid = CUuuid {
            bytes: [
                0x34, 0x30, 0xf7, 0x78, 0x7a, 0x25, 0x70, 0x4c, 0x90, 0x90, 0x8b, 0x0b, 0xb2, 0x47,
                0x81, 0x14,
            ],
        };
        assert_eq!(
            format_uuid(&uuid),
            "GPU-3430f778-7a25-704c-9090-8b0bb2478114"
        );
    }
}

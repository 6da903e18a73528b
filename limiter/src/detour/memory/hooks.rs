//! Memory detours: declarations only; the logic is in `ops`.

use super::ops;
use crate::sys::{
    CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_DESCRIPTOR, CUarray, CUdevice, CUdeviceptr,
    CUmemAllocationProp, CUmemGenericAllocationHandle, CUmemoryPool, CUmipmappedArray, CUresult,
    CUstream,
};

gpushare_macros::detours! {
    /// Every allocation and free API of the driver, and its memory reports.
    pub static MEMORY_DETOURS;

    /// Linear allocation.
    required fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult
        => ops::mem_alloc;
    /// Pitched linear allocation; charged by the pitch the driver chose.
    optional fn cuMemAllocPitch_v2(
        dptr: *mut CUdeviceptr,
        pitch: *mut usize,
        width_in_bytes: usize,
        height: usize,
        element_size_bytes: u32,
    ) -> CUresult => ops::mem_alloc_pitch;
    /// Unified memory, charged to the current device.
    optional fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: u32) -> CUresult
        => ops::mem_alloc_managed;
    /// Stream-ordered allocation.
    optional fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) -> CUresult
        => ops::mem_alloc_async;
    /// Stream-ordered allocation, per-thread default stream.
    optional fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) -> CUresult
        => ops::mem_alloc_async;
    /// Stream-ordered allocation from a pool.
    optional fn cuMemAllocFromPoolAsync(
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        pool: CUmemoryPool,
        stream: CUstream,
    ) -> CUresult => ops::mem_alloc_from_pool;
    /// Stream-ordered allocation from a pool, per-thread default stream.
    optional fn cuMemAllocFromPoolAsync_ptsz(
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        pool: CUmemoryPool,
        stream: CUstream,
    ) -> CUresult => ops::mem_alloc_from_pool;
    /// Physical memory for virtual memory management.
    optional fn cuMemCreate(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: u64,
    ) -> CUresult => ops::mem_create;
    /// A 1D or 2D array.
    optional fn cuArrayCreate_v2(array: *mut CUarray, descriptor: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult
        => ops::array_create;
    /// A 3D, layered or cubemap array.
    optional fn cuArray3DCreate_v2(array: *mut CUarray, descriptor: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult
        => ops::array_3d_create;
    /// A mipmapped array, charged for all its levels.
    optional fn cuMipmappedArrayCreate(
        array: *mut CUmipmappedArray,
        descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
        levels: u32,
    ) -> CUresult => ops::mipmapped_array_create;

    /// Frees linear memory of any allocation API.
    required fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult => ops::mem_free;
    /// Stream-ordered free.
    optional fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult
        => ops::mem_free_async;
    /// Stream-ordered free, per-thread default stream.
    optional fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult
        => ops::mem_free_async;
    /// Releases VMM physical memory.
    optional fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult => ops::mem_release;
    /// Destroys an array.
    optional fn cuArrayDestroy(array: CUarray) -> CUresult => ops::array_destroy;
    /// Destroys a mipmapped array.
    optional fn cuMipmappedArrayDestroy(array: CUmipmappedArray) -> CUresult
        => ops::mipmapped_array_destroy;

    /// Free and total memory of the current device, as the pod sees them.
    required fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult
        => ops::mem_get_info;
    /// The legacy 32-bit report.
    optional fn cuMemGetInfo(free: *mut u32, total: *mut u32) -> CUresult
        => ops::mem_get_info_v1;
    /// Total memory of a device, as the pod sees it.
    required fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult
        => ops::device_total_mem;
    /// The legacy 32-bit total.
    optional fn cuDeviceTotalMem(bytes: *mut u32, device: CUdevice) -> CUresult
        => ops::device_total_mem_v1;
}

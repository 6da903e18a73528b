//! Memory detours and their adapters. The declarations generate the
//! `extern "C"` detours; the adapters below are the only code of the family
//! that touches the caller's pointers: they check them once (null is a pass
//! through or an error), read what the driver wrote, write the pod's reports,
//! and hand typed values to the policy in `ops`.

use super::ops::{DeviceOnly, Memory, Pitched, Placement, Served};
use super::sizes;
use crate::entry;
use crate::error::{LimiterError, Pass, Result};
use crate::quota::Resource;
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
        => mem_alloc;
    /// Pitched linear allocation; charged by the pitch the driver chose.
    optional fn cuMemAllocPitch_v2(
        dptr: *mut CUdeviceptr,
        pitch: *mut usize,
        width_in_bytes: usize,
        height: usize,
        element_size_bytes: u32,
    ) -> CUresult => mem_alloc_pitch;
    /// Unified memory, charged to the current device.
    optional fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: u32) -> CUresult
        => mem_alloc_managed;
    /// Stream-ordered allocation.
    optional ptsz fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytesize: usize, stream: CUstream) -> CUresult
        => mem_alloc_async;
    /// Stream-ordered allocation from a pool.
    optional ptsz fn cuMemAllocFromPoolAsync(
        dptr: *mut CUdeviceptr,
        bytesize: usize,
        pool: CUmemoryPool,
        stream: CUstream,
    ) -> CUresult => mem_alloc_from_pool;
    /// Physical memory for virtual memory management.
    optional fn cuMemCreate(
        handle: *mut CUmemGenericAllocationHandle,
        size: usize,
        prop: *const CUmemAllocationProp,
        flags: u64,
    ) -> CUresult => mem_create;
    /// A 1D or 2D array.
    optional fn cuArrayCreate_v2(array: *mut CUarray, descriptor: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult
        => array_create;
    /// A 3D, layered or cubemap array.
    optional fn cuArray3DCreate_v2(array: *mut CUarray, descriptor: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult
        => array_3d_create;
    /// A mipmapped array, charged for all its levels.
    optional fn cuMipmappedArrayCreate(
        array: *mut CUmipmappedArray,
        descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
        levels: u32,
    ) -> CUresult => mipmapped_array_create;

    /// Frees linear memory of any allocation API.
    required fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult => mem_free;
    /// Stream-ordered free.
    optional ptsz fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult
        => mem_free_async;
    /// Releases VMM physical memory.
    optional fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult => mem_release;
    /// Destroys an array.
    optional fn cuArrayDestroy(array: CUarray) -> CUresult => array_destroy;
    /// Destroys a mipmapped array.
    optional fn cuMipmappedArrayDestroy(array: CUmipmappedArray) -> CUresult
        => mipmapped_array_destroy;

    /// Free and total memory of the current device, as the pod sees them.
    required fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult
        => report_memory;
    /// The legacy 32-bit report.
    optional fn cuMemGetInfo(free: *mut u32, total: *mut u32) -> CUresult => report_memory;
    /// Total memory of a device, as the pod sees it.
    required fn cuDeviceTotalMem_v2(bytes: *mut usize, device: CUdevice) -> CUresult
        => report_total;
    /// The legacy 32-bit total.
    optional fn cuDeviceTotalMem(bytes: *mut u32, device: CUdevice) -> CUresult => report_total;
}

/// The memory policy, when limits are enforced, once the pod is on its
/// GPUs: every call of the family needs them, so a swapped-out pod is
/// brought back first.
fn memory() -> Result<Memory> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter.resident();
    Ok(Memory {
        quota: &limiter.memory,
        spill: &limiter.spill,
        backing: &limiter.backing,
        ctx: &limiter.context,
        driver_free,
    })
}

/// The driver's free memory on the current device, by the original
/// `cuMemGetInfo_v2` (not the pod's view of it).
pub(crate) fn driver_free() -> Option<u64> {
    let original = cuMemGetInfo_v2::ORIGINAL.get()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: the driver's own function, with valid locals as out-pointers.
    let result = unsafe { original(&mut free, &mut total) };
    result.is_success().then_some(free as u64)
}

/// Linear memory on the current device, returned through `dptr`: the
/// driver's, or past the quota the host memory it was spilled to.
fn pointer_allocation(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    allocate: impl FnMut() -> CUresult,
) -> Result<CUresult> {
    if dptr.is_null() {
        return Err(LimiterError::Bypass(Pass::NullOutPointer));
    }
    // SAFETY: dptr is non-null, and written by the call that succeeded.
    let made = || Resource::Pointer(unsafe { dptr.read() });
    match memory()?.allocate_linear(bytesize as u64, allocate, made)? {
        Served::Device(result) => Ok(result),
        Served::Host(pointer) | Served::Backed(pointer) => {
            // SAFETY: dptr is non-null, valid for writes (the caller's out-pointer).
            unsafe { dptr.write(pointer) };
            Ok(CUresult::SUCCESS)
        }
    }
}

fn mem_alloc(
    original: cuMemAlloc_v2::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    pointer_allocation(dptr, bytesize, || unsafe { original(dptr, bytesize) })
}

fn mem_alloc_managed(
    original: cuMemAllocManaged::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: u32,
) -> Result<CUresult> {
    if dptr.is_null() {
        return Err(LimiterError::Bypass(Pass::NullOutPointer));
    }
    // SAFETY: the caller's own arguments.
    let allocate = || unsafe { original(dptr, bytesize, flags) };
    // SAFETY: dptr is non-null, and written by the call that succeeded.
    let made = || Resource::Pointer(unsafe { dptr.read() });
    let (placement, only) = (Placement::Current, DeviceOnly::MANAGED);
    let memory = memory()?;
    let result = memory.allocate_on_device(placement, bytesize as u64, only, allocate, made)?;
    if result.is_success() {
        // SAFETY: dptr is non-null, and written by the call that succeeded.
        memory
            .backing
            .managed_made(unsafe { dptr.read() }, bytesize as u64);
    }
    Ok(result)
}

/// Either stream: the charge is the same.
fn mem_alloc_async<const PER_THREAD: bool>(
    original: cuMemAllocAsync::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> Result<CUresult> {
    captured(stream)?;
    // SAFETY: the caller's own arguments.
    let allocate = || unsafe { original(dptr, bytesize, stream) };
    // Without the device's current pool (a driver that cannot say), the
    // allocation is charged on its own.
    match memory()?.current_pool() {
        Some(pool) => pooled_allocation(dptr, bytesize, pool, allocate),
        None => pointer_allocation(dptr, bytesize, allocate),
    }
}

fn mem_alloc_from_pool<const PER_THREAD: bool>(
    original: cuMemAllocFromPoolAsync::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> Result<CUresult> {
    captured(stream)?;
    // SAFETY: the caller's own arguments.
    let allocate = || unsafe { original(dptr, bytesize, pool, stream) };
    pooled_allocation(dptr, bytesize, pool, allocate)
}

/// Stream-ordered memory from `pool`, returned through `dptr`: charged as
/// the pool's reservation, or past the quota the host memory it was
/// spilled to.
fn pooled_allocation(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    allocate: impl FnMut() -> CUresult,
) -> Result<CUresult> {
    if dptr.is_null() {
        return Err(LimiterError::Bypass(Pass::NullOutPointer));
    }
    // SAFETY: dptr is non-null, and written by the call that succeeded.
    let made = || unsafe { dptr.read() };
    let trim = || crate::detour::held::trim_unused(pool);
    match memory()?.allocate_pooled(pool, bytesize as u64, allocate, made, trim)? {
        Served::Device(result) => Ok(result),
        Served::Host(pointer) | Served::Backed(pointer) => {
            // SAFETY: dptr is non-null, valid for writes (the caller's out-pointer).
            unsafe { dptr.write(pointer) };
            Ok(CUresult::SUCCESS)
        }
    }
}

/// A stream-ordered allocation into a graph being captured takes nothing
/// now: the graph's allocation node is charged when it is instantiated.
fn captured(stream: CUstream) -> Result<()> {
    let memory = memory()?;
    let capturing = memory
        .ctx
        .driver()
        .and_then(|driver| driver.timing.as_ref())
        .is_some_and(|timing| timing.is_capturing(stream));
    if capturing {
        return Err(LimiterError::Bypass(Pass::Captured));
    }
    Ok(())
}

fn mem_alloc_pitch(
    original: cuMemAllocPitch_v2::Signature,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width_in_bytes: usize,
    height: usize,
    element_size_bytes: u32,
) -> Result<CUresult> {
    if dptr.is_null() || pitch.is_null() {
        return Err(LimiterError::Bypass(Pass::NullOutPointer));
    }
    let served = memory()?.allocate_pitched(
        width_in_bytes,
        height,
        // SAFETY: the caller's own arguments.
        || unsafe { original(dptr, pitch, width_in_bytes, height, element_size_bytes) },
        // SAFETY: both non-null, and written by the call that succeeded.
        || unsafe { (dptr.read(), pitch.read()) },
        |pointer| {
            // SAFETY: frees the pointer just allocated, through the original.
            let _freed = cuMemFree_v2::ORIGINAL
                .get()
                .map(|free| unsafe { free(pointer) });
        },
    )?;
    match served {
        Pitched::Device(result) => Ok(result),
        Pitched::Served {
            pointer,
            pitch: row,
        } => {
            // SAFETY: both non-null, valid for writes (the caller's out-pointers).
            unsafe {
                dptr.write(pointer);
                pitch.write(row);
            }
            Ok(CUresult::SUCCESS)
        }
    }
}

fn mem_create(
    original: cuMemCreate::Signature,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> Result<CUresult> {
    if handle.is_null() {
        return Err(LimiterError::Bypass(Pass::NullOutPointer));
    }
    // SAFETY: the caller's property struct, null or valid for reads.
    let properties = unsafe { prop.as_ref() }.ok_or(LimiterError::Bypass(Pass::NoProperties))?;
    memory()?.allocate_physical(
        properties,
        size as u64,
        // SAFETY: the caller's own arguments.
        || unsafe { original(handle, size, prop, flags) },
        // SAFETY: handle is non-null, and written by the call that succeeded.
        || Resource::Handle(unsafe { handle.read() }),
    )
}

/// An array of `bytes` on the current device made by `api`, returned
/// through `array`; `resource` names its handle.
fn array_allocation<H>(
    api: &'static str,
    array: *mut *mut H,
    bytes: u64,
    allocate: impl FnMut() -> CUresult,
    resource: fn(usize) -> Resource,
) -> Result<CUresult> {
    // SAFETY: array is non-null (checked by the caller), and written by the
    // call that succeeded.
    let made = || resource(unsafe { array.read() } as usize);
    let (placement, only) = (Placement::Current, DeviceOnly::array(api));
    memory()?.allocate_on_device(placement, bytes, only, allocate, made)
}

/// The caller's array descriptor, with its out-pointer checked first.
///
/// # Safety
///
/// `descriptor` is null or valid for reads (the driver's contract).
unsafe fn array_shape<H, D: Copy>(array: *mut *mut H, descriptor: *const D) -> Result<D> {
    if array.is_null() {
        return Err(LimiterError::Bypass(Pass::NullOutPointer));
    }
    // SAFETY: forwarded from the caller.
    let shape = unsafe { descriptor.as_ref() }.copied();
    shape.ok_or(LimiterError::Bypass(Pass::NoDescriptor))
}

fn array_create(
    original: cuArrayCreate_v2::Signature,
    array: *mut CUarray,
    descriptor: *const CUDA_ARRAY_DESCRIPTOR,
) -> Result<CUresult> {
    // SAFETY: the caller's descriptor, per the driver's contract.
    let shape = unsafe { array_shape(array, descriptor) }?;
    let bytes = sizes::array_bytes(&CUDA_ARRAY3D_DESCRIPTOR {
        Width: shape.Width,
        Height: shape.Height,
        Depth: 0,
        Format: shape.Format,
        NumChannels: shape.NumChannels,
        Flags: 0,
    });
    // SAFETY: the caller's own arguments.
    let allocate = || unsafe { original(array, descriptor) };
    array_allocation("cuArrayCreate_v2", array, bytes, allocate, Resource::Array)
}

fn array_3d_create(
    original: cuArray3DCreate_v2::Signature,
    array: *mut CUarray,
    descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> Result<CUresult> {
    // SAFETY: the caller's descriptor, per the driver's contract.
    let shape = unsafe { array_shape(array, descriptor) }?;
    // SAFETY: the caller's own arguments.
    let allocate = || unsafe { original(array, descriptor) };
    let bytes = sizes::array_bytes(&shape);
    array_allocation(
        "cuArray3DCreate_v2",
        array,
        bytes,
        allocate,
        Resource::Array,
    )
}

fn mipmapped_array_create(
    original: cuMipmappedArrayCreate::Signature,
    array: *mut CUmipmappedArray,
    descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> Result<CUresult> {
    // SAFETY: the caller's descriptor, per the driver's contract.
    let shape = unsafe { array_shape(array, descriptor) }?;
    let bytes = sizes::mipmapped_bytes(&shape, levels);
    // SAFETY: the caller's own arguments.
    let allocate = || unsafe { original(array, descriptor, levels) };
    let api = "cuMipmappedArrayCreate";
    array_allocation(api, array, bytes, allocate, Resource::Mipmap)
}

fn mem_free(original: cuMemFree_v2::Signature, dptr: CUdeviceptr) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    memory()?.free_linear(dptr, false, || unsafe { original(dptr) })
}

/// A pool's allocation: its pool's charge follows what it reserves.
fn mem_free_async<const PER_THREAD: bool>(
    original: cuMemFreeAsync::Signature,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    let free = || unsafe { original(dptr, stream) };
    memory()?.free_linear(dptr, true, free)
}

fn mem_release(
    original: cuMemRelease::Signature,
    handle: CUmemGenericAllocationHandle,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    memory()?.free(Resource::Handle(handle), || unsafe { original(handle) })
}

fn array_destroy(original: cuArrayDestroy::Signature, array: CUarray) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    let free = || unsafe { original(array) };
    memory()?.free(Resource::Array(array as usize), free)
}

fn mipmapped_array_destroy(
    original: cuMipmappedArrayDestroy::Signature,
    array: CUmipmappedArray,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    let free = || unsafe { original(array) };
    memory()?.free(Resource::Mipmap(array as usize), free)
}

/// A byte count as a report writes it: `usize`, or `u32` for the legacy
/// entry points (saturated).
trait Bytes: Copy + Default {
    fn to_u64(self) -> u64;
    fn saturating_from(bytes: u64) -> Self;
}

impl Bytes for usize {
    fn to_u64(self) -> u64 {
        self as u64
    }
    fn saturating_from(bytes: u64) -> Self {
        usize::try_from(bytes).unwrap_or(usize::MAX)
    }
}

impl Bytes for u32 {
    fn to_u64(self) -> u64 {
        u64::from(self)
    }
    fn saturating_from(bytes: u64) -> Self {
        u32::try_from(bytes).unwrap_or(u32::MAX)
    }
}

/// `cuMemGetInfo(_v2)`: the driver's report into locals, then the pod's into
/// the caller's pointers.
fn report_memory<T: Bytes>(
    original: unsafe extern "C" fn(*mut T, *mut T) -> CUresult,
    free: *mut T,
    total: *mut T,
) -> Result<CUresult> {
    // Before the driver: a swapped-out pod is brought back first.
    let memory = memory();
    let (mut real_free, mut real_total) = (T::default(), T::default());
    // SAFETY: valid locals as out-pointers.
    let result = unsafe { original(&mut real_free, &mut real_total) };
    result
        .result()
        .map_err(|_| LimiterError::Bypass(Pass::DriverRefused))?;
    let real = (real_free.to_u64(), real_total.to_u64());
    let (shown_free, shown_total) = memory
        .and_then(|memory| memory.current_report(real.0, real.1))
        .unwrap_or(real);
    // SAFETY: the caller's out-pointers, null or valid for writes.
    let (Some(free), Some(total)) = (unsafe { free.as_mut() }, unsafe { total.as_mut() }) else {
        return Ok(CUresult::ERROR_INVALID_VALUE);
    };
    *free = T::saturating_from(shown_free);
    *total = T::saturating_from(shown_total);
    Ok(result)
}

/// `cuDeviceTotalMem(_v2)`: the driver's total into a local, then the pod's
/// into the caller's pointer.
fn report_total<T: Bytes>(
    original: unsafe extern "C" fn(*mut T, CUdevice) -> CUresult,
    bytes: *mut T,
    device: CUdevice,
) -> Result<CUresult> {
    // Before the driver: a swapped-out pod is brought back first.
    let memory = memory();
    let mut real = T::default();
    // SAFETY: a valid local as out-pointer.
    let result = unsafe { original(&mut real, device) };
    result
        .result()
        .map_err(|_| LimiterError::Bypass(Pass::DriverRefused))?;
    let real = real.to_u64();
    let shown = memory
        .and_then(|memory| memory.total(device, real))
        .unwrap_or(real);
    // SAFETY: the caller's out-pointer, null or valid for writes.
    let bytes = unsafe { bytes.as_mut() }.ok_or(LimiterError::NullArgument)?;
    *bytes = T::saturating_from(shown);
    Ok(result)
}

//! Memory logic: reserve before allocating, credit after freeing, and
//! rewrite reports. Each function receives the driver's original.

use crate::driver::Driver;
use crate::error::{LimiterError, Result};
use crate::quota::{MemoryQuota, Resource};
use crate::runtime;
use crate::spill;
use crate::sys::{
    CU_MEM_LOCATION_TYPE_DEVICE, CUDA_ARRAY_DESCRIPTOR, CUDA_ARRAY3D_CUBEMAP,
    CUDA_ARRAY3D_DESCRIPTOR, CUDA_ARRAY3D_LAYERED, CUarray, CUarray_format, CUdevice, CUdeviceptr,
    CUmemAllocationProp, CUmemGenericAllocationHandle, CUmemoryPool, CUmipmappedArray, CUresult,
    CUstream,
};

use super::hooks::{
    cuArray3DCreate_v2, cuArrayCreate_v2, cuArrayDestroy, cuDeviceTotalMem, cuDeviceTotalMem_v2,
    cuMemAlloc_v2, cuMemAllocAsync, cuMemAllocFromPoolAsync, cuMemAllocManaged, cuMemAllocPitch_v2,
    cuMemCreate, cuMemFree_v2, cuMemFreeAsync, cuMemGetInfo, cuMemGetInfo_v2, cuMemRelease,
    cuMipmappedArrayCreate, cuMipmappedArrayDestroy,
};

/// The quota and the limited device an allocation on the current context
/// goes to; `Bypass` when there is nothing to enforce.
fn current_limited_device() -> Result<(&'static MemoryQuota, usize)> {
    let quota = runtime::quota().ok_or(LimiterError::Bypass("limits off"))?;
    let driver = Driver::get().ok_or(LimiterError::Bypass("driver not resolved"))?;
    // Without a current context the driver reports its own error.
    let device = driver
        .current_device()
        .map_err(|_| LimiterError::Bypass("no current context"))?;
    limited(quota, device)
}

fn limited(quota: &'static MemoryQuota, device: CUdevice) -> Result<(&'static MemoryQuota, usize)> {
    let device = usize::try_from(device).map_err(|_| LimiterError::Bypass("bad device"))?;
    match quota.limit(device) {
        Some(_) => Ok((quota, device)),
        None => Err(LimiterError::Bypass("device unlimited")),
    }
}

/// Reserves `bytes` on the current device, runs `allocate`, and keeps the
/// charge under the resource it produced.
fn allocate_on_current(
    bytes: usize,
    allocate: impl FnOnce() -> CUresult,
    resource: impl FnOnce() -> Resource,
) -> Result<CUresult> {
    let (quota, device) = current_limited_device()?;
    charge(quota, device, bytes, allocate, resource)
}

fn charge(
    quota: &MemoryQuota,
    device: usize,
    bytes: usize,
    allocate: impl FnOnce() -> CUresult,
    resource: impl FnOnce() -> Resource,
) -> Result<CUresult> {
    if bytes == 0 {
        return Err(LimiterError::Bypass("empty allocation"));
    }
    let reservation = quota.reserve(device, bytes as u64)?;
    let result = allocate();
    if result.is_success() {
        reservation.commit(resource());
    }
    Ok(result)
}

/// Frees a resource with `free` and credits its charge if that succeeds.
fn release(resource: Resource, free: impl FnOnce() -> CUresult) -> Result<CUresult> {
    let quota = runtime::quota().ok_or(LimiterError::Bypass("limits off"))?;
    let charge = quota
        .take(resource)
        .ok_or(LimiterError::Bypass("not charged"))?;
    let result = free();
    if result.is_success() {
        quota.credit(charge);
    } else {
        quota.restore(resource, charge);
    }
    Ok(result)
}

/// Reads an out-pointer the driver will have written.
///
/// # Safety
///
/// `pointer` is null or valid for reads (an out-parameter after a successful call).
unsafe fn written<T: Copy>(pointer: *const T) -> Result<T> {
    // SAFETY: forwarded from the caller.
    unsafe { pointer.as_ref() }
        .copied()
        .ok_or(LimiterError::NullArgument)
}

/// An allocation that returns a device pointer through `dptr`.
fn pointer_allocation(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    allocate: impl FnOnce() -> CUresult,
) -> Result<CUresult> {
    if dptr.is_null() {
        return Err(LimiterError::Bypass("null out-pointer"));
    }
    // SAFETY: dptr is non-null and written by the successful call.
    allocate_on_current(bytesize, allocate, || Resource::Pointer(unsafe { *dptr }))
}

pub fn mem_alloc(
    original: cuMemAlloc_v2::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    let outcome = pointer_allocation(dptr, bytesize, || unsafe { original(dptr, bytesize) });
    spill::or_spill(outcome, dptr, bytesize as u64)
}

pub fn mem_alloc_managed(
    original: cuMemAllocManaged::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    flags: u32,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    let outcome = pointer_allocation(dptr, bytesize, || unsafe {
        original(dptr, bytesize, flags)
    });
    spill::unspillable(
        outcome,
        "cuMemAllocManaged",
        "cuMemAdvise and cuMemPrefetchAsync need managed memory",
    )
}

pub fn mem_alloc_async(
    original: cuMemAllocAsync::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    let outcome = pointer_allocation(dptr, bytesize, || unsafe {
        original(dptr, bytesize, stream)
    });
    spill::or_spill(outcome, dptr, bytesize as u64)
}

pub fn mem_alloc_from_pool(
    original: cuMemAllocFromPoolAsync::Signature,
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    let outcome = pointer_allocation(dptr, bytesize, || unsafe {
        original(dptr, bytesize, pool, stream)
    });
    spill::or_spill(outcome, dptr, bytesize as u64)
}

/// The driver rounds the pitch up to its alignment; reserve for the usual
/// 512 bytes and settle on the real pitch afterwards.
const PITCH_ESTIMATE_ALIGNMENT: usize = 512;

pub fn mem_alloc_pitch(
    original: cuMemAllocPitch_v2::Signature,
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width_in_bytes: usize,
    height: usize,
    element_size_bytes: u32,
) -> Result<CUresult> {
    if dptr.is_null() || pitch.is_null() {
        return Err(LimiterError::Bypass("null out-pointer"));
    }
    let (quota, device) = current_limited_device()?;
    let estimate = width_in_bytes
        .checked_next_multiple_of(PITCH_ESTIMATE_ALIGNMENT)
        .and_then(|row| row.checked_mul(height))
        .ok_or(LimiterError::Bypass("size overflows"))?;
    if estimate == 0 {
        return Err(LimiterError::Bypass("empty allocation"));
    }
    let mut reservation = match quota.reserve(device, estimate as u64) {
        Ok(reservation) => reservation,
        Err(over) => {
            return spill::or_spill_pitched(Err(over), dptr, pitch, estimate / height, height);
        }
    };
    // SAFETY: the caller's own arguments.
    let result = unsafe { original(dptr, pitch, width_in_bytes, height, element_size_bytes) };
    if !result.is_success() {
        return Ok(result);
    }
    // SAFETY: written by the successful call.
    let (pointer, actual_pitch) = unsafe { (written(dptr)?, written(pitch)?) };
    let actual = (actual_pitch as u64).saturating_mul(height as u64);
    if let Err(over) = reservation.resize(actual) {
        // The real pitch does not fit: undo, as if the driver had refused.
        // SAFETY: frees the pointer just allocated, through the original.
        let _freed = unsafe { cuMemFree_v2::ORIGINAL.get().map(|free| free(pointer)) };
        return Err(over);
    }
    reservation.commit(Resource::Pointer(pointer));
    Ok(result)
}

pub fn mem_create(
    original: cuMemCreate::Signature,
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> Result<CUresult> {
    if handle.is_null() {
        return Err(LimiterError::Bypass("null out-pointer"));
    }
    // SAFETY: the caller's property struct, read only.
    let prop_value = unsafe { written(prop) }.map_err(|_| LimiterError::Bypass("no properties"))?;
    if prop_value.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
        return Err(LimiterError::Bypass("host memory"));
    }
    let quota = runtime::quota().ok_or(LimiterError::Bypass("limits off"))?;
    let (quota, device) = limited(quota, prop_value.location.id)?;
    // SAFETY (closures): the caller's own arguments; handle written on success.
    let outcome = charge(
        quota,
        device,
        size,
        || unsafe { original(handle, size, prop, flags) },
        || Resource::Handle(unsafe { *handle }),
    );
    spill::unspillable(
        outcome,
        "cuMemCreate",
        "VMM memory is mapped as device memory",
    )
}

/// Bytes of one element of an array format; unknown (e.g. block-compressed
/// or packed video) formats are counted as 4, and the overhead measurement
/// picks up the difference.
fn element_bytes(format: CUarray_format) -> u64 {
    match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // (UN)SIGNED_INT32, FLOAT
        _ => 4,
    }
}

/// Bytes of an array of the given shape; a zero height or depth means the
/// dimension is absent.
pub fn array_bytes(descriptor: &CUDA_ARRAY3D_DESCRIPTOR) -> u64 {
    let faces = if descriptor.Flags & CUDA_ARRAY3D_CUBEMAP != 0 {
        6
    } else {
        1
    };
    // Layered or not, Depth multiplies: layers or the third dimension.
    element_bytes(descriptor.Format)
        .saturating_mul(u64::from(descriptor.NumChannels.max(1)))
        .saturating_mul(descriptor.Width.max(1) as u64)
        .saturating_mul(descriptor.Height.max(1) as u64)
        .saturating_mul(descriptor.Depth.max(1) as u64)
        .saturating_mul(faces)
}

/// Bytes of a mipmapped array: every level halves each present dimension
/// (layers and faces stay).
pub fn mipmapped_bytes(descriptor: &CUDA_ARRAY3D_DESCRIPTOR, levels: u32) -> u64 {
    let layered = descriptor.Flags & CUDA_ARRAY3D_LAYERED != 0;
    let mut level = *descriptor;
    let mut total = 0u64;
    for _ in 0..levels.max(1) {
        total = total.saturating_add(array_bytes(&level));
        level.Width = (level.Width / 2).max(1);
        if level.Height > 0 {
            level.Height = (level.Height / 2).max(1);
        }
        if level.Depth > 0 && !layered {
            level.Depth = (level.Depth / 2).max(1);
        }
    }
    total
}

/// Why arrays are never served from host memory.
const ARRAYS_STAY: &str = "arrays are opaque device layouts";

pub fn array_create(
    original: cuArrayCreate_v2::Signature,
    array: *mut CUarray,
    descriptor: *const CUDA_ARRAY_DESCRIPTOR,
) -> Result<CUresult> {
    if array.is_null() {
        return Err(LimiterError::Bypass("null out-pointer"));
    }
    // SAFETY: the caller's descriptor, read only.
    let shape =
        unsafe { written(descriptor) }.map_err(|_| LimiterError::Bypass("no descriptor"))?;
    let bytes = array_bytes(&CUDA_ARRAY3D_DESCRIPTOR {
        Width: shape.Width,
        Height: shape.Height,
        Depth: 0,
        Format: shape.Format,
        NumChannels: shape.NumChannels,
        Flags: 0,
    });
    // SAFETY (closures): the caller's own arguments; array written on success.
    let outcome = allocate_on_current(
        usize::try_from(bytes).unwrap_or(usize::MAX),
        || unsafe { original(array, descriptor) },
        || Resource::Array(unsafe { *array } as usize),
    );
    spill::unspillable(outcome, "cuArrayCreate_v2", ARRAYS_STAY)
}

pub fn array_3d_create(
    original: cuArray3DCreate_v2::Signature,
    array: *mut CUarray,
    descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
) -> Result<CUresult> {
    if array.is_null() {
        return Err(LimiterError::Bypass("null out-pointer"));
    }
    // SAFETY: the caller's descriptor, read only.
    let shape =
        unsafe { written(descriptor) }.map_err(|_| LimiterError::Bypass("no descriptor"))?;
    // SAFETY (closures): the caller's own arguments; array written on success.
    let outcome = allocate_on_current(
        usize::try_from(array_bytes(&shape)).unwrap_or(usize::MAX),
        || unsafe { original(array, descriptor) },
        || Resource::Array(unsafe { *array } as usize),
    );
    spill::unspillable(outcome, "cuArray3DCreate_v2", ARRAYS_STAY)
}

pub fn mipmapped_array_create(
    original: cuMipmappedArrayCreate::Signature,
    array: *mut CUmipmappedArray,
    descriptor: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: u32,
) -> Result<CUresult> {
    if array.is_null() {
        return Err(LimiterError::Bypass("null out-pointer"));
    }
    // SAFETY: the caller's descriptor, read only.
    let shape =
        unsafe { written(descriptor) }.map_err(|_| LimiterError::Bypass("no descriptor"))?;
    // SAFETY (closures): the caller's own arguments; array written on success.
    let outcome = allocate_on_current(
        usize::try_from(mipmapped_bytes(&shape, levels)).unwrap_or(usize::MAX),
        || unsafe { original(array, descriptor, levels) },
        || Resource::Mipmap(unsafe { *array } as usize),
    );
    spill::unspillable(outcome, "cuMipmappedArrayCreate", ARRAYS_STAY)
}

pub fn mem_free(original: cuMemFree_v2::Signature, dptr: CUdeviceptr) -> Result<CUresult> {
    if let Some(freed) = spill::free(dptr, false) {
        return Ok(freed);
    }
    // SAFETY: the caller's own argument.
    release(Resource::Pointer(dptr), || unsafe { original(dptr) })
}

pub fn mem_free_async(
    original: cuMemFreeAsync::Signature,
    dptr: CUdeviceptr,
    stream: CUstream,
) -> Result<CUresult> {
    if let Some(freed) = spill::free(dptr, true) {
        return Ok(freed);
    }
    // Credited when enqueued: the pool gives it back by the next synchronisation.
    // SAFETY: the caller's own arguments.
    release(Resource::Pointer(dptr), || unsafe {
        original(dptr, stream)
    })
}

pub fn mem_release(
    original: cuMemRelease::Signature,
    handle: CUmemGenericAllocationHandle,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    release(Resource::Handle(handle), || unsafe { original(handle) })
}

pub fn array_destroy(original: cuArrayDestroy::Signature, array: CUarray) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    release(Resource::Array(array as usize), || unsafe {
        original(array)
    })
}

pub fn mipmapped_array_destroy(
    original: cuMipmappedArrayDestroy::Signature,
    array: CUmipmappedArray,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    release(Resource::Mipmap(array as usize), || unsafe {
        original(array)
    })
}

/// The report of the current device, `(free, total)`, if it is limited.
fn current_report(real_free: u64, real_total: u64) -> Result<(u64, u64)> {
    let (quota, device) = current_limited_device()?;
    quota
        .report(device, real_free, real_total)
        .ok_or(LimiterError::Bypass("device unlimited"))
}

pub fn mem_get_info(
    original: cuMemGetInfo_v2::Signature,
    free: *mut usize,
    total: *mut usize,
) -> Result<CUresult> {
    let (mut real_free, mut real_total) = (0usize, 0usize);
    // SAFETY: valid locals as out-pointers.
    let result = unsafe { original(&mut real_free, &mut real_total) };
    if !result.is_success() {
        return Err(LimiterError::Bypass("driver refused"));
    }
    let (shown_free, shown_total) = current_report(real_free as u64, real_total as u64)
        .unwrap_or((real_free as u64, real_total as u64));
    // SAFETY: the caller's out-pointers, written only when non-null.
    unsafe {
        let (free, total) = (free.as_mut(), total.as_mut());
        let (Some(free), Some(total)) = (free, total) else {
            return Ok(CUresult::ERROR_INVALID_VALUE);
        };
        *free = shown_free as usize;
        *total = shown_total as usize;
    }
    Ok(result)
}

pub fn mem_get_info_v1(
    original: cuMemGetInfo::Signature,
    free: *mut u32,
    total: *mut u32,
) -> Result<CUresult> {
    let (mut real_free, mut real_total) = (0u32, 0u32);
    // SAFETY: valid locals as out-pointers.
    let result = unsafe { original(&mut real_free, &mut real_total) };
    if !result.is_success() {
        return Err(LimiterError::Bypass("driver refused"));
    }
    let (shown_free, shown_total) = current_report(u64::from(real_free), u64::from(real_total))
        .unwrap_or((u64::from(real_free), u64::from(real_total)));
    // SAFETY: the caller's out-pointers, written only when non-null.
    unsafe {
        let (Some(free), Some(total)) = (free.as_mut(), total.as_mut()) else {
            return Ok(CUresult::ERROR_INVALID_VALUE);
        };
        *free = u32::try_from(shown_free).unwrap_or(u32::MAX);
        *total = u32::try_from(shown_total).unwrap_or(u32::MAX);
    }
    Ok(result)
}

/// The total a pod sees for `device`, or `Bypass` when it is unlimited.
fn limited_total(device: CUdevice, real_total: u64) -> Result<u64> {
    let quota = runtime::quota().ok_or(LimiterError::Bypass("limits off"))?;
    let (quota, device) = limited(quota, device)?;
    let limit = quota
        .limit(device)
        .ok_or(LimiterError::Bypass("device unlimited"))?;
    Ok(limit.min(real_total))
}

pub fn device_total_mem(
    original: cuDeviceTotalMem_v2::Signature,
    bytes: *mut usize,
    device: CUdevice,
) -> Result<CUresult> {
    let mut real = 0usize;
    // SAFETY: a valid local as out-pointer.
    let result = unsafe { original(&mut real, device) };
    if !result.is_success() {
        return Err(LimiterError::Bypass("driver refused"));
    }
    let shown = limited_total(device, real as u64).unwrap_or(real as u64);
    // SAFETY: the caller's out-pointer, written only when non-null.
    let bytes = unsafe { bytes.as_mut() }.ok_or(LimiterError::NullArgument)?;
    *bytes = shown as usize;
    Ok(result)
}

pub fn device_total_mem_v1(
    original: cuDeviceTotalMem::Signature,
    bytes: *mut u32,
    device: CUdevice,
) -> Result<CUresult> {
    let mut real = 0u32;
    // SAFETY: a valid local as out-pointer.
    let result = unsafe { original(&mut real, device) };
    if !result.is_success() {
        return Err(LimiterError::Bypass("driver refused"));
    }
    let shown = limited_total(device, u64::from(real)).unwrap_or(u64::from(real));
    // SAFETY: the caller's out-pointer, written only when non-null.
    let bytes = unsafe { bytes.as_mut() }.ok_or(LimiterError::NullArgument)?;
    *bytes = u32::try_from(shown).unwrap_or(u32::MAX);
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(
        width: usize,
        height: usize,
        depth: usize,
        format: u32,
        channels: u32,
        flags: u32,
    ) -> CUDA_ARRAY3D_DESCRIPTOR {
        CUDA_ARRAY3D_DESCRIPTOR {
            Width: width,
            Height: height,
            Depth: depth,
            Format: format,
            NumChannels: channels,
            Flags: flags,
        }
    }

    #[test]
    fn array_sizes_follow_shape_format_and_flags() {
        let cases = [
            (shape(1024, 0, 0, 0x01, 1, 0), 1024),
            (shape(1024, 1024, 0, 0x20, 1, 0), 4 << 20),
            (shape(16, 16, 16, 0x10, 4, 0), 16 * 16 * 16 * 2 * 4),
            (
                shape(64, 64, 3, 0x03, 1, CUDA_ARRAY3D_LAYERED),
                64 * 64 * 3 * 4,
            ),
            (shape(32, 32, 0, 0x01, 1, CUDA_ARRAY3D_CUBEMAP), 32 * 32 * 6),
        ];
        for (descriptor, bytes) in cases {
            assert_eq!(array_bytes(&descriptor), bytes, "{descriptor:?}");
        }
    }

    #[test]
    fn mipmaps_sum_their_levels() {
        // 8x8 floats: 256 + 64 + 16 + 4 bytes.
        assert_eq!(mipmapped_bytes(&shape(8, 8, 0, 0x20, 1, 0), 4), 340);
        // Layers are not halved: 2 layers of 4 then 2 then 1 bytes.
        assert_eq!(
            mipmapped_bytes(&shape(4, 0, 2, 0x01, 1, CUDA_ARRAY3D_LAYERED), 3),
            14
        );
        assert_eq!(mipmapped_bytes(&shape(4, 0, 0, 0x01, 1, 0), 0), 4);
    }
}

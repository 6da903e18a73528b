//! Detours of the pointer queries. The adapters write the caller's
//! out-pointers only for memory the limiter backs; any other address is
//! the driver's to answer.

use std::ffi::c_void;

use super::ops;
use crate::error::{LimiterError, Result};
use crate::sys::{CUdeviceptr, CUpointer_attribute, CUresult};

gpushare_macros::detours! {
    /// What the driver says of an address.
    pub static POINTER_DETOURS;

    /// The base and size of the allocation holding an address.
    optional fn cuMemGetAddressRange_v2(
        base: *mut CUdeviceptr,
        size: *mut usize,
        pointer: CUdeviceptr,
    ) -> CUresult => address_range;
    /// One attribute of the memory at an address.
    optional fn cuPointerGetAttribute(
        data: *mut c_void,
        attribute: CUpointer_attribute,
        pointer: CUdeviceptr,
    ) -> CUresult => pointer_attribute;
}

fn address_range(
    _original: cuMemGetAddressRange_v2::Signature,
    base: *mut CUdeviceptr,
    size: *mut usize,
    pointer: CUdeviceptr,
) -> Result<CUresult> {
    let (start, bytes) = ops::backed_range(pointer)?;
    // SAFETY: the caller's out-pointers, each null or valid for writes.
    unsafe {
        if let Some(base) = base.as_mut() {
            *base = start;
        }
        if let Some(size) = size.as_mut() {
            *size = usize::try_from(bytes).unwrap_or(usize::MAX);
        }
    }
    Ok(CUresult::SUCCESS)
}

fn pointer_attribute(
    _original: cuPointerGetAttribute::Signature,
    data: *mut c_void,
    attribute: CUpointer_attribute,
    pointer: CUdeviceptr,
) -> Result<CUresult> {
    let value = ops::attribute(attribute, pointer)?;
    // SAFETY: the caller's out-pointer, null or valid for the attribute's
    // 8 bytes (a CUdeviceptr or a size_t).
    let data = unsafe { data.cast::<u64>().as_mut() }.ok_or(LimiterError::NullArgument)?;
    *data = value;
    Ok(CUresult::SUCCESS)
}

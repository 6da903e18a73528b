//! Detours of the legacy CUDA IPC calls. The adapters read and write the
//! caller's handle and pointers; any memory or handle the limiter did not
//! make is the driver's to answer.

use std::ffi::c_uint;

use super::ops;
use crate::error::{LimiterError, Result};
use crate::sys::{CUdeviceptr, CUipcMemHandle, CUresult};

gpushare_macros::detours! {
    /// CUDA IPC of device memory.
    pub static IPC_DETOURS;

    /// The handle another process opens to map an allocation.
    optional fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, pointer: CUdeviceptr) -> CUresult
        => get_handle;
    /// Maps the allocation a handle names.
    optional fn cuIpcOpenMemHandle_v2(
        pointer: *mut CUdeviceptr,
        handle: CUipcMemHandle,
        flags: c_uint,
    ) -> CUresult => open_handle;
    /// The same, by its older name.
    optional fn cuIpcOpenMemHandle(
        pointer: *mut CUdeviceptr,
        handle: CUipcMemHandle,
        flags: c_uint,
    ) -> CUresult => open_handle_v1;
    /// Unmaps what an open mapped.
    optional fn cuIpcCloseMemHandle(pointer: CUdeviceptr) -> CUresult => close_handle;
}

fn get_handle(
    _original: cuIpcGetMemHandle::Signature,
    handle: *mut CUipcMemHandle,
    pointer: CUdeviceptr,
) -> Result<CUresult> {
    // SAFETY: the caller's out-pointer, null or valid for a handle.
    let out = unsafe { handle.as_mut() }.ok_or(LimiterError::NullArgument)?;
    let bytes = ops::export(pointer)?;
    match bytes {
        Ok(bytes) => {
            out.reserved = bytes;
            Ok(CUresult::SUCCESS)
        }
        Err(code) => Ok(code),
    }
}

fn open_handle(
    _original: cuIpcOpenMemHandle_v2::Signature,
    pointer: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    _flags: c_uint,
) -> Result<CUresult> {
    open(pointer, &handle)
}

fn open_handle_v1(
    _original: cuIpcOpenMemHandle::Signature,
    pointer: *mut CUdeviceptr,
    handle: CUipcMemHandle,
    _flags: c_uint,
) -> Result<CUresult> {
    open(pointer, &handle)
}

/// Either open: the limiter's handles mapped here, the driver's passed on.
fn open(pointer: *mut CUdeviceptr, handle: &CUipcMemHandle) -> Result<CUresult> {
    let ticket = ops::ticket(handle)?;
    // SAFETY: the caller's out-pointer, null or valid for a device pointer.
    let out = unsafe { pointer.as_mut() }.ok_or(LimiterError::NullArgument)?;
    match ops::import(ticket) {
        Ok(address) => {
            *out = address;
            Ok(CUresult::SUCCESS)
        }
        Err(code) => Ok(code),
    }
}

fn close_handle(
    _original: cuIpcCloseMemHandle::Signature,
    pointer: CUdeviceptr,
) -> Result<CUresult> {
    ops::close(pointer)
}

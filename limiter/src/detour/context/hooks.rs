//! Context detours. Adapters hand the device and the driver's original (as a
//! closure) to the policy in `ops`; the out-pointer is only passed through.

use std::ffi::c_void;

use super::ops::{self, Creation};
use crate::error::Result;
use crate::sys::{CUcontext, CUdevice, CUresult};

gpushare_macros::detours! {
    /// Every call that creates a context.
    pub static CONTEXT_DETOURS;

    /// The device's primary context (what the runtime API uses), created on
    /// its first retain.
    optional fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, device: CUdevice) -> CUresult
        => primary_retain;
    /// An extra context.
    optional fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: u32, device: CUdevice) -> CUresult
        => ctx_create;
    /// An extra context with execution-affinity parameters.
    optional fn cuCtxCreate_v3(
        pctx: *mut CUcontext,
        params: *mut c_void,
        count: i32,
        flags: u32,
        device: CUdevice,
    ) -> CUresult => ctx_create_v3;
    /// An extra context with creation parameters (CUDA 12.5+).
    optional fn cuCtxCreate_v4(
        pctx: *mut CUcontext,
        params: *mut c_void,
        flags: u32,
        device: CUdevice,
    ) -> CUresult => ctx_create_v4;
}

fn primary_retain(
    original: cuDevicePrimaryCtxRetain::Signature,
    pctx: *mut CUcontext,
    device: CUdevice,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::create(device, Creation::Primary, || unsafe {
        original(pctx, device)
    })
}

fn ctx_create(
    original: cuCtxCreate_v2::Signature,
    pctx: *mut CUcontext,
    flags: u32,
    device: CUdevice,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::create(device, Creation::Extra, || unsafe {
        original(pctx, flags, device)
    })
}

fn ctx_create_v3(
    original: cuCtxCreate_v3::Signature,
    pctx: *mut CUcontext,
    params: *mut c_void,
    count: i32,
    flags: u32,
    device: CUdevice,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::create(device, Creation::Extra, || unsafe {
        original(pctx, params, count, flags, device)
    })
}

fn ctx_create_v4(
    original: cuCtxCreate_v4::Signature,
    pctx: *mut CUcontext,
    params: *mut c_void,
    flags: u32,
    device: CUdevice,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::create(device, Creation::Extra, || unsafe {
        original(pctx, params, flags, device)
    })
}

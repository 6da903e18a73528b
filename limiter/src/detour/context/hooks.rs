//! Context detours. Adapters hand the device and the driver's original (as a
//! closure) to the policy in `ops`; the out-pointer is only passed through.

use std::ffi::c_void;

use super::ops::{self, Creation};
use crate::error::{LimiterError, Pass, Result};
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
    /// A green context (a partition of the device's SMs), which takes a
    /// little memory of its own (measured). Its resource descriptor is a
    /// pointer.
    optional fn cuGreenCtxCreate(
        pctx: *mut c_void,
        desc: *mut c_void,
        device: CUdevice,
        flags: u32,
    ) -> CUresult => green_ctx_create;

    /// Gives an extra context's memory back.
    optional fn cuCtxDestroy_v2(context: CUcontext) -> CUresult => ctx_destroy;
    /// Gives the primary context's memory back on the last release.
    optional fn cuDevicePrimaryCtxRelease_v2(device: CUdevice) -> CUresult => primary_release;
    /// Destroys the primary context.
    optional fn cuDevicePrimaryCtxReset_v2(device: CUdevice) -> CUresult => primary_reset;
    /// Destroys a green context.
    optional fn cuGreenCtxDestroy(context: *mut c_void) -> CUresult => green_ctx_destroy;
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

fn green_ctx_create(
    original: cuGreenCtxCreate::Signature,
    pctx: *mut c_void,
    desc: *mut c_void,
    device: CUdevice,
    flags: u32,
) -> Result<CUresult> {
    if pctx.is_null() {
        return Err(LimiterError::Bypass(Pass::NullOutPointer));
    }
    let destroy = || {
        // SAFETY: `pctx` is non-null and holds the green context just made.
        let made = unsafe { pctx.cast::<*mut c_void>().read() };
        if let Some(destroy) = cuGreenCtxDestroy::ORIGINAL.get() {
            // SAFETY: destroys the green context this call made, through the original.
            let _ = unsafe { destroy(made) };
        }
    };
    // SAFETY: the caller's own arguments.
    ops::create_green(
        device,
        || unsafe { original(pctx, desc, device, flags) },
        destroy,
    )
}

fn ctx_destroy(original: cuCtxDestroy_v2::Signature, context: CUcontext) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::destroyed(|| unsafe { original(context) })
}

fn primary_release(
    original: cuDevicePrimaryCtxRelease_v2::Signature,
    device: CUdevice,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::destroyed(|| unsafe { original(device) })
}

fn primary_reset(
    original: cuDevicePrimaryCtxReset_v2::Signature,
    device: CUdevice,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::destroyed(|| unsafe { original(device) })
}

fn green_ctx_destroy(
    original: cuGreenCtxDestroy::Signature,
    context: *mut c_void,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::destroyed(|| unsafe { original(context) })
}

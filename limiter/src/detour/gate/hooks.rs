//! Detours of the copies, sets, synchronisations and queries. Every handler
//! is an `around` one that reads none of the caller's arguments (the driver
//! alone does): it only waits while the pod is swapped out, and the detour
//! calls the original from its own frame. The `_ptsz` twins come from
//! `ptsz` declarations; the `_ptds` twins of the synchronous copies and
//! sets, which that keyword does not name, are declared one by one, their
//! handlers called as `::<true>`. All are optional: older drivers lack some.

use std::ffi::{c_uint, c_void};

use super::ops::{self, Resident};
use crate::error::Result;
use crate::sys::{CUdeviceptr, CUevent, CUresult, CUstream};

gpushare_macros::detours! {
    /// Every call that uses the GPU without allocating or launching.
    pub static GATE_DETOURS;

    /// A copy between two addresses of the unified space.
    optional fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult
        => around args3::<false>;
    /// `cuMemcpy` on the per-thread default stream.
    optional fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult
        => around args3::<true>;
    /// An asynchronous copy in the unified space.
    optional ptsz fn cuMemcpyAsync(
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
        stream: CUstream,
    ) -> CUresult => around args4;

    /// Host to device.
    optional fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> CUresult
        => around args3::<false>;
    /// `cuMemcpyHtoD_v2` on the per-thread default stream.
    optional fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> CUresult
        => around args3::<true>;
    /// Host to device, asynchronous.
    optional ptsz fn cuMemcpyHtoDAsync_v2(
        dst: CUdeviceptr,
        src: *const c_void,
        bytes: usize,
        stream: CUstream,
    ) -> CUresult => around args4;

    /// Device to host.
    optional fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> CUresult
        => around args3::<false>;
    /// `cuMemcpyDtoH_v2` on the per-thread default stream.
    optional fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> CUresult
        => around args3::<true>;
    /// Device to host, asynchronous.
    optional ptsz fn cuMemcpyDtoHAsync_v2(
        dst: *mut c_void,
        src: CUdeviceptr,
        bytes: usize,
        stream: CUstream,
    ) -> CUresult => around args4;

    /// Device to device.
    optional fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult
        => around args3::<false>;
    /// `cuMemcpyDtoD_v2` on the per-thread default stream.
    optional fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult
        => around args3::<true>;
    /// Device to device, asynchronous.
    optional ptsz fn cuMemcpyDtoDAsync_v2(
        dst: CUdeviceptr,
        src: CUdeviceptr,
        bytes: usize,
        stream: CUstream,
    ) -> CUresult => around args4;

    /// Sets bytes.
    optional fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, count: usize) -> CUresult
        => around args3::<false>;
    /// `cuMemsetD8_v2` on the per-thread default stream.
    optional fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, value: u8, count: usize) -> CUresult
        => around args3::<true>;
    /// Sets 32-bit words.
    optional fn cuMemsetD32_v2(dst: CUdeviceptr, value: c_uint, count: usize) -> CUresult
        => around args3::<false>;
    /// `cuMemsetD32_v2` on the per-thread default stream.
    optional fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, value: c_uint, count: usize) -> CUresult
        => around args3::<true>;
    /// Sets bytes, asynchronously.
    optional ptsz fn cuMemsetD8Async(
        dst: CUdeviceptr,
        value: u8,
        count: usize,
        stream: CUstream,
    ) -> CUresult => around args4;
    /// Sets 32-bit words, asynchronously.
    optional ptsz fn cuMemsetD32Async(
        dst: CUdeviceptr,
        value: c_uint,
        count: usize,
        stream: CUstream,
    ) -> CUresult => around args4;

    /// Waits for a stream's work.
    optional ptsz fn cuStreamSynchronize(stream: CUstream) -> CUresult => around args1;
    /// Waits for the context's work.
    optional fn cuCtxSynchronize() -> CUresult => around args0::<false>;
    /// Waits for an event.
    optional fn cuEventSynchronize(event: CUevent) -> CUresult => around args1::<false>;
    /// Records an event in a stream.
    optional ptsz fn cuEventRecord(event: CUevent, stream: CUstream) -> CUresult => around args2;
    /// Makes a stream wait for an event.
    optional ptsz fn cuStreamWaitEvent(stream: CUstream, event: CUevent, flags: c_uint) -> CUresult
        => around args3;
    /// Whether a stream's work is done.
    optional ptsz fn cuStreamQuery(stream: CUstream) -> CUresult => around args1;
    /// Whether an event has happened.
    optional fn cuEventQuery(event: CUevent) -> CUresult => around args1::<false>;
}

// The adapters, by the number of arguments they leave to the driver;
// `PER_THREAD` (the twins' `true`) changes nothing here.

fn args0<const PER_THREAD: bool>() -> Result<Resident> {
    ops::resident()
}

fn args1<const PER_THREAD: bool>(_: impl Copy) -> Result<Resident> {
    ops::resident()
}

fn args2<const PER_THREAD: bool>(_: impl Copy, _: impl Copy) -> Result<Resident> {
    ops::resident()
}

fn args3<const PER_THREAD: bool>(_: impl Copy, _: impl Copy, _: impl Copy) -> Result<Resident> {
    ops::resident()
}

fn args4<const PER_THREAD: bool>(
    _: impl Copy,
    _: impl Copy,
    _: impl Copy,
    _: impl Copy,
) -> Result<Resident> {
    ops::resident()
}

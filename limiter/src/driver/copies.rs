//! What a swap of the memory the limiter backs (`backing::swap`) needs
//! besides the VMM functions: the calling thread's current context set and
//! restored (the link thread that swaps has none of its own), a context's
//! work waited for, pinned host memory, and copies between it and the
//! device. Called from the limiter's own threads, under the detour guard,
//! so the gate's detours of the copies pass them straight to the driver.

use std::ffi::c_void;

use super::{DriverError, symbol};
use crate::sys::{
    CU_MEMHOSTALLOC_PORTABLE, CUcontext, CUdeviceptr, CuCtxGetCurrent, CuCtxSetCurrent,
    CuCtxSynchronize, CuMemFreeHost, CuMemHostAlloc, CuMemcpyDtoH, CuMemcpyHtoD,
};

/// The driver's functions for copies to host memory and back; absent
/// (`None` from [`Copies::load`]) from drivers that lack any of them.
pub(crate) struct Copies {
    get_current: CuCtxGetCurrent,
    set_current: CuCtxSetCurrent,
    synchronize: CuCtxSynchronize,
    host_alloc: CuMemHostAlloc,
    free_host: CuMemFreeHost,
    to_host: CuMemcpyDtoH,
    to_device: CuMemcpyHtoD,
}

/// Pinned host memory of [`Copies::pin`]: its address, kept as a number so
/// that the book that holds it can be shared between threads. Freed only
/// through [`Copies::unpin`], which consumes it.
#[derive(Debug)]
pub(crate) struct Pinned {
    address: usize,
    bytes: u64,
}

impl Pinned {
    /// Its size in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Copies {
    /// Resolves the functions from a loaded libcuda; `None` if one is missing.
    ///
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub(super) unsafe fn load(handle: *mut c_void) -> Option<Self> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            Some(Self {
                get_current: symbol(handle, c"cuCtxGetCurrent")?,
                set_current: symbol(handle, c"cuCtxSetCurrent")?,
                synchronize: symbol(handle, c"cuCtxSynchronize")?,
                host_alloc: symbol(handle, c"cuMemHostAlloc")?,
                free_host: symbol(handle, c"cuMemFreeHost")?,
                to_host: symbol(handle, c"cuMemcpyDtoH_v2")?,
                to_device: symbol(handle, c"cuMemcpyHtoD_v2")?,
            })
        }
    }

    /// The calling thread's current context, as a number (0: none).
    pub(crate) fn current(&self) -> Result<usize, DriverError> {
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        unsafe { (self.get_current)(&mut context) }.result()?;
        Ok(context as usize)
    }

    /// Makes `context` (a number [`Self::current`] returned; 0: none) the
    /// calling thread's current context.
    pub(crate) fn make_current(&self, context: usize) -> Result<(), DriverError> {
        // SAFETY: a context the driver handed out, or none; the driver
        // checks that it is alive.
        unsafe { (self.set_current)(context as CUcontext) }.result()
    }

    /// Waits for all the work of the calling thread's current context.
    pub(crate) fn synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: no arguments.
        unsafe { (self.synchronize)() }.result()
    }

    /// `bytes` of host memory pinned for every context (`PORTABLE`).
    pub(crate) fn pin(&self, bytes: u64) -> Result<Pinned, DriverError> {
        let size = usize::try_from(bytes).map_err(|_| DriverError::INVALID_VALUE)?;
        let mut pointer: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the driver's signature.
        unsafe { (self.host_alloc)(&mut pointer, size, CU_MEMHOSTALLOC_PORTABLE) }.result()?;
        if pointer.is_null() {
            return Err(DriverError::INVALID_VALUE);
        }
        Ok(Pinned {
            address: pointer as usize,
            bytes,
        })
    }

    /// Frees `pinned`; the driver refusing hands it back with its answer.
    pub(crate) fn unpin(&self, pinned: Pinned) -> Result<(), (Pinned, DriverError)> {
        // SAFETY: a pointer cuMemHostAlloc returned; `Pinned` is consumed
        // here, so it is freed once.
        let result = unsafe { (self.free_host)(pinned.address as *mut c_void) };
        result.result().map_err(|error| (pinned, error))
    }

    /// Copies all of `pinned` from the device memory at `source`.
    pub(crate) fn to_host(&self, pinned: &Pinned, source: CUdeviceptr) -> Result<(), DriverError> {
        let size = usize::try_from(pinned.bytes).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: `pinned` is `size` bytes of host memory the limiter owns;
        // the driver checks the device range.
        unsafe { (self.to_host)(pinned.address as *mut c_void, source, size) }.result()
    }

    /// Copies all of `pinned` to the device memory at `target`.
    pub(crate) fn to_device(
        &self,
        target: CUdeviceptr,
        pinned: &Pinned,
    ) -> Result<(), DriverError> {
        let size = usize::try_from(pinned.bytes).map_err(|_| DriverError::INVALID_VALUE)?;
        // SAFETY: as in `to_host`, the other way.
        unsafe { (self.to_device)(target, pinned.address as *const c_void, size) }.result()
    }
}

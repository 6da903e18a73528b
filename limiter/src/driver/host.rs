//! Pinned host memory mapped into the device's address space, for
//! oversubscription (`spill`). None of these functions is patched.

use std::ffi::c_void;

use super::symbol;
use crate::sys::{
    CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE, CUdeviceptr, CUresult, CuCtxSynchronize,
    CuMemFreeHost, CuMemHostAlloc, CuMemHostGetDevicePointer,
};

/// The driver's pinned-host-memory functions.
pub struct HostMemory {
    alloc: CuMemHostAlloc,
    device_pointer: CuMemHostGetDevicePointer,
    free: CuMemFreeHost,
    synchronize: CuCtxSynchronize,
}

/// Pinned host memory the device can address. Made only by
/// [`HostMemory::allocate_mapped`] and consumed by [`HostMemory::free`], so
/// it is freed at most once.
#[derive(Debug)]
pub struct MappedHost {
    host: usize,
    device: CUdeviceptr,
}

impl MappedHost {
    /// The address kernels reach it at.
    pub fn device_pointer(&self) -> CUdeviceptr {
        self.device
    }
}

impl HostMemory {
    /// Resolves the functions from a loaded libcuda; `None` if one is missing.
    ///
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub(super) unsafe fn load(handle: *mut c_void) -> Option<Self> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            Some(Self {
                alloc: symbol(handle, c"cuMemHostAlloc")?,
                device_pointer: symbol(handle, c"cuMemHostGetDevicePointer_v2")?,
                free: symbol(handle, c"cuMemFreeHost")?,
                synchronize: symbol(handle, c"cuCtxSynchronize")?,
            })
        }
    }

    /// `bytes` of pinned host memory (`DEVICEMAP | PORTABLE`) and its device
    /// address; on failure, what failed and the driver's answer.
    pub fn allocate_mapped(&self, bytes: usize) -> Result<MappedHost, (&'static str, CUresult)> {
        let mut pointer: *mut c_void = std::ptr::null_mut();
        let flags = CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a valid out-pointer; the driver's signature.
        let result = unsafe { (self.alloc)(&mut pointer, bytes, flags) };
        if !result.is_success() || pointer.is_null() {
            return Err(("cuMemHostAlloc", result));
        }
        let mut device: CUdeviceptr = 0;
        // SAFETY: `pointer` is the mapped pinned memory just allocated.
        let result = unsafe { (self.device_pointer)(&mut device, pointer, 0) };
        if !result.is_success() {
            // SAFETY: ours, never handed out.
            let _freed = unsafe { (self.free)(pointer) };
            return Err(("cuMemHostGetDevicePointer", result));
        }
        Ok(MappedHost {
            host: pointer as usize,
            device,
        })
    }

    /// Frees `memory`; the driver refusing hands it back with its answer.
    pub fn free(&self, memory: MappedHost) -> Result<CUresult, (MappedHost, CUresult)> {
        // SAFETY: a pointer cuMemHostAlloc returned; `MappedHost` is consumed
        // here, so it is freed once.
        let result = unsafe { (self.free)(memory.host as *mut c_void) };
        if result.is_success() {
            Ok(result)
        } else {
            Err((memory, result))
        }
    }

    /// Waits for the calling thread's current context.
    pub fn synchronize(&self) -> CUresult {
        // SAFETY: no arguments.
        unsafe { (self.synchronize)() }
    }
}

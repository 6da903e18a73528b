//! Pinned host memory mapped into the device's address space, for
//! oversubscription (`spill`). None of these functions is patched.

use std::ffi::c_void;

use super::{DriverError, symbol};
use crate::sys::{
    CU_MEMHOSTALLOC_DEVICEMAP, CU_MEMHOSTALLOC_PORTABLE, CUdeviceptr, CuCtxSynchronize,
    CuMemFreeHost, CuMemHostAlloc, CuMemHostGetDevicePointer,
};

/// The driver's pinned-host-memory functions.
pub(crate) struct HostMemory {
    alloc: CuMemHostAlloc,
    device_pointer: CuMemHostGetDevicePointer,
    free: CuMemFreeHost,
    synchronize: CuCtxSynchronize,
}

/// Why pinned mapped host memory could not be had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HostMemoryError {
    #[error("cuMemHostAlloc failed: {0}")]
    Alloc(DriverError),
    #[error("cuMemHostAlloc returned a null pointer")]
    NullPointer,
    #[error("cuMemHostGetDevicePointer failed: {0}")]
    DevicePointer(DriverError),
}

/// Pinned host memory the device can address. Made only by
/// [`HostMemory::allocate_mapped`] and consumed by [`HostMemory::free`], so
/// it is freed at most once.
#[derive(Debug)]
pub(crate) struct MappedHost {
    host: usize,
    device: CUdeviceptr,
}

impl MappedHost {
    /// The address kernels reach it at.
    pub(crate) fn device_pointer(&self) -> CUdeviceptr {
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
    /// address; on failure, which call failed and the driver's answer.
    pub(crate) fn allocate_mapped(&self, bytes: usize) -> Result<MappedHost, HostMemoryError> {
        let mut pointer: *mut c_void = std::ptr::null_mut();
        let flags = CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a valid out-pointer; the driver's signature.
        unsafe { (self.alloc)(&mut pointer, bytes, flags) }
            .result()
            .map_err(HostMemoryError::Alloc)?;
        if pointer.is_null() {
            return Err(HostMemoryError::NullPointer);
        }
        let mut device: CUdeviceptr = 0;
        // SAFETY: `pointer` is the mapped pinned memory just allocated.
        let mapped = unsafe { (self.device_pointer)(&mut device, pointer, 0) }.result();
        if let Err(error) = mapped {
            // SAFETY: ours, never handed out.
            let _freed = unsafe { (self.free)(pointer) };
            return Err(HostMemoryError::DevicePointer(error));
        }
        Ok(MappedHost {
            host: pointer as usize,
            device,
        })
    }

    /// Frees `memory`; the driver refusing hands it back with its answer.
    pub(crate) fn free(&self, memory: MappedHost) -> Result<(), (MappedHost, DriverError)> {
        // SAFETY: a pointer cuMemHostAlloc returned; `MappedHost` is consumed
        // here, so it is freed once.
        let result = unsafe { (self.free)(memory.host as *mut c_void) };
        result.result().map_err(|error| (memory, error))
    }

    /// Waits for the calling thread's current context.
    pub(crate) fn synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: no arguments.
        unsafe { (self.synchronize)() }.result()
    }
}

//! The driver's virtual memory management functions, for the memory the
//! limiter backs itself (`backing`): an address range reserved, physical
//! memory created on a GPU, mapped there and made accessible, and undone in
//! the reverse order; and the memory shared with other processes of the pod
//! by CUDA IPC, as file descriptors (`backing::ipc`). Called from inside a
//! detour or from the limiter's own threads, under the detour guard: the
//! quota's detours of `cuMemCreate` and `cuMemRelease` pass these calls
//! straight to the driver.

use std::ffi::c_void;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use super::{DriverError, symbol};
use crate::sys::{
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE, CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE, CUdevice, CUdeviceptr, CUmemAccessDesc, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmemLocation, CuCtxSynchronize, CuMemAddressFree,
    CuMemAddressReserve, CuMemCreate, CuMemExportToShareableHandle, CuMemGetAllocationGranularity,
    CuMemImportFromShareableHandle, CuMemMap, CuMemRelease, CuMemSetAccess, CuMemUnmap,
};

/// The driver's VMM functions; absent (`None` from [`Vmm::load`]) from
/// drivers that lack any of them.
pub(crate) struct Vmm {
    granularity: CuMemGetAllocationGranularity,
    reserve: CuMemAddressReserve,
    free_address: CuMemAddressFree,
    create: CuMemCreate,
    release: CuMemRelease,
    map: CuMemMap,
    unmap: CuMemUnmap,
    set_access: CuMemSetAccess,
    synchronize: CuCtxSynchronize,
    /// Exports memory as a file descriptor, and imports it (absent from
    /// drivers that lack them: nothing is shared then).
    export: Option<CuMemExportToShareableHandle>,
    import: Option<CuMemImportFromShareableHandle>,
    /// Whether memory is created exportable (a file descriptor requested):
    /// set off for good the first time the driver refuses it.
    shareable: AtomicBool,
}

/// Pinned device memory on one GPU, as a VMM allocation; exportable as a
/// file descriptor when `shareable`.
fn device_memory(device: CUdevice, shareable: bool) -> CUmemAllocationProp {
    CUmemAllocationProp {
        type_: CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: if shareable {
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            0
        },
        location: CUmemLocation {
            type_: CU_MEM_LOCATION_TYPE_DEVICE,
            id: device,
        },
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: [0; 8],
    }
}

impl Vmm {
    /// Resolves the functions from a loaded libcuda; `None` if one is missing.
    ///
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub(super) unsafe fn load(handle: *mut c_void) -> Option<Self> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            Some(Self {
                granularity: symbol(handle, c"cuMemGetAllocationGranularity")?,
                reserve: symbol(handle, c"cuMemAddressReserve")?,
                free_address: symbol(handle, c"cuMemAddressFree")?,
                create: symbol(handle, c"cuMemCreate")?,
                release: symbol(handle, c"cuMemRelease")?,
                map: symbol(handle, c"cuMemMap")?,
                unmap: symbol(handle, c"cuMemUnmap")?,
                set_access: symbol(handle, c"cuMemSetAccess")?,
                synchronize: symbol(handle, c"cuCtxSynchronize")?,
                export: symbol(handle, c"cuMemExportToShareableHandle"),
                import: symbol(handle, c"cuMemImportFromShareableHandle"),
                shareable: AtomicBool::new(true),
            })
        }
    }

    /// The smallest unit of `device`'s VMM memory, in bytes.
    pub(crate) fn granularity(&self, device: CUdevice) -> Result<u64, DriverError> {
        let mut bytes = 0usize;
        let prop = device_memory(device, false);
        let minimum = CU_MEM_ALLOC_GRANULARITY_MINIMUM;
        // SAFETY: a valid out-pointer and properties.
        unsafe { (self.granularity)(&mut bytes, &prop, minimum) }.result()?;
        Ok(bytes as u64)
    }

    /// A free address range of `size` bytes, aligned to `alignment`.
    pub(crate) fn reserve(&self, size: u64, alignment: u64) -> Result<CUdeviceptr, DriverError> {
        let (size, alignment) = (to_usize(size)?, to_usize(alignment)?);
        let mut address: CUdeviceptr = 0;
        // SAFETY: a valid out-pointer; no address hint, no flags.
        unsafe { (self.reserve)(&mut address, size, alignment, 0, 0) }.result()?;
        Ok(address)
    }

    /// Gives back a range [`Self::reserve`] returned, once nothing is mapped there.
    pub(crate) fn free_address(&self, address: CUdeviceptr, size: u64) -> Result<(), DriverError> {
        // SAFETY: plain values; the driver checks the range.
        unsafe { (self.free_address)(address, to_usize(size)?) }.result()
    }

    /// `size` bytes of physical memory on `device`, exportable as a file
    /// descriptor where the driver allows it (the program may share it by
    /// CUDA IPC: [`Self::export`]).
    pub(crate) fn create(
        &self,
        size: u64,
        device: CUdevice,
    ) -> Result<CUmemGenericAllocationHandle, DriverError> {
        let bytes = to_usize(size)?;
        let create = |shareable| {
            let prop = device_memory(device, shareable);
            let mut handle: CUmemGenericAllocationHandle = 0;
            // SAFETY: a valid out-pointer and properties; no flags.
            unsafe { (self.create)(&mut handle, bytes, &prop, 0) }
                .result()
                .map(|()| handle)
        };
        if !self.shareable.load(Ordering::Relaxed) || self.export.is_none() {
            return create(false);
        }
        create(true).or_else(|error| {
            // A driver or platform that cannot export: plain memory, as
            // before; out of memory is out of memory either way.
            if error == DriverError::OUT_OF_MEMORY {
                return Err(error);
            }
            let plain = create(false)?;
            self.shareable.store(false, Ordering::Relaxed);
            tracing::info!(%error, "device memory cannot be made exportable here; CUDA IPC of backed memory is off");
            Ok(plain)
        })
    }

    /// A new file descriptor for `handle`'s memory, which another process
    /// imports ([`Self::import`]) to map the same bytes.
    pub(crate) fn export(
        &self,
        handle: CUmemGenericAllocationHandle,
    ) -> Result<OwnedFd, DriverError> {
        let export = self.export.ok_or(DriverError::NOT_FOUND)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: a valid out-pointer for the file descriptor type's `int`.
        unsafe {
            export(
                (&raw mut fd).cast::<c_void>(),
                handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        }
        .result()?;
        if fd < 0 {
            return Err(DriverError::INVALID_VALUE);
        }
        // SAFETY: the driver made this descriptor for the caller, who owns it.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The memory another process exported as `fd` (which stays the
    /// caller's), as a handle of this process to map and release.
    pub(crate) fn import(
        &self,
        fd: BorrowedFd<'_>,
    ) -> Result<CUmemGenericAllocationHandle, DriverError> {
        let import = self.import.ok_or(DriverError::NOT_FOUND)?;
        let mut handle: CUmemGenericAllocationHandle = 0;
        // The descriptor travels as the pointer-sized value itself.
        let os_handle = fd.as_raw_fd() as isize as *mut c_void;
        // SAFETY: a valid out-pointer; the descriptor is open for the call.
        unsafe {
            import(
                &mut handle,
                os_handle,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        }
        .result()?;
        Ok(handle)
    }

    /// Drops the reference [`Self::create`] returned; the memory goes once unmapped.
    pub(crate) fn release(&self, handle: CUmemGenericAllocationHandle) -> Result<(), DriverError> {
        // SAFETY: a plain value; the driver checks the handle.
        unsafe { (self.release)(handle) }.result()
    }

    /// Maps all of `handle`'s `size` bytes at `address`, then lets
    /// `device` read and write them.
    pub(crate) fn map(
        &self,
        address: CUdeviceptr,
        size: u64,
        handle: CUmemGenericAllocationHandle,
        device: CUdevice,
    ) -> Result<(), DriverError> {
        let bytes = to_usize(size)?;
        // SAFETY: plain values; the driver checks the range and the handle.
        unsafe { (self.map)(address, bytes, 0, handle, 0) }.result()?;
        let access = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: device,
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one valid descriptor.
        let granted = unsafe { (self.set_access)(address, bytes, &access, 1) }.result();
        if let Err(error) = granted {
            // Ours, mapped just now: nothing else can have used it.
            let _unmapped = self.unmap(address, size);
            return Err(error);
        }
        Ok(())
    }

    /// Unmaps `[address, address + size)`.
    pub(crate) fn unmap(&self, address: CUdeviceptr, size: u64) -> Result<(), DriverError> {
        // SAFETY: plain values; the driver checks the range.
        unsafe { (self.unmap)(address, to_usize(size)?) }.result()
    }

    /// Waits for the calling thread's current context: memory is unmapped
    /// only once no work of the program can still use it.
    pub(crate) fn synchronize(&self) -> Result<(), DriverError> {
        // SAFETY: no arguments.
        unsafe { (self.synchronize)() }.result()
    }
}

fn to_usize(bytes: u64) -> Result<usize, DriverError> {
    usize::try_from(bytes).map_err(|_| DriverError::INVALID_VALUE)
}

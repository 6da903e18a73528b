//! The CUDA driver and NVML functions the limiter calls itself, resolved
//! from the loaded libraries (by the loader, as it finds them) and held as
//! typed pointers. None of them is patched, so calling them never re-enters
//! a detour. Nothing here opens a library or installs a hook.
//!
//! - [`Driver`]: the device queries accounting needs (this file);
//! - [`Timing`] (`timing.rs`): events, streams and occupancy, to measure launches;
//!   and (`timing/calibration.rs`) what an event bracket holds besides the
//!   kernel ([`Timing::launch_overheads`]);
//! - [`Nvml`] (`nvml.rs`): the UUIDs, indices and per-process usage of NVML;
//! - [`HostMemory`] (`host.rs`): pinned mapped host memory, for oversubscription;
//! - [`Held`] (`held.rs`): context limits, graph allocation nodes and graph
//!   pools: memory the driver holds outside allocations;
//! - [`Vmm`] (`vmm.rs`): the virtual memory management API, for the memory
//!   the limiter backs itself (`backing`);
//! - [`Copies`] (`copies.rs`): contexts set and waited for, host buffers
//!   pinned as they are first copied into, and copies on a stream of the
//!   limiter's own, for the swap of that memory (`backing::swap`); and
//!   (`prefault.rs`) that host memory faulted in ahead of its pinning, on
//!   a few threads ([`Faulting`]).

use std::ffi::{CStr, c_int, c_void};

use crate::sys::{
    CU_DEVICE_ATTRIBUTE_MPS_ENABLED, CUdevice, CUuuid, CuCtxGetDevice, CuDeviceGet,
    CuDeviceGetAttribute, CuDeviceGetCount, CuDeviceGetUuid, format_uuid,
};

mod copies;
mod held;
mod host;
mod nvml;
mod prefault;
mod result;
mod timing;
mod vmm;

pub(crate) use copies::{Copies, HostBuffer};
pub(crate) use held::Held;
pub(crate) use host::{HostMemory, MappedHost};
pub(crate) use nvml::Nvml;
pub(crate) use prefault::{Faulting, Span};
pub(crate) use result::DriverError;
pub(crate) use timing::{LaunchOverheads, Timing};
pub(crate) use vmm::Vmm;

/// Looks `name` up in `handle` as a function of type `F`.
///
/// # Safety
///
/// `F` must be the function-pointer type of the symbol `name` in that library.
unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &CStr) -> Option<F> {
    // SAFETY: handle comes from dlopen; name is NUL-terminated.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if address.is_null() {
        return None;
    }
    // SAFETY: forwarded from the caller: F is this symbol's pointer type.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

/// CUDA driver functions the limiter calls itself.
pub(crate) struct Driver {
    ctx_get_device: CuCtxGetDevice,
    device_get_uuid: CuDeviceGetUuid,
    device_get_count: Option<CuDeviceGetCount>,
    device_get: Option<CuDeviceGet>,
    device_get_attribute: Option<CuDeviceGetAttribute>,
    /// Measuring kernels; absent from drivers that lack any of it.
    pub timing: Option<Timing>,
    /// Pinned mapped host memory, for oversubscription.
    pub host: Option<HostMemory>,
    /// What the driver holds outside allocations.
    pub held: Held,
    /// Virtual memory management, for backed allocations.
    pub vmm: Option<Vmm>,
    /// Copies to pinned host memory and back, for their swap.
    pub copies: Option<Copies>,
}

impl Driver {
    /// Resolves the functions from a loaded libcuda; `None` if one is missing.
    pub(crate) fn load(handle: *mut c_void) -> Option<Driver> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            Some(Driver {
                ctx_get_device: symbol(handle, c"cuCtxGetDevice")?,
                device_get_uuid: symbol(handle, c"cuDeviceGetUuid_v2")
                    .or_else(|| symbol(handle, c"cuDeviceGetUuid"))?,
                device_get_count: symbol(handle, c"cuDeviceGetCount"),
                device_get: symbol(handle, c"cuDeviceGet"),
                device_get_attribute: symbol(handle, c"cuDeviceGetAttribute"),
                timing: Timing::load(handle),
                host: HostMemory::load(handle),
                held: Held::load(handle),
                vmm: Vmm::load(handle),
                copies: Copies::load(handle),
            })
        }
    }

    /// The device of the calling thread's current context.
    pub(crate) fn current_device(&self) -> Result<CUdevice, DriverError> {
        let mut device: CUdevice = 0;
        // SAFETY: a valid out-pointer, per the driver's contract.
        unsafe { (self.ctx_get_device)(&mut device) }.result()?;
        Ok(device)
    }

    /// The number of devices, once the application has initialised CUDA.
    pub(crate) fn device_count(&self) -> Option<u32> {
        let count = self.device_get_count?;
        let mut devices = 0;
        // SAFETY: a valid out-pointer.
        let result = unsafe { count(&mut devices) };
        (result.is_success()).then(|| devices.max(0) as u32)
    }

    /// Whether CUDA device `ordinal`'s contexts run under MPS
    /// (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`): false when the driver found no
    /// MPS control daemon, or was refused by it, and runs alone.
    pub(crate) fn mps_enabled(&self, ordinal: u32) -> Result<bool, DriverError> {
        let get = self.device_get.ok_or(DriverError::NOT_FOUND)?;
        let attribute = self.device_get_attribute.ok_or(DriverError::NOT_FOUND)?;
        let ordinal = c_int::try_from(ordinal).map_err(|_| DriverError::INVALID_VALUE)?;
        let mut device: CUdevice = 0;
        // SAFETY: a valid out-pointer, per the driver's contract.
        unsafe { get(&mut device, ordinal) }.result()?;
        let mut enabled: c_int = 0;
        // SAFETY: a valid out-pointer; this attribute is an int.
        unsafe { attribute(&mut enabled, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, device) }.result()?;
        Ok(enabled != 0)
    }

    /// The device's UUID as NVML prints it (`GPU-…`).
    pub(crate) fn device_uuid(&self, device: CUdevice) -> Option<String> {
        let mut uuid = CUuuid::default();
        // SAFETY: a valid out-pointer, per the driver's contract.
        let result = unsafe { (self.device_get_uuid)(&mut uuid, device) };
        result.is_success().then(|| format_uuid(&uuid))
    }
}

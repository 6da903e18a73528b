//! The NVML functions the limiter calls itself: a device's UUID and index,
//! every GPU NVML shows, and what a process uses on it.

use std::ffi::{CStr, c_char, c_uint, c_void};

use super::symbol;
use crate::sys::{
    NVML_DEVICE_UUID_V2_BUFFER_SIZE, NVML_VALUE_NOT_AVAILABLE,
    NvmlDeviceGetComputeRunningProcesses, NvmlDeviceGetComputeRunningProcessesV1,
    NvmlDeviceGetCount, NvmlDeviceGetHandleByIndex, NvmlDeviceGetHandleByUUID, NvmlDeviceGetIndex,
    NvmlDeviceGetUUID, NvmlInit, nvmlDevice_t, nvmlProcessInfo_t, nvmlProcessInfo_v1_t,
    nvmlReturn_t,
};

/// NVML functions the limiter calls itself.
pub(crate) struct Nvml {
    get_handle_by_uuid: NvmlDeviceGetHandleByUUID,
    get_uuid: NvmlDeviceGetUUID,
    /// Only the NVML reports need it; older libraries may lack it.
    get_index: Option<NvmlDeviceGetIndex>,
    /// Only an MPS client's check of what NVML shows it needs these.
    get_count: Option<NvmlDeviceGetCount>,
    get_handle_by_index: Option<NvmlDeviceGetHandleByIndex>,
    get_processes: ProcessList,
}

/// An entry of NVML's process list, of either size.
trait ProcessEntry: Copy + Default {
    fn pid(&self) -> u32;
    fn used(&self) -> u64;
}

impl ProcessEntry for nvmlProcessInfo_t {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn used(&self) -> u64 {
        self.usedGpuMemory
    }
}

impl ProcessEntry for nvmlProcessInfo_v1_t {
    fn pid(&self) -> u32 {
        self.pid
    }
    fn used(&self) -> u64 {
        self.usedGpuMemory
    }
}

/// What NVML says `pid` uses on `device`, through the process list call
/// `get` that writes entries of type `E`.
fn used_by<E: ProcessEntry>(
    device: nvmlDevice_t,
    pid: u32,
    get: unsafe extern "C" fn(nvmlDevice_t, *mut c_uint, *mut E) -> nvmlReturn_t,
) -> Option<u64> {
    let mut infos = [E::default(); 64];
    let mut count = infos.len() as c_uint;
    // SAFETY: count is the capacity of infos, entries of the size `get`
    // writes (its signature says which).
    let result = unsafe { get(device, &mut count, infos.as_mut_ptr()) };
    if result != nvmlReturn_t::SUCCESS {
        return None;
    }
    infos[..(count as usize).min(infos.len())]
        .iter()
        .find(|info| info.pid() == pid)
        .map(ProcessEntry::used)
}

/// The running-processes query NVML offers, with the entry size it writes.
#[derive(Clone, Copy)]
enum ProcessList {
    /// `_v3` (and `_v2`): `nvmlProcessInfo_t`, 24 bytes an entry.
    Current(NvmlDeviceGetComputeRunningProcesses),
    /// The unversioned v1: `nvmlProcessInfo_v1_t`, 16 bytes an entry.
    V1(NvmlDeviceGetComputeRunningProcessesV1),
}

impl Nvml {
    /// Resolves and initialises NVML from a loaded libnvidia-ml; `None` if
    /// a function is missing or `nvmlInit_v2` fails.
    pub(crate) fn open(handle: *mut c_void) -> Option<Nvml> {
        // SAFETY: the types are NVML's signatures for these symbols.
        let (init, nvml) = unsafe {
            let init: NvmlInit = symbol(handle, c"nvmlInit_v2")?;
            let nvml = Nvml {
                get_handle_by_uuid: symbol(handle, c"nvmlDeviceGetHandleByUUID")?,
                get_uuid: symbol(handle, c"nvmlDeviceGetUUID")?,
                get_index: symbol(handle, c"nvmlDeviceGetIndex"),
                get_count: symbol(handle, c"nvmlDeviceGetCount_v2"),
                get_handle_by_index: symbol(handle, c"nvmlDeviceGetHandleByIndex_v2"),
                get_processes: symbol(handle, c"nvmlDeviceGetComputeRunningProcesses_v3")
                    .map(ProcessList::Current)
                    .or_else(|| {
                        symbol(handle, c"nvmlDeviceGetComputeRunningProcesses_v2")
                            .map(ProcessList::Current)
                    })
                    .or_else(|| {
                        symbol(handle, c"nvmlDeviceGetComputeRunningProcesses").map(ProcessList::V1)
                    })?,
            };
            (init, nvml)
        };
        // SAFETY: no arguments; NVML reference-counts initialisation.
        let result = unsafe { init() };
        if !result.is_success() {
            tracing::warn!(code = result.0, "nvmlInit_v2 failed");
            return None;
        }
        Some(nvml)
    }

    /// The UUID of an NVML device handle.
    pub(crate) fn device_uuid(&self, device: nvmlDevice_t) -> Option<String> {
        let mut buffer = [0 as c_char; NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        // SAFETY: the buffer and its length match.
        let result =
            unsafe { (self.get_uuid)(device, buffer.as_mut_ptr(), buffer.len() as c_uint) };
        if !result.is_success() {
            return None;
        }
        // SAFETY: NVML wrote a NUL-terminated string into the buffer.
        let uuid = unsafe { CStr::from_ptr(buffer.as_ptr()) };
        uuid.to_str().ok().map(str::to_owned)
    }

    /// The NVML index of a device handle.
    pub(crate) fn device_index(&self, device: nvmlDevice_t) -> Option<u32> {
        let get_index = self.get_index?;
        let mut index: c_uint = 0;
        // SAFETY: a valid out-pointer.
        let result = unsafe { get_index(device, &mut index) };
        result.is_success().then_some(index)
    }

    /// The UUIDs of every GPU NVML shows, in NVML's order (its indices);
    /// `None` where NVML cannot say.
    pub(crate) fn device_uuids(&self) -> Option<Vec<String>> {
        let (get_count, get_handle) = (self.get_count?, self.get_handle_by_index?);
        let mut count: c_uint = 0;
        // SAFETY: a valid out-pointer.
        if !unsafe { get_count(&mut count) }.is_success() {
            return None;
        }
        (0..count)
            .map(|index| {
                let mut device: nvmlDevice_t = std::ptr::null_mut();
                // SAFETY: an index NVML counted and a valid out-pointer.
                let found = unsafe { get_handle(index, &mut device) }.is_success();
                found.then(|| self.device_uuid(device)).flatten()
            })
            .collect()
    }

    /// NVML's handle of the GPU `uuid`.
    pub(crate) fn device_handle(&self, uuid: &str) -> Option<nvmlDevice_t> {
        let uuid = std::ffi::CString::new(uuid).ok()?;
        let mut device: nvmlDevice_t = std::ptr::null_mut();
        // SAFETY: a NUL-terminated UUID and a valid out-pointer.
        let result = unsafe { (self.get_handle_by_uuid)(uuid.as_ptr(), &mut device) };
        result.is_success().then_some(device)
    }

    /// Device memory NVML attributes to process `pid` on the GPU `uuid`:
    /// everything it holds there, allocations and the driver's own.
    pub(crate) fn process_used(&self, uuid: &str, pid: u32) -> Option<u64> {
        let device = self.device_handle(uuid)?;
        let used = match self.get_processes {
            ProcessList::Current(get) => used_by(device, pid, get),
            ProcessList::V1(get) => used_by(device, pid, get),
        };
        // NVML_VALUE_NOT_AVAILABLE (all ones): NVML does not know; charging
        // it would saturate the pod's usage.
        used.filter(|bytes| *bytes != NVML_VALUE_NOT_AVAILABLE)
    }
}

//! The CUDA driver and NVML functions the limiter calls itself, resolved once
//! from the loaded libraries and held as typed pointers. None of them is
//! patched, so calling them never re-enters a detour.

use std::ffi::{CStr, c_char, c_uint, c_void};
use std::sync::OnceLock;

use crate::loader;
use crate::sys::{
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, CU_STREAM_CAPTURE_MODE_RELAXED,
    CU_STREAM_CAPTURE_STATUS_NONE, CU_STREAM_NON_BLOCKING, CUcontext, CUdevice, CUevent,
    CUfunction, CUgraphExec, CUresult, CUstream, CUuuid, CuCtxGetCurrent, CuCtxGetDevice,
    CuDeviceGetAttribute, CuDeviceGetCount, CuDeviceGetUuid, CuEventCreate, CuEventDestroy,
    CuEventElapsedTime, CuEventQuery, CuEventRecord, CuEventSynchronize,
    CuGraphInstantiateWithFlags, CuGraphLaunch, CuLaunchKernel, CuModuleGetFunction,
    CuModuleLoadData, CuOccupancyMaxActiveBlocksPerMultiprocessor, CuStreamBeginCapture,
    CuStreamCreate, CuStreamEndCapture, CuStreamGetCtx, CuStreamIsCapturing, CuStreamQuery,
    CuThreadExchangeStreamCaptureMode, NVML_DEVICE_UUID_V2_BUFFER_SIZE, NVML_VALUE_NOT_AVAILABLE,
    NvmlDeviceGetComputeRunningProcesses, NvmlDeviceGetComputeRunningProcessesV1,
    NvmlDeviceGetHandleByUUID, NvmlDeviceGetIndex, NvmlDeviceGetUUID, NvmlInit, format_uuid,
    nvmlDevice_t, nvmlProcessInfo_t, nvmlProcessInfo_v1_t, nvmlReturn_t,
};

/// Looks `name` up in `handle` as a function of type `F`.
///
/// # Safety
///
/// `F` must be the function-pointer type of the symbol `name` in that library.
pub(crate) unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &CStr) -> Option<F> {
    // SAFETY: handle comes from dlopen; name is NUL-terminated.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if address.is_null() {
        return None;
    }
    // SAFETY: forwarded from the caller: F is this symbol's pointer type.
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

/// CUDA driver functions the limiter calls itself.
pub struct Driver {
    ctx_get_device: CuCtxGetDevice,
    device_get_uuid: CuDeviceGetUuid,
    device_get_count: Option<CuDeviceGetCount>,
    /// Measuring kernels; absent from drivers that lack any of it.
    pub timing: Option<Timing>,
    /// Pinned mapped host memory, for oversubscription.
    pub host: Option<crate::spill::HostApi>,
}

/// Events and streams, to measure how long launches keep the GPU busy.
pub struct Timing {
    ctx_get_current: CuCtxGetCurrent,
    stream_get_ctx: CuStreamGetCtx,
    stream_is_capturing: CuStreamIsCapturing,
    event_create: CuEventCreate,
    event_record: CuEventRecord,
    event_query: CuEventQuery,
    event_elapsed: CuEventElapsedTime,
    event_destroy: CuEventDestroy,
    exchange_capture_mode: Option<CuThreadExchangeStreamCaptureMode>,
    stream_query: Option<CuStreamQuery>,
    device_attribute: Option<CuDeviceGetAttribute>,
    occupancy: Option<CuOccupancyMaxActiveBlocksPerMultiprocessor>,
    calibration: Option<CalibrationApi>,
}

/// What measuring the launch overhead needs: an empty kernel of our own.
struct CalibrationApi {
    module_load_data: CuModuleLoadData,
    module_get_function: CuModuleGetFunction,
    stream_create: CuStreamCreate,
    event_synchronize: CuEventSynchronize,
    launch_kernel: CuLaunchKernel,
    begin_capture: Option<CuStreamBeginCapture>,
    end_capture: Option<CuStreamEndCapture>,
    instantiate: Option<CuGraphInstantiateWithFlags>,
    graph_launch: Option<CuGraphLaunch>,
}

/// What an event bracket around one launch holds beyond the launch's own
/// back-to-back period (what the same launch takes in a loop without
/// events), by launch path (see [`Timing::launch_overheads`]): launched
/// into an idle stream (the events' own time and the launch latency) and
/// queued behind other work (the events' own time, about 2 µs on an H100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchOverheads {
    pub kernel_idle_ns: u64,
    pub kernel_queued_ns: u64,
    /// Graph launches start faster; `None` where graphs could not be made.
    pub graph_idle_ns: Option<u64>,
    pub graph_queued_ns: Option<u64>,
    /// The empty kernel's own back-to-back period, taken off the queued ones.
    pub empty_kernel_ns: u64,
}

/// An empty kernel, and one that holds its stream for its parameter's
/// nanoseconds (so that the next launch queues), JIT-compiled by the driver
/// for whatever GPU it runs on.
const CALIBRATION_PTX: &CStr = c".version 7.0
.target sm_75
.address_size 64
.visible .entry gpushare_calibrate()
{
    ret;
}
.visible .entry gpushare_hold(.param .u64 gpushare_hold_ns)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [gpushare_hold_ns];
    mov.u64 %rd2, %globaltimer;
    add.u64 %rd3, %rd2, %rd1;
$L_hold:
    mov.u64 %rd2, %globaltimer;
    setp.lt.u64 %p1, %rd2, %rd3;
    @%p1 bra $L_hold;
    ret;
}
";

/// How long the hold kernel keeps the stream busy: far longer than the host
/// needs to queue the bracketed launch behind it.
const HOLD_NS: u64 = 50_000;

impl Timing {
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    unsafe fn load(handle: *mut c_void) -> Option<Self> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            Some(Self {
                ctx_get_current: symbol(handle, c"cuCtxGetCurrent")?,
                stream_get_ctx: symbol(handle, c"cuStreamGetCtx")?,
                stream_is_capturing: symbol(handle, c"cuStreamIsCapturing")?,
                event_create: symbol(handle, c"cuEventCreate")?,
                event_record: symbol(handle, c"cuEventRecord")?,
                event_query: symbol(handle, c"cuEventQuery")?,
                event_elapsed: symbol(handle, c"cuEventElapsedTime_v2")
                    .or_else(|| symbol(handle, c"cuEventElapsedTime"))?,
                event_destroy: symbol(handle, c"cuEventDestroy_v2")?,
                exchange_capture_mode: symbol(handle, c"cuThreadExchangeStreamCaptureMode"),
                stream_query: symbol(handle, c"cuStreamQuery"),
                device_attribute: symbol(handle, c"cuDeviceGetAttribute"),
                occupancy: symbol(handle, c"cuOccupancyMaxActiveBlocksPerMultiprocessor"),
                calibration: (|| {
                    Some(CalibrationApi {
                        module_load_data: symbol(handle, c"cuModuleLoadData")?,
                        module_get_function: symbol(handle, c"cuModuleGetFunction")?,
                        stream_create: symbol(handle, c"cuStreamCreate")?,
                        event_synchronize: symbol(handle, c"cuEventSynchronize")?,
                        // The patched entry: inside the limiter's guard it
                        // forwards straight to the original.
                        launch_kernel: symbol(handle, c"cuLaunchKernel")?,
                        begin_capture: symbol(handle, c"cuStreamBeginCapture_v2"),
                        end_capture: symbol(handle, c"cuStreamEndCapture"),
                        instantiate: symbol(handle, c"cuGraphInstantiateWithFlags"),
                        // Patched too: forwards to the original under the guard.
                        graph_launch: symbol(handle, c"cuGraphLaunch"),
                    })
                })(),
            })
        }
    }

    /// Lets the calling thread query events while another thread captures a
    /// graph in global mode: otherwise each query would invalidate the
    /// application's capture (error 900).
    pub fn relax_capture_mode(&self) {
        let Some(exchange) = self.exchange_capture_mode else {
            return;
        };
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer.
        let result = unsafe { exchange(&mut mode) };
        if !result.is_success() {
            tracing::warn!(code = result.0, "cannot relax the monitor's capture mode");
        }
    }

    /// What an event bracket around one launch holds besides the kernel, in
    /// the current context: the lower quartile of a few brackets around an empty
    /// kernel of our own, launched directly and as a graph, into an idle
    /// stream and queued behind a kernel that holds the stream. On
    /// `app_stream` (idle: nothing of the application's is waited for) when
    /// given, since launch latency depends on the kind of stream (the legacy
    /// default stream's is longer), else on a private stream. `None` if it
    /// cannot be measured.
    pub fn launch_overheads(&self, app_stream: Option<CUstream>) -> Option<LaunchOverheads> {
        let api = self.calibration.as_ref()?;
        // Synchronising below must not break another thread's global capture.
        let mut previous_mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        if let Some(exchange) = self.exchange_capture_mode {
            // SAFETY: a valid in/out pointer.
            unsafe { exchange(&mut previous_mode) };
        }
        let measured = self.measure_overheads(api, app_stream);
        if let Some(exchange) = self.exchange_capture_mode {
            // SAFETY: restores the thread's own mode.
            unsafe { exchange(&mut previous_mode) };
        }
        measured
    }

    fn measure_overheads(
        &self,
        api: &CalibrationApi,
        app_stream: Option<CUstream>,
    ) -> Option<LaunchOverheads> {
        let (mut module, mut function, mut hold, mut stream) = (
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        );
        // SAFETY: valid out-pointers and a NUL-terminated PTX image; the
        // module and stream stay for the life of the context (a few bytes).
        let ready = unsafe {
            (api.module_load_data)(&mut module, CALIBRATION_PTX.as_ptr().cast()).is_success()
                && (api.module_get_function)(&mut function, module, c"gpushare_calibrate".as_ptr())
                    .is_success()
                && (api.module_get_function)(&mut hold, module, c"gpushare_hold".as_ptr())
                    .is_success()
                && (api.stream_create)(&mut stream, CU_STREAM_NON_BLOCKING).is_success()
        };
        if !ready {
            return None;
        }
        let (start, end) = (self.create_event()?, self.create_event()?);
        // The driver double reads a kernel's duration from its first
        // parameter; the real driver ignores parameters of the empty kernel.
        let mut zero: u64 = 0;
        let mut params = [(&raw mut zero).cast::<c_void>()];
        let mut hold_ns: u64 = HOLD_NS;
        let mut hold_params = [(&raw mut hold_ns).cast::<c_void>()];
        // Graphs are captured on the private stream (the legacy default
        // stream cannot be); everything is bracketed on `measured`.
        let measured = app_stream.unwrap_or(stream);
        let launch = |function: CUfunction, params: *mut *mut c_void, stream: CUstream| {
            // SAFETY: our own kernels and parameters; a stream of ours, or
            // the application's while idle (our empty kernels change nothing).
            unsafe {
                (api.launch_kernel)(
                    function,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params,
                    std::ptr::null_mut(),
                )
            }
        };
        let (params, hold_params) = (params.as_mut_ptr(), hold_params.as_mut_ptr());
        let launch_empty = || launch(function, params, measured);
        let hold_stream = || launch(hold, hold_params, measured).is_success();
        // Brackets around one empty kernel, from an idle stream and queued
        // behind a kernel holding the stream; around two queued, so that
        // their difference is the empty kernel's own back-to-back period,
        // which the brackets hold but a launch replacing it does not add.
        let idle = self.low_bracket(api, start, end, measured, || true, launch_empty)?;
        let queued = self.low_bracket(api, start, end, measured, hold_stream, launch_empty)?;
        let two = || launch_empty().is_success() && launch_empty().is_success();
        let queued_two = self.low_bracket(api, start, end, measured, hold_stream, || {
            if two() {
                CUresult::SUCCESS
            } else {
                CUresult::ERROR_NOT_READY
            }
        })?;
        let empty = queued_two.saturating_sub(queued);
        let graph = self.instantiate_graph(api, stream, || launch(function, params, stream));
        let graph_bracket = |queued: bool| {
            let (exec, graph_launch) = graph?;
            // SAFETY (closure): our own graph; the stream as above.
            let replay = || unsafe { graph_launch(exec, measured) };
            let before = || !queued || hold_stream();
            self.low_bracket(api, start, end, measured, before, replay)
        };
        let graph_idle = graph_bracket(false);
        let graph_queued = graph_bracket(true);
        self.destroy(start);
        self.destroy(end);
        Some(LaunchOverheads {
            // From an idle stream the empty kernel's own period is not taken
            // back: a kernel launched into an idle GPU does not start sooner
            // for being longer, and measured so on the H100 (check 11).
            kernel_idle_ns: idle,
            kernel_queued_ns: queued.saturating_sub(empty),
            graph_idle_ns: graph_idle,
            graph_queued_ns: graph_queued.map(|ns| ns.saturating_sub(empty)),
            empty_kernel_ns: empty,
        })
    }

    /// Captures one launch into a graph on `stream` and instantiates it.
    fn instantiate_graph(
        &self,
        api: &CalibrationApi,
        stream: CUstream,
        launch: impl FnOnce() -> CUresult,
    ) -> Option<(CUgraphExec, CuGraphLaunch)> {
        let (begin, end, instantiate, graph_launch) = (
            api.begin_capture?,
            api.end_capture?,
            api.instantiate?,
            api.graph_launch?,
        );
        let (mut graph, mut exec) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: our own stream, relaxed capture (touches no other thread's);
        // valid out-pointers; the graph stays for the life of the context.
        let made = unsafe {
            if !begin(stream, CU_STREAM_CAPTURE_MODE_RELAXED).is_success() {
                return None;
            }
            let launched = launch().is_success();
            // A begun capture is always ended, whatever the launch did.
            let ended = end(stream, &mut graph).is_success();
            launched && ended && instantiate(&mut exec, graph, 0).is_success()
        };
        made.then_some((exec, graph_launch))
    }

    /// The lower quartile of the GPU time between `start` and `end`
    /// recorded around `launch`, each time after `before` (which may queue
    /// work ahead): latencies only ever come out longer than they are, so
    /// the low ones are the truer, and a quartile of many is stable from
    /// one process to the next.
    fn low_bracket(
        &self,
        api: &CalibrationApi,
        start: CUevent,
        end: CUevent,
        stream: CUstream,
        mut before: impl FnMut() -> bool,
        mut launch: impl FnMut() -> CUresult,
    ) -> Option<u64> {
        const RUNS: usize = 24;
        let mut brackets = Vec::with_capacity(RUNS);
        for _ in 0..RUNS {
            // SAFETY: our own events and stream.
            let done = before()
                && self.record(start, stream)
                && launch().is_success()
                && self.record(end, stream)
                && unsafe { (api.event_synchronize)(end) }.is_success();
            if !done {
                return None;
            }
            brackets.extend(self.elapsed_ns(start, end));
        }
        brackets.sort_unstable();
        brackets.get(brackets.len() / 4).copied()
    }

    /// Whether `stream` is being captured into a graph (its launches do not run).
    pub fn is_capturing(&self, stream: CUstream) -> bool {
        // The legacy default stream (0 or CU_STREAM_LEGACY) cannot be
        // captured: skip the driver call on the most common launch path.
        if (stream as usize) <= 1 {
            return false;
        }
        let mut status = CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a valid out-pointer; the caller's stream.
        let result = unsafe { (self.stream_is_capturing)(stream, &mut status) };
        result.is_success() && status != CU_STREAM_CAPTURE_STATUS_NONE
    }

    /// The context of `stream` (the current one for the default streams).
    pub fn stream_context(&self, stream: CUstream) -> Option<CUcontext> {
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: valid out-pointers; the caller's stream.
        let result = unsafe {
            if (stream as usize) <= 2 {
                (self.ctx_get_current)(&mut context)
            } else {
                (self.stream_get_ctx)(stream, &mut context)
            }
        };
        (result.is_success() && !context.is_null()).then_some(context)
    }

    /// Whether all work queued on `stream` has finished (`None`: unknown).
    pub fn stream_idle(&self, stream: CUstream) -> Option<bool> {
        let query = self.stream_query?;
        // SAFETY: the caller's stream.
        match unsafe { query(stream) } {
            CUresult::SUCCESS => Some(true),
            CUresult::ERROR_NOT_READY => Some(false),
            _ => None,
        }
    }

    /// The number of SMs of `device`.
    pub fn sm_count(&self, device: CUdevice) -> Option<u32> {
        let attribute = self.device_attribute?;
        let mut count = 0;
        // SAFETY: a valid out-pointer; any device ordinal is checked by the driver.
        let result =
            unsafe { attribute(&mut count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device) };
        (result.is_success() && count > 0).then_some(count as u32)
    }

    /// How many blocks of `threads` threads and `shared_bytes` dynamic shared
    /// memory of `function` one SM holds at once.
    pub fn blocks_per_sm(
        &self,
        function: CUfunction,
        threads: u32,
        shared_bytes: u32,
    ) -> Option<u32> {
        let occupancy = self.occupancy?;
        let mut blocks = 0;
        let threads = i32::try_from(threads).ok()?;
        // SAFETY: a valid out-pointer; the caller's function handle, which the
        // driver validates.
        let result = unsafe { occupancy(&mut blocks, function, threads, shared_bytes as usize) };
        (result.is_success() && blocks > 0).then_some(blocks as u32)
    }

    /// A new timing event in the current context.
    pub fn create_event(&self) -> Option<CUevent> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flags 0 = default (timing enabled).
        let result = unsafe { (self.event_create)(&mut event, 0) };
        result.is_success().then_some(event)
    }

    pub fn record(&self, event: CUevent, stream: CUstream) -> bool {
        // SAFETY: an event of ours and the caller's stream.
        unsafe { (self.event_record)(event, stream) }.is_success()
    }

    /// `Ok(true)` once the event's work is done, `Ok(false)` before.
    pub fn query(&self, event: CUevent) -> Result<bool, CUresult> {
        // SAFETY: an event of ours.
        match unsafe { (self.event_query)(event) } {
            CUresult::SUCCESS => Ok(true),
            CUresult::ERROR_NOT_READY => Ok(false),
            error => Err(error),
        }
    }

    /// GPU nanoseconds between two completed events.
    pub fn elapsed_ns(&self, start: CUevent, end: CUevent) -> Option<u64> {
        let mut milliseconds = 0f32;
        // SAFETY: a valid out-pointer; events of ours.
        let result = unsafe { (self.event_elapsed)(&mut milliseconds, start, end) };
        (result.is_success() && milliseconds >= 0.0).then(|| (f64::from(milliseconds) * 1e6) as u64)
    }

    pub fn destroy(&self, event: CUevent) {
        // SAFETY: an event of ours, used no more.
        let result = unsafe { (self.event_destroy)(event) };
        if !result.is_success() {
            tracing::debug!(code = result.0, "cuEventDestroy failed");
        }
    }
}

static DRIVER: OnceLock<Driver> = OnceLock::new();

impl Driver {
    /// Resolves the functions from a loaded libcuda; `None` if one is missing.
    pub fn load(handle: *mut c_void) -> Option<&'static Driver> {
        if let Some(driver) = DRIVER.get() {
            return Some(driver);
        }
        // SAFETY: the types are the driver's signatures for these symbols.
        let driver = unsafe {
            Driver {
                ctx_get_device: symbol(handle, c"cuCtxGetDevice")?,
                device_get_uuid: symbol(handle, c"cuDeviceGetUuid_v2")
                    .or_else(|| symbol(handle, c"cuDeviceGetUuid"))?,
                device_get_count: symbol(handle, c"cuDeviceGetCount"),
                timing: Timing::load(handle),
                host: crate::spill::HostApi::load(handle),
            }
        };
        Some(DRIVER.get_or_init(|| driver))
    }

    /// The driver, once libcuda has been seen.
    pub fn get() -> Option<&'static Driver> {
        DRIVER.get()
    }

    /// The device of the calling thread's current context.
    pub fn current_device(&self) -> Result<CUdevice, CUresult> {
        let mut device: CUdevice = 0;
        // SAFETY: a valid out-pointer, per the driver's contract.
        let result = unsafe { (self.ctx_get_device)(&mut device) };
        if result.is_success() {
            Ok(device)
        } else {
            Err(result)
        }
    }

    /// The number of devices, once the application has initialised CUDA.
    pub fn device_count(&self) -> Option<u32> {
        let count = self.device_get_count?;
        let mut devices = 0;
        // SAFETY: a valid out-pointer.
        let result = unsafe { count(&mut devices) };
        (result.is_success()).then(|| devices.max(0) as u32)
    }

    /// The device's UUID as NVML prints it (`GPU-…`).
    pub fn device_uuid(&self, device: CUdevice) -> Option<String> {
        let mut uuid = CUuuid::default();
        // SAFETY: a valid out-pointer, per the driver's contract.
        let result = unsafe { (self.device_get_uuid)(&mut uuid, device) };
        result.is_success().then(|| format_uuid(&uuid))
    }
}

/// NVML functions the limiter calls itself.
pub struct Nvml {
    get_handle_by_uuid: NvmlDeviceGetHandleByUUID,
    get_uuid: NvmlDeviceGetUUID,
    /// Only the NVML reports need it; older libraries may lack it.
    get_index: Option<NvmlDeviceGetIndex>,
    get_processes: ProcessList,
}

/// The running-processes query NVML offers, with the entry size it writes.
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

#[derive(Clone, Copy)]
enum ProcessList {
    /// `_v3` (and `_v2`): `nvmlProcessInfo_t`, 24 bytes an entry.
    Current(NvmlDeviceGetComputeRunningProcesses),
    /// The unversioned v1: `nvmlProcessInfo_v1_t`, 16 bytes an entry.
    V1(NvmlDeviceGetComputeRunningProcessesV1),
}

static NVML: OnceLock<Option<Nvml>> = OnceLock::new();

impl Nvml {
    /// NVML, loaded and initialised on first use; `None` where it is absent
    /// (then driver overhead cannot be measured; a warning says so once).
    pub fn get() -> Option<&'static Nvml> {
        NVML.get_or_init(|| {
            let nvml = Self::open();
            if nvml.is_none() {
                tracing::warn!(
                    "NVML unavailable: memory the driver takes for itself is not charged to the pod"
                );
            }
            nvml
        })
        .as_ref()
    }

    fn open() -> Option<Nvml> {
        let handle = loader::open_library(c"libnvidia-ml.so.1")?;
        // SAFETY: the types are NVML's signatures for these symbols.
        let (init, nvml) = unsafe {
            let init: NvmlInit = symbol(handle, c"nvmlInit_v2")?;
            let nvml = Nvml {
                get_handle_by_uuid: symbol(handle, c"nvmlDeviceGetHandleByUUID")?,
                get_uuid: symbol(handle, c"nvmlDeviceGetUUID")?,
                get_index: symbol(handle, c"nvmlDeviceGetIndex"),
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
    pub fn device_uuid(&self, device: nvmlDevice_t) -> Option<String> {
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
    pub fn device_index(&self, device: nvmlDevice_t) -> Option<u32> {
        let get_index = self.get_index?;
        let mut index: c_uint = 0;
        // SAFETY: a valid out-pointer.
        let result = unsafe { get_index(device, &mut index) };
        result.is_success().then_some(index)
    }

    /// Device memory NVML attributes to process `pid` on the GPU `uuid`:
    /// everything it holds there, allocations and the driver's own.
    pub fn process_used(&self, uuid: &str, pid: u32) -> Option<u64> {
        let uuid = std::ffi::CString::new(uuid).ok()?;
        let mut device: nvmlDevice_t = std::ptr::null_mut();
        // SAFETY: a NUL-terminated UUID and a valid out-pointer.
        let result = unsafe { (self.get_handle_by_uuid)(uuid.as_ptr(), &mut device) };
        if !result.is_success() {
            return None;
        }
        let used = match self.get_processes {
            ProcessList::Current(get) => used_by(device, pid, get),
            ProcessList::V1(get) => used_by(device, pid, get),
        };
        // NVML_VALUE_NOT_AVAILABLE (all ones): NVML does not know; charging
        // it would saturate the pod's usage.
        used.filter(|bytes| *bytes != NVML_VALUE_NOT_AVAILABLE)
    }
}

//! What an event bracket around one launch holds besides the kernel,
//! measured once per context with kernels of our own.

use std::ffi::{CStr, c_void};

use gpushare_utils::bucket::monotonic_ns;

use super::Timing;
use crate::driver::symbol;
use crate::sys::{
    CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_NON_BLOCKING, CUevent, CUfunction, CUgraphExec,
    CUresult, CUstream, CuEventSynchronize, CuGraphInstantiateWithFlags, CuGraphLaunch,
    CuLaunchKernel, CuModuleGetFunction, CuModuleLoadData, CuStreamBeginCapture, CuStreamCreate,
    CuStreamEndCapture,
};

/// What measuring the launch overhead needs: an empty kernel of our own.
pub(super) struct CalibrationApi {
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

impl CalibrationApi {
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub(super) unsafe fn load(handle: *mut c_void) -> Option<Self> {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
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
        }
    }
}

/// What an event bracket around one launch holds beyond the launch's own
/// back-to-back period (what the same launch takes in a loop without
/// events), by launch path (see [`Timing::launch_overheads`]): launched
/// into an idle stream (the events' own time and the launch latency) and
/// queued behind other work (the events' own time, about 2 µs on an H100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LaunchOverheads {
    pub kernel_idle_ns: u64,
    pub kernel_queued_ns: u64,
    /// Graph launches start faster; `None` where graphs could not be made.
    pub graph_idle_ns: Option<u64>,
    pub graph_queued_ns: Option<u64>,
    /// How long the kernel launch call typically took (the median) in the
    /// idle brackets, which hold it: a later launch whose call takes longer
    /// (a module loaded in the call) holds the difference too.
    pub kernel_idle_call_ns: u64,
    /// The empty kernel's own back-to-back period, taken off the queued ones.
    pub empty_kernel_ns: u64,
}

/// One kind of calibration bracket: its GPU time's lower quartile, its
/// launch call's median; and its GPU time's median and upper quartile, which
/// the debug log shows (how far a sample's overhead strays from the one
/// taken off).
#[derive(Debug, Clone, Copy)]
struct Bracket {
    gpu_ns: u64,
    call_ns: u64,
    gpu_median_ns: u64,
    gpu_upper_ns: u64,
}

/// The `quarters`/4 quantile of `sorted`, which is in ascending order.
fn quantile(sorted: &[u64], quarters: usize) -> Option<u64> {
    sorted.get(sorted.len() * quarters / 4).copied()
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
    /// What an event bracket around one launch holds besides the kernel, in
    /// the current context: the lower quartile of a few brackets around an empty
    /// kernel of our own, launched directly and as a graph, into an idle
    /// stream and queued behind a kernel that holds the stream. On
    /// `app_stream` (idle: nothing of the application's is waited for) when
    /// given, since launch latency depends on the kind of stream (the legacy
    /// default stream's is longer), else on a private stream. `None` if it
    /// cannot be measured.
    pub(crate) fn launch_overheads(&self, app_stream: Option<CUstream>) -> Option<LaunchOverheads> {
        let api = self.calibration.as_ref()?;
        // Synchronising below must not break another thread's global capture.
        self.with_relaxed_capture(|| self.measure_overheads(api, app_stream))
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
        let empty = queued_two.gpu_ns.saturating_sub(queued.gpu_ns);
        for (kind, bracket) in [
            ("idle", idle),
            ("queued", queued),
            ("queued two", queued_two),
        ] {
            tracing::debug!(
                kind,
                lower_quartile_ns = bracket.gpu_ns,
                median_ns = bracket.gpu_median_ns,
                upper_quartile_ns = bracket.gpu_upper_ns,
                "calibration brackets"
            );
        }
        let graph = self.instantiate_graph(api, stream, || launch(function, params, stream));
        let graph_bracket = |queued: bool| {
            let (exec, graph_launch) = graph?;
            // SAFETY: for closure: our own graph; the stream as above.
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
            kernel_idle_ns: idle.gpu_ns,
            kernel_queued_ns: queued.gpu_ns.saturating_sub(empty),
            graph_idle_ns: graph_idle.map(|bracket| bracket.gpu_ns),
            graph_queued_ns: graph_queued.map(|bracket| bracket.gpu_ns.saturating_sub(empty)),
            kernel_idle_call_ns: idle.call_ns,
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
    /// the low ones are the truer, and a quartile of many is stable from one
    /// process to the next. And the median of how long the launch call took:
    /// a sample's call is taken as late only beyond a typical one, so that
    /// where a kernel outlasts the call (and the call's end is not in the
    /// bracket) a call of the usual length takes nothing off its time.
    fn low_bracket(
        &self,
        api: &CalibrationApi,
        start: CUevent,
        end: CUevent,
        stream: CUstream,
        mut before: impl FnMut() -> bool,
        mut launch: impl FnMut() -> CUresult,
    ) -> Option<Bracket> {
        const RUNS: usize = 24;
        let (mut gpu, mut call) = (Vec::with_capacity(RUNS), Vec::with_capacity(RUNS));
        for _ in 0..RUNS {
            if !(before() && self.record(start, stream)) {
                return None;
            }
            let called_at = monotonic_ns();
            let launched = launch().is_success();
            call.push(monotonic_ns().saturating_sub(called_at));
            // SAFETY: our own event.
            let done = launched
                && self.record(end, stream)
                && unsafe { (api.event_synchronize)(end) }.is_success();
            if !done {
                return None;
            }
            gpu.extend(self.elapsed_ns(start, end));
        }
        gpu.sort_unstable();
        call.sort_unstable();
        Some(Bracket {
            gpu_ns: quantile(&gpu, 1)?,
            call_ns: quantile(&call, 2)?,
            gpu_median_ns: quantile(&gpu, 2)?,
            gpu_upper_ns: quantile(&gpu, 3)?,
        })
    }
}

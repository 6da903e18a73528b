//! Events, streams and occupancy: what measuring launches asks the driver.

use std::ffi::c_void;

use super::{DriverError, symbol};

mod calibration;

use crate::sys::{
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, CU_EVENT_DISABLE_TIMING,
    CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_STATUS_NONE, CUcontext, CUdevice, CUevent,
    CUfunction, CUresult, CUstream, CuCtxGetCurrent, CuDeviceGetAttribute, CuEventCreate,
    CuEventDestroy, CuEventElapsedTime, CuEventQuery, CuEventRecord,
    CuOccupancyMaxActiveBlocksPerMultiprocessor, CuStreamGetCtx, CuStreamIsCapturing,
    CuStreamQuery, CuThreadExchangeStreamCaptureMode,
};
use calibration::CalibrationApi;
pub(crate) use calibration::LaunchOverheads;

/// Events and streams, to measure how long launches keep the GPU busy.
pub(crate) struct Timing {
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

impl Timing {
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub(super) unsafe fn load(handle: *mut c_void) -> Option<Self> {
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
                calibration: CalibrationApi::load(handle),
            })
        }
    }

    /// Lets the calling thread query events while another thread captures a
    /// graph in global mode: otherwise each query would invalidate the
    /// application's capture (error 900).
    pub(crate) fn relax_capture_mode(&self) {
        let Some(exchange) = self.exchange_capture_mode else {
            return;
        };
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer.
        if let Err(error) = unsafe { exchange(&mut mode) }.result() {
            tracing::warn!(%error, "cannot relax the monitor's capture mode");
        }
    }

    /// Whether `stream` is being captured into a graph (its launches do not run).
    pub(crate) fn is_capturing(&self, stream: CUstream) -> bool {
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

    /// Runs `f` with the calling thread's capture mode relaxed, then gives
    /// the thread its own mode back: `f` may query and synchronise while
    /// another thread captures a graph in global mode.
    pub(crate) fn with_relaxed_capture<R>(&self, f: impl FnOnce() -> R) -> R {
        let Some(exchange) = self.exchange_capture_mode else {
            return f();
        };
        let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: a valid in/out pointer.
        unsafe { exchange(&mut mode) };
        let result = f();
        // SAFETY: restores the thread's own mode.
        unsafe { exchange(&mut mode) };
        result
    }

    /// The context of `stream` (the current one for the default streams).
    pub(crate) fn stream_context(&self, stream: CUstream) -> Option<CUcontext> {
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
    pub(crate) fn stream_idle(&self, stream: CUstream) -> Option<bool> {
        let query = self.stream_query?;
        // SAFETY: the caller's stream.
        match unsafe { query(stream) } {
            CUresult::SUCCESS => Some(true),
            CUresult::ERROR_NOT_READY => Some(false),
            _ => None,
        }
    }

    /// The number of SMs of `device`.
    pub(crate) fn sm_count(&self, device: CUdevice) -> Option<u32> {
        let attribute = self.device_attribute?;
        let mut count = 0;
        // SAFETY: a valid out-pointer; any device ordinal is checked by the driver.
        let result =
            unsafe { attribute(&mut count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device) };
        (result.is_success() && count > 0).then_some(count as u32)
    }

    /// How many blocks of `threads` threads and `shared_bytes` dynamic shared
    /// memory of `function` one SM holds at once.
    pub(crate) fn blocks_per_sm(
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
    pub(crate) fn create_event(&self) -> Option<CUevent> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; flags 0 = default (timing enabled).
        let result = unsafe { (self.event_create)(&mut event, 0) };
        result.is_success().then_some(event)
    }

    /// A new event without timing, only to be queried: cheaper to record
    /// on real drivers than a timing one.
    pub(crate) fn create_sync_event(&self) -> Option<CUevent> {
        let mut event: CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; a documented flag.
        let result = unsafe { (self.event_create)(&mut event, CU_EVENT_DISABLE_TIMING) };
        result.is_success().then_some(event)
    }

    pub(crate) fn record(&self, event: CUevent, stream: CUstream) -> bool {
        // SAFETY: an event of ours and the caller's stream.
        unsafe { (self.event_record)(event, stream) }.is_success()
    }

    /// `Ok(true)` once the event's work is done, `Ok(false)` before.
    pub(crate) fn query(&self, event: CUevent) -> Result<bool, DriverError> {
        // SAFETY: an event of ours.
        match unsafe { (self.event_query)(event) } {
            CUresult::ERROR_NOT_READY => Ok(false),
            status => status.result().map(|()| true),
        }
    }

    /// GPU nanoseconds between two completed events.
    pub(crate) fn elapsed_ns(&self, start: CUevent, end: CUevent) -> Option<u64> {
        let mut milliseconds = 0f32;
        // SAFETY: a valid out-pointer; events of ours.
        let result = unsafe { (self.event_elapsed)(&mut milliseconds, start, end) };
        (result.is_success() && milliseconds >= 0.0).then(|| (f64::from(milliseconds) * 1e6) as u64)
    }

    pub(crate) fn destroy(&self, event: CUevent) {
        // SAFETY: an event of ours, used no more.
        if let Err(error) = unsafe { (self.event_destroy)(event) }.result() {
            tracing::debug!(%error, "cuEventDestroy failed");
        }
    }
}

//! The double's simulated GPU clock: launches occupy one timeline per device,
//! events, streams and graphs follow it, and the probe's `spin`, `run`,
//! `series`, `pace` and `maxstall` report it, whichever way they reach the
//! driver.
//!
//! Timer-based assertions leave room for a loaded CI box: busy time is exact
//! (it is booked, not measured), shares are retried a few times.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{CString, c_char, c_int, c_uint, c_void};

mod common;

use common::{in_fresh_process, lines, run};
use gpushare_examples::{BUSY_SYMBOL, double_dir, probe_field};

const MS: u64 = 1_000_000;

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_INVALID_HANDLE: c_int = 400;
const CUDA_ERROR_ILLEGAL_STATE: c_int = 401;
const CUDA_ERROR_NOT_READY: c_int = 600;
const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: c_int = 900;
const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: c_int = 901;
const CU_STREAM_PER_THREAD: Handle = 2 as Handle;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;
const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;
const CU_STREAM_CAPTURE_STATUS_INVALIDATED: c_int = 2;
const CU_STREAM_CAPTURE_MODE_GLOBAL: c_int = 0;
const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;

type Handle = *mut c_void;

/// `CLOCK_MONOTONIC` in ns, the double's clock.
fn now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) },
        0
    );
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

// ---------------------------------------------------------------- in process

/// `CUlaunchConfig` of cuda.h.
#[repr(C)]
struct LaunchConfig {
    grid: [c_uint; 3],
    block: [c_uint; 3],
    shared_mem_bytes: c_uint,
    stream: Handle,
    attrs: *mut c_void,
    num_attrs: c_uint,
}

type Launch = unsafe extern "C" fn(
    Handle,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Handle,
    *mut *mut c_void,
    *mut *mut c_void,
) -> c_int;

/// The function at `address`, as the function pointer type `F`.
///
/// # Safety
///
/// `address` must be a function whose signature is `F`'s.
unsafe fn fn_from<F: Copy>(address: *mut c_void) -> F {
    assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
    // SAFETY: F is a function pointer of the same size (checked), and the
    // caller vouches for its signature.
    unsafe { std::mem::transmute_copy(&address) }
}

/// The double's entry points these tests call, with the signatures of cuda.h.
struct Driver {
    init: unsafe extern "C" fn(c_uint) -> c_int,
    retain: unsafe extern "C" fn(*mut Handle, c_int) -> c_int,
    set_current: unsafe extern "C" fn(Handle) -> c_int,
    ctx_synchronize: unsafe extern "C" fn() -> c_int,
    attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int,
    module_load: unsafe extern "C" fn(*mut Handle, *const c_void) -> c_int,
    get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> c_int,
    launch: Launch,
    launch_ptsz: Launch,
    launch_ex: unsafe extern "C" fn(
        *const LaunchConfig,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int,
    event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int,
    event_record: unsafe extern "C" fn(Handle, Handle) -> c_int,
    event_query: unsafe extern "C" fn(Handle) -> c_int,
    event_synchronize: unsafe extern "C" fn(Handle) -> c_int,
    elapsed: unsafe extern "C" fn(*mut f32, Handle, Handle) -> c_int,
    elapsed_v1: unsafe extern "C" fn(*mut f32, Handle, Handle) -> c_int,
    event_destroy: unsafe extern "C" fn(Handle) -> c_int,
    stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int,
    stream_destroy: unsafe extern "C" fn(Handle) -> c_int,
    stream_synchronize: unsafe extern "C" fn(Handle) -> c_int,
    stream_query: unsafe extern "C" fn(Handle) -> c_int,
    stream_get_ctx: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    stream_get_ctx_ptsz: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    get_current: unsafe extern "C" fn(*mut Handle) -> c_int,
    begin_capture: unsafe extern "C" fn(Handle, c_int) -> c_int,
    begin_capture_ptsz: unsafe extern "C" fn(Handle, c_int) -> c_int,
    end_capture: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    end_capture_ptsz: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    is_capturing: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    is_capturing_ptsz: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    exchange_mode: unsafe extern "C" fn(*mut c_int) -> c_int,
    instantiate: unsafe extern "C" fn(*mut Handle, Handle, u64) -> c_int,
    graph_launch: unsafe extern "C" fn(Handle, Handle) -> c_int,
    graph_launch_ptsz: unsafe extern "C" fn(Handle, Handle) -> c_int,
    exec_destroy: unsafe extern "C" fn(Handle) -> c_int,
    graph_destroy: unsafe extern "C" fn(Handle) -> c_int,
    busy: unsafe extern "C" fn(c_int, u64, u64) -> u64,
}

impl Driver {
    /// Opens the double's libcuda in this process (never closed).
    fn open() -> Driver {
        let path = CString::new(double_dir().join("libcuda.so.1").to_str().unwrap()).unwrap();
        // SAFETY: path is a valid C string; the double's constructors are trivial.
        let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!lib.is_null(), "dlopen libcuda.so.1 failed");
        let sym = |name: &str| {
            let c_name = CString::new(name).unwrap();
            // SAFETY: lib is a live handle and c_name a valid C string.
            let address = unsafe { libc::dlsym(lib, c_name.as_ptr()) };
            assert!(!address.is_null(), "{name} is not exported");
            address
        };
        macro_rules! f {
            ($name:literal) => {
                // SAFETY: the field's type is the signature of the export in
                // cuda.h (or of the accessor in double_common.h).
                unsafe { fn_from(sym($name)) }
            };
        }
        Driver {
            init: f!("cuInit"),
            retain: f!("cuDevicePrimaryCtxRetain"),
            set_current: f!("cuCtxSetCurrent"),
            ctx_synchronize: f!("cuCtxSynchronize"),
            attribute: f!("cuDeviceGetAttribute"),
            module_load: f!("cuModuleLoadData"),
            get_function: f!("cuModuleGetFunction"),
            launch: f!("cuLaunchKernel"),
            launch_ptsz: f!("cuLaunchKernel_ptsz"),
            launch_ex: f!("cuLaunchKernelEx"),
            event_create: f!("cuEventCreate"),
            event_record: f!("cuEventRecord"),
            event_query: f!("cuEventQuery"),
            event_synchronize: f!("cuEventSynchronize"),
            elapsed: f!("cuEventElapsedTime_v2"),
            elapsed_v1: f!("cuEventElapsedTime"),
            event_destroy: f!("cuEventDestroy_v2"),
            stream_create: f!("cuStreamCreate"),
            stream_destroy: f!("cuStreamDestroy_v2"),
            stream_synchronize: f!("cuStreamSynchronize"),
            stream_query: f!("cuStreamQuery"),
            stream_get_ctx: f!("cuStreamGetCtx"),
            stream_get_ctx_ptsz: f!("cuStreamGetCtx_ptsz"),
            get_current: f!("cuCtxGetCurrent"),
            begin_capture: f!("cuStreamBeginCapture_v2"),
            begin_capture_ptsz: f!("cuStreamBeginCapture_v2_ptsz"),
            end_capture: f!("cuStreamEndCapture"),
            end_capture_ptsz: f!("cuStreamEndCapture_ptsz"),
            is_capturing: f!("cuStreamIsCapturing"),
            is_capturing_ptsz: f!("cuStreamIsCapturing_ptsz"),
            exchange_mode: f!("cuThreadExchangeStreamCaptureMode"),
            instantiate: f!("cuGraphInstantiateWithFlags"),
            graph_launch: f!("cuGraphLaunch"),
            graph_launch_ptsz: f!("cuGraphLaunch_ptsz"),
            exec_destroy: f!("cuGraphExecDestroy"),
            graph_destroy: f!("cuGraphDestroy"),
            busy: f!("gpushare_double_busy_ns"),
        }
    }

    /// cuInit, then the primary context of `device` made current.
    fn start(&self, device: c_int) {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the arguments are plain values.
        unsafe {
            assert_eq!((self.init)(0), CUDA_SUCCESS);
            assert_eq!((self.retain)(&mut ctx, device), CUDA_SUCCESS);
            assert_eq!((self.set_current)(ctx), CUDA_SUCCESS);
        }
    }

    /// A kernel handle from a freshly loaded module.
    fn function(&self) -> Handle {
        let (mut module, mut function) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: valid out-pointers; the image is any non-NULL pointer.
        unsafe {
            assert_eq!(
                (self.module_load)(&mut module, c"any image".as_ptr().cast()),
                CUDA_SUCCESS
            );
            assert_eq!(
                (self.get_function)(&mut function, module, c"gpushare_spin".as_ptr()),
                CUDA_SUCCESS
            );
        }
        function
    }

    /// cuLaunchKernel (or its _ptsz) of `f` for `ns` on `stream`.
    fn run(&self, launch: Launch, f: Handle, ns: u64, stream: Handle) -> c_int {
        let mut ns = ns;
        let mut params = [(&raw mut ns).cast::<c_void>()];
        // SAFETY: params[0] points to the u64 the double reads during the call.
        unsafe {
            launch(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
    }

    fn busy(&self, device: c_int, from: u64, to: u64) -> u64 {
        // SAFETY: plain values.
        unsafe { (self.busy)(device, from, to) }
    }

    fn event(&self, flags: c_uint) -> Handle {
        let mut event = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        assert_eq!(
            unsafe { (self.event_create)(&mut event, flags) },
            CUDA_SUCCESS
        );
        event
    }

    /// cuEventElapsedTime_v2, and the same from the v1 export.
    fn elapsed(&self, start: Handle, end: Handle) -> (c_int, f32) {
        let (mut ms, mut ms_v1) = (f32::NAN, f32::NAN);
        // SAFETY: valid out-pointers; the handles are checked by the double.
        let (rc, rc_v1) = unsafe {
            (
                (self.elapsed)(&mut ms, start, end),
                (self.elapsed_v1)(&mut ms_v1, start, end),
            )
        };
        assert_eq!(rc, rc_v1);
        if rc == CUDA_SUCCESS {
            assert_eq!(ms, ms_v1);
        }
        (rc, ms)
    }

    fn capture_status(&self, stream: Handle, ptsz: bool) -> c_int {
        let mut status = -1;
        let is_capturing = if ptsz {
            self.is_capturing_ptsz
        } else {
            self.is_capturing
        };
        // SAFETY: valid out-pointer.
        assert_eq!(unsafe { is_capturing(stream, &mut status) }, CUDA_SUCCESS);
        status
    }
}

/// Set in the copy of this test binary that runs a test in a fresh process.

#[test]
fn events_and_streams_follow_the_simulated_clock() {
    if !in_fresh_process(
        "events_and_streams_follow_the_simulated_clock",
        &[("GPUSHARE_DOUBLE_KERNEL_NS", "3000000")],
    ) {
        return;
    }
    let cu = Driver::open();
    cu.start(0);
    let f = cu.function();
    let null: Handle = std::ptr::null_mut();
    let nowhere: *mut *mut c_void = std::ptr::null_mut();
    let (start, end, never) = (cu.event(0), cu.event(0), cu.event(0));
    // SAFETY (all calls below): the handles come from the double, which
    // checks them; out-pointers are valid.
    unsafe {
        let mut sms = 0;
        assert_eq!(
            (cu.attribute)(&mut sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0),
            CUDA_SUCCESS
        );
        assert_eq!(sms, 132);
        assert_eq!((cu.attribute)(&mut sms, 9999, 0), CUDA_ERROR_INVALID_VALUE);

        // Never recorded: complete, as in the real driver, but untimed.
        assert_eq!((cu.event_query)(never), CUDA_SUCCESS);
        assert_eq!((cu.event_synchronize)(never), CUDA_SUCCESS);
        assert_eq!(cu.elapsed(never, never).0, CUDA_ERROR_INVALID_HANDLE);

        // A first kernel keeps the GPU busy, so the next one starts exactly
        // when it ends and the events bracket exactly 20 ms.
        assert_eq!(cu.run(cu.launch, f, 200 * MS, null), CUDA_SUCCESS);
        assert_eq!((cu.event_record)(start, null), CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch, f, 20 * MS, null), CUDA_SUCCESS);
        assert_eq!((cu.event_record)(end, null), CUDA_SUCCESS);
        assert_eq!((cu.event_query)(end), CUDA_ERROR_NOT_READY);
        assert_eq!((cu.event_query)(start), CUDA_ERROR_NOT_READY);
        assert_eq!(cu.elapsed(start, end).0, CUDA_ERROR_NOT_READY);
        assert_eq!((cu.stream_query)(null), CUDA_ERROR_NOT_READY);
        assert_eq!(cu.elapsed(never, end).0, CUDA_ERROR_INVALID_HANDLE);
        assert_eq!((cu.event_synchronize)(end), CUDA_SUCCESS);
        assert_eq!((cu.event_query)(end), CUDA_SUCCESS);
        assert_eq!((cu.stream_query)(null), CUDA_SUCCESS);
        assert_eq!(cu.elapsed(start, end), (CUDA_SUCCESS, 20.0));
        assert_eq!(cu.elapsed(end, start), (CUDA_SUCCESS, -20.0));

        // Without kernelParams a kernel lasts GPUSHARE_DOUBLE_KERNEL_NS.
        assert_eq!(cu.run(cu.launch, f, 200 * MS, null), CUDA_SUCCESS);
        assert_eq!((cu.event_record)(start, CU_STREAM_PER_THREAD), CUDA_SUCCESS);
        let launched = (cu.launch)(f, 1, 1, 1, 1, 1, 1, 0, null, nowhere, nowhere);
        assert_eq!(launched, CUDA_SUCCESS);
        assert_eq!((cu.event_record)(end, null), CUDA_SUCCESS);
        assert_eq!((cu.event_synchronize)(end), CUDA_SUCCESS);
        assert_eq!(cu.elapsed(start, end), (CUDA_SUCCESS, 3.0));

        // An idle GPU stamps the time of the record.
        assert_eq!((cu.event_record)(start, null), CUDA_SUCCESS);
        assert_eq!((cu.event_query)(start), CUDA_SUCCESS);
        let (rc, ms) = cu.elapsed(end, start);
        assert_eq!(rc, CUDA_SUCCESS);
        assert!((0.0..1000.0).contains(&ms), "{ms}");

        let untimed = cu.event(CU_EVENT_DISABLE_TIMING);
        assert_eq!((cu.event_record)(untimed, null), CUDA_SUCCESS);
        assert_eq!(cu.elapsed(untimed, end).0, CUDA_ERROR_INVALID_HANDLE);
        assert_eq!((cu.event_destroy)(untimed), CUDA_SUCCESS);
        assert_eq!((cu.event_query)(untimed), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!((cu.event_destroy)(untimed), CUDA_ERROR_INVALID_HANDLE);
        let mut event = null;
        assert_eq!(
            (cu.event_create)(&mut event, 0x100),
            CUDA_ERROR_INVALID_VALUE
        );

        // Streams: query, synchronize, and the context waits for everything.
        let mut stream = null;
        assert_eq!((cu.stream_create)(&mut stream, 1), CUDA_SUCCESS);
        let (mut current, mut ctx) = (null, null);
        assert_eq!((cu.get_current)(&mut current), CUDA_SUCCESS);
        for (get_ctx, s) in [
            (cu.stream_get_ctx, stream),
            (cu.stream_get_ctx, null),
            (cu.stream_get_ctx_ptsz, null),
            (cu.stream_get_ctx, CU_STREAM_PER_THREAD),
        ] {
            ctx = null;
            assert_eq!(get_ctx(s, &mut ctx), CUDA_SUCCESS);
            assert_eq!(ctx, current);
        }
        assert_eq!(
            (cu.stream_get_ctx)(7 as Handle, &mut ctx),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(cu.run(cu.launch, f, 50 * MS, stream), CUDA_SUCCESS);
        assert_eq!((cu.stream_query)(stream), CUDA_ERROR_NOT_READY);
        assert_eq!((cu.stream_synchronize)(stream), CUDA_SUCCESS);
        assert_eq!((cu.stream_query)(stream), CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch_ptsz, f, 50 * MS, null), CUDA_SUCCESS);
        assert_eq!(
            (cu.stream_query)(CU_STREAM_PER_THREAD),
            CUDA_ERROR_NOT_READY
        );
        assert_eq!((cu.ctx_synchronize)(), CUDA_SUCCESS);
        assert_eq!((cu.stream_query)(stream), CUDA_SUCCESS);
        assert_eq!((cu.stream_destroy)(stream), CUDA_SUCCESS);
        assert_eq!((cu.stream_query)(stream), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(cu.run(cu.launch, f, MS, stream), CUDA_ERROR_INVALID_HANDLE);

        // Bad launches queue nothing.
        let t = now();
        assert_eq!(cu.run(cu.launch, null, MS, null), CUDA_ERROR_INVALID_HANDLE);
        let zero_grid = (cu.launch)(f, 0, 1, 1, 1, 1, 1, 0, null, nowhere, nowhere);
        assert_eq!(zero_grid, CUDA_ERROR_INVALID_VALUE);
        let too_big = (cu.launch)(f, 1, 1, 1, 1024, 2, 1, 0, null, nowhere, nowhere);
        assert_eq!(too_big, CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cu.busy(0, t, u64::MAX), 0);
    }
}

#[test]
fn capture_records_kernels_and_graph_launches_run_them() {
    if !in_fresh_process("capture_records_kernels_and_graph_launches_run_them", &[]) {
        return;
    }
    let cu = Driver::open();
    cu.start(0);
    let f = cu.function();
    let null: Handle = std::ptr::null_mut();
    // SAFETY (all calls below): the handles come from the double, which
    // checks them; out-pointers are valid.
    unsafe {
        let mut stream = null;
        assert_eq!((cu.stream_create)(&mut stream, 0), CUDA_SUCCESS);
        assert_eq!(
            cu.capture_status(stream, false),
            CU_STREAM_CAPTURE_STATUS_NONE
        );
        assert_eq!(
            (cu.begin_capture)(null, 0),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "the legacy stream cannot capture"
        );
        assert_eq!((cu.begin_capture)(stream, 7), CUDA_ERROR_INVALID_VALUE);

        let t0 = now();
        assert_eq!((cu.begin_capture)(stream, 0), CUDA_SUCCESS);
        assert_eq!(
            cu.capture_status(stream, false),
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        );
        assert_eq!((cu.begin_capture)(stream, 0), CUDA_ERROR_ILLEGAL_STATE);
        assert_eq!(cu.run(cu.launch, f, 10 * MS, stream), CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch_ptsz, f, 10 * MS, stream), CUDA_SUCCESS);
        let mut ns = 10 * MS;
        let mut params = [(&raw mut ns).cast::<c_void>()];
        let config = LaunchConfig {
            grid: [1, 1, 1],
            block: [32, 1, 1],
            shared_mem_bytes: 0,
            stream,
            attrs: null,
            num_attrs: 0,
        };
        assert_eq!(
            (cu.launch_ex)(&config, f, params.as_mut_ptr(), null.cast()),
            CUDA_SUCCESS
        );
        assert_eq!(cu.busy(0, t0, u64::MAX), 0, "captured kernels do not run");
        let mut graph = null;
        assert_eq!((cu.end_capture)(stream, &mut graph), CUDA_SUCCESS);
        assert_eq!(
            cu.capture_status(stream, false),
            CU_STREAM_CAPTURE_STATUS_NONE
        );
        assert_eq!(
            (cu.end_capture)(stream, &mut graph),
            CUDA_ERROR_ILLEGAL_STATE
        );
        let mut exec = null;
        assert_eq!((cu.instantiate)(&mut exec, graph, 0), CUDA_SUCCESS);
        assert_eq!((cu.graph_destroy)(graph), CUDA_SUCCESS);
        assert_eq!(cu.busy(0, t0, u64::MAX), 0);

        // A graph launch occupies the captured 30 ms, through either entry point.
        let t1 = now();
        assert_eq!((cu.graph_launch)(exec, null), CUDA_SUCCESS);
        assert_eq!((cu.ctx_synchronize)(), CUDA_SUCCESS);
        assert_eq!(cu.busy(0, t1, now()), 30 * MS);
        assert_eq!((cu.graph_launch_ptsz)(exec, null), CUDA_SUCCESS);
        assert_eq!((cu.stream_synchronize)(CU_STREAM_PER_THREAD), CUDA_SUCCESS);
        assert_eq!(cu.busy(0, t1, now()), 60 * MS);
        assert_eq!((cu.exec_destroy)(exec), CUDA_SUCCESS);
        assert_eq!((cu.graph_launch)(exec, null), CUDA_ERROR_INVALID_HANDLE);

        // The per-thread stream captures; the legacy one keeps running.
        let t2 = now();
        assert_eq!((cu.begin_capture_ptsz)(null, 1), CUDA_SUCCESS);
        assert_eq!(
            cu.capture_status(null, true),
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        );
        assert_eq!(
            cu.capture_status(CU_STREAM_PER_THREAD, false),
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        );
        assert_eq!(
            cu.capture_status(null, false),
            CU_STREAM_CAPTURE_STATUS_NONE
        );
        assert_eq!(cu.run(cu.launch_ptsz, f, 7 * MS, null), CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch, f, 5 * MS, null), CUDA_SUCCESS);
        assert_eq!((cu.end_capture_ptsz)(null, &mut graph), CUDA_SUCCESS);
        assert_eq!((cu.instantiate)(&mut exec, graph, 0), CUDA_SUCCESS);
        assert_eq!((cu.graph_launch)(exec, stream), CUDA_SUCCESS);
        assert_eq!((cu.ctx_synchronize)(), CUDA_SUCCESS);
        assert_eq!(cu.busy(0, t2, now()), 12 * MS);
        assert_eq!((cu.stream_destroy)(stream), CUDA_SUCCESS);
    }
}

/// Driver is plain function pointers, usable from any thread.
struct Shared<'a>(&'a Driver);

// SAFETY: the double's entry points are thread-safe, like the driver's.
unsafe impl Sync for Shared<'_> {}

#[test]
fn unsafe_calls_during_capture_break_it_as_on_the_real_driver() {
    if !in_fresh_process(
        "unsafe_calls_during_capture_break_it_as_on_the_real_driver",
        &[],
    ) {
        return;
    }
    let cu = Driver::open();
    cu.start(0);
    let f = cu.function();
    let null: Handle = std::ptr::null_mut();
    let (done, timed) = (cu.event(0), cu.event(0));
    let mut stream = null;
    // SAFETY (all calls below): the handles come from the double, which
    // checks them; out-pointers are valid.
    unsafe {
        assert_eq!((cu.event_record)(done, null), CUDA_SUCCESS);
        assert_eq!((cu.stream_create)(&mut stream, 1), CUDA_SUCCESS);
        let shared = Shared(&cu);
        // Runs `op(handle)` on a new thread with the context current.
        let elsewhere = |op: fn(&Driver, Handle) -> c_int, handle: Handle| {
            let (shared, handle) = (&shared, handle as usize);
            std::thread::scope(|scope| {
                scope
                    .spawn(move || {
                        shared.0.start(0);
                        op(shared.0, handle as Handle)
                    })
                    .join()
                    .unwrap()
            })
        };
        let query: fn(&Driver, Handle) -> c_int = |cu, event| (cu.event_query)(event);
        let end = |expected: c_int| {
            let mut graph = null;
            assert_eq!((cu.end_capture)(stream, &mut graph), expected);
            assert_eq!(graph.is_null(), expected != CUDA_SUCCESS);
        };

        // Safe during any capture: records, elapsed times, other launches.
        assert_eq!(
            (cu.begin_capture)(stream, CU_STREAM_CAPTURE_MODE_GLOBAL),
            CUDA_SUCCESS
        );
        assert_eq!((cu.event_record)(timed, stream), CUDA_SUCCESS);
        assert_eq!((cu.event_record)(timed, null), CUDA_SUCCESS);
        assert_eq!(cu.elapsed(done, done).0, CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch, f, MS, null), CUDA_SUCCESS);
        assert_eq!(
            cu.capture_status(stream, false),
            CU_STREAM_CAPTURE_STATUS_ACTIVE
        );
        // A query on the capturing thread breaks a GLOBAL capture...
        assert_eq!(query(&cu, done), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        assert_eq!(
            cu.capture_status(stream, false),
            CU_STREAM_CAPTURE_STATUS_INVALIDATED
        );
        assert_eq!(
            cu.run(cu.launch, f, MS, stream),
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
        assert_eq!(
            (cu.event_record)(timed, stream),
            CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        );
        end(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        assert_eq!(
            cu.capture_status(stream, false),
            CU_STREAM_CAPTURE_STATUS_NONE
        );
        // ... and so does one from any other thread.
        assert_eq!(
            (cu.begin_capture)(stream, CU_STREAM_CAPTURE_MODE_GLOBAL),
            CUDA_SUCCESS
        );
        assert_eq!(
            elsewhere(|cu, stream| (cu.stream_query)(stream), null),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        end(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        // Unless that thread has switched itself to RELAXED.
        assert_eq!(
            (cu.begin_capture)(stream, CU_STREAM_CAPTURE_MODE_GLOBAL),
            CUDA_SUCCESS
        );
        let relaxed = elsewhere(
            |cu, event| {
                let mut mode = CU_STREAM_CAPTURE_MODE_RELAXED;
                assert_eq!((cu.exchange_mode)(&mut mode), CUDA_SUCCESS);
                assert_eq!(mode, CU_STREAM_CAPTURE_MODE_GLOBAL, "the default");
                (cu.event_query)(event) + (cu.event_synchronize)(event)
            },
            done,
        );
        assert_eq!(relaxed, CUDA_SUCCESS);
        end(CUDA_SUCCESS);

        // THREAD_LOCAL: only the capturing thread is bound.
        assert_eq!(
            (cu.begin_capture)(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            CUDA_SUCCESS
        );
        assert_eq!(elsewhere(query, done), CUDA_SUCCESS);
        assert_eq!(
            elsewhere(|cu, stream| (cu.stream_synchronize)(stream), null),
            CUDA_SUCCESS
        );
        end(CUDA_SUCCESS);
        assert_eq!(
            (cu.begin_capture)(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            CUDA_SUCCESS
        );
        assert_eq!(
            (cu.event_synchronize)(done),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        );
        end(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);

        // RELAXED: queries are fine; the context or the stream itself is not.
        let breakers: [fn(&Driver, Handle) -> c_int; 3] = [
            |cu, _| (cu.ctx_synchronize)(),
            |cu, stream| (cu.stream_query)(stream),
            |cu, stream| (cu.stream_synchronize)(stream),
        ];
        for breaker in breakers {
            assert_eq!(
                (cu.begin_capture)(stream, CU_STREAM_CAPTURE_MODE_RELAXED),
                CUDA_SUCCESS
            );
            assert_eq!(query(&cu, done), CUDA_SUCCESS);
            assert_eq!(elsewhere(query, done), CUDA_SUCCESS);
            assert_eq!(breaker(&cu, stream), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
            end(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
        }

        // No capture, no rules.
        assert_eq!(query(&cu, done), CUDA_SUCCESS);
        assert_eq!((cu.ctx_synchronize)(), CUDA_SUCCESS);
        assert_eq!(
            (cu.exchange_mode)(std::ptr::null_mut()),
            CUDA_ERROR_INVALID_VALUE
        );
    }
}

#[test]
fn busy_time_is_clipped_to_the_window_and_kept_per_device() {
    if !in_fresh_process(
        "busy_time_is_clipped_to_the_window_and_kept_per_device",
        &[("GPUSHARE_DOUBLE_DEVICES", "2")],
    ) {
        return;
    }
    let cu = Driver::open();
    cu.start(0);
    let f = cu.function();
    let null: Handle = std::ptr::null_mut();
    let start = now();
    assert_eq!(cu.run(cu.launch, f, 300 * MS, null), CUDA_SUCCESS);
    let launched = now();
    // The kernel covers [start, start + 300 ms) give or take the launch.
    assert_eq!(cu.busy(0, launched, launched + 10 * MS), 10 * MS);
    assert_eq!(cu.busy(0, launched + MS, launched + MS + 1), 1);
    assert_eq!(cu.busy(0, launched, launched), 0);
    assert_eq!(cu.busy(0, launched + 10, launched), 0);
    assert_eq!(cu.busy(1, 0, u64::MAX), 0);
    assert_eq!(cu.busy(-1, 0, u64::MAX), 0);
    assert_eq!(cu.busy(2, 0, u64::MAX), 0);
    let to_end = cu.busy(0, launched, u64::MAX);
    assert!(to_end <= 300 * MS && to_end > 290 * MS, "{to_end}");
    assert_eq!(cu.busy(0, 0, start), 0);
    // Back-to-back kernels merge into one interval; the total stays exact.
    for _ in 0..100 {
        assert_eq!(cu.run(cu.launch, f, MS / 10, null), CUDA_SUCCESS);
    }
    // SAFETY: no arguments.
    assert_eq!(unsafe { (cu.ctx_synchronize)() }, CUDA_SUCCESS);
    assert_eq!(cu.busy(0, 0, u64::MAX), 310 * MS);

    cu.start(1);
    let f1 = cu.function();
    assert_eq!(cu.run(cu.launch, f1, 5 * MS, null), CUDA_SUCCESS);
    // SAFETY: no arguments.
    assert_eq!(unsafe { (cu.ctx_synchronize)() }, CUDA_SUCCESS);
    assert_eq!(cu.busy(1, 0, u64::MAX), 5 * MS);
    assert_eq!(cu.busy(0, 0, u64::MAX), 310 * MS);
}

// ---------------------------------------------------------------- probes

/// The three ways a program reaches the driver.
const VARIANTS: &[(&str, &[&str])] = &[
    ("cudaprobe", &["--via", "dlsym"]),
    ("cudaprobe", &["--via", "getproc"]),
    ("cudaprobe_linked", &[]),
];

/// Every launch API of `spin`, `run` and `pace` that takes its duration from
/// the kernel parameter.
const TIMED_APIS: &[&str] = &[
    "kernel",
    "kernel_ptsz",
    "ex",
    "ex_ptsz",
    "coop",
    "coop_ptsz",
    "graph",
    "graph_ptsz",
];

/// The legacy launches, which last `GPUSHARE_DOUBLE_KERNEL_NS`.
const LEGACY_APIS: &[&str] = &["legacy", "grid", "grid_async"];

fn field(line: &str, key: &str) -> u64 {
    probe_field(line, key).unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// Runs the one-command `script` until its share reaches `min_pm` (timers on
/// a loaded box oversleep), at most 5 times; returns the last line.
fn best_share(
    name: &str,
    options: &[&str],
    script: &str,
    env: &[(&str, &str)],
    min_pm: u64,
) -> String {
    let mut line = String::new();
    for _ in 0..5 {
        line = lines(name, options, script, env).remove(0);
        if field(&line, "share_pm") >= min_pm {
            break;
        }
    }
    line
}

#[test]
fn spin_fills_the_gpu_through_every_launch_api() {
    for &(name, options) in VARIANTS {
        for api in TIMED_APIS {
            let script = format!("spin {api} 1000 20");
            let line = best_share(name, options, &script, &[], 950);
            let context = format!("{name} {options:?}: {line}");
            assert!(
                line.starts_with(&format!("{script} -> 0 wall_ns=")),
                "{context}"
            );
            let (wall, busy) = (field(&line, "wall_ns"), field(&line, "busy_ns"));
            assert!(busy.abs_diff(20 * MS) <= 20 * MS / 100, "{context}");
            assert!(wall >= busy, "{context}");
            assert_eq!(field(&line, "share_pm"), busy * 1000 / wall, "{context}");
            assert!(field(&line, "share_pm") >= 950, "{context}");
        }
    }
}

#[test]
fn legacy_launches_last_the_default_kernel_time() {
    for &(name, options) in VARIANTS {
        let script: String = LEGACY_APIS
            .iter()
            .map(|api| format!("spin {api} 1000 10 "))
            .collect();
        for (env, busy) in [
            (&[][..], 10 * 100_000),
            (&[("GPUSHARE_DOUBLE_KERNEL_NS", "500000")][..], 10 * 500_000),
        ] {
            let out = lines(name, options, &script, env);
            assert_eq!(out.len(), LEGACY_APIS.len());
            for (line, api) in out.iter().zip(LEGACY_APIS) {
                assert!(
                    line.starts_with(&format!("spin {api} 1000 10 -> 0 wall_ns=")),
                    "{name} {options:?}: {line}"
                );
                assert_eq!(field(line, "busy_ns"), busy, "{name} {options:?}: {line}");
            }
        }
    }
}

#[test]
fn run_series_pace_and_maxstall_report_the_clock() {
    // A short queue keeps the backlog after the 100 ms of launching short.
    let env = [("GPUSHARE_DOUBLE_QUEUE_DEPTH", "16")];
    for &(name, options) in VARIANTS {
        let out = lines(
            name,
            options,
            "run kernel 200 100 series 10 maxstall pace graph 1000 10 0 maxstall",
            &env,
        );
        let context = format!("{name} {options:?}: {out:#?}");
        assert_eq!(out.len(), 5, "{context}");

        assert!(
            out[0].starts_with("run kernel 200 100 -> 0 launches="),
            "{context}"
        );
        let launches = field(&out[0], "launches");
        let (wall, busy) = (field(&out[0], "wall_ns"), field(&out[0], "busy_ns"));
        // 100 ms of launching, then the 16 queued kernels drain.
        assert!(wall >= 100 * MS && launches >= 16, "{context}");
        assert!(launches * 200_000 <= wall + 200_000, "{context}");
        assert_eq!(busy, launches * 200_000, "{context}");
        assert_eq!(field(&out[0], "share_pm"), busy * 1000 / wall, "{context}");

        let series = out[1].strip_prefix("series 10 pm=").expect(&context);
        let windows: Vec<u64> = series.split(',').map(|pm| pm.parse().unwrap()).collect();
        assert_eq!(windows.len() as u64, wall / (10 * MS), "{context}");
        assert!(windows.iter().all(|&pm| pm <= 1000), "{context}");
        let mut sorted = windows.clone();
        sorted.sort_unstable();
        assert!(sorted[sorted.len() / 2] >= 900, "{context}");

        // With the queue full, a launch waits for a kernel to finish.
        assert!(out[2].starts_with("maxstall ns="), "{context}");
        assert!(field(&out[2], "ns") >= 50_000, "{context}");

        // GPU-bound: 10 back-to-back 1 ms graphs.
        assert!(
            out[3].starts_with("pace graph 1000 10 0 -> 0 ns_per_iter="),
            "{context}"
        );
        assert!(field(&out[3], "ns_per_iter") >= MS, "{context}");
        assert!(out[4].starts_with("maxstall ns="), "{context}");
        assert!(field(&out[4], "ns") < 100 * MS, "{context}");
    }

    // Host-bound: 3 ms of host work per 100 µs kernel.
    let out = lines(
        "cudaprobe",
        &[],
        "pace kernel_ptsz 100 5 3000 series 5",
        &[],
    );
    assert!(
        out[0].starts_with("pace kernel_ptsz 100 5 3000 -> 0 ns_per_iter="),
        "{out:?}"
    );
    assert!(field(&out[0], "ns_per_iter") >= 3 * MS, "{out:?}");
    let windows: Vec<u64> = out[1]
        .strip_prefix("series 5 pm=")
        .unwrap()
        .split(',')
        .map(|pm| pm.parse().unwrap())
        .collect();
    assert!(!windows.is_empty(), "{out:?}");
    assert!(windows.iter().all(|&pm| pm <= 100), "mostly idle: {out:?}");
}

#[test]
fn a_full_launch_queue_blocks_the_launch() {
    let out = lines(
        "cudaprobe",
        &[],
        "spin kernel 10000 4 maxstall",
        &[("GPUSHARE_DOUBLE_QUEUE_DEPTH", "2")],
    );
    assert_eq!(field(&out[0], "busy_ns"), 40 * MS, "{out:?}");
    // The third launch waits for the first kernel (10 ms).
    assert!(field(&out[1], "ns") >= 5 * MS, "{out:?}");
}

#[test]
fn malformed_compute_scripts_exit_2_before_doing_anything() {
    for script in [
        "series 10",
        "maxstall",
        "info maxstall spin kernel 1 1",
        "spin bogus 1 1",
        "spin kernel 1",
        "run kernel x 1",
        "pace kernel 1 1",
        "spin kernel 1 1 series 0",
    ] {
        let output = run("cudaprobe", &[], script, &[]);
        assert_eq!(output.status.code(), Some(2), "{script}");
        assert!(output.stdout.is_empty(), "{script}");
        assert!(
            String::from_utf8_lossy(&output.stderr).starts_with("cudaprobe: "),
            "{script}"
        );
    }
}

#[test]
fn probe_fields_parse() {
    let line = "run kernel 1 2 -> 0 launches=7 wall_ns=10 busy_ns=5 share_pm=500";
    assert_eq!(probe_field(line, "launches"), Some(7));
    assert_eq!(probe_field(line, "share_pm"), Some(500));
    assert_eq!(probe_field(line, "wall"), None);
    assert_eq!(probe_field("maxstall ns=x", "ns"), None);
    assert_eq!(BUSY_SYMBOL, "gpushare_double_busy_ns");
}

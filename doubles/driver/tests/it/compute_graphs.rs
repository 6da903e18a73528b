//! Stream capture and graphs in the double, in process: captured kernels run
//! when the graph is launched, and calls that are unsafe during a capture
//! break it as on the real driver.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{c_int, c_void};

use crate::common;

use common::in_process::*;
use common::{CUDA_SUCCESS, MS, in_fresh_process};

#[test]
fn capture_records_kernels_and_graph_launches_run_them() {
    if !in_fresh_process("capture_records_kernels_and_graph_launches_run_them", &[]) {
        return;
    }
    let cu = Driver::open();
    cu.start(0);
    let f = cu.function();
    let null: Handle = std::ptr::null_mut();
    // SAFETY: for all calls below: the handles come from the double, which
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
    // SAFETY: for all calls below: the handles come from the double, which
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

//! The double's simulated GPU clock, in process: launches occupy one
//! timeline per device, events and streams follow it, and busy time is kept
//! per device.
//!
//! Busy time is exact (it is booked, not measured), so a loaded CI box does
//! not move these assertions.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::c_void;

use crate::common;

use common::in_process::*;
use common::{CUDA_SUCCESS, MS, in_fresh_process};

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
    // SAFETY: for all calls below: the handles come from the double, which
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
    // The kernel started between `start` and `launched` (however long the
    // thread was descheduled between them), so its rest is within that.
    assert!(
        to_end <= 300 * MS && to_end >= (start + 300 * MS).saturating_sub(launched),
        "{to_end}"
    );
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

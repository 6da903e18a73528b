//! The double's copies, sets and stream waits: each entry point checks what
//! the model in `cuda.c` says (its context, its stream, its ranges) and
//! moves nothing.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{c_int, c_uint, c_void};

use crate::common;

use common::in_process::{
    CU_STREAM_PER_THREAD, CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, Handle, Lib,
};
use common::{CUDA_SUCCESS, MIB, in_fresh_process};

const CUDA_ERROR_NOT_INITIALIZED: c_int = 3;
const CUDA_ERROR_INVALID_CONTEXT: c_int = 201;
const CU_MEMHOSTALLOC_DEVICEMAP: c_uint = 2;
const CU_EVENT_WAIT_EXTERNAL: c_uint = 1;

type DevPtr = u64;
type Copy = unsafe extern "C" fn(DevPtr, DevPtr, usize) -> c_int;
type CopyAsync = unsafe extern "C" fn(DevPtr, DevPtr, usize, Handle) -> c_int;
type HtoD = unsafe extern "C" fn(DevPtr, *const c_void, usize) -> c_int;
type HtoDAsync = unsafe extern "C" fn(DevPtr, *const c_void, usize, Handle) -> c_int;
type DtoH = unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> c_int;
type DtoHAsync = unsafe extern "C" fn(*mut c_void, DevPtr, usize, Handle) -> c_int;
type SetD8 = unsafe extern "C" fn(DevPtr, u8, usize) -> c_int;
type SetD8Async = unsafe extern "C" fn(DevPtr, u8, usize, Handle) -> c_int;
type SetD32 = unsafe extern "C" fn(DevPtr, c_uint, usize) -> c_int;
type SetD32Async = unsafe extern "C" fn(DevPtr, c_uint, usize, Handle) -> c_int;
type WaitEvent = unsafe extern "C" fn(Handle, Handle, c_uint) -> c_int;

/// The function `name` of `lib`, as `F`.
///
/// # Safety
///
/// `F` must be the signature of `name` in cuda.h.
unsafe fn f<F: std::marker::Copy>(lib: &Lib, name: &str) -> F {
    // SAFETY: as the caller vouches.
    unsafe { lib.function(name) }
}

#[test]
fn copies_and_sets_check_their_ranges_and_move_nothing() {
    if !in_fresh_process("copies_and_sets_check_their_ranges_and_move_nothing", &[]) {
        return;
    }
    let lib = Lib::open("libcuda.so.1");
    let host = vec![0u8; 2 * MIB as usize];
    let src = host.as_ptr().cast::<c_void>();
    let mut sink = vec![0u8; 2 * MIB as usize];
    let dst = sink.as_mut_ptr().cast::<c_void>();
    let host_addr = src as DevPtr;
    let n = MIB as usize;

    // SAFETY: every transmute names an export with the signature of cuda.h;
    // every pointer passed is valid for the call or deliberately NULL, and
    // the double never dereferences device addresses.
    unsafe {
        let init: unsafe extern "C" fn(c_uint) -> c_int = f(&lib, "cuInit");
        let retain: unsafe extern "C" fn(*mut Handle, c_int) -> c_int =
            f(&lib, "cuDevicePrimaryCtxRetain");
        let set_current: unsafe extern "C" fn(Handle) -> c_int = f(&lib, "cuCtxSetCurrent");
        let alloc: unsafe extern "C" fn(*mut DevPtr, usize) -> c_int = f(&lib, "cuMemAlloc_v2");
        let free: unsafe extern "C" fn(DevPtr) -> c_int = f(&lib, "cuMemFree_v2");
        let host_alloc: unsafe extern "C" fn(*mut *mut c_void, usize, c_uint) -> c_int =
            f(&lib, "cuMemHostAlloc");
        let stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int =
            f(&lib, "cuStreamCreate");
        let event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int =
            f(&lib, "cuEventCreate");
        let event_record_ptsz: unsafe extern "C" fn(Handle, Handle) -> c_int =
            f(&lib, "cuEventRecord_ptsz");
        let htod: HtoD = f(&lib, "cuMemcpyHtoD_v2");

        assert_eq!(htod(0, src, 16), CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(init(0), CUDA_SUCCESS);
        assert_eq!(
            htod(0, src, 16),
            CUDA_ERROR_INVALID_CONTEXT,
            "no current context"
        );
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(set_current(ctx), CUDA_SUCCESS);
        let mut d: DevPtr = 0;
        assert_eq!(alloc(&mut d, n), CUDA_SUCCESS);
        let mut stream = std::ptr::null_mut();
        assert_eq!(stream_create(&mut stream, 0), CUDA_SUCCESS);
        let bogus = 0x1234 as Handle;
        let streams = [
            (std::ptr::null_mut(), CUDA_SUCCESS),
            (CU_STREAM_PER_THREAD, CUDA_SUCCESS),
            (stream, CUDA_SUCCESS),
            (bogus, CUDA_ERROR_INVALID_HANDLE),
        ];

        // Host to device, then device to host: in range, past the end, a
        // NULL host pointer, an address that is no allocation; zero bytes
        // pass unchecked.
        let half = n / 2;
        for name in ["cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds"] {
            let copy: HtoD = f(&lib, name);
            assert_eq!(copy(d, src, n), CUDA_SUCCESS, "{name}");
            assert_eq!(
                copy(d + half as u64, src, half + 1),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
            assert_eq!(
                copy(d, std::ptr::null(), 16),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
            assert_eq!(
                copy(0xdead_0000, src, 16),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
            assert_eq!(copy(0, std::ptr::null(), 0), CUDA_SUCCESS, "{name}");
        }
        for name in ["cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds"] {
            let copy: DtoH = f(&lib, name);
            assert_eq!(copy(dst, d + 512, n - 512), CUDA_SUCCESS, "{name}");
            assert_eq!(copy(dst, d + 512, n), CUDA_ERROR_INVALID_VALUE, "{name}");
            assert_eq!(
                copy(std::ptr::null_mut(), d, 16),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
        }
        for name in [
            "cuMemcpyDtoD_v2",
            "cuMemcpyDtoD_v2_ptds",
            "cuMemcpy",
            "cuMemcpy_ptds",
        ] {
            let copy: Copy = f(&lib, name);
            assert_eq!(copy(d, d + half as u64, half), CUDA_SUCCESS, "{name}");
            assert_eq!(
                copy(d, d + half as u64, half + 1),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
        }
        // Unified addressing: either side may be host memory.
        for name in ["cuMemcpy", "cuMemcpy_ptds"] {
            let copy: Copy = f(&lib, name);
            assert_eq!(copy(d, host_addr, n), CUDA_SUCCESS, "{name}");
            assert_eq!(copy(dst as DevPtr, host_addr, n), CUDA_SUCCESS, "{name}");
            assert_eq!(copy(0, host_addr, 16), CUDA_ERROR_INVALID_VALUE, "{name}");
        }
        for name in ["cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz"] {
            let copy: HtoDAsync = f(&lib, name);
            for (s, rc) in streams {
                assert_eq!(copy(d, src, n, s), rc, "{name} {s:?}");
            }
            assert_eq!(
                copy(d, src, n + 1, stream),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
        }
        for name in ["cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz"] {
            let copy: DtoHAsync = f(&lib, name);
            for (s, rc) in streams {
                assert_eq!(copy(dst, d, n, s), rc, "{name} {s:?}");
            }
            assert_eq!(
                copy(std::ptr::null_mut(), d, 8, stream),
                CUDA_ERROR_INVALID_VALUE
            );
        }
        for name in [
            "cuMemcpyDtoDAsync_v2",
            "cuMemcpyDtoDAsync_v2_ptsz",
            "cuMemcpyAsync",
            "cuMemcpyAsync_ptsz",
        ] {
            let copy: CopyAsync = f(&lib, name);
            for (s, rc) in streams {
                assert_eq!(copy(d, d + 8, 8, s), rc, "{name} {s:?}");
            }
            assert_eq!(
                copy(d, d + 8, n, stream),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
        }

        // Sets: N elements of 1 or 4 bytes; a count whose bytes overflow.
        for name in ["cuMemsetD8_v2", "cuMemsetD8_v2_ptds"] {
            let set: SetD8 = f(&lib, name);
            assert_eq!(set(d, 7, n), CUDA_SUCCESS, "{name}");
            assert_eq!(set(d, 7, n + 1), CUDA_ERROR_INVALID_VALUE, "{name}");
        }
        for name in ["cuMemsetD32_v2", "cuMemsetD32_v2_ptds"] {
            let set: SetD32 = f(&lib, name);
            assert_eq!(set(d, 7, n / 4), CUDA_SUCCESS, "{name}");
            assert_eq!(set(d, 7, n / 4 + 1), CUDA_ERROR_INVALID_VALUE, "{name}");
            assert_eq!(
                set(d, 7, usize::MAX / 2),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
        }
        for name in ["cuMemsetD8Async", "cuMemsetD8Async_ptsz"] {
            let set: SetD8Async = f(&lib, name);
            for (s, rc) in streams {
                assert_eq!(set(d, 7, n, s), rc, "{name} {s:?}");
            }
            assert_eq!(set(d, 7, n + 1, stream), CUDA_ERROR_INVALID_VALUE, "{name}");
        }
        for name in ["cuMemsetD32Async", "cuMemsetD32Async_ptsz"] {
            let set: SetD32Async = f(&lib, name);
            for (s, rc) in streams {
                assert_eq!(set(d, 7, n / 4, s), rc, "{name} {s:?}");
            }
            assert_eq!(
                set(d, 7, n / 4 + 1, stream),
                CUDA_ERROR_INVALID_VALUE,
                "{name}"
            );
        }

        // Mapped pinned host memory is a device range too.
        let mut pinned = std::ptr::null_mut();
        assert_eq!(
            host_alloc(&mut pinned, n, CU_MEMHOSTALLOC_DEVICEMAP),
            CUDA_SUCCESS
        );
        assert_eq!(htod(pinned as DevPtr, src, n), CUDA_SUCCESS);
        assert_eq!(htod(pinned as DevPtr, src, n + 1), CUDA_ERROR_INVALID_VALUE);

        // A freed allocation is no range any more.
        assert_eq!(free(d), CUDA_SUCCESS);
        assert_eq!(htod(d, src, 16), CUDA_ERROR_INVALID_VALUE);

        // Stream waits check the stream, the event and the flags.
        let mut event = std::ptr::null_mut();
        assert_eq!(event_create(&mut event, 0), CUDA_SUCCESS);
        assert_eq!(event_record_ptsz(event, std::ptr::null_mut()), CUDA_SUCCESS);
        for name in ["cuStreamWaitEvent", "cuStreamWaitEvent_ptsz"] {
            let wait: WaitEvent = f(&lib, name);
            for (s, rc) in streams {
                assert_eq!(wait(s, event, 0), rc, "{name} {s:?}");
            }
            assert_eq!(wait(stream, event, CU_EVENT_WAIT_EXTERNAL), CUDA_SUCCESS);
            assert_eq!(wait(stream, event, 2), CUDA_ERROR_INVALID_VALUE, "{name}");
            assert_eq!(wait(stream, bogus, 0), CUDA_ERROR_INVALID_HANDLE, "{name}");
        }
    }
}

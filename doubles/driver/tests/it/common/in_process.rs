//! The double's libraries opened in this test process: [`Lib`] for reading
//! entry points, [`Driver`] for calling the ones the clock tests use.

use std::ffi::{CString, c_char, c_int, c_uint, c_void};

use gpushare_examples::double_dir;

use super::CUDA_SUCCESS;

/// One of the double's libraries, opened in this process and never closed.
pub(crate) struct Lib(*mut c_void);

impl Lib {
    pub(crate) fn open(file: &str) -> Lib {
        let path = CString::new(double_dir().join(file).to_str().unwrap()).unwrap();
        // SAFETY: path is a valid C string; the double's constructors are trivial.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {file} failed");
        Lib(handle)
    }

    pub(crate) fn sym(&self, name: &str) -> *const u8 {
        let c_name = CString::new(name).unwrap();
        // SAFETY: self.0 is a live handle and c_name a valid C string.
        let address = unsafe { libc::dlsym(self.0, c_name.as_ptr()) };
        assert!(!address.is_null(), "{name} is not exported");
        address.cast()
    }

    /// The function `name`, as the function pointer type `F`.
    ///
    /// # Safety
    ///
    /// `F` must be the signature of `name` (in cuda.h, nvml.h or
    /// double_common.h).
    pub(crate) unsafe fn function<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller vouches for the signature; fn_from checks the size.
        unsafe { fn_from(self.sym(name).cast_mut().cast()) }
    }

    /// The first `len` bytes of the function `name`.
    pub(crate) fn code(&self, name: &str, len: usize) -> &'static [u8] {
        // SAFETY: code of a loaded library that is never unloaded; every stub
        // is longer than the lengths read here, and text is readable.
        unsafe { std::slice::from_raw_parts(self.sym(name), len) }
    }
}

pub(crate) const CUDA_ERROR_INVALID_VALUE: c_int = 1;
pub(crate) const CUDA_ERROR_INVALID_HANDLE: c_int = 400;
pub(crate) const CUDA_ERROR_ILLEGAL_STATE: c_int = 401;
pub(crate) const CUDA_ERROR_NOT_READY: c_int = 600;
pub(crate) const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: c_int = 900;
pub(crate) const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: c_int = 901;
pub(crate) const CU_STREAM_PER_THREAD: Handle = 2 as Handle;
pub(crate) const CU_EVENT_DISABLE_TIMING: c_uint = 2;
pub(crate) const CU_STREAM_CAPTURE_STATUS_NONE: c_int = 0;
pub(crate) const CU_STREAM_CAPTURE_STATUS_ACTIVE: c_int = 1;
pub(crate) const CU_STREAM_CAPTURE_STATUS_INVALIDATED: c_int = 2;
pub(crate) const CU_STREAM_CAPTURE_MODE_GLOBAL: c_int = 0;
pub(crate) const CU_STREAM_CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
pub(crate) const CU_STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
pub(crate) const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;

pub(crate) type Handle = *mut c_void;

/// `CLOCK_MONOTONIC` in ns, the double's clock.
pub(crate) fn now() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    assert_eq!(rc, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

// ---------------------------------------------------------------- in process

/// `CUlaunchConfig` of cuda.h.
#[repr(C)]
pub(crate) struct LaunchConfig {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: Handle,
    pub attrs: *mut c_void,
    pub num_attrs: c_uint,
}

pub(crate) type Launch = unsafe extern "C" fn(
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
pub(crate) struct Driver {
    pub init: unsafe extern "C" fn(c_uint) -> c_int,
    pub retain: unsafe extern "C" fn(*mut Handle, c_int) -> c_int,
    pub set_current: unsafe extern "C" fn(Handle) -> c_int,
    pub ctx_synchronize: unsafe extern "C" fn() -> c_int,
    pub attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int,
    pub module_load: unsafe extern "C" fn(*mut Handle, *const c_void) -> c_int,
    pub get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> c_int,
    pub launch: Launch,
    pub launch_ptsz: Launch,
    pub launch_ex: unsafe extern "C" fn(
        *const LaunchConfig,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> c_int,
    pub event_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int,
    pub event_record: unsafe extern "C" fn(Handle, Handle) -> c_int,
    pub event_query: unsafe extern "C" fn(Handle) -> c_int,
    pub event_synchronize: unsafe extern "C" fn(Handle) -> c_int,
    pub elapsed: unsafe extern "C" fn(*mut f32, Handle, Handle) -> c_int,
    pub elapsed_v1: unsafe extern "C" fn(*mut f32, Handle, Handle) -> c_int,
    pub event_destroy: unsafe extern "C" fn(Handle) -> c_int,
    pub stream_create: unsafe extern "C" fn(*mut Handle, c_uint) -> c_int,
    pub stream_destroy: unsafe extern "C" fn(Handle) -> c_int,
    pub stream_synchronize: unsafe extern "C" fn(Handle) -> c_int,
    pub stream_query: unsafe extern "C" fn(Handle) -> c_int,
    pub stream_get_ctx: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    pub stream_get_ctx_ptsz: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    pub get_current: unsafe extern "C" fn(*mut Handle) -> c_int,
    pub begin_capture: unsafe extern "C" fn(Handle, c_int) -> c_int,
    pub begin_capture_ptsz: unsafe extern "C" fn(Handle, c_int) -> c_int,
    pub end_capture: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    pub end_capture_ptsz: unsafe extern "C" fn(Handle, *mut Handle) -> c_int,
    pub is_capturing: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    pub is_capturing_ptsz: unsafe extern "C" fn(Handle, *mut c_int) -> c_int,
    pub exchange_mode: unsafe extern "C" fn(*mut c_int) -> c_int,
    pub instantiate: unsafe extern "C" fn(*mut Handle, Handle, u64) -> c_int,
    pub graph_launch: unsafe extern "C" fn(Handle, Handle) -> c_int,
    pub graph_launch_ptsz: unsafe extern "C" fn(Handle, Handle) -> c_int,
    pub exec_destroy: unsafe extern "C" fn(Handle) -> c_int,
    pub graph_destroy: unsafe extern "C" fn(Handle) -> c_int,
    pub busy: unsafe extern "C" fn(c_int, u64, u64) -> u64,
}

impl Driver {
    /// Opens the double's libcuda in this process (never closed).
    pub(crate) fn open() -> Driver {
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
    pub(crate) fn start(&self, device: c_int) {
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the arguments are plain values.
        unsafe {
            assert_eq!((self.init)(0), CUDA_SUCCESS);
            assert_eq!((self.retain)(&mut ctx, device), CUDA_SUCCESS);
            assert_eq!((self.set_current)(ctx), CUDA_SUCCESS);
        }
    }

    /// A kernel handle from a freshly loaded module.
    pub(crate) fn function(&self) -> Handle {
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
    pub(crate) fn run(&self, launch: Launch, f: Handle, ns: u64, stream: Handle) -> c_int {
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

    pub(crate) fn busy(&self, device: c_int, from: u64, to: u64) -> u64 {
        // SAFETY: plain values.
        unsafe { (self.busy)(device, from, to) }
    }

    pub(crate) fn event(&self, flags: c_uint) -> Handle {
        let mut event = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        let rc = unsafe { (self.event_create)(&mut event, flags) };
        assert_eq!(rc, CUDA_SUCCESS);
        event
    }

    /// cuEventElapsedTime_v2, and the same from the v1 export.
    pub(crate) fn elapsed(&self, start: Handle, end: Handle) -> (c_int, f32) {
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

    pub(crate) fn capture_status(&self, stream: Handle, ptsz: bool) -> c_int {
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

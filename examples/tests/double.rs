//! The driver double: its entry points have the shapes measured on the H100,
//! `cuGetProcAddress` hands out the exported addresses, and the probe programs
//! print what the fake GPU should report, whichever way they reach the driver.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::collections::BTreeSet;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

mod common;

use common::{in_fresh_process, lines, run};
use gpushare_examples::{
    BUSY_SYMBOL, CU_GUARD_IMM, CU_PROLOGUE, CU_PROLOGUE_LEN, DEFAULT_CONTEXT_BYTES,
    NVML_ENTRY_POINTS, NVML_INIT_V2_PREFIX, NVML_MEMINFO_PROLOGUE, command, cu_entry_points,
    double_dir, program, uuid,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const CTX: u64 = DEFAULT_CONTEXT_BYTES;

const CUDA_SUCCESS: c_int = 0;
const CUDA_ERROR_NOT_FOUND: c_int = 500;
const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;

/// One of the double's libraries, opened in this process and never closed.
struct Lib(*mut c_void);

impl Lib {
    fn open(file: &str) -> Lib {
        let path = CString::new(double_dir().join(file).to_str().unwrap()).unwrap();
        // SAFETY: path is a valid C string; the double's constructors are trivial.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(!handle.is_null(), "dlopen {file} failed");
        Lib(handle)
    }

    fn sym(&self, name: &str) -> *const u8 {
        let c_name = CString::new(name).unwrap();
        // SAFETY: self.0 is a live handle and c_name a valid C string.
        let address = unsafe { libc::dlsym(self.0, c_name.as_ptr()) };
        assert!(!address.is_null(), "{name} is not exported");
        address.cast()
    }

    /// The first `len` bytes of the function `name`.
    fn code(&self, name: &str, len: usize) -> &'static [u8] {
        // SAFETY: code of a loaded library that is never unloaded; every stub
        // is longer than the lengths read here, and text is readable.
        unsafe { std::slice::from_raw_parts(self.sym(name), len) }
    }
}

/// The base address of the object that maps `address`.
fn object_of(address: *const u8) -> usize {
    // SAFETY: dladdr only reads the loader's tables; info is plain data.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let found = unsafe { libc::dladdr(address.cast(), &mut info) };
    assert_ne!(found, 0, "{address:?} is in no loaded object");
    info.dli_fbase as usize
}

fn le_i32(bytes: &[u8]) -> i32 {
    i32::from_le_bytes(bytes.try_into().unwrap())
}

#[test]
fn every_cu_entry_point_starts_with_the_h100_prologue() {
    let lib = Lib::open("libcuda.so.1");
    let names: Vec<&str> = cu_entry_points().collect();
    assert_eq!(names.len(), 89, "{names:?}");
    for name in names {
        let code = lib.code(name, CU_PROLOGUE_LEN + 8);
        assert_eq!(code[..12], CU_PROLOGUE, "{name}");
        let imm = u32::from_le_bytes(code[16..20].try_into().unwrap());
        assert_eq!(imm, CU_GUARD_IMM, "{name}");
        assert!(
            i8::try_from(imm as i32).is_err(),
            "{name}: imm32 must not fit in imm8"
        );
        // The cmp reads a data word of the library itself, RIP-relative.
        let after_cmp = lib.sym(name).wrapping_add(CU_PROLOGUE_LEN);
        let word = after_cmp.wrapping_offset(le_i32(&code[12..16]) as isize);
        assert_eq!(object_of(word), object_of(lib.sym(name)), "{name}");
        // SAFETY: word lies in the library's mapped data, 4-byte aligned.
        assert_eq!(unsafe { word.cast::<u32>().read() }, CU_GUARD_IMM, "{name}");
        // add rsp,8; pop r12; pop rbp; jmp rel32 to the implementation.
        assert_eq!(
            code[20..28],
            [0x48, 0x83, 0xc4, 0x08, 0x41, 0x5c, 0x5d, 0xe9],
            "{name}"
        );
    }
}

#[test]
fn nvml_entry_points_have_the_h100_shapes() {
    let lib = Lib::open("libnvidia-ml.so.1");
    for name in ["nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"] {
        assert_eq!(lib.code(name, 14), NVML_MEMINFO_PROLOGUE, "{name}");
    }

    let init = lib.sym("nvmlInit_v2");
    let code = lib.code("nvmlInit_v2", 7);
    assert_eq!(code[..3], NVML_INIT_V2_PREFIX);
    let target = init
        .wrapping_add(7)
        .wrapping_offset(le_i32(&code[3..7]) as isize);
    assert_eq!(target, lib.sym("nvmlInitWithFlags"));
    assert_eq!(
        init.wrapping_add(7),
        lib.sym("nvmlShutdown"),
        "no padding after nvmlInit_v2"
    );

    for &name in NVML_ENTRY_POINTS {
        if !matches!(
            name,
            "nvmlInit_v2" | "nvmlDeviceGetMemoryInfo" | "nvmlDeviceGetMemoryInfo_v2"
        ) {
            assert_eq!(lib.code(name, 12), CU_PROLOGUE, "{name}");
        }
    }
}

/// The dynamic symbols `nm` sees defined in `file`.
fn exports(file: &str) -> BTreeSet<String> {
    let output = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(double_dir().join(file))
        .output()
        .expect("run nm");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .filter_map(|line| line.split_whitespace().nth(2).map(str::to_owned))
        .collect()
}

#[test]
fn the_libraries_export_the_api_and_nothing_else() {
    let mut cuda: BTreeSet<String> = cu_entry_points().map(str::to_owned).collect();
    cuda.insert("gpushare_double_state".to_owned());
    cuda.insert(BUSY_SYMBOL.to_owned());
    assert_eq!(exports("libcuda.so.1"), cuda);
    let nvml: BTreeSet<String> = NVML_ENTRY_POINTS.iter().map(|&n| n.to_owned()).collect();
    assert_eq!(exports("libnvidia-ml.so.1"), nvml);
}

type GetProcAddressV2 =
    unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64, *mut c_int) -> c_int;
type GetProcAddress = unsafe extern "C" fn(*const c_char, *mut *mut c_void, c_int, u64) -> c_int;

#[test]
fn get_proc_address_hands_out_the_exported_addresses() {
    let lib = Lib::open("libcuda.so.1");
    // SAFETY: the exported cuGetProcAddress_v2 has this signature (cuda.h).
    let getproc: GetProcAddressV2 = unsafe { std::mem::transmute(lib.sym("cuGetProcAddress_v2")) };
    let lookup = |symbol: &str, version: c_int, flags: u64| {
        let symbol = CString::new(symbol).unwrap();
        let mut pfn = std::ptr::null_mut();
        let mut status = -1;
        // SAFETY: valid C string and out-pointers.
        let rc = unsafe { getproc(symbol.as_ptr(), &mut pfn, version, flags, &mut status) };
        (rc, pfn.cast_const().cast::<u8>(), status)
    };

    for (base, version, flags, exported) in [
        ("cuMemAlloc", 13000, 0, "cuMemAlloc_v2"),
        ("cuMemFree", 13000, 0, "cuMemFree_v2"),
        ("cuMemGetInfo", 13000, 0, "cuMemGetInfo_v2"),
        ("cuMemGetInfo", 3010, 0, "cuMemGetInfo"),
        ("cuDeviceTotalMem", 13000, 0, "cuDeviceTotalMem_v2"),
        ("cuDeviceTotalMem", 3010, 0, "cuDeviceTotalMem"),
        ("cuCtxCreate", 13000, 0, "cuCtxCreate_v2"),
        ("cuMemAllocPitch", 13000, 0, "cuMemAllocPitch_v2"),
        ("cuArrayCreate", 13000, 0, "cuArrayCreate_v2"),
        ("cuArray3DCreate", 13000, 0, "cuArray3DCreate_v2"),
        ("cuGetProcAddress", 13000, 0, "cuGetProcAddress_v2"),
        ("cuMemAllocAsync", 13000, 0, "cuMemAllocAsync"),
        ("cuMemAllocAsync", 13000, 2, "cuMemAllocAsync_ptsz"),
        (
            "cuMemAllocFromPoolAsync",
            13000,
            0,
            "cuMemAllocFromPoolAsync",
        ),
        (
            "cuMemAllocFromPoolAsync",
            13000,
            2,
            "cuMemAllocFromPoolAsync_ptsz",
        ),
        ("cuMemFreeAsync", 13000, 0, "cuMemFreeAsync"),
        ("cuMemFreeAsync", 13000, 2, "cuMemFreeAsync_ptsz"),
        ("cuMemAlloc", 13000, 2, "cuMemAlloc_v2"),
        ("cuInit", 13000, 0, "cuInit"),
        ("cuMemCreate", 13000, 0, "cuMemCreate"),
        ("cuMipmappedArrayCreate", 13000, 0, "cuMipmappedArrayCreate"),
        // Launches, streams, events and graphs: the per-thread flag picks
        // the _ptsz export where the driver has one.
        ("cuLaunchKernel", 13000, 0, "cuLaunchKernel"),
        ("cuLaunchKernel", 13000, 2, "cuLaunchKernel_ptsz"),
        ("cuLaunchKernelEx", 13000, 0, "cuLaunchKernelEx"),
        ("cuLaunchKernelEx", 13000, 2, "cuLaunchKernelEx_ptsz"),
        (
            "cuLaunchCooperativeKernel",
            13000,
            0,
            "cuLaunchCooperativeKernel",
        ),
        (
            "cuLaunchCooperativeKernel",
            13000,
            2,
            "cuLaunchCooperativeKernel_ptsz",
        ),
        ("cuLaunch", 13000, 2, "cuLaunch"),
        ("cuLaunchGrid", 13000, 0, "cuLaunchGrid"),
        ("cuLaunchGridAsync", 13000, 2, "cuLaunchGridAsync"),
        ("cuGraphLaunch", 13000, 0, "cuGraphLaunch"),
        ("cuGraphLaunch", 13000, 2, "cuGraphLaunch_ptsz"),
        (
            "cuGraphInstantiate",
            13000,
            0,
            "cuGraphInstantiateWithFlags",
        ),
        (
            "cuGraphInstantiateWithFlags",
            13000,
            0,
            "cuGraphInstantiateWithFlags",
        ),
        ("cuStreamBeginCapture", 13000, 0, "cuStreamBeginCapture_v2"),
        (
            "cuStreamBeginCapture",
            13000,
            2,
            "cuStreamBeginCapture_v2_ptsz",
        ),
        ("cuStreamEndCapture", 13000, 2, "cuStreamEndCapture_ptsz"),
        ("cuStreamIsCapturing", 13000, 2, "cuStreamIsCapturing_ptsz"),
        (
            "cuThreadExchangeStreamCaptureMode",
            13000,
            0,
            "cuThreadExchangeStreamCaptureMode",
        ),
        ("cuStreamSynchronize", 13000, 0, "cuStreamSynchronize"),
        ("cuStreamSynchronize", 13000, 2, "cuStreamSynchronize_ptsz"),
        ("cuStreamQuery", 13000, 2, "cuStreamQuery_ptsz"),
        ("cuStreamCreate", 13000, 2, "cuStreamCreate"),
        ("cuStreamGetCtx", 13000, 0, "cuStreamGetCtx"),
        ("cuStreamGetCtx", 13000, 2, "cuStreamGetCtx_ptsz"),
        ("cuStreamDestroy", 13000, 0, "cuStreamDestroy_v2"),
        ("cuEventCreate", 13000, 0, "cuEventCreate"),
        ("cuEventRecord", 13000, 0, "cuEventRecord"),
        ("cuEventRecord", 13000, 2, "cuEventRecord_ptsz"),
        ("cuEventQuery", 13000, 2, "cuEventQuery"),
        ("cuEventSynchronize", 13000, 0, "cuEventSynchronize"),
        ("cuEventElapsedTime", 13000, 0, "cuEventElapsedTime_v2"),
        ("cuEventElapsedTime", 12000, 0, "cuEventElapsedTime"),
        ("cuEventDestroy", 13000, 0, "cuEventDestroy_v2"),
        ("cuModuleLoadData", 13000, 0, "cuModuleLoadData"),
        ("cuModuleGetFunction", 13000, 0, "cuModuleGetFunction"),
        ("cuModuleUnload", 13000, 0, "cuModuleUnload"),
        ("cuDeviceGetAttribute", 13000, 0, "cuDeviceGetAttribute"),
    ] {
        let (rc, pfn, status) = lookup(base, version, flags);
        assert_eq!(
            (rc, status),
            (CUDA_SUCCESS, CU_GET_PROC_ADDRESS_SUCCESS),
            "{base}"
        );
        assert_eq!(pfn, lib.sym(exported), "{base} v{version} flags {flags}");
    }

    for unknown in [
        "cuLaunchHostFunc",
        "cuMemAlloc_v2",
        "cuMemAllocAsync_ptsz",
        "cuLaunchKernel_ptsz",
        "cuStreamBeginCapture_v2",
        "cuEventDestroy_v2",
        "gpushare_double_state",
        "gpushare_double_busy_ns",
        "cuserid",
    ] {
        let (rc, pfn, status) = lookup(unknown, 13000, 0);
        assert_eq!(
            (rc, pfn, status),
            (
                CUDA_ERROR_NOT_FOUND,
                std::ptr::null(),
                CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
            ),
            "{unknown}"
        );
    }

    // SAFETY: the exported cuGetProcAddress (v1) has this signature.
    let getproc_v1: GetProcAddress = unsafe { std::mem::transmute(lib.sym("cuGetProcAddress")) };
    let mut pfn = std::ptr::null_mut();
    // SAFETY: valid C string and out-pointer.
    let rc = unsafe { getproc_v1(c"cuMemAllocAsync".as_ptr(), &mut pfn, 13000, 2) };
    assert_eq!(rc, CUDA_SUCCESS);
    assert_eq!(pfn.cast_const().cast(), lib.sym("cuMemAllocAsync_ptsz"));
}

#[test]
fn devices_have_the_documented_identity() {
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type DeviceString = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
    type DeviceUuid = unsafe extern "C" fn(*mut [u8; 16], c_int) -> c_int;
    type ErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
    type NvmlInit = unsafe extern "C" fn() -> c_int;
    type NvmlByIndex = unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int;
    type NvmlByString = unsafe extern "C" fn(*const c_char, *mut *mut c_void) -> c_int;
    type NvmlUuid = unsafe extern "C" fn(*mut c_void, *mut c_char, c_uint) -> c_int;
    type NvmlErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

    let cuda = Lib::open("libcuda.so.1");
    let nvml = Lib::open("libnvidia-ml.so.1");
    // SAFETY (all transmutes and calls below): the signatures are those of
    // cuda.h / nvml.h, and every pointer passed is valid for the call.
    unsafe {
        let cu_init: Init = std::mem::transmute(cuda.sym("cuInit"));
        let bus_id: DeviceString = std::mem::transmute(cuda.sym("cuDeviceGetPCIBusId"));
        let cu_uuid: DeviceUuid = std::mem::transmute(cuda.sym("cuDeviceGetUuid_v2"));
        let error_name: ErrorName = std::mem::transmute(cuda.sym("cuGetErrorName"));
        assert_eq!(cu_init(0), CUDA_SUCCESS);
        let mut bytes = [0u8; 16];
        assert_eq!(cu_uuid(&mut bytes, 0), CUDA_SUCCESS);
        assert_eq!(
            bytes,
            [
                0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee,
                0xff, 0
            ]
        );
        let mut text = [0 as c_char; 64];
        assert_eq!(bus_id(text.as_mut_ptr(), 64, 0), CUDA_SUCCESS);
        assert_eq!(
            CStr::from_ptr(text.as_ptr()).to_str().unwrap(),
            "0000:18:00.0"
        );
        let mut name = std::ptr::null();
        assert_eq!(error_name(2, &mut name), CUDA_SUCCESS);
        assert_eq!(
            CStr::from_ptr(name).to_str().unwrap(),
            "CUDA_ERROR_OUT_OF_MEMORY"
        );

        let init: NvmlInit = std::mem::transmute(nvml.sym("nvmlInit_v2"));
        let by_index: NvmlByIndex = std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByIndex_v2"));
        let by_uuid: NvmlByString = std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByUUID"));
        let by_pci: NvmlByString =
            std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByPciBusId_v2"));
        let get_uuid: NvmlUuid = std::mem::transmute(nvml.sym("nvmlDeviceGetUUID"));
        let error_string: NvmlErrorString = std::mem::transmute(nvml.sym("nvmlErrorString"));
        assert_eq!(init(), 0);
        let mut handle = std::ptr::null_mut();
        assert_eq!(by_index(0, &mut handle), 0);
        assert_eq!(get_uuid(handle, text.as_mut_ptr(), 64), 0);
        assert_eq!(CStr::from_ptr(text.as_ptr()).to_str().unwrap(), uuid(0));
        assert_eq!(uuid(0), "GPU-11223344-5566-7788-99aa-bbccddeeff00");
        assert_eq!(get_uuid(handle, text.as_mut_ptr(), 40), 7, "needs 41 bytes");
        let mut other = std::ptr::null_mut();
        let wanted = CString::new(uuid(0)).unwrap();
        assert_eq!(by_uuid(wanted.as_ptr(), &mut other), 0);
        assert_eq!(other, handle);
        assert_eq!(by_uuid(c"GPU-nope".as_ptr(), &mut other), 6);
        other = std::ptr::null_mut();
        assert_eq!(by_pci(c"00000000:18:00.0".as_ptr(), &mut other), 0);
        assert_eq!(other, handle);
        assert_eq!(
            CStr::from_ptr(error_string(7)).to_str().unwrap(),
            "Insufficient Size"
        );
    }
}

#[repr(C)]
#[derive(Debug, Default, PartialEq)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
#[derive(Debug, Default)]
struct NvmlProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// Set in the copy of this test binary that runs a test in a fresh process.

#[test]
fn a_process_meets_nvml_first_then_cuda_before_and_after_init() {
    type Status = unsafe extern "C" fn() -> c_int;
    type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Version = unsafe extern "C" fn(*mut c_int) -> c_int;
    type Init = unsafe extern "C" fn(c_uint) -> c_int;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
    type MemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
    type SetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
    type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
    type Release = unsafe extern "C" fn(c_int) -> c_int;
    type AddressRange = unsafe extern "C" fn(*mut u64, *mut usize, u64) -> c_int;
    type NvmlByIndex = unsafe extern "C" fn(c_uint, *mut *mut c_void) -> c_int;
    type NvmlMemInfo = unsafe extern "C" fn(*mut c_void, *mut NvmlMemory) -> c_int;
    type NvmlProcs = unsafe extern "C" fn(*mut c_void, *mut c_uint, *mut NvmlProcessInfo) -> c_int;

    if !in_fresh_process(
        "a_process_meets_nvml_first_then_cuda_before_and_after_init",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
    ) {
        return;
    }
    let total = 4 * GIB;
    // SAFETY (all transmutes and calls below): the signatures are those of
    // cuda.h / nvml.h, and every pointer passed is valid for the call.
    unsafe {
        // NVML alone: the device is there, and nothing is used.
        let nvml = Lib::open("libnvidia-ml.so.1");
        let nvml_init: Status = std::mem::transmute(nvml.sym("nvmlInit_v2"));
        let by_index: NvmlByIndex = std::mem::transmute(nvml.sym("nvmlDeviceGetHandleByIndex_v2"));
        let nvml_mem: NvmlMemInfo = std::mem::transmute(nvml.sym("nvmlDeviceGetMemoryInfo"));
        let procs: NvmlProcs =
            std::mem::transmute(nvml.sym("nvmlDeviceGetComputeRunningProcesses_v3"));
        let memory = |handle| {
            let mut m = NvmlMemory::default();
            assert_eq!(nvml_mem(handle, &mut m), 0);
            m
        };
        let mut handle = std::ptr::null_mut();
        assert_eq!(by_index(0, &mut handle), 1, "NVML_ERROR_UNINITIALIZED");
        assert_eq!(nvml_init(), 0);
        assert_eq!(by_index(0, &mut handle), 0);
        assert_eq!(by_index(1, &mut handle), 2, "one device");
        let unused = NvmlMemory {
            total,
            free: total,
            used: 0,
        };
        assert_eq!(memory(handle), unused);
        let mut count: c_uint = 0;
        assert_eq!(procs(handle, &mut count, std::ptr::null_mut()), 0);
        assert_eq!(count, 0);

        // libcuda before cuInit: only the version calls work.
        let cuda = Lib::open("libcuda.so.1");
        let sym = |name| cuda.sym(name);
        let init: Init = std::mem::transmute(sym("cuInit"));
        let version: Version = std::mem::transmute(sym("cuDriverGetVersion"));
        let device_count: Count = std::mem::transmute(sym("cuDeviceGetCount"));
        let alloc: Alloc = std::mem::transmute(sym("cuMemAlloc_v2"));
        let mem_info: MemInfo = std::mem::transmute(sym("cuMemGetInfo_v2"));
        let set_current: SetCurrent = std::mem::transmute(sym("cuCtxSetCurrent"));
        let retain: Retain = std::mem::transmute(sym("cuDevicePrimaryCtxRetain"));
        let release: Release = std::mem::transmute(sym("cuDevicePrimaryCtxRelease_v2"));
        let range: AddressRange = std::mem::transmute(sym("cuMemGetAddressRange_v2"));
        let (mut n, mut ptr, mut free, mut size) = (0, 0u64, 0usize, 0usize);
        assert_eq!(version(&mut n), CUDA_SUCCESS);
        assert_eq!(n, 13000);
        assert_eq!(device_count(&mut n), 3);
        assert_eq!(alloc(&mut ptr, 1 << 20), 3);
        assert_eq!(mem_info(&mut free, &mut size), 3);
        assert_eq!(set_current(std::ptr::null_mut()), 3);

        // After cuInit, allocations need a context.
        assert_eq!(init(0), CUDA_SUCCESS);
        assert_eq!(device_count(&mut n), CUDA_SUCCESS);
        assert_eq!(n, 1);
        assert_eq!(alloc(&mut ptr, 1 << 20), 201, "CUDA_ERROR_INVALID_CONTEXT");
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), CUDA_SUCCESS);
        assert_eq!(set_current(ctx), CUDA_SUCCESS);
        // NVML now finds libcuda, loaded after it, and sees the context.
        assert_eq!(memory(handle).used, CTX);
        assert_eq!(alloc(&mut ptr, 1 << 20), CUDA_SUCCESS);
        assert_eq!(ptr % 512, 0);
        let mut base = 0u64;
        assert_eq!(range(&mut base, &mut size, ptr + 5), CUDA_SUCCESS);
        assert_eq!((base, size), (ptr, 1 << 20));
        assert_eq!(
            range(&mut base, &mut size, ptr + (1 << 20)),
            CUDA_ERROR_NOT_FOUND
        );
        assert_eq!(memory(handle).used, CTX + MIB);
        let mut info = [NvmlProcessInfo::default(), NvmlProcessInfo::default()];
        count = 0;
        assert_eq!(
            procs(handle, &mut count, info.as_mut_ptr()),
            7,
            "INSUFFICIENT_SIZE"
        );
        assert_eq!(count, 1);
        count = 2;
        assert_eq!(procs(handle, &mut count, info.as_mut_ptr()), 0);
        assert_eq!(count, 1);
        assert_eq!(info[0].pid, std::process::id());
        assert_eq!(info[0].used_gpu_memory, CTX + MIB);

        // Releasing the primary context frees what was allocated in it.
        assert_eq!(release(0), CUDA_SUCCESS);
        assert_eq!(memory(handle), unused);
        assert_eq!(release(0), 201);
        assert_eq!(alloc(&mut ptr, 1 << 20), 201);
    }
}

// ---------------------------------------------------------------- probes

/// The three ways a program reaches the driver.
const VARIANTS: &[(&str, &[&str])] = &[
    ("cudaprobe", &["--via", "dlsym"]),
    ("cudaprobe", &["--via", "getproc"]),
    ("cudaprobe_linked", &[]),
];

/// Runs `script` through every variant and checks the exact output.
fn expect_everywhere(script: &str, env: &[(&str, &str)], expected: &[String]) {
    for &(name, options) in VARIANTS {
        assert_eq!(
            lines(name, options, script, env),
            expected,
            "{name} {options:?}"
        );
    }
}

#[test]
fn probes_see_the_fake_gpu_the_same_way() {
    let total = 8 * GIB;
    let used = CTX + GIB + 2 * GIB + MIB + MIB;
    let expected = [
        "alloc mem 1g -> 0 0".to_owned(),
        format!("info 0 free={} total={total}", total - CTX - GIB),
        "alloc create 2g -> 0 1".to_owned(),
        "alloc array 1m -> 0 2".to_owned(),
        "alloc mipmap 1m -> 0 3".to_owned(),
        format!("nvml 0 free={} used={used} total={total}", total - used),
        format!("nvml_v2 0 free={} used={used} total={total}", total - used),
        format!("nvml_procs 0 count=1 used={used}"),
        "free 0 -> 0".to_owned(),
        "free 1 -> 0".to_owned(),
        "free 2 -> 0".to_owned(),
        "free 3 -> 0".to_owned(),
        format!("info 0 free={} total={total}", total - CTX),
        "fill 1g count=7 last=2".to_owned(),
        format!("info 0 free={} total={total}", total - CTX - 7 * GIB),
        "freeall 0".to_owned(),
        format!("nvml_procs 0 count=1 used={CTX}"),
    ];
    // The literal numbers, for whoever greps for them.
    assert_eq!(expected[1], "info 0 free=7201619968 total=8589934592");
    assert_eq!(
        expected[5],
        "nvml 0 free=5052039168 used=3537895424 total=8589934592"
    );
    expect_everywhere(
        "alloc mem 1g info alloc create 2g alloc array 1m alloc mipmap 1m nvml nvml_v2 \
         nvml_procs free 0 free 1 free 2 free 3 info fill 1g info freeall nvml_procs",
        &[("GPUSHARE_DOUBLE_TOTAL", "8g")],
        &expected,
    );
}

#[test]
fn every_allocation_api_charges_its_size_and_frees_it() {
    let total = 16 * GIB;
    let script = "alloc mem 4m alloc pitch 1000 alloc managed 4m alloc async 4m \
                  alloc async_ptsz 4m alloc pool 4m alloc pool_ptsz 4m alloc create 4m \
                  alloc array 4m alloc array3d 4m alloc mipmap 4m info \
                  free 0 free 1 free 2 free 3 free 4 free 5 free 6 free 7 free 8 free 9 free 10 \
                  info free 0 free 7 free 8 free 10";
    let apis = [
        ("mem", "4m"),
        ("pitch", "1000"),
        ("managed", "4m"),
        ("async", "4m"),
        ("async_ptsz", "4m"),
        ("pool", "4m"),
        ("pool_ptsz", "4m"),
        ("create", "4m"),
        ("array", "4m"),
        ("array3d", "4m"),
        ("mipmap", "4m"),
    ];
    let mut expected: Vec<String> = apis
        .iter()
        .enumerate()
        .map(|(id, (api, size))| format!("alloc {api} {size} -> 0 {id}"))
        .collect();
    // pitch 1000 is charged one 1024-byte row.
    let used = CTX + 10 * 4 * MIB + KIB;
    expected.push(format!("info 0 free={} total={total}", total - used));
    expected.extend((0..11).map(|id| format!("free {id} -> 0")));
    expected.push(format!("info 0 free={} total={total}", total - CTX));
    // Twice freed: an unknown pointer (1), an unknown array (400).
    expected.extend(
        [
            "free 0 -> 1",
            "free 7 -> 1",
            "free 8 -> 400",
            "free 10 -> 400",
        ]
        .map(String::from),
    );
    expect_everywhere(script, &[], &expected);
}

#[test]
fn allocations_that_do_not_fit_fail_and_take_nothing() {
    let total = GIB;
    let expected = [
        "alloc mem 1g -> 2 -".to_owned(),
        "alloc mem 0 -> 1 -".to_owned(),
        "alloc create 3m -> 1 -".to_owned(),
        format!("info 0 free={} total={total}", total - CTX),
        "alloc mem 724m -> 0 0".to_owned(),
        "alloc mem 1 -> 2 -".to_owned(),
        "alloc create 2m -> 2 -".to_owned(),
        format!("info 0 free=0 total={total}"),
        "free 0 -> 0".to_owned(),
        format!("info 0 free={} total={total}", total - CTX),
    ];
    expect_everywhere(
        "alloc mem 1g alloc mem 0 alloc create 3m info alloc mem 724m alloc mem 1 \
         alloc create 2m info free 0 info",
        &[("GPUSHARE_DOUBLE_TOTAL", "1g")],
        &expected,
    );
}

#[test]
fn total_memory_through_both_generations() {
    expect_everywhere(
        "totalmem totalmem_v1 info_v1",
        &[("GPUSHARE_DOUBLE_TOTAL", "8g")],
        &[
            "totalmem 0 8589934592".to_owned(),
            "totalmem_v1 0 4294967295".to_owned(),
            "info_v1 0 free=4294967295 total=4294967295".to_owned(),
        ],
    );
    expect_everywhere(
        "totalmem totalmem_v1 info_v1",
        &[("GPUSHARE_DOUBLE_TOTAL", "1g")],
        &[
            "totalmem 0 1073741824".to_owned(),
            "totalmem_v1 0 1073741824".to_owned(),
            format!("info_v1 0 free={} total=1073741824", GIB - CTX),
        ],
    );
}

#[test]
fn hammer_from_four_threads() {
    expect_everywhere(
        "hammer 4 2000 1m info",
        &[("GPUSHARE_DOUBLE_TOTAL", "8g")],
        &[
            "hammer ok=8000 oom=0 other=0".to_owned(),
            format!("info 0 free={} total={}", 8 * GIB - CTX, 8 * GIB),
        ],
    );

    // Room for two 1 MiB blocks among four threads: some allocations fail,
    // none wrongly, and everything comes back.
    let env = [
        ("GPUSHARE_DOUBLE_TOTAL", "2m"),
        ("GPUSHARE_DOUBLE_CONTEXT_BYTES", "0"),
    ];
    for &(name, options) in VARIANTS {
        let out = lines(name, options, "hammer 4 5000 1m info", &env);
        let counts: Vec<u64> = out[0]
            .strip_prefix("hammer ")
            .unwrap()
            .split(' ')
            .map(|kv| kv.split_once('=').unwrap().1.parse().unwrap())
            .collect();
        assert_eq!(counts[0] + counts[1], 20_000, "{out:?}");
        assert_eq!(counts[2], 0, "{out:?}");
        assert!(counts[0] > 0, "{out:?}");
        assert_eq!(out[1], "info 0 free=2097152 total=2097152");
    }
}

#[test]
fn devices_are_separate() {
    let env = [
        ("GPUSHARE_DOUBLE_DEVICES", "2"),
        ("GPUSHARE_DOUBLE_TOTAL", "4g"),
    ];
    let used = CTX + GIB;
    for &(name, options) in VARIANTS {
        let mut args = options.to_vec();
        args.extend(["--device", "1"]);
        assert_eq!(
            lines(
                name,
                &args,
                "alloc mem 1g alloc create 2m info nvml nvml_procs",
                &env
            ),
            [
                "alloc mem 1g -> 0 0".to_owned(),
                "alloc create 2m -> 0 1".to_owned(),
                format!("info 0 free={} total={}", 4 * GIB - used - 2 * MIB, 4 * GIB),
                format!(
                    "nvml 0 free={} used={} total={}",
                    4 * GIB - used - 2 * MIB,
                    used + 2 * MIB,
                    4 * GIB
                ),
                format!("nvml_procs 0 count=1 used={}", used + 2 * MIB),
            ],
            "{name} {options:?}"
        );
    }

    let output = run("cudaprobe", &["--device", "1"], "info", &[]);
    assert_eq!(output.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "cudaprobe: cuDeviceGet failed: 101\n"
    );
}

#[test]
fn context_bytes_come_from_the_environment() {
    expect_everywhere(
        "info nvml",
        &[
            ("GPUSHARE_DOUBLE_TOTAL", "1g"),
            ("GPUSHARE_DOUBLE_CONTEXT_BYTES", "0"),
        ],
        &[
            "info 0 free=1073741824 total=1073741824".to_owned(),
            "nvml 0 free=1073741824 used=0 total=1073741824".to_owned(),
        ],
    );
}

#[test]
fn malformed_scripts_exit_2_before_doing_anything() {
    for script in [
        "info alloc bogus 1m",
        "info alloc mem",
        "info alloc mem 1x",
        "info frobnicate",
        "info hammer 0 1 1m",
        "info sleep",
    ] {
        let output = run("cudaprobe", &[], script, &[]);
        assert_eq!(output.status.code(), Some(2), "{script}");
        assert!(output.stdout.is_empty(), "{script}");
        assert!(
            String::from_utf8_lossy(&output.stderr).starts_with("cudaprobe: "),
            "{script}"
        );
    }
    // An unknown ID shows only when it runs.
    let output = run("cudaprobe_linked", &[], "info free 3", &[]);
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(output.stdout.split(|&b| b == b'\n').count(), 2);
}

#[test]
fn wait_blocks_until_a_line_arrives() {
    let mut child = command("cudaprobe")
        .args(["pid", "sleep", "5", "wait", "pid"])
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn the probe");
    let pid = format!("pid {}", child.id());
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut next = || {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line.trim_end().to_owned()
    };
    assert_eq!(next(), pid);
    assert_eq!(next(), "sleep 5");
    assert_eq!(next(), "ready");
    child.stdin.take().unwrap().write_all(b"go\n").unwrap();
    assert_eq!(next(), "resumed");
    assert_eq!(next(), pid);
    assert!(child.wait().unwrap().success());
}

#[test]
fn the_double_lives_where_the_crate_says() {
    for file in [
        "libcuda.so.1",
        "libcuda.so",
        "libnvidia-ml.so.1",
        "libnvidia-ml.so",
    ] {
        assert!(double_dir().join(file).exists(), "{file}");
    }
    for name in ["cudaprobe", "cudaprobe_linked"] {
        assert!(Path::new(&program(name)).is_file(), "{name}");
    }
}

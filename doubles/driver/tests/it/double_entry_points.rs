//! The driver double's entry points: they have the shapes measured on the
//! H100, the libraries export the API and nothing else, and
//! `cuGetProcAddress` hands out the exported addresses.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::collections::BTreeSet;
use std::ffi::{CString, c_char, c_int, c_void};
use std::process::Command;

use crate::common;

use common::in_process::Lib;
use common::{CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS};
use gpushare_examples::{
    BUSY_SYMBOL, CU_GUARD_IMM, CU_PROLOGUE, CU_PROLOGUE_LEN, NVML_ENTRY_POINTS,
    NVML_INIT_V2_PREFIX, NVML_MEMINFO_PROLOGUE, cu_entry_points, double_dir,
};

const CU_GET_PROC_ADDRESS_SUCCESS: c_int = 0;
const CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND: c_int = 1;

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
    assert_eq!(names.len(), 171, "{names:?}");
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
        // Driver-held memory: limits, modules and libraries, graph memory,
        // pools.
        ("cuCtxSetLimit", 13000, 0, "cuCtxSetLimit"),
        ("cuCtxGetLimit", 13000, 0, "cuCtxGetLimit"),
        ("cuCtxDestroy", 13000, 0, "cuCtxDestroy_v2"),
        ("cuModuleLoad", 13000, 0, "cuModuleLoad"),
        ("cuModuleLoadDataEx", 13000, 0, "cuModuleLoadDataEx"),
        ("cuModuleLoadFatBinary", 13000, 0, "cuModuleLoadFatBinary"),
        ("cuModuleGetGlobal", 13000, 0, "cuModuleGetGlobal_v2"),
        ("cuLibraryLoadData", 13000, 0, "cuLibraryLoadData"),
        ("cuLibraryLoadFromFile", 13000, 0, "cuLibraryLoadFromFile"),
        ("cuLibraryUnload", 13000, 0, "cuLibraryUnload"),
        ("cuGraphCreate", 13000, 0, "cuGraphCreate"),
        ("cuGraphAddMemAllocNode", 13000, 0, "cuGraphAddMemAllocNode"),
        ("cuGraphAddMemFreeNode", 13000, 0, "cuGraphAddMemFreeNode"),
        ("cuGraphGetNodes", 13000, 0, "cuGraphGetNodes"),
        ("cuGraphNodeGetType", 13000, 0, "cuGraphNodeGetType"),
        (
            "cuGraphMemAllocNodeGetParams",
            13000,
            0,
            "cuGraphMemAllocNodeGetParams",
        ),
        ("cuGraphUpload", 13000, 0, "cuGraphUpload"),
        ("cuGraphUpload", 13000, 2, "cuGraphUpload_ptsz"),
        (
            "cuGraphInstantiateWithParams",
            13000,
            0,
            "cuGraphInstantiateWithParams",
        ),
        ("cuDeviceGraphMemTrim", 13000, 0, "cuDeviceGraphMemTrim"),
        (
            "cuDeviceGetDefaultMemPool",
            13000,
            0,
            "cuDeviceGetDefaultMemPool",
        ),
        ("cuDeviceGetMemPool", 13000, 0, "cuDeviceGetMemPool"),
        ("cuMemPoolSetAttribute", 13000, 0, "cuMemPoolSetAttribute"),
        ("cuMemPoolGetAttribute", 13000, 2, "cuMemPoolGetAttribute"),
        ("cuMemPoolTrimTo", 13000, 0, "cuMemPoolTrimTo"),
        // Copies, sets and stream waits: synchronous ones take the
        // per-thread stream as _ptds, async ones as _ptsz.
        ("cuMemcpy", 13000, 0, "cuMemcpy"),
        ("cuMemcpy", 13000, 2, "cuMemcpy_ptds"),
        ("cuMemcpyAsync", 13000, 0, "cuMemcpyAsync"),
        ("cuMemcpyAsync", 13000, 2, "cuMemcpyAsync_ptsz"),
        ("cuMemcpyHtoD", 13000, 0, "cuMemcpyHtoD_v2"),
        ("cuMemcpyHtoD", 13000, 2, "cuMemcpyHtoD_v2_ptds"),
        ("cuMemcpyHtoDAsync", 13000, 0, "cuMemcpyHtoDAsync_v2"),
        ("cuMemcpyHtoDAsync", 13000, 2, "cuMemcpyHtoDAsync_v2_ptsz"),
        ("cuMemcpyDtoH", 13000, 0, "cuMemcpyDtoH_v2"),
        ("cuMemcpyDtoH", 13000, 2, "cuMemcpyDtoH_v2_ptds"),
        ("cuMemcpyDtoHAsync", 13000, 0, "cuMemcpyDtoHAsync_v2"),
        ("cuMemcpyDtoHAsync", 13000, 2, "cuMemcpyDtoHAsync_v2_ptsz"),
        ("cuMemcpyDtoD", 13000, 0, "cuMemcpyDtoD_v2"),
        ("cuMemcpyDtoD", 13000, 2, "cuMemcpyDtoD_v2_ptds"),
        ("cuMemcpyDtoDAsync", 13000, 0, "cuMemcpyDtoDAsync_v2"),
        ("cuMemcpyDtoDAsync", 13000, 2, "cuMemcpyDtoDAsync_v2_ptsz"),
        ("cuMemsetD8", 13000, 0, "cuMemsetD8_v2"),
        ("cuMemsetD8", 13000, 2, "cuMemsetD8_v2_ptds"),
        ("cuMemsetD32", 13000, 0, "cuMemsetD32_v2"),
        ("cuMemsetD32", 13000, 2, "cuMemsetD32_v2_ptds"),
        ("cuMemsetD8Async", 13000, 0, "cuMemsetD8Async"),
        ("cuMemsetD8Async", 13000, 2, "cuMemsetD8Async_ptsz"),
        ("cuMemsetD32Async", 13000, 0, "cuMemsetD32Async"),
        ("cuMemsetD32Async", 13000, 2, "cuMemsetD32Async_ptsz"),
        ("cuStreamWaitEvent", 13000, 0, "cuStreamWaitEvent"),
        ("cuStreamWaitEvent", 13000, 2, "cuStreamWaitEvent_ptsz"),
        (
            "cuCheckpointProcessLock",
            13000,
            0,
            "cuCheckpointProcessLock",
        ),
        (
            "cuCheckpointProcessGetState",
            13000,
            2,
            "cuCheckpointProcessGetState",
        ),
        // Shareable handles and legacy IPC: cuIpcOpenMemHandle is the _v2
        // from CUDA 11.0 on.
        (
            "cuMemExportToShareableHandle",
            13000,
            0,
            "cuMemExportToShareableHandle",
        ),
        (
            "cuMemImportFromShareableHandle",
            13000,
            0,
            "cuMemImportFromShareableHandle",
        ),
        ("cuIpcGetMemHandle", 13000, 0, "cuIpcGetMemHandle"),
        ("cuIpcOpenMemHandle", 13000, 0, "cuIpcOpenMemHandle_v2"),
        ("cuIpcOpenMemHandle", 11000, 2, "cuIpcOpenMemHandle_v2"),
        ("cuIpcOpenMemHandle", 10020, 0, "cuIpcOpenMemHandle"),
        ("cuIpcCloseMemHandle", 13000, 0, "cuIpcCloseMemHandle"),
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
        "cuModuleGetGlobal_v2",
        "cuGraphUpload_ptsz",
        "cuMemcpy_ptds",
        "cuMemcpyHtoD_v2",
        "cuMemsetD8Async_ptsz",
        "cuIpcOpenMemHandle_v2",
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

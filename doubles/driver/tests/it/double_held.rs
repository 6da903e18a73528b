//! Memory the double's driver takes without an allocation call: created
//! contexts, context limits, module globals (a fat binary library's at its
//! first use in each context), graph memory and pool memory count in
//! cuMemGetInfo and NVML, refuse what does not fit, and come back when
//! unloaded, destroyed, trimmed or released.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{CString, c_char, c_int, c_uint, c_void};

use crate::common;

use common::in_process::{LaunchConfig, Lib, now};
use common::{
    CTX, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, GIB, KIB, MIB, VARIANTS, in_fresh_process, lines, run,
};

const CUDA_ERROR_INVALID_VALUE: c_int = 1;
const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;
const CUDA_ERROR_INVALID_CONTEXT: c_int = 201;
const CUDA_ERROR_FILE_NOT_FOUND: c_int = 301;
const CUDA_ERROR_INVALID_HANDLE: c_int = 400;
const CU_LIMIT_MALLOC_HEAP_SIZE: c_int = 2;
const CU_GRAPH_NODE_TYPE_KERNEL: c_int = 0;
const CU_GRAPH_NODE_TYPE_MEM_ALLOC: c_int = 10;
const CU_GRAPH_NODE_TYPE_MEM_FREE: c_int = 11;
const CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD: u64 = 2;
const CU_MEMPOOL_ATTR_RELEASE_THRESHOLD: c_int = 4;
const CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT: c_int = 5;

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

fn info(used: u64, total: u64) -> String {
    format!("info 0 free={} total={total}", total - used)
}

fn procs(used: u64) -> String {
    format!("nvml_procs 0 count=1 used={used}")
}

#[test]
fn each_created_context_holds_its_bytes_until_destroyed() {
    let total = GIB;
    let expected = [
        info(CTX, total),
        "context -> 0 0".to_owned(),
        info(2 * CTX, total),
        procs(2 * CTX),
        "context -> 0 1".to_owned(),
        // A fourth 300 MiB context does not fit in 1 GiB.
        "context -> 2 -".to_owned(),
        format!(
            "nvml 0 free={} used={} total={total}",
            total - 3 * CTX,
            3 * CTX
        ),
        // 124 MiB are left.
        "alloc mem 200m -> 2 -".to_owned(),
        "alloc mem 100m -> 0 0".to_owned(),
        "context_destroy 0 -> 0".to_owned(),
        "context_destroy 1 -> 0".to_owned(),
        "context_destroy 1 -> 201".to_owned(),
        info(CTX + 100 * MIB, total),
        procs(CTX + 100 * MIB),
    ];
    expect_everywhere(
        "info context info nvml_procs context context nvml alloc mem 200m alloc mem 100m \
         context_destroy 0 context_destroy 1 context_destroy 1 info nvml_procs",
        &[("GPUSHARE_DOUBLE_TOTAL", "1g")],
        &expected,
    );
}

#[test]
fn context_limits_hold_what_they_are_set_above_their_defaults() {
    let total = GIB;
    // heap 64 MiB over 8 MiB, fifo 2 MiB over 1 MiB, stack 16 bytes over
    // 1024 for each of 132 x 2048 resident threads.
    let held = 64 * MIB + 2 * MIB + 16 * 132 * 2048;
    let expected = [
        "getlimit heap -> 0 8388608".to_owned(),
        "getlimit fifo -> 0 1048576".to_owned(),
        "getlimit stack -> 0 1024".to_owned(),
        info(CTX, total),
        "setlimit heap 72m -> 0".to_owned(),
        "setlimit fifo 3m -> 0".to_owned(),
        "setlimit stack 1040 -> 0".to_owned(),
        info(CTX + held, total),
        procs(CTX + held),
        // 1016 MiB of heap would not fit: the limit stays as it was.
        "setlimit heap 1g -> 2".to_owned(),
        "getlimit heap -> 0 75497472".to_owned(),
        info(CTX + held, total),
        // 592 MiB of heap leave 126 MiB.
        "setlimit heap 600m -> 0".to_owned(),
        "alloc mem 200m -> 2 -".to_owned(),
        // Below the default holds nothing.
        "setlimit heap 4m -> 0".to_owned(),
        "setlimit stack 512 -> 0".to_owned(),
        info(CTX + 2 * MIB, total),
        "setlimit fifo 1m -> 0".to_owned(),
        info(CTX, total),
        "getlimit stack -> 0 512".to_owned(),
    ];
    expect_everywhere(
        "getlimit heap getlimit fifo getlimit stack info setlimit heap 72m setlimit fifo 3m \
         setlimit stack 1040 info nvml_procs setlimit heap 1g getlimit heap info \
         setlimit heap 600m alloc mem 200m setlimit heap 4m setlimit stack 512 info \
         setlimit fifo 1m info getlimit stack",
        &[("GPUSHARE_DOUBLE_TOTAL", "1g")],
        &expected,
    );
}

#[test]
fn module_globals_are_held_while_loaded() {
    let total = 2 * GIB;
    let loaded = 512 * MIB + 256 * MIB + 128 * MIB;
    let expected = [
        "module 512m -> 0 0".to_owned(),
        "module_ex 256m -> 0 1".to_owned(),
        "library 128m -> 0 2".to_owned(),
        info(CTX + loaded, total),
        procs(CTX + loaded),
        "module 2g -> 2 -".to_owned(),
        // 852 MiB are left.
        "alloc mem 1g -> 2 -".to_owned(),
        "unload 0 -> 0".to_owned(),
        info(CTX + 384 * MIB, total),
        "unload 1 -> 0".to_owned(),
        "unload 2 -> 0".to_owned(),
        info(CTX, total),
        "unload 2 -> 400".to_owned(),
        // An image without globals holds nothing.
        "module 0 -> 0 3".to_owned(),
        info(CTX, total),
    ];
    expect_everywhere(
        "module 512m module_ex 256m library 128m info nvml_procs module 2g alloc mem 1g \
         unload 0 info unload 1 unload 2 info unload 2 module 0 info",
        &[("GPUSHARE_DOUBLE_TOTAL", "2g")],
        &expected,
    );
}

#[test]
fn fat_binary_libraries_take_their_globals_at_first_use() {
    let total = 4 * GIB;
    let globals = 3 * GIB;
    let expected = [
        // Registered as the runtime registers a translation unit: nothing yet.
        "fatlib 3g -> 0 0".to_owned(),
        info(CTX, total),
        procs(CTX),
        "libkernel 0 first -> 0 0".to_owned(),
        "libkernel 0 second -> 0 1".to_owned(),
        info(CTX, total),
        // The first launch of one of its kernels in the context takes them.
        "launchk 0 -> 0".to_owned(),
        info(CTX + globals, total),
        procs(CTX + globals),
        // Once per context: another kernel, another launch, a function.
        "launchk 1 -> 0".to_owned(),
        "launchk 0 -> 0".to_owned(),
        "kernelfunc 1 -> 0".to_owned(),
        "kernellib 1 -> 0".to_owned(),
        info(CTX + globals, total),
        "alloc mem 1g -> 2 -".to_owned(),
        // A text image's library holds its globals from its load; its
        // kernels add nothing.
        "library 256m -> 0 1".to_owned(),
        "libkernel 1 k -> 0 2".to_owned(),
        "launchk 2 -> 0".to_owned(),
        "kernelfunc 2 -> 0".to_owned(),
        info(CTX + globals + 256 * MIB, total),
        // Unloaded: the globals come back, and its kernels are gone.
        "unload 0 -> 0".to_owned(),
        info(CTX + 256 * MIB, total),
        "kernellib 0 -> 400".to_owned(),
        "launchk 0 -> 400".to_owned(),
        "unload 1 -> 0".to_owned(),
        info(CTX, total),
        // Looking its global up is a first use too (driver 580's, where
        // fatlib's cubin has no kernel).
        "fatlib 1g -> 0 2".to_owned(),
        info(CTX, total),
        format!("libglobal 2 -> 0 {GIB}"),
        info(CTX + GIB, total),
        format!("libglobal 2 -> 0 {GIB}"),
        info(CTX + GIB, total),
        "unload 2 -> 0".to_owned(),
        info(CTX, total),
    ];
    expect_everywhere(
        "fatlib 3g info nvml_procs libkernel 0 first libkernel 0 second info launchk 0 info \
         nvml_procs launchk 1 launchk 0 kernelfunc 1 kernellib 1 info alloc mem 1g \
         library 256m libkernel 1 k launchk 2 kernelfunc 2 info unload 0 info kernellib 0 \
         launchk 0 unload 1 info fatlib 1g info libglobal 2 info libglobal 2 info unload 2 info",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
        &expected,
    );
}

#[test]
fn a_first_use_that_does_not_fit_fails_and_takes_nothing() {
    let total = 2 * GIB;
    let expected = [
        "fatlib 2g -> 0 0".to_owned(),
        "libkernel 0 k -> 0 0".to_owned(),
        "launchk 0 -> 2".to_owned(),
        "kernelfunc 0 -> 2".to_owned(),
        "libglobal 0 -> 2 0".to_owned(),
        info(CTX, total),
        procs(CTX),
        // 724 MiB are left once 1 GiB is allocated: a 1 GiB first use fails
        // until the allocation is freed.
        "fatlib 1g -> 0 1".to_owned(),
        "libkernel 1 k -> 0 1".to_owned(),
        "alloc mem 1g -> 0 0".to_owned(),
        "launchk 1 -> 2".to_owned(),
        info(CTX + GIB, total),
        "free 0 -> 0".to_owned(),
        "launchk 1 -> 0".to_owned(),
        info(CTX + GIB, total),
        "unload 1 -> 0".to_owned(),
        "unload 0 -> 0".to_owned(),
        info(CTX, total),
    ];
    expect_everywhere(
        "fatlib 2g libkernel 0 k launchk 0 kernelfunc 0 libglobal 0 info nvml_procs fatlib 1g \
         libkernel 1 k alloc mem 1g launchk 1 info free 0 launchk 1 info unload 1 unload 0 info",
        &[("GPUSHARE_DOUBLE_TOTAL", "2g")],
        &expected,
    );
}

#[test]
fn graph_memory_is_reserved_at_first_run_and_retained_until_trimmed() {
    let total = 4 * GIB;
    let expected = [
        // Instantiating charges nothing; the first upload reserves the need.
        "graph_alloc 1g -> 0 0".to_owned(),
        info(CTX, total),
        "graph_upload 0 -> 0".to_owned(),
        info(CTX + GIB, total),
        procs(CTX + GIB),
        "graph_launch 0 -> 0".to_owned(),
        info(CTX + GIB, total),
        // 3 GiB more do not fit; the exec stays unreserved.
        "graph_alloc 3g -> 0 1".to_owned(),
        "graph_launch 1 -> 2".to_owned(),
        info(CTX + GIB, total),
        "alloc mem 3g -> 2 -".to_owned(),
        // A destroyed exec's memory stays, retained, and serves the next.
        "graph_destroy 0 -> 0".to_owned(),
        info(CTX + GIB, total),
        "graph_alloc 512m -> 0 2".to_owned(),
        "graph_upload 2 -> 0".to_owned(),
        info(CTX + GIB, total),
        "graph_destroy 2 -> 0".to_owned(),
        "graph_destroy 2 -> 400".to_owned(),
        "graph_trim -> 0".to_owned(),
        info(CTX, total),
        "graph_launch 1 -> 0".to_owned(),
        info(CTX + 3 * GIB, total),
        "graph_destroy 1 -> 0".to_owned(),
        "graph_trim -> 0".to_owned(),
        info(CTX, total),
        // A captured cuMemAllocAsync is an alloc node: nothing until run.
        "capture_alloc 512m -> 0 3".to_owned(),
        info(CTX, total),
        "graph_launch 3 -> 0".to_owned(),
        info(CTX + 512 * MIB, total),
        procs(CTX + 512 * MIB),
        "graph_destroy 3 -> 0".to_owned(),
        "graph_trim -> 0".to_owned(),
        info(CTX, total),
    ];
    expect_everywhere(
        "graph_alloc 1g info graph_upload 0 info nvml_procs graph_launch 0 info \
         graph_alloc 3g graph_launch 1 info alloc mem 3g graph_destroy 0 info \
         graph_alloc 512m graph_upload 2 info graph_destroy 2 graph_destroy 2 graph_trim info \
         graph_launch 1 info graph_destroy 1 graph_trim info \
         capture_alloc 512m info graph_launch 3 info nvml_procs graph_destroy 3 graph_trim info",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
        &expected,
    );
}

#[test]
fn pools_retain_freed_bytes_above_a_release_threshold() {
    let total = 2 * GIB;
    let expected = [
        "pool_reserved 0 reserved=0 used=0".to_owned(),
        // Threshold 0: a free gives the bytes back at once.
        "alloc async 100m -> 0 0".to_owned(),
        format!("pool_reserved 0 reserved={} used={}", 100 * MIB, 100 * MIB),
        "free 0 -> 0".to_owned(),
        "pool_reserved 0 reserved=0 used=0".to_owned(),
        info(CTX, total),
        // Threshold max: the pool keeps them, through the synchronize.
        "pool_threshold max -> 0".to_owned(),
        "alloc async 100m -> 0 1".to_owned(),
        "free 1 -> 0".to_owned(),
        format!("pool_reserved 0 reserved={} used=0", 100 * MIB),
        info(CTX + 100 * MIB, total),
        procs(CTX + 100 * MIB),
        // A pool allocation reuses them.
        "alloc pool 60m -> 0 2".to_owned(),
        format!("pool_reserved 0 reserved={} used={}", 100 * MIB, 60 * MIB),
        info(CTX + 100 * MIB, total),
        "alloc mem 1700m -> 2 -".to_owned(),
        "pool_trim 0 -> 0".to_owned(),
        format!("pool_reserved 0 reserved={} used={}", 60 * MIB, 60 * MIB),
        info(CTX + 60 * MIB, total),
        // A synchronize releases down to the threshold.
        "free 2 -> 0".to_owned(),
        "pool_threshold 32m -> 0".to_owned(),
        format!("pool_reserved 0 reserved={} used=0", 60 * MIB),
        "sync 0".to_owned(),
        format!("pool_reserved 0 reserved={} used=0", 32 * MIB),
        info(CTX + 32 * MIB, total),
        "pool_trim 16m -> 0".to_owned(),
        info(CTX + 16 * MIB, total),
        "pool_threshold 0 -> 0".to_owned(),
        "sync 0".to_owned(),
        "pool_reserved 0 reserved=0 used=0".to_owned(),
        info(CTX, total),
    ];
    expect_everywhere(
        "pool_reserved alloc async 100m pool_reserved free 0 pool_reserved info \
         pool_threshold max alloc async 100m free 1 pool_reserved info nvml_procs \
         alloc pool 60m pool_reserved info alloc mem 1700m pool_trim 0 pool_reserved info \
         free 2 pool_threshold 32m pool_reserved sync pool_reserved info pool_trim 16m info \
         pool_threshold 0 sync pool_reserved info",
        &[("GPUSHARE_DOUBLE_TOTAL", "2g")],
        &expected,
    );
}

#[test]
fn malformed_held_scripts_exit_2() {
    for script in [
        "info setlimit bogus 1m",
        "info setlimit heap",
        "info getlimit",
        "info module",
        "info library 1x",
        "info graph_launch",
        "info pool_threshold maxi",
        "info context_destroy x",
        "info fatlib",
        "info fatlib 1x",
        "info libkernel 0",
        "info libkernel x k",
        "info launchk",
        "info kernelfunc x",
        "info kernellib",
        "info libglobal",
    ] {
        common::assert_malformed(script);
    }
    for (script, lines) in [
        ("info unload 0", 1),
        ("info graph_upload 0", 1),
        ("info context_destroy 0", 1),
        ("info libkernel 0 k", 1),
        ("info launchk 0", 1),
        ("info fatlib 1m kernellib 0", 2),
        // A module has no kernels.
        ("info module 1m libkernel 0 k", 2),
        ("info module 1m libglobal 0", 2),
    ] {
        let output = run("cudaprobe", &[], script, &[]);
        assert_eq!(output.status.code(), Some(2), "{script}");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout).lines().count(),
            lines,
            "{script}"
        );
    }
}

// ---------------------------------------------------------------- in process

type Init = unsafe extern "C" fn(c_uint) -> c_int;
type Retain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type Release = unsafe extern "C" fn(c_int) -> c_int;
type SetCurrent = unsafe extern "C" fn(*mut c_void) -> c_int;
type CtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> c_int;
type CtxDestroy = unsafe extern "C" fn(*mut c_void) -> c_int;
type MemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
type SetLimit = unsafe extern "C" fn(c_int, usize) -> c_int;
type GetLimit = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type ModuleLoad = unsafe extern "C" fn(*mut *mut c_void, *const c_char) -> c_int;
type ModuleLoadData = unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> c_int;
type Unload = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetGlobal = unsafe extern "C" fn(*mut u64, *mut usize, *mut c_void, *const c_char) -> c_int;
type LibraryLoadFromFile = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_char,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
) -> c_int;

/// `CUmemPoolProps` and `CUDA_MEM_ALLOC_NODE_PARAMS` of cuda.h.
#[repr(C)]
struct AllocNodeParams {
    alloc_type: c_int,
    handle_types: c_int,
    location_type: c_int,
    location_id: c_int,
    win32_security_attributes: *mut c_void,
    max_size: usize,
    usage: u16,
    reserved: [u8; 54],
    access_descs: *const c_void,
    access_desc_count: usize,
    bytesize: usize,
    dptr: u64,
}

impl AllocNodeParams {
    fn pinned(bytesize: usize, device: c_int) -> AllocNodeParams {
        AllocNodeParams {
            alloc_type: 1,
            handle_types: 0,
            location_type: 1,
            location_id: device,
            win32_security_attributes: std::ptr::null_mut(),
            max_size: 0,
            usage: 0,
            reserved: [0; 54],
            access_descs: std::ptr::null(),
            access_desc_count: 0,
            bytesize,
            dptr: 0,
        }
    }
}

const _: () = assert!(size_of::<AllocNodeParams>() == 120);

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` of cuda.h.
#[repr(C)]
struct InstantiateParams {
    flags: u64,
    upload_stream: *mut c_void,
    err_node: *mut c_void,
    result: c_int,
}

/// The context's device's used bytes, as cuMemGetInfo_v2 has it.
fn used(mem_info: MemInfo) -> u64 {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    assert_eq!(unsafe { mem_info(&mut free, &mut total) }, CUDA_SUCCESS);
    (total - free) as u64
}

#[test]
fn modules_and_limits_go_with_their_context_libraries_do_not() {
    if !in_fresh_process(
        "modules_and_limits_go_with_their_context_libraries_do_not",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
    ) {
        return;
    }
    let image = std::env::temp_dir().join(format!("gpushare-double-{}.image", std::process::id()));
    std::fs::write(
        &image,
        "gpushare-double-module globals=1048576\nthe rest of it",
    )
    .unwrap();
    let path = CString::new(image.to_str().unwrap()).unwrap();
    let cuda = Lib::open("libcuda.so.1");
    // SAFETY: for all transmutes and calls below: the signatures are those of
    // cuda.h, and every pointer passed is valid for the call.
    unsafe {
        let init: Init = std::mem::transmute(cuda.sym("cuInit"));
        let retain: Retain = std::mem::transmute(cuda.sym("cuDevicePrimaryCtxRetain"));
        let release: Release = std::mem::transmute(cuda.sym("cuDevicePrimaryCtxRelease_v2"));
        let set_current: SetCurrent = std::mem::transmute(cuda.sym("cuCtxSetCurrent"));
        let ctx_create: CtxCreate = std::mem::transmute(cuda.sym("cuCtxCreate_v2"));
        let ctx_destroy: CtxDestroy = std::mem::transmute(cuda.sym("cuCtxDestroy_v2"));
        let mem_info: MemInfo = std::mem::transmute(cuda.sym("cuMemGetInfo_v2"));
        let set_limit: SetLimit = std::mem::transmute(cuda.sym("cuCtxSetLimit"));
        let get_limit: GetLimit = std::mem::transmute(cuda.sym("cuCtxGetLimit"));
        let module_load: ModuleLoad = std::mem::transmute(cuda.sym("cuModuleLoad"));
        let load_data: ModuleLoadData = std::mem::transmute(cuda.sym("cuModuleLoadData"));
        let module_unload: Unload = std::mem::transmute(cuda.sym("cuModuleUnload"));
        let get_global: GetGlobal = std::mem::transmute(cuda.sym("cuModuleGetGlobal_v2"));
        let library_load: LibraryLoadFromFile =
            std::mem::transmute(cuda.sym("cuLibraryLoadFromFile"));
        let library_unload: Unload = std::mem::transmute(cuda.sym("cuLibraryUnload"));
        let null = std::ptr::null_mut();

        let mut primary = null;
        assert_eq!(init(0), CUDA_SUCCESS);
        assert_eq!(retain(&mut primary, 0), CUDA_SUCCESS);
        assert_eq!(set_current(primary), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX);

        // Images from files: the file's first bytes say what they hold.
        let (mut module, mut library) = (null, null);
        assert_eq!(module_load(&mut module, path.as_ptr()), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX + MIB);
        let (mut dptr, mut bytes) = (0u64, 0usize);
        assert_eq!(
            get_global(&mut dptr, &mut bytes, module, c"any_name".as_ptr()),
            CUDA_SUCCESS
        );
        assert_eq!(bytes as u64, MIB);
        assert_eq!(dptr % 512, 0);
        assert_ne!(dptr, 0);
        let no_options = std::ptr::null_mut();
        assert_eq!(
            library_load(
                &mut library,
                path.as_ptr(),
                no_options,
                null.cast(),
                0,
                no_options,
                null.cast(),
                0
            ),
            CUDA_SUCCESS
        );
        assert_eq!(used(mem_info), CTX + 2 * MIB);
        let mut missing = null;
        assert_eq!(
            module_load(&mut missing, c"/nonexistent/gpushare.image".as_ptr()),
            CUDA_ERROR_FILE_NOT_FOUND
        );
        let mut plain = null;
        assert_eq!(
            load_data(&mut plain, c"any other image".as_ptr().cast()),
            CUDA_SUCCESS
        );
        assert_eq!(
            get_global(&mut dptr, &mut bytes, plain, c"any_name".as_ptr()),
            CUDA_ERROR_NOT_FOUND
        );
        assert_eq!(used(mem_info), CTX + 2 * MIB);

        // A created context: its bytes, its module; the limit is the GPU's.
        let mut created = null;
        assert_eq!(ctx_create(&mut created, 0, 0), CUDA_SUCCESS);
        assert_eq!(used(mem_info), 2 * CTX + 2 * MIB);
        let mut own = null;
        assert_eq!(
            load_data(
                &mut own,
                c"gpushare-double-module globals=4194304".as_ptr().cast()
            ),
            CUDA_SUCCESS
        );
        assert_eq!(set_limit(CU_LIMIT_MALLOC_HEAP_SIZE, 16 << 20), CUDA_SUCCESS);
        assert_eq!(used(mem_info), 2 * CTX + 2 * MIB + 4 * MIB + 8 * MIB);
        assert_eq!(ctx_destroy(created), CUDA_SUCCESS);
        let (mut free, mut total) = (0usize, 0usize);
        assert_eq!(
            mem_info(&mut free, &mut total),
            CUDA_ERROR_INVALID_CONTEXT,
            "the destroyed context was current"
        );
        assert_eq!(set_current(primary), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX + 2 * MIB + 8 * MIB);
        assert_eq!(module_unload(own), CUDA_ERROR_INVALID_HANDLE);
        let mut heap = 0usize;
        assert_eq!(
            get_limit(&mut heap, CU_LIMIT_MALLOC_HEAP_SIZE),
            CUDA_SUCCESS
        );
        assert_eq!(heap, 16 << 20);

        // The GPU's last context: its modules and limits go, the library stays.
        assert_eq!(release(0), CUDA_SUCCESS);
        assert_eq!(retain(&mut primary, 0), CUDA_SUCCESS);
        assert_eq!(set_current(primary), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX + MIB);
        assert_eq!(module_unload(module), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            get_limit(&mut heap, CU_LIMIT_MALLOC_HEAP_SIZE),
            CUDA_SUCCESS
        );
        assert_eq!(heap, 8 << 20);
        assert_eq!(library_unload(library), CUDA_SUCCESS);
        assert_eq!(library_unload(library), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(used(mem_info), CTX);
    }
    std::fs::remove_file(&image).unwrap();
}

type GraphCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type AddAllocNode = unsafe extern "C" fn(
    *mut *mut c_void,
    *mut c_void,
    *const *mut c_void,
    usize,
    *mut AllocNodeParams,
) -> c_int;
type AddFreeNode =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const *mut c_void, usize, u64) -> c_int;
type GetNodes = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut usize) -> c_int;
type NodeType = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;
type AllocNodeGetParams = unsafe extern "C" fn(*mut c_void, *mut AllocNodeParams) -> c_int;
type InstantiateWithParams =
    unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *mut InstantiateParams) -> c_int;
type Destroy = unsafe extern "C" fn(*mut c_void) -> c_int;
type Trim = unsafe extern "C" fn(c_int) -> c_int;
type StreamCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type BeginCapture = unsafe extern "C" fn(*mut c_void, c_int) -> c_int;
type EndCapture = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> c_int;
type AllocAsync = unsafe extern "C" fn(*mut u64, usize, *mut c_void) -> c_int;
type FreeAsync = unsafe extern "C" fn(u64, *mut c_void) -> c_int;
type DefaultPool = unsafe extern "C" fn(*mut *mut c_void, c_int) -> c_int;
type PoolAttribute = unsafe extern "C" fn(*mut c_void, c_int, *mut c_void) -> c_int;
type EventCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int;
type EventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> c_int;

#[test]
fn graphs_list_their_memory_nodes_and_events_settle_pools() {
    if !in_fresh_process(
        "graphs_list_their_memory_nodes_and_events_settle_pools",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
    ) {
        return;
    }
    let cuda = Lib::open("libcuda.so.1");
    let cu = common::in_process::Driver::open();
    cu.start(0);
    // SAFETY: for all transmutes and calls below: the signatures are those of
    // cuda.h, and every pointer passed is valid for the call.
    unsafe {
        let mem_info: MemInfo = std::mem::transmute(cuda.sym("cuMemGetInfo_v2"));
        let graph_create: GraphCreate = std::mem::transmute(cuda.sym("cuGraphCreate"));
        let add_alloc: AddAllocNode = std::mem::transmute(cuda.sym("cuGraphAddMemAllocNode"));
        let add_free: AddFreeNode = std::mem::transmute(cuda.sym("cuGraphAddMemFreeNode"));
        let get_nodes: GetNodes = std::mem::transmute(cuda.sym("cuGraphGetNodes"));
        let node_type: NodeType = std::mem::transmute(cuda.sym("cuGraphNodeGetType"));
        let alloc_params: AllocNodeGetParams =
            std::mem::transmute(cuda.sym("cuGraphMemAllocNodeGetParams"));
        let instantiate: InstantiateWithParams =
            std::mem::transmute(cuda.sym("cuGraphInstantiateWithParams"));
        let exec_destroy: Destroy = std::mem::transmute(cuda.sym("cuGraphExecDestroy"));
        let graph_destroy: Destroy = std::mem::transmute(cuda.sym("cuGraphDestroy"));
        let trim: Trim = std::mem::transmute(cuda.sym("cuDeviceGraphMemTrim"));
        let stream_create: StreamCreate = std::mem::transmute(cuda.sym("cuStreamCreate"));
        let begin: BeginCapture = std::mem::transmute(cuda.sym("cuStreamBeginCapture_v2"));
        let end: EndCapture = std::mem::transmute(cuda.sym("cuStreamEndCapture"));
        let alloc_async: AllocAsync = std::mem::transmute(cuda.sym("cuMemAllocAsync"));
        let free_async: FreeAsync = std::mem::transmute(cuda.sym("cuMemFreeAsync"));
        let default_pool: DefaultPool = std::mem::transmute(cuda.sym("cuDeviceGetDefaultMemPool"));
        let set_attr: PoolAttribute = std::mem::transmute(cuda.sym("cuMemPoolSetAttribute"));
        let get_attr: PoolAttribute = std::mem::transmute(cuda.sym("cuMemPoolGetAttribute"));
        let event_create: EventCreate = std::mem::transmute(cuda.sym("cuEventCreate"));
        let event_record: EventRecord = std::mem::transmute(cuda.sym("cuEventRecord"));
        let event_sync: Destroy = std::mem::transmute(cuda.sym("cuEventSynchronize"));
        let null = std::ptr::null_mut();
        assert_eq!(used(mem_info), CTX);

        // A graph built by hand: an alloc node and the free node of its address.
        let (mut graph, mut alloc, mut free) = (null, null, null);
        assert_eq!(graph_create(&mut graph, 0), CUDA_SUCCESS);
        let mut params = AllocNodeParams::pinned(64 << 20, 0);
        assert_eq!(
            add_alloc(&mut alloc, graph, std::ptr::null(), 0, &mut params),
            CUDA_SUCCESS
        );
        assert_ne!(params.dptr, 0);
        assert_eq!(
            add_free(&mut free, graph, &alloc, 1, params.dptr),
            CUDA_SUCCESS
        );
        assert_eq!(
            add_free(
                &mut free,
                graph,
                std::ptr::null(),
                0,
                params.dptr + 4096 * GIB
            ),
            CUDA_ERROR_INVALID_VALUE,
            "only a graph allocation's address"
        );
        assert_eq!(used(mem_info), CTX, "nodes charge nothing");
        let mut count = 0usize;
        assert_eq!(
            get_nodes(graph, std::ptr::null_mut(), &mut count),
            CUDA_SUCCESS
        );
        assert_eq!(count, 2);
        let mut nodes = [null; 3];
        count = 3;
        assert_eq!(
            get_nodes(graph, nodes.as_mut_ptr(), &mut count),
            CUDA_SUCCESS
        );
        assert_eq!((count, nodes[0], nodes[2]), (2, alloc, null));
        let mut kind = -1;
        assert_eq!(node_type(nodes[1], &mut kind), CUDA_SUCCESS);
        assert_eq!(kind, CU_GRAPH_NODE_TYPE_MEM_FREE);
        let mut read = AllocNodeParams::pinned(0, 7);
        assert_eq!(alloc_params(alloc, &mut read), CUDA_SUCCESS);
        assert_eq!(
            (read.bytesize, read.dptr, read.location_id),
            (64 << 20, params.dptr, 0)
        );
        assert_eq!(alloc_params(free, &mut read), CUDA_ERROR_INVALID_VALUE);

        // Instantiated with an upload: reserved at once, retained after.
        let mut exec = null;
        let mut upload = InstantiateParams {
            flags: CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD,
            upload_stream: null,
            err_node: null,
            result: -1,
        };
        assert_eq!(instantiate(&mut exec, graph, &mut upload), CUDA_SUCCESS);
        assert_eq!(upload.result, 0);
        assert_eq!(used(mem_info), CTX + 64 * MIB);
        assert_eq!(exec_destroy(exec), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX + 64 * MIB);
        assert_eq!(trim(0), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX);
        let mut too_big = AllocNodeParams::pinned(4 << 30, 0);
        assert_eq!(
            add_alloc(&mut alloc, graph, std::ptr::null(), 0, &mut too_big),
            CUDA_SUCCESS
        );
        exec = null;
        assert_eq!(
            instantiate(&mut exec, graph, &mut upload),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!((exec, upload.result), (null, 1));
        assert_eq!(used(mem_info), CTX);
        assert_eq!(graph_destroy(graph), CUDA_SUCCESS);

        // Captured: an alloc node, the kernel, the free node.
        let f = cu.function();
        let mut stream = null;
        assert_eq!(stream_create(&mut stream, 1), CUDA_SUCCESS);
        assert_eq!(begin(stream, 0), CUDA_SUCCESS);
        let mut dptr = 0u64;
        assert_eq!(alloc_async(&mut dptr, 32 << 20, stream), CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch, f, 1000, stream), CUDA_SUCCESS);
        assert_eq!(free_async(dptr, stream), CUDA_SUCCESS);
        assert_eq!(end(stream, &mut graph), CUDA_SUCCESS);
        count = 3;
        assert_eq!(
            get_nodes(graph, nodes.as_mut_ptr(), &mut count),
            CUDA_SUCCESS
        );
        assert_eq!(count, 3);
        let kinds: Vec<c_int> = nodes
            .iter()
            .map(|&node| {
                let mut kind = -1;
                assert_eq!(node_type(node, &mut kind), CUDA_SUCCESS);
                kind
            })
            .collect();
        assert_eq!(
            kinds,
            [
                CU_GRAPH_NODE_TYPE_MEM_ALLOC,
                CU_GRAPH_NODE_TYPE_KERNEL,
                CU_GRAPH_NODE_TYPE_MEM_FREE
            ]
        );
        assert_eq!(used(mem_info), CTX);
        assert_eq!(graph_destroy(graph), CUDA_SUCCESS);

        // An event synchronize settles the pool down to its threshold.
        let mut pool = null;
        assert_eq!(default_pool(&mut pool, 0), CUDA_SUCCESS);
        let mut threshold = u64::MAX;
        assert_eq!(
            set_attr(
                pool,
                CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut threshold).cast()
            ),
            CUDA_SUCCESS
        );
        assert_eq!(alloc_async(&mut dptr, 16 << 20, null), CUDA_SUCCESS);
        assert_eq!(free_async(dptr, null), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX + 16 * MIB);
        let mut reserved = 0u64;
        assert_eq!(
            get_attr(
                pool,
                CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&raw mut reserved).cast()
            ),
            CUDA_SUCCESS
        );
        assert_eq!(reserved, 16 * MIB);
        threshold = 0;
        assert_eq!(
            set_attr(
                pool,
                CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut threshold).cast()
            ),
            CUDA_SUCCESS
        );
        assert_eq!(
            used(mem_info),
            CTX + 16 * MIB,
            "released only at a synchronize"
        );
        let mut event = null;
        assert_eq!(event_create(&mut event, 0), CUDA_SUCCESS);
        assert_eq!(event_record(event, null), CUDA_SUCCESS);
        assert_eq!(event_sync(event), CUDA_SUCCESS);
        assert_eq!(used(mem_info), CTX);
    }
}

// ---------------------------------------------------------------- fat binaries

type LibraryLoadData = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_void,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
    *mut c_int,
    *mut *mut c_void,
    c_uint,
) -> c_int;
type GetKernel = unsafe extern "C" fn(*mut *mut c_void, *mut c_void, *const c_char) -> c_int;
/// cuKernelGetLibrary, cuKernelGetFunction and cuLibraryGetModule: what a
/// handle belongs to or stands for.
type HandleOf = unsafe extern "C" fn(*mut *mut c_void, *mut c_void) -> c_int;

const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
const FATBIN_KIND_PTX: u16 = 1;
const FATBIN_KIND_ELF: u16 = 2;
const FATBIN_ZSTD: u64 = 0x8000;
const FATBIN_LZ4: u64 = 0x2000;
const SHT_PROGBITS: u32 = 1;
const SHT_NOBITS: u32 = 8;
/// Where a lone entry's payload begins: after the container's header and
/// the entry's.
const PAYLOAD_AT: usize = 16 + 64;
/// Where [`cubin`] puts the section headers when it has one section of its
/// own: after the ELF header and "\0.shstrtab\0.nv.global\0", 8-aligned.
const ONE_SECTION_SHOFF: usize = 88;

/// One entry of a fat binary.
struct Entry {
    kind: u16,
    arch: u32,
    flags: u64,
    payload: Vec<u8>,
}

impl Entry {
    fn elf(arch: u32, flags: u64, payload: Vec<u8>) -> Entry {
        Entry {
            kind: FATBIN_KIND_ELF,
            arch,
            flags,
            payload,
        }
    }
}

/// A fat binary container as nvcc 13 writes it, little endian: the 16-byte
/// header, then each entry's 64-byte header and its payload, padded to 8.
fn fat_binary(entries: &[Entry]) -> Vec<u8> {
    let mut body = Vec::new();
    for entry in entries {
        let padded = entry.payload.len().next_multiple_of(8);
        body.extend(entry.kind.to_le_bytes());
        body.extend(0x0101u16.to_le_bytes());
        body.extend(64u32.to_le_bytes());
        body.extend((padded as u64).to_le_bytes());
        body.extend([0; 12]); // compressed size, unknown, minor, major
        body.extend(entry.arch.to_le_bytes());
        body.extend([0; 8]); // name offset and length
        body.extend(entry.flags.to_le_bytes());
        body.extend([0; 16]);
        body.extend(&entry.payload);
        body.resize(body.len() + padded - entry.payload.len(), 0);
    }
    let mut fat = Vec::new();
    fat.extend(0xBA55_ED50u32.to_le_bytes());
    fat.extend(1u16.to_le_bytes());
    fat.extend(16u16.to_le_bytes());
    fat.extend((body.len() as u64).to_le_bytes());
    fat.extend(body);
    fat
}

/// An ELF64 cubin of a null section, .shstrtab and `sections` (name, type,
/// size), with no data and no code.
fn cubin(sections: &[(&str, u32, u64)]) -> Vec<u8> {
    let mut names = vec![0u8];
    let mut name_at = Vec::new();
    for name in std::iter::once(".shstrtab").chain(sections.iter().map(|s| s.0)) {
        name_at.push(names.len() as u32);
        names.extend(name.as_bytes());
        names.push(0);
    }
    let shoff = (64 + names.len()).next_multiple_of(8);
    let shnum = sections.len() + 2;
    let mut elf = vec![0u8; shoff + 64 * shnum];
    elf[..7].copy_from_slice(b"\x7fELF\x02\x01\x01");
    elf[0x28..0x30].copy_from_slice(&(shoff as u64).to_le_bytes());
    elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
    elf[0x3c..0x3e].copy_from_slice(&(shnum as u16).to_le_bytes());
    elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
    elf[64..64 + names.len()].copy_from_slice(&names);
    let headers = std::iter::once((name_at[0], 3, 64, names.len() as u64)).chain(
        sections
            .iter()
            .zip(&name_at[1..])
            .map(|(&(_, kind, size), &name)| (name, kind, 0, size)),
    );
    for (i, (name, kind, offset, size)) in headers.enumerate() {
        let at = shoff + 64 * (i + 1);
        elf[at..at + 4].copy_from_slice(&name.to_le_bytes());
        elf[at + 4..at + 8].copy_from_slice(&kind.to_le_bytes());
        elf[at + 0x18..at + 0x20].copy_from_slice(&(offset as u64).to_le_bytes());
        elf[at + 0x20..at + 0x28].copy_from_slice(&size.to_le_bytes());
    }
    elf
}

/// A fat binary of one uncompressed ELF entry for sm_90 whose .nv.global
/// holds `bytes`.
fn one_global(bytes: u64) -> Vec<u8> {
    fat_binary(&[Entry::elf(
        90,
        0,
        cubin(&[(".nv.global", SHT_NOBITS, bytes)]),
    )])
}

/// `__fatBinC_Wrapper_t`, what nvcc emits for a translation unit.
#[repr(C)]
struct Wrapper {
    magic: c_int,
    version: c_int,
    data: *const c_void,
    filename_or_fatbins: *const c_void,
}

impl Wrapper {
    fn of(data: *const c_void) -> Wrapper {
        Wrapper {
            magic: 0x4662_43B1,
            version: 1,
            data,
            filename_or_fatbins: std::ptr::null(),
        }
    }
}

/// `image` copied to end where an unreadable page begins, so that reading a
/// byte past it faults. Never unmapped.
fn before_guard(image: &[u8]) -> *const c_void {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let pages = image.len().div_ceil(page) + 1;
    // SAFETY: a fresh anonymous mapping of this test's alone; the copy stays
    // within its readable pages, ending where the last (guard) page begins.
    unsafe {
        let base = libc::mmap(
            std::ptr::null_mut(),
            pages * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(base, libc::MAP_FAILED);
        let guard = base.cast::<u8>().add((pages - 1) * page);
        assert_eq!(libc::mprotect(guard.cast(), page, libc::PROT_NONE), 0);
        let start = guard.sub(image.len());
        std::ptr::copy_nonoverlapping(image.as_ptr(), start, image.len());
        start.cast()
    }
}

/// The library entry points the fat binary tests call.
struct Libraries {
    mem_info: MemInfo,
    load: LibraryLoadData,
    unload: Unload,
    get_kernel: GetKernel,
    kernel_library: HandleOf,
    kernel_function: HandleOf,
    library_module: HandleOf,
    library_global: GetGlobal,
}

impl Libraries {
    fn open(cuda: &Lib) -> Libraries {
        // SAFETY: the types are the signatures of cuda.h.
        unsafe {
            let mem_info: MemInfo = std::mem::transmute(cuda.sym("cuMemGetInfo_v2"));
            let load: LibraryLoadData = std::mem::transmute(cuda.sym("cuLibraryLoadData"));
            let unload: Unload = std::mem::transmute(cuda.sym("cuLibraryUnload"));
            let get_kernel: GetKernel = std::mem::transmute(cuda.sym("cuLibraryGetKernel"));
            let kernel_library: HandleOf = std::mem::transmute(cuda.sym("cuKernelGetLibrary"));
            let kernel_function: HandleOf = std::mem::transmute(cuda.sym("cuKernelGetFunction"));
            let library_module: HandleOf = std::mem::transmute(cuda.sym("cuLibraryGetModule"));
            let library_global: GetGlobal = std::mem::transmute(cuda.sym("cuLibraryGetGlobal"));
            Libraries {
                mem_info,
                load,
                unload,
                get_kernel,
                kernel_library,
                kernel_function,
                library_module,
                library_global,
            }
        }
    }

    /// cuLibraryLoadData of `code`, without options.
    fn load(&self, code: *const c_void) -> (c_int, *mut c_void) {
        let mut library = std::ptr::null_mut();
        let none = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; no options; code is the caller's image.
        let rc = unsafe {
            (self.load)(
                &mut library,
                code,
                none,
                none.cast(),
                0,
                none,
                none.cast(),
                0,
            )
        };
        (rc, library)
    }

    fn kernel(&self, library: *mut c_void, name: &std::ffi::CStr) -> *mut c_void {
        let mut kernel = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and C string.
        let rc = unsafe { (self.get_kernel)(&mut kernel, library, name.as_ptr()) };
        assert_eq!(rc, CUDA_SUCCESS);
        kernel
    }

    /// `of`(out, handle): its result and what it wrote.
    fn handle_of(&self, of: HandleOf, handle: *mut c_void) -> (c_int, *mut c_void) {
        let mut out = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the double vets the handle.
        let rc = unsafe { of(&mut out, handle) };
        (rc, out)
    }

    fn global(&self, library: *mut c_void) -> (c_int, u64, usize) {
        let (mut dptr, mut bytes) = (0u64, 0usize);
        // SAFETY: valid out-pointers and C string.
        let rc = unsafe { (self.library_global)(&mut dptr, &mut bytes, library, c"g".as_ptr()) };
        (rc, dptr, bytes)
    }

    fn used(&self) -> u64 {
        used(self.mem_info)
    }
}

#[test]
fn library_kernels_take_the_globals_in_each_context_they_are_used_in() {
    if !in_fresh_process(
        "library_kernels_take_the_globals_in_each_context_they_are_used_in",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
    ) {
        return;
    }
    let cuda = Lib::open("libcuda.so.1");
    let cu = common::in_process::Driver::open();
    let libs = Libraries::open(&cuda);
    // SAFETY: for all transmutes and calls below: the signatures are those of
    // cuda.h, and every pointer passed is valid for the call.
    unsafe {
        let release: Release = std::mem::transmute(cuda.sym("cuDevicePrimaryCtxRelease_v2"));
        let ctx_create: CtxCreate = std::mem::transmute(cuda.sym("cuCtxCreate_v2"));
        let ctx_destroy: CtxDestroy = std::mem::transmute(cuda.sym("cuCtxDestroy_v2"));
        let module_global: GetGlobal = std::mem::transmute(cuda.sym("cuModuleGetGlobal_v2"));
        let module_unload: Unload = std::mem::transmute(cuda.sym("cuModuleUnload"));
        let null = std::ptr::null_mut();
        assert_eq!((cu.init)(0), CUDA_SUCCESS);
        let (mut major, mut minor) = (0, 0);
        assert_eq!(
            (cu.attribute)(&mut major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0),
            CUDA_SUCCESS
        );
        assert_eq!(
            (cu.attribute)(&mut minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0),
            CUDA_SUCCESS
        );
        assert_eq!((major, minor), (9, 0), "an H100's");

        // Of its ELF entries, the first uncompressed one for sm_90 counts:
        // its .nv.global and .nv.global.init, nothing else.
        let globals = MIB + 256 * KIB;
        let other = cubin(&[(".nv.global", SHT_NOBITS, 64 * MIB)]);
        let image = fat_binary(&[
            Entry {
                kind: FATBIN_KIND_PTX,
                arch: 90,
                flags: 0,
                payload: b".version 9.0\n".to_vec(),
            },
            Entry::elf(80, 0, other.clone()),
            Entry::elf(90, FATBIN_ZSTD, other.clone()),
            Entry::elf(
                90,
                0,
                cubin(&[
                    (".nv.global", SHT_NOBITS, MIB),
                    (".nv.global.init", SHT_PROGBITS, 256 * KIB),
                    (".nv.constant0.k", SHT_PROGBITS, 64 * MIB),
                    (".text.k", SHT_PROGBITS, 64 * MIB),
                ]),
            ),
            Entry::elf(90, 0, other),
        ]);
        let wrapper = Wrapper::of(before_guard(&image));

        // Registered before any context exists, as the runtime may.
        let (rc, library) = libs.load((&raw const wrapper).cast());
        assert_eq!(rc, CUDA_SUCCESS);
        let kernel = libs.kernel(library, c"kernel_a");
        let second = libs.kernel(library, c"kernel_b");
        assert_ne!(kernel, second);
        assert_eq!(libs.kernel(library, c"kernel_a"), kernel);
        assert_eq!(
            libs.handle_of(libs.kernel_function, kernel).0,
            CUDA_ERROR_INVALID_CONTEXT
        );
        cu.start(0);
        assert_eq!(libs.used(), CTX);
        assert_eq!(
            libs.handle_of(libs.kernel_library, kernel),
            (CUDA_SUCCESS, library)
        );
        let function = cu.function();
        assert_eq!(
            libs.handle_of(libs.kernel_library, function).0,
            CUDA_ERROR_INVALID_HANDLE,
            "a module's function is no kernel"
        );
        assert_eq!(libs.used(), CTX);

        // The first launch, through any launch API, takes the globals once.
        let config = LaunchConfig {
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shared_mem_bytes: 0,
            stream: null,
            attrs: null,
            num_attrs: 0,
        };
        assert_eq!(
            (cu.launch_ex)(&config, kernel, null.cast(), null.cast()),
            CUDA_SUCCESS
        );
        assert_eq!(libs.used(), CTX + globals);
        assert_eq!(cu.run(cu.launch_ptsz, second, 1000, null), CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch, kernel, 1000, null), CUDA_SUCCESS);
        assert_eq!(libs.used(), CTX + globals);

        // Its global and its module in the context answer the same.
        let (rc, dptr, bytes) = libs.global(library);
        assert_eq!((rc, bytes as u64), (CUDA_SUCCESS, globals));
        assert_eq!(dptr % 512, 0);
        let (rc, module) = libs.handle_of(libs.library_module, library);
        assert_eq!(rc, CUDA_SUCCESS);
        let (mut module_dptr, mut module_bytes) = (0u64, 0usize);
        assert_eq!(
            module_global(&mut module_dptr, &mut module_bytes, module, c"g".as_ptr()),
            CUDA_SUCCESS
        );
        assert_eq!((module_dptr, module_bytes), (dptr, bytes));
        assert_eq!(module_unload(module), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(libs.used(), CTX + globals);

        // A fresh context: cuKernelGetFunction takes them there too.
        let mut created = null;
        assert_eq!(ctx_create(&mut created, 0, 0), CUDA_SUCCESS);
        assert_eq!(libs.used(), 2 * CTX + globals);
        let (rc, there) = libs.handle_of(libs.kernel_function, kernel);
        assert_eq!(rc, CUDA_SUCCESS);
        assert_ne!(there, kernel);
        assert_eq!(libs.used(), 2 * (CTX + globals));
        assert_eq!(
            libs.handle_of(libs.kernel_function, kernel),
            (CUDA_SUCCESS, there)
        );
        assert_eq!(cu.run(cu.launch, there, 1000, null), CUDA_SUCCESS);
        assert_eq!(cu.run(cu.launch, second, 1000, null), CUDA_SUCCESS);
        assert_eq!(libs.used(), 2 * (CTX + globals));
        // The context's end gives back what was taken in it.
        assert_eq!(ctx_destroy(created), CUDA_SUCCESS);
        assert_eq!((cu.set_current)(null), CUDA_SUCCESS);
        let mut primary = null;
        assert_eq!((cu.retain)(&mut primary, 0), CUDA_SUCCESS);
        assert_eq!((cu.set_current)(primary), CUDA_SUCCESS);
        assert_eq!(libs.used(), CTX + globals);
        assert_eq!(
            cu.run(cu.launch, there, 1000, null),
            CUDA_ERROR_INVALID_HANDLE,
            "its function went with the context"
        );
        // The GPU's last context: the library stays, to be used again.
        assert_eq!(release(0), CUDA_SUCCESS);
        assert_eq!(release(0), CUDA_SUCCESS);
        cu.start(0);
        assert_eq!(libs.used(), CTX);
        assert_eq!(cu.run(cu.launch, kernel, 1000, null), CUDA_SUCCESS);
        assert_eq!(libs.used(), CTX + globals);

        // Unloaded: the globals come back and its kernels are gone.
        assert_eq!((libs.unload)(library), CUDA_SUCCESS);
        assert_eq!(libs.used(), CTX);
        assert_eq!(
            libs.handle_of(libs.kernel_library, kernel).0,
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            cu.run(cu.launch, kernel, 1000, null),
            CUDA_ERROR_INVALID_HANDLE
        );

        // A first use that does not fit fails, takes nothing, runs nothing.
        let huge = one_global(4 * GIB);
        let (rc, library) = libs.load(huge.as_ptr().cast());
        assert_eq!(rc, CUDA_SUCCESS);
        let kernel = libs.kernel(library, c"k");
        // The earlier launches (one of the double's default 100 µs) have
        // finished: what runs from here is this launch's.
        assert_eq!((cu.ctx_synchronize)(), CUDA_SUCCESS);
        let from = now();
        assert_eq!(
            cu.run(cu.launch, kernel, 50 * common::MS, null),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!((cu.ctx_synchronize)(), CUDA_SUCCESS);
        assert_eq!(cu.busy(0, from, now()), 0, "the launch did not run");
        assert_eq!(
            libs.handle_of(libs.kernel_function, kernel).0,
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(
            libs.handle_of(libs.library_module, library).0,
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(libs.global(library).0, CUDA_ERROR_OUT_OF_MEMORY);
        assert_eq!(libs.used(), CTX);
        assert_eq!((libs.unload)(library), CUDA_SUCCESS);
    }
}

/// `image` with its container's count of entry bytes set to what follows
/// its header.
fn sized(mut image: Vec<u8>) -> Vec<u8> {
    let size = image.len() as u64 - 16;
    image[8..16].copy_from_slice(&size.to_le_bytes());
    image
}

/// `image` with `bytes` written at `at`.
fn patched(mut image: Vec<u8>, at: usize, bytes: &[u8]) -> Vec<u8> {
    image[at..at + bytes.len()].copy_from_slice(bytes);
    image
}

#[test]
fn malformed_fat_binaries_load_holding_nothing() {
    if !in_fresh_process(
        "malformed_fat_binaries_load_holding_nothing",
        &[("GPUSHARE_DOUBLE_TOTAL", "4g")],
    ) {
        return;
    }
    let cuda = Lib::open("libcuda.so.1");
    let cu = common::in_process::Driver::open();
    let libs = Libraries::open(&cuda);
    cu.start(0);
    // What the library at `code` takes at its first launch; each image ends
    // where an unreadable page begins, so a read past its end would crash.
    let first_use = |code: *const c_void| -> u64 {
        let (rc, library) = libs.load(code);
        assert_eq!(rc, CUDA_SUCCESS);
        let kernel = libs.kernel(library, c"k");
        assert_eq!(
            cu.run(cu.launch, kernel, 1000, std::ptr::null_mut()),
            CUDA_SUCCESS
        );
        let taken = libs.used() - CTX;
        // SAFETY: a library this closure loaded.
        assert_eq!(unsafe { (libs.unload)(library) }, CUDA_SUCCESS);
        assert_eq!(libs.used(), CTX);
        taken
    };
    let good = one_global(MIB);
    assert_eq!(first_use(before_guard(&good)), MIB);
    let shoff = PAYLOAD_AT + 0x28;
    let names = PAYLOAD_AT + ONE_SECTION_SHOFF + 64;
    let global = names + 64;
    let mut bad: Vec<(&str, Vec<u8>)> = Vec::new();
    for cut in [
        16,
        20,
        16 + 63,
        PAYLOAD_AT,
        PAYLOAD_AT + 40,
        global + 10,
        good.len() - 1,
    ] {
        bad.push(("truncated", sized(good[..cut].to_vec())));
    }
    for (what, at, bytes) in [
        (
            "an entry header under 64 bytes",
            16 + 4,
            &0u32.to_le_bytes()[..],
        ),
        (
            "a payload past the end",
            16 + 8,
            &u64::MAX.to_le_bytes()[..],
        ),
        ("compressed size set", 16 + 16, &8u32.to_le_bytes()[..]),
        ("zstd", 16 + 40, &FATBIN_ZSTD.to_le_bytes()[..]),
        ("lz4", 16 + 40, &FATBIN_LZ4.to_le_bytes()[..]),
        ("another arch", 16 + 28, &80u32.to_le_bytes()[..]),
        ("a PTX entry", 16, &FATBIN_KIND_PTX.to_le_bytes()[..]),
        ("container version 2", 4, &2u16.to_le_bytes()[..]),
        ("a 32-byte container header", 6, &32u16.to_le_bytes()[..]),
        ("not ELF", PAYLOAD_AT, b"\x7fELG"),
        ("ELF32", PAYLOAD_AT + 4, &[1]),
        ("big endian", PAYLOAD_AT + 5, &[2]),
        (
            "sections past the end",
            shoff,
            &(u64::MAX - 8).to_le_bytes()[..],
        ),
        (
            "65535 sections",
            PAYLOAD_AT + 0x3c,
            &u16::MAX.to_le_bytes()[..],
        ),
        (
            "8-byte section headers",
            PAYLOAD_AT + 0x3a,
            &8u16.to_le_bytes()[..],
        ),
        (
            "no name section",
            PAYLOAD_AT + 0x3e,
            &7u16.to_le_bytes()[..],
        ),
        (
            "names past the end",
            names + 0x18,
            &u64::MAX.to_le_bytes()[..],
        ),
        (
            "names longer than the cubin",
            names + 0x20,
            &4096u64.to_le_bytes()[..],
        ),
        ("a name past the names", global, &1000u32.to_le_bytes()[..]),
        ("a name cut short", names + 0x20, &13u64.to_le_bytes()[..]),
    ] {
        bad.push((what, patched(good.clone(), at, bytes)));
    }
    for (what, image) in &bad {
        assert_eq!(first_use(before_guard(image)), 0, "{what}");
        let wrapper = Wrapper::of(before_guard(image));
        assert_eq!(first_use((&raw const wrapper).cast()), 0, "{what}, wrapped");
    }
    // A wrapper of nothing, or of something else.
    let text = c"gpushare-double-module globals=1048576";
    for data in [std::ptr::null(), text.as_ptr().cast()] {
        let wrapper = Wrapper::of(data);
        assert_eq!(first_use((&raw const wrapper).cast()), 0);
    }
    // A text image is no fat binary: its globals come with the load.
    let (rc, library) = libs.load(text.as_ptr().cast());
    assert_eq!((rc, libs.used()), (CUDA_SUCCESS, CTX + MIB));
    // SAFETY: the library just loaded.
    assert_eq!(unsafe { (libs.unload)(library) }, CUDA_SUCCESS);
}

//! Memory the double's driver takes without an allocation call: created
//! contexts, context limits, module globals, graph memory and pool memory
//! count in cuMemGetInfo and NVML, refuse what does not fit, and come back
//! when unloaded, destroyed, trimmed or released.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{CString, c_char, c_int, c_uint, c_void};

mod common;

use common::in_process::Lib;
use common::{
    CTX, CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS, GIB, MIB, VARIANTS, in_fresh_process, lines, run,
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
    ] {
        common::assert_malformed(script);
    }
    for script in [
        "info unload 0",
        "info graph_upload 0",
        "info context_destroy 0",
    ] {
        let output = run("cudaprobe", &[], script, &[]);
        assert_eq!(output.status.code(), Some(2), "{script}");
        assert_eq!(String::from_utf8_lossy(&output.stdout).lines().count(), 1);
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
    // SAFETY (all transmutes and calls below): the signatures are those of
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
    // SAFETY (all transmutes and calls below): the signatures are those of
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

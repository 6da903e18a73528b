/*
 * cudaprobe: drives the CUDA driver API and NVML from a small command script,
 * one output line per command, for tests that preload the limiter.
 *
 * Built twice from this source:
 * - cudaprobe: reaches the driver only through dlopen("libcuda.so.1") and
 *   dlopen("libnvidia-ml.so.1") (both at start, before cuInit), then dlsym;
 *   or, with --via getproc, dlsym of cuGetProcAddress_v2 alone and every other
 *   cu* pointer through it (base names, cudaVersion 13000, flags 0, or flags 2
 *   for the _ptsz APIs; the legacy v1 cuMemGetInfo and cuDeviceTotalMem with
 *   cudaVersion 3010). NVML functions always come from dlsym. The compute
 *   entry points (modules, launches, streams, graphs) are optional there: one
 *   the driver lacks fails its command with CUDA_ERROR_NOT_FOUND (500).
 * - cudaprobe_linked (-DCUDAPROBE_LINKED): linked with -lcuda -lnvidia-ml and
 *   calling the functions directly (through the PLT).
 *
 * Usage: cudaprobe [--via dlsym|getproc] [--device N] CMD...
 * Start: cuInit(0), cuDeviceGet(N), cuDevicePrimaryCtxRetain, cuCtxSetCurrent;
 * a failure there prints "cudaprobe: <step> failed: <CUresult>" on stderr and
 * exits 1. Then the commands run left to right, each printing one line on
 * stdout (flushed), RESULT being the numeric CUresult / nvmlReturn_t, SIZE
 * echoed as written (digits with an optional binary k/m/g/t suffix):
 *
 *   alloc API SIZE        -> "alloc API SIZE -> RESULT ID" (ID "-" on failure)
 *       mem      cuMemAlloc_v2(SIZE)
 *       pitch    cuMemAllocPitch_v2(width SIZE, height 1, element 4)
 *       managed  cuMemAllocManaged(SIZE, CU_MEM_ATTACH_GLOBAL)
 *       async    cuMemAllocAsync(SIZE, stream 0)        async_ptsz  its _ptsz
 *       pool     cuMemAllocFromPoolAsync(SIZE, NULL pool, stream 0)
 *                                                      pool_ptsz   its _ptsz
 *       create   cuMemCreate(SIZE, pinned, device N); SIZE must be a multiple
 *                of the 2 MiB granularity, as for the real driver
 *       array    cuArrayCreate_v2(UNSIGNED_INT8, 1 channel, Width SIZE, Height 1)
 *       array3d  cuArray3DCreate_v2(same, Depth 1)
 *       mipmap   cuMipmappedArrayCreate(same as array3d, 1 level)
 *     IDs are 0, 1, 2, ... over every successful allocation, fill's included.
 *   free ID               -> "free ID -> RESULT", with the API matching the
 *                            allocation (async/pool: cuMemFreeAsync(_ptsz) on
 *                            stream 0, then cuCtxSynchronize); freeing an ID
 *                            twice calls the driver twice
 *   info                  -> "info RESULT free=F total=T"     (cuMemGetInfo_v2)
 *   info_v1               -> "info_v1 RESULT free=F total=T"  (cuMemGetInfo)
 *   totalmem              -> "totalmem RESULT T"              (cuDeviceTotalMem_v2)
 *   totalmem_v1           -> "totalmem_v1 RESULT T"           (cuDeviceTotalMem)
 *   nvml                  -> "nvml RESULT free=F used=U total=T": nvmlInit_v2,
 *                            nvmlDeviceGetHandleByIndex_v2(N),
 *                            nvmlDeviceGetMemoryInfo, nvmlShutdown
 *   nvml_v2               -> "nvml_v2 RESULT free=F used=U total=T", the same
 *                            with nvmlDeviceGetMemoryInfo_v2
 *   nvml_procs            -> "nvml_procs RESULT count=N used=U": the processes
 *                            of nvmlDeviceGetComputeRunningProcesses_v3 (sized
 *                            by a first call with count 0), U the usage of the
 *                            entry with our pid (0 if none)
 *   fill SIZE             -> "fill SIZE count=N last=RESULT": cuMemAlloc_v2(SIZE)
 *                            until the first failure; the blocks stay allocated
 *   hammer THREADS ITERS SIZE
 *                         -> "hammer ok=A oom=B other=C": each thread sets the
 *                            context, then ITERS cuMemAlloc_v2/cuMemFree_v2
 *                            pairs; ok = pairs that succeeded, oom = allocations
 *                            that failed with OUT_OF_MEMORY, other = any other
 *                            failure of either call
 *   ptr ID                -> "ptr ID -> RESULT type=T size=S start=B": T the
 *                            CU_POINTER_ATTRIBUTE_MEMORY_TYPE of ID's pointer
 *                            (1 host, 2 device), S and B from
 *                            cuMemGetAddressRange_v2 of the pointer + 1: the
 *                            range's size and 1 if it starts at the pointer;
 *                            RESULT the first failure of the two calls
 *   freeall               -> "freeall RESULT": frees every live ID in order;
 *                            the first non-zero result, or 0
 *   sleep MS              -> "sleep MS", printed after sleeping
 *   wait                  -> "ready", then blocks until a line (or EOF) on
 *                            stdin, then "resumed"
 *   pid                   -> "pid N"
 *
 * Compute. Kernels are the spin kernel (spin_ptx below: one u64 parameter,
 * the ns it busy-waits on the GPU's global timer; the double's simulated
 * clock reads the same parameter as the kernel's duration), grid and block
 * 1x1x1, on the legacy default stream (NULL; the per-thread one for _ptsz).
 * API is one of:
 *       kernel      cuLaunchKernel              kernel_ptsz  its _ptsz
 *       ex          cuLaunchKernelEx            ex_ptsz      its _ptsz
 *       coop        cuLaunchCooperativeKernel   coop_ptsz    its _ptsz
 *       graph       cuGraphLaunch of a graph exec holding one kernel, captured
 *                   (cuStreamBeginCapture_v2, global mode, cuLaunchKernel,
 *                   cuStreamEndCapture) on a created stream and instantiated
 *                   before the clock starts; destroyed after
 *                                               graph_ptsz   cuGraphLaunch_ptsz
 *       legacy      cuLaunch                    grid         cuLaunchGrid(1, 1)
 *       grid_async  cuLaunchGridAsync(1, 1, NULL); these three launch
 *                   gpushare_spin_default, which takes no parameter and
 *                   spins 100 µs: on the double their kernels last
 *                   GPUSHARE_DOUBLE_KERNEL_NS (default 100 µs) whatever
 *                   DUR_US says
 * Each measured command stops at the first failed launch, then calls
 * cuCtxSynchronize; RESULT is the first failure of a launch (or of the
 * setup before it), else of the synchronize. W (wall_ns) runs from just
 * before the first launch to the return of cuCtxSynchronize; B (busy_ns) is
 * the device's busy time within it from the double's accessor
 * gpushare_double_busy_ns (found with dlsym; 0 on a real driver, which has
 * none); S (share_pm) = 1000 * B / W, rounded down. All times in ns.
 *   spin API DUR_US COUNT -> "spin API DUR_US COUNT -> RESULT wall_ns=W busy_ns=B
 *                            share_pm=S": COUNT launches of DUR_US µs kernels,
 *                            back to back
 *   run API DUR_US MS     -> "run API DUR_US MS -> RESULT launches=N wall_ns=W
 *                            busy_ns=B share_pm=S": launches as fast as the API
 *                            returns until MS ms have passed since the first;
 *                            N = successful launches
 *   pace API DUR_US COUNT HOST_US
 *                         -> "pace API DUR_US COUNT HOST_US -> RESULT
 *                            ns_per_iter=X": COUNT times (HOST_US µs of
 *                            busy-waiting on the host, then one launch);
 *                            X = W / COUNT (0 when COUNT is 0)
 *   shapes N DUR_US COUNT HOST_US
 *                         -> "shapes N DUR_US COUNT HOST_US -> RESULT
 *                            ns_per_iter=X busy_ns=B share_pm=S": as pace with
 *                            cuLaunchKernel, but launch i has a grid of
 *                            1 + (i * 7919) % N blocks of 128 threads (N
 *                            distinct shapes; every block spins DUR_US, so on
 *                            the double a kernel lasts DUR_US per wave of
 *                            132 * 16 blocks); HOST_US 0 launches back to back
 *   functions F DUR_US COUNT HOST_US
 *                         -> "functions F DUR_US COUNT HOST_US -> RESULT
 *                            ns_per_iter=X busy_ns=B share_pm=S": as pace with
 *                            cuLaunchKernel of 1x1 grids, but launch i runs
 *                            function i % F, each a distinct handle named
 *                            gpushare_spin_f<k> (the double's modules hold any
 *                            name; a real driver answers NOT_FOUND)
 *   series WINDOW_MS      -> "series WINDOW_MS pm=a,b,c": for the last spin,
 *                            run or pace, the busy share in per mille of each
 *                            whole WINDOW_MS window from the start of its W
 *                            on (a partial last window is left out; "pm=" when
 *                            none fits)
 *   maxstall              -> "maxstall ns=X": the longest a single launch call
 *                            of the last spin, run or pace took to return
 *   idle STEP_US          -> "idle STEP_US at=a-b,c-d": the stretches of the
 *                            last spin, run or pace during which the device
 *                            was idle for at least a whole STEP_US window,
 *                            from the start of the first such window to the
 *                            end of the last, CLOCK_MONOTONIC ns ("at=" when
 *                            none)
 *   clock                 -> "clock ns=N": CLOCK_MONOTONIC now
 *
 * Numbers are printed in decimal; on a failed query the figures are 0. Exit
 * status 0, or 2 with a message on stderr for a malformed script (checked in
 * full before anything runs; series and maxstall need an earlier spin, run or
 * pace, and series a WINDOW_MS of 1 or more) or an unknown ID.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_min.h"
#include "double_common.h"

#define CUDA_VERSION_USED 13000
#define CUDA_VERSION_LEGACY 3010

/* (function, base name for cuGetProcAddress, cudaVersion, flags) */
#define CU_FUNCS(X)                                                                     \
    X(cuInit, "cuInit", CUDA_VERSION_USED, 0)                                           \
    X(cuDeviceGet, "cuDeviceGet", CUDA_VERSION_USED, 0)                                 \
    X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", CUDA_VERSION_USED, 0)       \
    X(cuCtxSetCurrent, "cuCtxSetCurrent", CUDA_VERSION_USED, 0)                         \
    X(cuCtxSynchronize, "cuCtxSynchronize", CUDA_VERSION_USED, 0)                       \
    X(cuMemGetInfo, "cuMemGetInfo", CUDA_VERSION_LEGACY, 0)                             \
    X(cuMemGetInfo_v2, "cuMemGetInfo", CUDA_VERSION_USED, 0)                            \
    X(cuDeviceTotalMem, "cuDeviceTotalMem", CUDA_VERSION_LEGACY, 0)                     \
    X(cuDeviceTotalMem_v2, "cuDeviceTotalMem", CUDA_VERSION_USED, 0)                    \
    X(cuMemAlloc_v2, "cuMemAlloc", CUDA_VERSION_USED, 0)                                \
    X(cuMemAllocPitch_v2, "cuMemAllocPitch", CUDA_VERSION_USED, 0)                      \
    X(cuMemAllocManaged, "cuMemAllocManaged", CUDA_VERSION_USED, 0)                     \
    X(cuMemAllocAsync, "cuMemAllocAsync", CUDA_VERSION_USED, 0)                         \
    X(cuMemAllocAsync_ptsz, "cuMemAllocAsync", CUDA_VERSION_USED, 2)                    \
    X(cuMemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", CUDA_VERSION_USED, 0)         \
    X(cuMemAllocFromPoolAsync_ptsz, "cuMemAllocFromPoolAsync", CUDA_VERSION_USED, 2)    \
    X(cuMemFree_v2, "cuMemFree", CUDA_VERSION_USED, 0)                                  \
    X(cuMemFreeAsync, "cuMemFreeAsync", CUDA_VERSION_USED, 0)                           \
    X(cuMemFreeAsync_ptsz, "cuMemFreeAsync", CUDA_VERSION_USED, 2)                      \
    X(cuMemCreate, "cuMemCreate", CUDA_VERSION_USED, 0)                                 \
    X(cuMemRelease, "cuMemRelease", CUDA_VERSION_USED, 0)                               \
    X(cuArrayCreate_v2, "cuArrayCreate", CUDA_VERSION_USED, 0)                          \
    X(cuArray3DCreate_v2, "cuArray3DCreate", CUDA_VERSION_USED, 0)                      \
    X(cuArrayDestroy, "cuArrayDestroy", CUDA_VERSION_USED, 0)                           \
    X(cuMipmappedArrayCreate, "cuMipmappedArrayCreate", CUDA_VERSION_USED, 0)           \
    X(cuMipmappedArrayDestroy, "cuMipmappedArrayDestroy", CUDA_VERSION_USED, 0)

/*
 * The compute entry points, optional in the dlopen build: a real driver may
 * lack the legacy launches, and a command that needs a missing one reports
 * CUDA_ERROR_NOT_FOUND (500) instead of the probe failing to start.
 */
#define CU_COMPUTE_FUNCS(X)                                                             \
    X(cuModuleLoadData, "cuModuleLoadData", CUDA_VERSION_USED, 0)                       \
    X(cuModuleGetFunction, "cuModuleGetFunction", CUDA_VERSION_USED, 0)                 \
    X(cuLaunchKernel, "cuLaunchKernel", CUDA_VERSION_USED, 0)                           \
    X(cuLaunchKernel_ptsz, "cuLaunchKernel", CUDA_VERSION_USED, 2)                      \
    X(cuLaunchKernelEx, "cuLaunchKernelEx", CUDA_VERSION_USED, 0)                       \
    X(cuLaunchKernelEx_ptsz, "cuLaunchKernelEx", CUDA_VERSION_USED, 2)                  \
    X(cuLaunchCooperativeKernel, "cuLaunchCooperativeKernel", CUDA_VERSION_USED, 0)     \
    X(cuLaunchCooperativeKernel_ptsz, "cuLaunchCooperativeKernel", CUDA_VERSION_USED, 2) \
    X(cuLaunch, "cuLaunch", CUDA_VERSION_USED, 0)                                       \
    X(cuLaunchGrid, "cuLaunchGrid", CUDA_VERSION_USED, 0)                               \
    X(cuLaunchGridAsync, "cuLaunchGridAsync", CUDA_VERSION_USED, 0)                     \
    X(cuGraphLaunch, "cuGraphLaunch", CUDA_VERSION_USED, 0)                             \
    X(cuGraphLaunch_ptsz, "cuGraphLaunch", CUDA_VERSION_USED, 2)                        \
    X(cuStreamCreate, "cuStreamCreate", CUDA_VERSION_USED, 0)                           \
    X(cuStreamDestroy_v2, "cuStreamDestroy", CUDA_VERSION_USED, 0)                      \
    X(cuStreamBeginCapture_v2, "cuStreamBeginCapture", CUDA_VERSION_USED, 0)            \
    X(cuStreamEndCapture, "cuStreamEndCapture", CUDA_VERSION_USED, 0)                   \
    X(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags", CUDA_VERSION_USED, 0) \
    X(cuGraphExecDestroy, "cuGraphExecDestroy", CUDA_VERSION_USED, 0)                   \
    X(cuGraphDestroy, "cuGraphDestroy", CUDA_VERSION_USED, 0)                           \
    X(cuPointerGetAttribute, "cuPointerGetAttribute", CUDA_VERSION_USED, 0)             \
    X(cuMemGetAddressRange_v2, "cuMemGetAddressRange", CUDA_VERSION_USED, 0)

#define NVML_FUNCS(X)                                                                   \
    X(nvmlInit_v2)                                                                      \
    X(nvmlShutdown)                                                                     \
    X(nvmlDeviceGetHandleByIndex_v2)                                                    \
    X(nvmlDeviceGetMemoryInfo)                                                          \
    X(nvmlDeviceGetMemoryInfo_v2)                                                       \
    X(nvmlDeviceGetComputeRunningProcesses_v3)

#ifdef CUDAPROBE_LINKED
#define CU(name) name
#define CU_OPT(name, ...) name(__VA_ARGS__)
#define NVML(name) name
#else
static struct {
#define CU_SLOT(name, base, version, flags) __typeof__(&name) name;
    CU_FUNCS(CU_SLOT)
    CU_COMPUTE_FUNCS(CU_SLOT)
#undef CU_SLOT
#define NVML_SLOT(name) __typeof__(&name) name;
    NVML_FUNCS(NVML_SLOT)
#undef NVML_SLOT
} drv;
#define CU(name) drv.name
#define CU_OPT(name, ...) (drv.name == NULL ? CUDA_ERROR_NOT_FOUND : drv.name(__VA_ARGS__))
#define NVML(name) drv.name
#endif

/* The double's busy-time accessor; NULL on a real driver. */
static gpushare_double_busy_fn busy_fn;

static void die(int status, const char *fmt, ...)
    __attribute__((noreturn, format(printf, 2, 3)));

/* Exit status 1: the environment failed us; 2: the script is malformed. */
static void die(int status, const char *fmt, ...) {
    va_list ap;
    fputs("cudaprobe: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

#ifndef CUDAPROBE_LINKED
static void *symbol(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (p == NULL) {
        die(1, "dlsym %s failed", name);
    }
    return p;
}

static void load_api(int via_getproc) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    void *busy;
    void *nvml;
    if (cuda == NULL) {
        die(1, "%s", dlerror());
    }
    nvml = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (nvml == NULL) {
        die(1, "%s", dlerror());
    }
    if (via_getproc) {
        __typeof__(&cuGetProcAddress_v2) getproc =
            (__typeof__(&cuGetProcAddress_v2))symbol(cuda, "cuGetProcAddress_v2");
        CUdriverProcAddressQueryResult status;
        void *p;
#define CU_GETPROC(name, base, version, flags)                                          \
    p = NULL;                                                                           \
    if (getproc(base, &p, version, flags, &status) != CUDA_SUCCESS || p == NULL ||      \
        status != CU_GET_PROC_ADDRESS_SUCCESS) {                                        \
        die(1, "cuGetProcAddress_v2(%s) failed", base);                                 \
    }                                                                                   \
    drv.name = (__typeof__(&name))p;
        CU_FUNCS(CU_GETPROC)
#undef CU_GETPROC
#define CU_GETPROC_OPT(name, base, version, flags)                                      \
    p = NULL;                                                                           \
    if (getproc(base, &p, version, flags, &status) == CUDA_SUCCESS &&                   \
        status == CU_GET_PROC_ADDRESS_SUCCESS) {                                        \
        drv.name = (__typeof__(&name))p;                                                \
    }
        CU_COMPUTE_FUNCS(CU_GETPROC_OPT)
#undef CU_GETPROC_OPT
    } else {
#define CU_DLSYM(name, base, version, flags) drv.name = (__typeof__(&name))symbol(cuda, #name);
        CU_FUNCS(CU_DLSYM)
#undef CU_DLSYM
#define CU_DLSYM_OPT(name, base, version, flags) drv.name = (__typeof__(&name))dlsym(cuda, #name);
        CU_COMPUTE_FUNCS(CU_DLSYM_OPT)
#undef CU_DLSYM_OPT
    }
    busy = dlsym(cuda, GPUSHARE_DOUBLE_BUSY_SYMBOL);
    memcpy(&busy_fn, &busy, sizeof busy_fn);
#define NVML_DLSYM(name) drv.name = (__typeof__(&name))symbol(nvml, #name);
    NVML_FUNCS(NVML_DLSYM)
#undef NVML_DLSYM
}
#endif

/* ---------------------------------------------------------------- allocations */

enum api_kind {
    API_MEM,
    API_PITCH,
    API_MANAGED,
    API_ASYNC,
    API_ASYNC_PTSZ,
    API_POOL,
    API_POOL_PTSZ,
    API_CREATE,
    API_ARRAY,
    API_ARRAY3D,
    API_MIPMAP,
    API_COUNT
};

static const char *const api_names[API_COUNT] = {
    "mem", "pitch", "managed", "async", "async_ptsz", "pool", "pool_ptsz",
    "create", "array", "array3d", "mipmap",
};

/* The launch APIs of spin, run and pace. */
enum launch_api {
    LAUNCH_KERNEL,
    LAUNCH_KERNEL_PTSZ,
    LAUNCH_EX,
    LAUNCH_EX_PTSZ,
    LAUNCH_COOP,
    LAUNCH_COOP_PTSZ,
    LAUNCH_GRAPH,
    LAUNCH_GRAPH_PTSZ,
    LAUNCH_LEGACY,
    LAUNCH_GRID,
    LAUNCH_GRID_ASYNC,
    LAUNCH_COUNT
};

static const char *const launch_names[LAUNCH_COUNT] = {
    "kernel", "kernel_ptsz", "ex",     "ex_ptsz", "coop",      "coop_ptsz",
    "graph",  "graph_ptsz",  "legacy", "grid",    "grid_async",
};

struct record {
    enum api_kind api;
    unsigned long long handle; /* CUdeviceptr, allocation handle, or array */
    int live;
};

static struct record *records;
static size_t record_count, record_cap;
static int device_ordinal;
static CUdevice device;
static CUcontext context;

static size_t remember(enum api_kind api, unsigned long long handle) {
    if (record_count == record_cap) {
        size_t cap = record_cap ? record_cap * 2 : 64;
        struct record *grown = realloc(records, cap * sizeof *grown);
        if (grown == NULL) {
            die(1, "out of host memory");
        }
        records = grown;
        record_cap = cap;
    }
    records[record_count].api = api;
    records[record_count].handle = handle;
    records[record_count].live = 1;
    return record_count++;
}

static CUresult do_alloc(enum api_kind api, size_t size, unsigned long long *handle) {
    CUdeviceptr dptr = 0;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    switch (api) {
    case API_MEM:
        rc = CU(cuMemAlloc_v2)(&dptr, size);
        break;
    case API_PITCH: {
        size_t pitch = 0;
        rc = CU(cuMemAllocPitch_v2)(&dptr, &pitch, size, 1, 4);
        break;
    }
    case API_MANAGED:
        rc = CU(cuMemAllocManaged)(&dptr, size, CU_MEM_ATTACH_GLOBAL);
        break;
    case API_ASYNC:
        rc = CU(cuMemAllocAsync)(&dptr, size, NULL);
        break;
    case API_ASYNC_PTSZ:
        rc = CU(cuMemAllocAsync_ptsz)(&dptr, size, NULL);
        break;
    case API_POOL:
        rc = CU(cuMemAllocFromPoolAsync)(&dptr, size, NULL, NULL);
        break;
    case API_POOL_PTSZ:
        rc = CU(cuMemAllocFromPoolAsync_ptsz)(&dptr, size, NULL, NULL);
        break;
    case API_CREATE: {
        CUmemAllocationProp prop;
        CUmemGenericAllocationHandle h = 0;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        rc = CU(cuMemCreate)(&h, size, &prop, 0);
        dptr = h;
        break;
    }
    case API_ARRAY: {
        CUDA_ARRAY_DESCRIPTOR desc;
        CUarray array = NULL;
        memset(&desc, 0, sizeof desc);
        desc.Width = size;
        desc.Height = 1;
        desc.Format = CU_AD_FORMAT_UNSIGNED_INT8;
        desc.NumChannels = 1;
        rc = CU(cuArrayCreate_v2)(&array, &desc);
        dptr = (uintptr_t)array;
        break;
    }
    case API_ARRAY3D:
    case API_MIPMAP: {
        CUDA_ARRAY3D_DESCRIPTOR desc;
        memset(&desc, 0, sizeof desc);
        desc.Width = size;
        desc.Height = 1;
        desc.Depth = 1;
        desc.Format = CU_AD_FORMAT_UNSIGNED_INT8;
        desc.NumChannels = 1;
        if (api == API_ARRAY3D) {
            CUarray array = NULL;
            rc = CU(cuArray3DCreate_v2)(&array, &desc);
            dptr = (uintptr_t)array;
        } else {
            CUmipmappedArray mipmap = NULL;
            rc = CU(cuMipmappedArrayCreate)(&mipmap, &desc, 1);
            dptr = (uintptr_t)mipmap;
        }
        break;
    }
    case API_COUNT:
        break;
    }
    *handle = dptr;
    return rc;
}

static CUresult do_free(const struct record *r) {
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    switch (r->api) {
    case API_MEM:
    case API_PITCH:
    case API_MANAGED:
        rc = CU(cuMemFree_v2)(r->handle);
        break;
    case API_ASYNC:
    case API_POOL:
        rc = CU(cuMemFreeAsync)(r->handle, NULL);
        if (rc == CUDA_SUCCESS) {
            rc = CU(cuCtxSynchronize)();
        }
        break;
    case API_ASYNC_PTSZ:
    case API_POOL_PTSZ:
        rc = CU(cuMemFreeAsync_ptsz)(r->handle, NULL);
        if (rc == CUDA_SUCCESS) {
            rc = CU(cuCtxSynchronize)();
        }
        break;
    case API_CREATE:
        rc = CU(cuMemRelease)(r->handle);
        break;
    case API_ARRAY:
    case API_ARRAY3D:
        rc = CU(cuArrayDestroy)((CUarray)(uintptr_t)r->handle);
        break;
    case API_MIPMAP:
        rc = CU(cuMipmappedArrayDestroy)((CUmipmappedArray)(uintptr_t)r->handle);
        break;
    case API_COUNT:
        break;
    }
    return rc;
}

/* ---------------------------------------------------------------- parsing */

static int parse_u64(const char *text, unsigned long long *out, int allow_suffix) {
    char *end = NULL;
    unsigned long long value;
    unsigned shift = 0;
    if (text == NULL || *text < '0' || *text > '9') {
        return -1;
    }
    errno = 0;
    value = strtoull(text, &end, 10);
    if (errno != 0) {
        return -1;
    }
    if (allow_suffix) {
        switch (*end) {
        case 'k': case 'K': shift = 10; end++; break;
        case 'm': case 'M': shift = 20; end++; break;
        case 'g': case 'G': shift = 30; end++; break;
        case 't': case 'T': shift = 40; end++; break;
        default: break;
        }
    }
    if (*end != '\0' || (shift != 0 && value > (~0ULL >> shift))) {
        return -1;
    }
    *out = value << shift;
    return 0;
}

static size_t arg_size(const char *text) {
    unsigned long long v = 0;
    if (parse_u64(text, &v, 1) != 0 || v > SIZE_MAX) {
        die(2, "bad size '%s'", text ? text : "");
    }
    return (size_t)v;
}

static unsigned long long arg_number(const char *text) {
    unsigned long long v = 0;
    if (parse_u64(text, &v, 0) != 0) {
        die(2, "bad number '%s'", text ? text : "");
    }
    return v;
}

/* The index of `text` among the `count` names; dies naming `what` if absent. */
static int arg_name(const char *text, const char *const *names, int count, const char *what) {
    int i;
    for (i = 0; i < count; i++) {
        if (text != NULL && strcmp(text, names[i]) == 0) {
            return i;
        }
    }
    die(2, "unknown %s API '%s'", what, text ? text : "");
    return count;
}

static enum api_kind arg_api(const char *text) {
    return (enum api_kind)arg_name(text, api_names, API_COUNT, "allocation");
}

static enum launch_api arg_launch(const char *text) {
    return (enum launch_api)arg_name(text, launch_names, LAUNCH_COUNT, "launch");
}

/* ---------------------------------------------------------------- commands */

static void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* One output line, flushed at once: tests read it while we run. */
static void emit(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
}

struct hammer_job {
    unsigned long long iters;
    size_t size;
    unsigned long long ok, oom, other;
};

static void *hammer_thread(void *arg) {
    struct hammer_job *job = arg;
    unsigned long long i;
    if (CU(cuCtxSetCurrent)(context) != CUDA_SUCCESS) {
        job->other += job->iters;
        return NULL;
    }
    for (i = 0; i < job->iters; i++) {
        CUdeviceptr p = 0;
        CUresult rc = CU(cuMemAlloc_v2)(&p, job->size);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            job->oom++;
        } else if (rc != CUDA_SUCCESS) {
            job->other++;
        } else if (CU(cuMemFree_v2)(p) != CUDA_SUCCESS) {
            job->other++;
        } else {
            job->ok++;
        }
    }
    return NULL;
}

static void cmd_hammer(unsigned long long threads, unsigned long long iters, size_t size) {
    pthread_t *ids = calloc(threads, sizeof *ids);
    struct hammer_job *jobs = calloc(threads, sizeof *jobs);
    unsigned long long i, ok = 0, oom = 0, other = 0;
    if (ids == NULL || jobs == NULL) {
        die(1, "out of host memory");
    }
    for (i = 0; i < threads; i++) {
        jobs[i].iters = iters;
        jobs[i].size = size;
        if (pthread_create(&ids[i], NULL, hammer_thread, &jobs[i]) != 0) {
            die(1, "pthread_create failed");
        }
    }
    for (i = 0; i < threads; i++) {
        pthread_join(ids[i], NULL);
        ok += jobs[i].ok;
        oom += jobs[i].oom;
        other += jobs[i].other;
    }
    free(ids);
    free(jobs);
    emit("hammer ok=%llu oom=%llu other=%llu", ok, oom, other);
}

static void cmd_nvml(const char *name, int v2) {
    nvmlDevice_t dev = NULL;
    unsigned long long total = 0, free_bytes = 0, used = 0;
    nvmlReturn_t rc = NVML(nvmlInit_v2)();
    if (rc == NVML_SUCCESS) {
        rc = NVML(nvmlDeviceGetHandleByIndex_v2)((unsigned)device_ordinal, &dev);
        if (rc == NVML_SUCCESS && v2) {
            nvmlMemory_v2_t m;
            memset(&m, 0, sizeof m);
            m.version = nvmlMemory_v2;
            rc = NVML(nvmlDeviceGetMemoryInfo_v2)(dev, &m);
            if (rc == NVML_SUCCESS) {
                total = m.total;
                free_bytes = m.free;
                used = m.used;
            }
        } else if (rc == NVML_SUCCESS) {
            nvmlMemory_t m;
            memset(&m, 0, sizeof m);
            rc = NVML(nvmlDeviceGetMemoryInfo)(dev, &m);
            if (rc == NVML_SUCCESS) {
                total = m.total;
                free_bytes = m.free;
                used = m.used;
            }
        }
        {
            nvmlReturn_t down = NVML(nvmlShutdown)();
            if (rc == NVML_SUCCESS) {
                rc = down;
            }
        }
    }
    emit("%s %d free=%llu used=%llu total=%llu", name, (int)rc, free_bytes, used, total);
}

static void cmd_nvml_procs(void) {
    nvmlDevice_t dev = NULL;
    unsigned int count = 0, i;
    unsigned long long used = 0;
    nvmlProcessInfo_t *infos = NULL;
    nvmlReturn_t rc = NVML(nvmlInit_v2)();
    if (rc == NVML_SUCCESS) {
        rc = NVML(nvmlDeviceGetHandleByIndex_v2)((unsigned)device_ordinal, &dev);
        if (rc == NVML_SUCCESS) {
            rc = NVML(nvmlDeviceGetComputeRunningProcesses_v3)(dev, &count, NULL);
            if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
                infos = calloc(count, sizeof *infos);
                if (infos == NULL) {
                    die(1, "out of host memory");
                }
                rc = NVML(nvmlDeviceGetComputeRunningProcesses_v3)(dev, &count, infos);
            }
            if (rc != NVML_SUCCESS) {
                count = 0;
            }
            for (i = 0; i < count; i++) {
                if (infos[i].pid == (unsigned int)getpid()) {
                    used = infos[i].usedGpuMemory;
                }
            }
            free(infos);
        }
        {
            nvmlReturn_t down = NVML(nvmlShutdown)();
            if (rc == NVML_SUCCESS) {
                rc = down;
            }
        }
    }
    emit("nvml_procs %d count=%u used=%llu", (int)rc, count, used);
}

/* ---------------------------------------------------------------- compute */

/*
 * The spin kernels: gpushare_spin busy-waits on the GPU's global timer for
 * its one parameter, in ns; gpushare_spin_default, for the legacy launches
 * that pass no parameter, for 100 µs (the double's default kernel time). The
 * double runs any image; a real GPU JIT-compiles this.
 */
static const char spin_ptx[] =
    ".version 6.4\n"
    ".target sm_75\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry gpushare_spin(.param .u64 gpushare_spin_ns)\n"
    "{\n"
    "    .reg .pred %p<2>;\n"
    "    .reg .b64 %rd<5>;\n"
    "    ld.param.u64 %rd1, [gpushare_spin_ns];\n"
    "    mov.u64 %rd2, %globaltimer;\n"
    "$L_spin:\n"
    "    mov.u64 %rd3, %globaltimer;\n"
    "    sub.s64 %rd4, %rd3, %rd2;\n"
    "    setp.lt.u64 %p1, %rd4, %rd1;\n"
    "    @%p1 bra $L_spin;\n"
    "    ret;\n"
    "}\n"
    "\n"
    ".visible .entry gpushare_spin_default()\n"
    "{\n"
    "    .reg .pred %p<2>;\n"
    "    .reg .b64 %rd<5>;\n"
    "    mov.u64 %rd1, 100000;\n"
    "    mov.u64 %rd2, %globaltimer;\n"
    "$L_spin_default:\n"
    "    mov.u64 %rd3, %globaltimer;\n"
    "    sub.s64 %rd4, %rd3, %rd2;\n"
    "    setp.lt.u64 %p1, %rd4, %rd1;\n"
    "    @%p1 bra $L_spin_default;\n"
    "    ret;\n"
    "}\n";

static CUfunction spin_function, spin_default_function;

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* Loads the spin kernels once per process. */
static CUresult spin_kernel(void) {
    static CUmodule module;
    CUresult rc;
    if (spin_default_function != NULL) {
        return CUDA_SUCCESS;
    }
    if (module == NULL) {
        rc = CU_OPT(cuModuleLoadData, &module, spin_ptx);
        if (rc != CUDA_SUCCESS) {
            module = NULL;
            return rc;
        }
    }
    rc = CU_OPT(cuModuleGetFunction, &spin_function, module, "gpushare_spin");
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuModuleGetFunction, &spin_default_function, module,
                    "gpushare_spin_default");
    }
    if (rc != CUDA_SUCCESS) {
        spin_function = spin_default_function = NULL;
    }
    return rc;
}

/* One API launching kernels of one duration; graphs hold one captured kernel. */
struct launcher {
    enum launch_api api;
    unsigned long long ns;
    void *params[1];
    CUstream stream;
    CUgraph graph;
    CUgraphExec exec;
};

static CUresult launcher_open(struct launcher *l, enum launch_api api, unsigned long long dur_us) {
    CUresult rc;
    memset(l, 0, sizeof *l);
    l->api = api;
    l->ns = dur_us * 1000ULL;
    l->params[0] = &l->ns;
    rc = spin_kernel();
    if (rc != CUDA_SUCCESS || (api != LAUNCH_GRAPH && api != LAUNCH_GRAPH_PTSZ)) {
        return rc;
    }
    rc = CU_OPT(cuStreamCreate, &l->stream, CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) {
        l->stream = NULL;
        return rc;
    }
    /* GLOBAL, PyTorch's default: the mode that any thread's unsafe call breaks. */
    rc = CU_OPT(cuStreamBeginCapture_v2, l->stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
    if (rc == CUDA_SUCCESS) {
        CUresult launched = CU_OPT(cuLaunchKernel, spin_function, 1, 1, 1, 1, 1, 1, 0,
                                   l->stream, l->params, NULL);
        rc = CU_OPT(cuStreamEndCapture, l->stream, &l->graph);
        if (rc != CUDA_SUCCESS) {
            l->graph = NULL;
        } else if (launched != CUDA_SUCCESS) {
            rc = launched;
        }
    }
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuGraphInstantiateWithFlags, &l->exec, l->graph, 0);
        if (rc != CUDA_SUCCESS) {
            l->exec = NULL;
        }
    }
    return rc;
}

static void launcher_close(struct launcher *l) {
    if (l->exec != NULL) {
        (void)CU_OPT(cuGraphExecDestroy, l->exec);
    }
    if (l->graph != NULL) {
        (void)CU_OPT(cuGraphDestroy, l->graph);
    }
    if (l->stream != NULL) {
        (void)CU_OPT(cuStreamDestroy_v2, l->stream);
    }
}

static CUresult launch_once(struct launcher *l) {
    CUfunction f = spin_function;
    switch (l->api) {
    case LAUNCH_KERNEL:
        return CU_OPT(cuLaunchKernel, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params, NULL);
    case LAUNCH_KERNEL_PTSZ:
        return CU_OPT(cuLaunchKernel_ptsz, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params, NULL);
    case LAUNCH_EX:
    case LAUNCH_EX_PTSZ: {
        CUlaunchConfig config;
        memset(&config, 0, sizeof config);
        config.gridDimX = config.gridDimY = config.gridDimZ = 1;
        config.blockDimX = config.blockDimY = config.blockDimZ = 1;
        if (l->api == LAUNCH_EX) {
            return CU_OPT(cuLaunchKernelEx, &config, f, l->params, NULL);
        }
        return CU_OPT(cuLaunchKernelEx_ptsz, &config, f, l->params, NULL);
    }
    case LAUNCH_COOP:
        return CU_OPT(cuLaunchCooperativeKernel, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params);
    case LAUNCH_COOP_PTSZ:
        return CU_OPT(cuLaunchCooperativeKernel_ptsz, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params);
    case LAUNCH_GRAPH:
        return CU_OPT(cuGraphLaunch, l->exec, NULL);
    case LAUNCH_GRAPH_PTSZ:
        return CU_OPT(cuGraphLaunch_ptsz, l->exec, NULL);
    case LAUNCH_LEGACY:
        return CU_OPT(cuLaunch, spin_default_function);
    case LAUNCH_GRID:
        return CU_OPT(cuLaunchGrid, spin_default_function, 1, 1);
    case LAUNCH_GRID_ASYNC:
        return CU_OPT(cuLaunchGridAsync, spin_default_function, 1, 1, NULL);
    case LAUNCH_COUNT:
        break;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* The last spin, run or pace: its interval and its slowest launch call. */
static struct {
    unsigned long long start, end, max_call;
} last_run;

/* One launch, timed into last_run.max_call. */
/* Notes how long a launch call made at `before` took, for maxstall. */
static void note_call(unsigned long long before) {
    unsigned long long took = now_ns() - before;
    if (took > last_run.max_call) {
        last_run.max_call = took;
    }
}

static CUresult timed_launch(struct launcher *l) {
    unsigned long long before = now_ns();
    CUresult rc = launch_once(l);
    note_call(before);
    return rc;
}

/* Host work between paced launches: spins for `us` microseconds. */
static void host_work(unsigned long long us) {
    unsigned long long until = now_ns() + us * 1000ULL;
    while (now_ns() < until) {
        /* host work */
    }
}

static unsigned long long busy_between(unsigned long long from, unsigned long long to) {
    return busy_fn != NULL ? busy_fn(device_ordinal, from, to) : 0;
}

/* Ends a measured command: synchronize, close the interval. */
static CUresult finish_run(CUresult rc, unsigned long long start) {
    CUresult sync = CU(cuCtxSynchronize)();
    last_run.start = start;
    last_run.end = now_ns();
    return rc != CUDA_SUCCESS ? rc : sync;
}

static unsigned long long per_mille(unsigned long long part, unsigned long long whole) {
    return whole == 0 ? 0 : part * 1000ULL / whole;
}

/*
 * spin (count launches) or, with `for_ns`, run (launches until count ns after
 * the first); stops at the first failed launch. Returns the result, with the
 * successful launches in *launches.
 */
static CUresult launch_loop(enum launch_api api, unsigned long long dur_us,
                            unsigned long long count, int for_ns, unsigned long long *launches) {
    struct launcher l;
    CUresult rc = launcher_open(&l, api, dur_us);
    unsigned long long start = now_ns();
    last_run.max_call = 0;
    *launches = 0;
    while (rc == CUDA_SUCCESS && (for_ns ? now_ns() - start < count : *launches < count)) {
        rc = timed_launch(&l);
        if (rc == CUDA_SUCCESS) {
            ++*launches;
        }
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    return rc;
}

static void cmd_spin(const char *api_text, enum launch_api api, const char *dur_text,
                     unsigned long long dur_us, const char *count_text, unsigned long long count) {
    unsigned long long launches = 0, wall, busy;
    CUresult rc = launch_loop(api, dur_us, count, 0, &launches);
    wall = last_run.end - last_run.start;
    busy = busy_between(last_run.start, last_run.end);
    emit("spin %s %s %s -> %d wall_ns=%llu busy_ns=%llu share_pm=%llu", api_text, dur_text,
         count_text, (int)rc, wall, busy, per_mille(busy, wall));
}

static void cmd_run(const char *api_text, enum launch_api api, const char *dur_text,
                    unsigned long long dur_us, const char *ms_text, unsigned long long ms) {
    unsigned long long launches = 0, wall, busy;
    CUresult rc = launch_loop(api, dur_us, ms * 1000000ULL, 1, &launches);
    wall = last_run.end - last_run.start;
    busy = busy_between(last_run.start, last_run.end);
    emit("run %s %s %s -> %d launches=%llu wall_ns=%llu busy_ns=%llu share_pm=%llu", api_text,
         dur_text, ms_text, (int)rc, launches, wall, busy, per_mille(busy, wall));
}

/* What pace, shapes and functions share after their first argument: the
 * kernel's duration, the iterations, the host work per iteration. */
struct paced {
    const char *dur_text, *count_text, *host_text;
    unsigned long long dur_us, count, host_us;
};

/* The closing line of shapes and functions: `what` is the command and its
 * first argument. */
static void emit_paced(const char *cmd, const char *what, const struct paced *p, CUresult rc) {
    unsigned long long wall = last_run.end - last_run.start;
    unsigned long long busy = busy_between(last_run.start, last_run.end);
    emit("%s %s %s %s %s -> %d ns_per_iter=%llu busy_ns=%llu share_pm=%llu", cmd, what,
         p->dur_text, p->count_text, p->host_text, (int)rc, p->count == 0 ? 0 : wall / p->count,
         busy, per_mille(busy, wall));
}

static void cmd_pace(const char *api_text, enum launch_api api, const struct paced *p) {
    struct launcher l;
    CUresult rc = launcher_open(&l, api, p->dur_us);
    unsigned long long start = now_ns(), i;
    last_run.max_call = 0;
    for (i = 0; rc == CUDA_SUCCESS && i < p->count; i++) {
        host_work(p->host_us);
        rc = timed_launch(&l);
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    emit("pace %s %s %s %s -> %d ns_per_iter=%llu", api_text, p->dur_text, p->count_text,
         p->host_text, (int)rc, p->count == 0 ? 0 : (last_run.end - last_run.start) / p->count);
}

static void cmd_shapes(const char *n_text, unsigned long long n, const struct paced *p) {
    struct launcher l;
    CUresult rc = launcher_open(&l, LAUNCH_KERNEL, p->dur_us);
    unsigned long long start = now_ns(), i;
    last_run.max_call = 0;
    for (i = 0; rc == CUDA_SUCCESS && i < p->count; i++) {
        unsigned grid = (unsigned)(1 + (i * 7919ULL) % n);
        unsigned long long before;
        host_work(p->host_us);
        before = now_ns();
        rc = CU_OPT(cuLaunchKernel, spin_function, grid, 1, 1, 128, 1, 1, 0, NULL, l.params, NULL);
        note_call(before);
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    emit_paced("shapes", n_text, p, rc);
}

static void cmd_functions(const char *f_text, unsigned long long f, const struct paced *p) {
    struct launcher l;
    CUresult rc = launcher_open(&l, LAUNCH_KERNEL, p->dur_us);
    CUfunction *functions = calloc((size_t)f, sizeof *functions);
    CUmodule module = NULL;
    unsigned long long start, i;
    if (functions == NULL) {
        die(1, "out of host memory");
    }
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuModuleLoadData, &module, spin_ptx);
    }
    for (i = 0; rc == CUDA_SUCCESS && i < f; i++) {
        char name[64];
        snprintf(name, sizeof name, "gpushare_spin_f%llu", i);
        rc = CU_OPT(cuModuleGetFunction, &functions[i], module, name);
    }
    start = now_ns();
    last_run.max_call = 0;
    for (i = 0; rc == CUDA_SUCCESS && i < p->count; i++) {
        unsigned long long before;
        host_work(p->host_us);
        before = now_ns();
        rc = CU_OPT(cuLaunchKernel, functions[i % f], 1, 1, 1, 1, 1, 1, 0, NULL, l.params, NULL);
        note_call(before);
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    free(functions);
    emit_paced("functions", f_text, p, rc);
}

/* Appends item (n bytes) to the growing NUL-terminated string *text. */
static void append_text(char **text, size_t *len, size_t *cap, const char *item, size_t n) {
    if (*len + n + 1 > *cap) {
        char *grown;
        *cap = 2 * (*len + n + 1);
        grown = realloc(*text, *cap);
        if (grown == NULL) {
            die(1, "out of host memory");
        }
        *text = grown;
    }
    memcpy(*text + *len, item, n + 1);
    *len += n;
}

static void cmd_series(const char *window_text, unsigned long long window_ms) {
    unsigned long long window = window_ms * 1000000ULL, from;
    size_t cap = 64, len = 0;
    char *text = malloc(cap);
    if (text == NULL) {
        die(1, "out of host memory");
    }
    text[0] = '\0';
    for (from = last_run.start; window != 0 && last_run.end - from >= window; from += window) {
        char item[32];
        int n = snprintf(item, sizeof item, "%s%llu", len == 0 ? "" : ",",
                         per_mille(busy_between(from, from + window), window));
        append_text(&text, &len, &cap, item, (size_t)n);
    }
    emit("series %s pm=%s", window_text, text);
    free(text);
}

/* Reads DUR COUNT HOST from argv at *i, in that order. */
static struct paced paced_args(int argc, char **argv, int *i) {
    struct paced p;
    p.dur_text = *i < argc ? argv[(*i)++] : NULL;
    p.dur_us = arg_number(p.dur_text);
    p.count_text = *i < argc ? argv[(*i)++] : NULL;
    p.count = arg_number(p.count_text);
    p.host_text = *i < argc ? argv[(*i)++] : NULL;
    p.host_us = arg_number(p.host_text);
    return p;
}

/* Dies if the microseconds of `p` overflow nanoseconds. */
static void check_paced(const char *cmd, const struct paced *p) {
    if (p->dur_us > ~0ULL / 1000 || p->host_us > ~0ULL / 1000) {
        die(2, "%s: number too large", cmd);
    }
}

/* Appends an ",a-b" item ("a-b" first) to the growing string *text. */
static void append_span(char **text, size_t *len, size_t *cap, unsigned long long a,
                        unsigned long long b) {
    char item[48];
    int n = snprintf(item, sizeof item, "%s%llu-%llu", *len == 0 ? "" : ",", a, b);
    append_text(text, len, cap, item, (size_t)n);
}

static void cmd_idle(const char *step_text, unsigned long long step_us) {
    unsigned long long step = step_us * 1000ULL, from, idle_from = 0;
    int in_idle = 0;
    size_t cap = 64, len = 0;
    char *text = malloc(cap);
    if (text == NULL) {
        die(1, "out of host memory");
    }
    text[0] = '\0';
    for (from = last_run.start; step != 0 && last_run.end - from >= step; from += step) {
        int idle = busy_between(from, from + step) == 0;
        if (idle && !in_idle) {
            idle_from = from;
        } else if (!idle && in_idle) {
            append_span(&text, &len, &cap, idle_from, from);
        }
        in_idle = idle;
    }
    if (in_idle) {
        append_span(&text, &len, &cap, idle_from, from);
    }
    emit("idle %s at=%s", step_text, text);
    free(text);
}

/* Runs (execute) or only checks (!execute) the script; returns at its end. */
static void run_script(int argc, char **argv, int execute) {
    int i = 0;
    int measured = 0; /* a spin, run or pace came earlier */
#define NEXT() (i < argc ? argv[i++] : NULL)
    while (i < argc) {
        const char *cmd = NEXT();
        if (strcmp(cmd, "alloc") == 0) {
            const char *api_text = NEXT();
            enum api_kind api = arg_api(api_text);
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                unsigned long long handle = 0;
                CUresult rc = do_alloc(api, size, &handle);
                if (rc == CUDA_SUCCESS) {
                    size_t id = remember(api, handle);
                    emit("alloc %s %s -> %d %zu", api_text, size_text, (int)rc, id);
                } else {
                    emit("alloc %s %s -> %d -", api_text, size_text, (int)rc);
                }
            }
        } else if (strcmp(cmd, "free") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                CUresult rc;
                if (id >= record_count) {
                    die(2, "unknown ID '%s'", id_text);
                }
                rc = do_free(&records[id]);
                if (rc == CUDA_SUCCESS) {
                    records[id].live = 0;
                }
                emit("free %s -> %d", id_text, (int)rc);
            }
        } else if (strcmp(cmd, "ptr") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                unsigned int type = 0;
                CUdeviceptr base = 0;
                size_t range = 0;
                CUresult rc, rc2;
                if (id >= record_count) {
                    die(2, "unknown ID '%s'", id_text);
                }
                rc = CU_OPT(cuPointerGetAttribute, &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                            records[id].handle);
                rc2 = CU_OPT(cuMemGetAddressRange_v2, &base, &range, records[id].handle + 1);
                emit("ptr %s -> %d type=%u size=%zu start=%d", id_text,
                     (int)(rc != CUDA_SUCCESS ? rc : rc2), type, range,
                     base == records[id].handle);
            }
        } else if (strcmp(cmd, "info") == 0 || strcmp(cmd, "info_v1") == 0) {
            if (execute) {
                unsigned long long f = 0, t = 0;
                CUresult rc;
                if (cmd[4] == '\0') {
                    size_t f2 = 0, t2 = 0;
                    rc = CU(cuMemGetInfo_v2)(&f2, &t2);
                    f = f2;
                    t = t2;
                } else {
                    unsigned int f1 = 0, t1 = 0;
                    rc = CU(cuMemGetInfo)(&f1, &t1);
                    f = f1;
                    t = t1;
                }
                if (rc != CUDA_SUCCESS) {
                    f = t = 0;
                }
                emit("%s %d free=%llu total=%llu", cmd, (int)rc, f, t);
            }
        } else if (strcmp(cmd, "totalmem") == 0 || strcmp(cmd, "totalmem_v1") == 0) {
            if (execute) {
                unsigned long long t = 0;
                CUresult rc;
                if (cmd[8] == '\0') {
                    size_t t2 = 0;
                    rc = CU(cuDeviceTotalMem_v2)(&t2, device);
                    t = t2;
                } else {
                    unsigned int t1 = 0;
                    rc = CU(cuDeviceTotalMem)(&t1, device);
                    t = t1;
                }
                emit("%s %d %llu", cmd, (int)rc, rc == CUDA_SUCCESS ? t : 0);
            }
        } else if (strcmp(cmd, "nvml") == 0 || strcmp(cmd, "nvml_v2") == 0) {
            if (execute) {
                cmd_nvml(cmd, cmd[4] != '\0');
            }
        } else if (strcmp(cmd, "nvml_procs") == 0) {
            if (execute) {
                cmd_nvml_procs();
            }
        } else if (strcmp(cmd, "fill") == 0) {
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                unsigned long long count = 0;
                for (;;) {
                    CUdeviceptr p = 0;
                    CUresult rc = CU(cuMemAlloc_v2)(&p, size);
                    if (rc != CUDA_SUCCESS) {
                        emit("fill %s count=%llu last=%d", size_text, count, (int)rc);
                        break;
                    }
                    remember(API_MEM, p);
                    count++;
                }
            }
        } else if (strcmp(cmd, "hammer") == 0) {
            unsigned long long threads = arg_number(NEXT());
            unsigned long long iters = arg_number(NEXT());
            size_t size = arg_size(NEXT());
            if (threads == 0 || threads > 1024) {
                die(2, "hammer needs 1..1024 threads");
            }
            if (execute) {
                cmd_hammer(threads, iters, size);
            }
        } else if (strcmp(cmd, "freeall") == 0) {
            if (execute) {
                CUresult first = CUDA_SUCCESS;
                size_t id;
                for (id = 0; id < record_count; id++) {
                    if (records[id].live) {
                        CUresult rc = do_free(&records[id]);
                        if (rc == CUDA_SUCCESS) {
                            records[id].live = 0;
                        } else if (first == CUDA_SUCCESS) {
                            first = rc;
                        }
                    }
                }
                emit("freeall %d", (int)first);
            }
        } else if (strcmp(cmd, "sleep") == 0) {
            const char *ms_text = NEXT();
            unsigned long long ms = arg_number(ms_text);
            if (execute) {
                struct timespec ts;
                ts.tv_sec = (time_t)(ms / 1000);
                ts.tv_nsec = (long)(ms % 1000) * 1000000L;
                while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
                }
                emit("sleep %s", ms_text);
            }
        } else if (strcmp(cmd, "wait") == 0) {
            if (execute) {
                char line[256];
                emit("ready");
                if (fgets(line, sizeof line, stdin) == NULL) {
                    clearerr(stdin);
                }
                emit("resumed");
            }
        } else if (strcmp(cmd, "pid") == 0) {
            if (execute) {
                emit("pid %ld", (long)getpid());
            }
        } else if (strcmp(cmd, "spin") == 0 || strcmp(cmd, "run") == 0) {
            const char *api_text = NEXT();
            enum launch_api api = arg_launch(api_text);
            const char *dur_text = NEXT();
            unsigned long long dur_us = arg_number(dur_text);
            const char *n_text = NEXT();
            unsigned long long n = arg_number(n_text);
            if (dur_us > ~0ULL / 1000 || (cmd[0] == 'r' && n > ~0ULL / 1000000)) {
                die(2, "%s: number too large", cmd);
            }
            measured = 1;
            if (execute && cmd[0] == 's') {
                cmd_spin(api_text, api, dur_text, dur_us, n_text, n);
            } else if (execute) {
                cmd_run(api_text, api, dur_text, dur_us, n_text, n);
            }
        } else if (strcmp(cmd, "pace") == 0) {
            const char *api_text = NEXT();
            enum launch_api api = arg_launch(api_text);
            struct paced p = paced_args(argc, argv, &i);
            check_paced(cmd, &p);
            measured = 1;
            if (execute) {
                cmd_pace(api_text, api, &p);
            }
        } else if (strcmp(cmd, "shapes") == 0) {
            const char *n_text = NEXT();
            unsigned long long n = arg_number(n_text);
            struct paced p = paced_args(argc, argv, &i);
            if (n == 0 || n > 0x7fffffffULL) {
                die(2, "shapes: N must be 1 to 2^31-1");
            }
            check_paced(cmd, &p);
            measured = 1;
            if (execute) {
                cmd_shapes(n_text, n, &p);
            }
        } else if (strcmp(cmd, "functions") == 0) {
            const char *f_text = NEXT();
            unsigned long long f = arg_number(f_text);
            struct paced p = paced_args(argc, argv, &i);
            if (f == 0 || f > 1000000) {
                die(2, "functions: F must be 1 to 1000000");
            }
            check_paced(cmd, &p);
            measured = 1;
            if (execute) {
                cmd_functions(f_text, f, &p);
            }
        } else if (strcmp(cmd, "series") == 0) {
            const char *window_text = NEXT();
            unsigned long long window_ms = arg_number(window_text);
            if (window_ms == 0 || window_ms > ~0ULL / 1000000) {
                die(2, "series needs a window of 1 ms or more");
            }
            if (!measured) {
                die(2, "series needs an earlier spin, run or pace");
            }
            if (execute) {
                cmd_series(window_text, window_ms);
            }
        } else if (strcmp(cmd, "idle") == 0) {
            const char *step_text = NEXT();
            unsigned long long step_us = arg_number(step_text);
            if (step_us == 0 || step_us > ~0ULL / 1000) {
                die(2, "idle needs a step of 1 us or more");
            }
            if (!measured) {
                die(2, "idle needs an earlier spin, run or pace");
            }
            if (execute) {
                cmd_idle(step_text, step_us);
            }
        } else if (strcmp(cmd, "clock") == 0) {
            if (execute) {
                emit("clock ns=%llu", now_ns());
            }
        } else if (strcmp(cmd, "maxstall") == 0) {
            if (!measured) {
                die(2, "maxstall needs an earlier spin, run or pace");
            }
            if (execute) {
                emit("maxstall ns=%llu", last_run.max_call);
            }
        } else {
            die(2, "unknown command '%s'", cmd);
        }
    }
#undef NEXT
}

static void check(const char *step, CUresult rc) {
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "cudaprobe: %s failed: %d\n", step, (int)rc);
        exit(1);
    }
}

int main(int argc, char **argv) {
    int via_getproc = 0;
    int i = 1;
    while (i < argc && strncmp(argv[i], "--", 2) == 0) {
        if (strcmp(argv[i], "--via") == 0 && i + 1 < argc) {
            if (strcmp(argv[i + 1], "dlsym") == 0) {
                via_getproc = 0;
            } else if (strcmp(argv[i + 1], "getproc") == 0) {
                via_getproc = 1;
            } else {
                die(2, "--via takes dlsym or getproc, not '%s'", argv[i + 1]);
            }
            i += 2;
        } else if (strcmp(argv[i], "--device") == 0 && i + 1 < argc) {
            unsigned long long n = arg_number(argv[i + 1]);
            if (n > 64) {
                die(2, "bad device '%s'", argv[i + 1]);
            }
            device_ordinal = (int)n;
            i += 2;
        } else {
            die(2, "unknown or incomplete option '%s'", argv[i]);
        }
    }
#ifdef CUDAPROBE_LINKED
    if (via_getproc) {
        die(2, "--via getproc needs the dlopen build (cudaprobe)");
    }
#endif
    run_script(argc - i, argv + i, 0);
#ifndef CUDAPROBE_LINKED
    load_api(via_getproc);
#else
    {
        void *busy = dlsym(RTLD_DEFAULT, GPUSHARE_DOUBLE_BUSY_SYMBOL);
        memcpy(&busy_fn, &busy, sizeof busy_fn);
    }
#endif
    check("cuInit", CU(cuInit)(0));
    check("cuDeviceGet", CU(cuDeviceGet)(&device, device_ordinal));
    check("cuDevicePrimaryCtxRetain", CU(cuDevicePrimaryCtxRetain)(&context, device));
    check("cuCtxSetCurrent", CU(cuCtxSetCurrent)(context));
    run_script(argc - i, argv + i, 1);
    return 0;
}

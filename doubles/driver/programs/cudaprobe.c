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
 *   the driver lacks fails its command with CUDA_ERROR_NOT_FOUND (500), and
 *   so do those of driver-held memory (cuCtxCreate asked for with
 *   cudaVersion 11000, which names cuCtxCreate_v2).
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
 *       pool     cuMemAllocFromPoolAsync(SIZE, the probe's pool, stream 0)
 *                                                      pool_ptsz   its _ptsz
 *       create   cuMemCreate(SIZE, pinned, device N); SIZE must be a multiple
 *                of the 2 MiB granularity, as for the real driver
 *       array    cuArrayCreate_v2(UNSIGNED_INT8, 1 channel, Width SIZE, Height 1)
 *       array3d  cuArray3DCreate_v2(same, Depth 1)
 *       mipmap   cuMipmappedArrayCreate(same as array3d, 1 level)
 *     IDs are 0, 1, 2, ... over every successful allocation, fill's and
 *     those of the shared memory commands (below) included.
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
 *   gpus                  -> "gpus RESULT cuda=U,... nvml RESULT=U,... visible=V":
 *                            the UUID of every CUDA device (cuDeviceGetCount,
 *                            cuDeviceGetUuid_v2) and of every GPU NVML shows
 *                            (nvmlDeviceGetCount_v2, nvmlDeviceGetUUID), each
 *                            in its own order; V is CUDA_VISIBLE_DEVICES as
 *                            the program reads it ("unset")
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
 *   write ID SEED         -> "write ID SEED -> RESULT at=0xADDR": ID's bytes (as
 *                            many as asked for) from a pattern SEED names
 *                            (cuMemcpyHtoD_v2); ADDR its pointer
 *   check ID SEED         -> "check ID SEED -> RESULT differ=N at=0xADDR": ID's
 *                            bytes read back (cuMemcpyDtoH_v2), N how many
 *                            differ from the pattern (on the double, every
 *                            byte but of VMM memory, whose bytes it keeps)
 *   freeall               -> "freeall RESULT": frees every live ID in order;
 *                            the first non-zero result, or 0
 *   sleep MS              -> "sleep MS", printed after sleeping
 *   wait                  -> "ready", then blocks until a line (or EOF) on
 *                            stdin, then "resumed"
 *   pid                   -> "pid N"
 *
 * Shared memory: legacy IPC handles, and VMM memory with POSIX file
 * descriptor handles (their entry points found as the compute ones are; one
 * the driver lacks fails its command with CUDA_ERROR_NOT_FOUND, 500). What
 * they open, allocate or import takes the next allocation ID, which write,
 * check, ptr, free and freeall take; RESULT is the first failure.
 *   ipc-export ID         -> "ipc-export ID -> RESULT handle=HEX":
 *                            cuIpcGetMemHandle of ID's pointer; HEX its 64
 *                            bytes as 128 lowercase hex digits (zeros on
 *                            failure)
 *   ipc-open HEX          -> "ipc-open -> RESULT id=ID at=0xADDR size=S", or
 *                            "ipc-open -> RESULT" on failure:
 *                            cuIpcOpenMemHandle_v2 of the handle HEX spells
 *                            (128 hex digits) with
 *                            CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS; S from
 *                            cuMemGetAddressRange_v2 of ADDR. free ID calls
 *                            cuIpcCloseMemHandle
 *   ipc-close ID          -> "ipc-close ID -> RESULT": cuIpcCloseMemHandle of
 *                            ID's pointer; ID is freed when it succeeds
 *   vmm-alloc SIZE        -> "vmm-alloc SIZE -> RESULT id=ID at=0xADDR size=S",
 *                            or "vmm-alloc SIZE -> RESULT" on failure:
 *                            cuMemCreate(SIZE, pinned, device N, requested
 *                            handle type POSIX file descriptor),
 *                            cuMemAddressReserve, cuMemMap and
 *                            cuMemSetAccess (read-write for device N); a
 *                            failure undoes the steps before it. free ID
 *                            calls cuMemRelease, cuMemUnmap, then
 *                            cuMemAddressFree
 *   vmm-export ID         -> "vmm-export ID -> RESULT fd=FD" (FD -1 on
 *                            failure): cuMemExportToShareableHandle (POSIX
 *                            file descriptor) of the memory of an ID of
 *                            alloc create, vmm-alloc or vmm-import (another
 *                            exits with status 2); FD stays open, without
 *                            close-on-exec, so a child could inherit it
 *   vmm-import FROM       -> "vmm-import FROM -> RESULT id=ID at=0xADDR
 *                            size=S", or "vmm-import FROM -> RESULT" on
 *                            failure: cuMemImportFromShareableHandle of a
 *                            descriptor, then mapped as vmm-alloc maps. FROM
 *                            is its number, "last" (the last vmm-export's,
 *                            which must come earlier in the script) or a
 *                            path, such as /proc/PID/fd/FD of another
 *                            process, opened for the call and closed after.
 *                            S is the descriptor's size (fstat: the double's
 *                            memfd has it, a real driver's descriptor not)
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
 * none); S (share_pm) = 1000 * B / W, rounded down; D (delay_ns) is how
 * long the launching thread was runnable but waiting for a CPU within W
 * (/proc/thread-self/schedstat; 0 where the kernel keeps no such account):
 * what a loaded machine, not the limiter, took from the run. All times in
 * ns.
 *   spin API DUR_US COUNT -> "spin API DUR_US COUNT -> RESULT wall_ns=W busy_ns=B
 *                            share_pm=S delay_ns=D launching_ns=L": COUNT launches
 *                            of DUR_US µs kernels, back to back; L is how long
 *                            after the start of W the last launch call
 *                            returned (the GPU can idle only before then)
 *   run API DUR_US MS     -> "run API DUR_US MS -> RESULT launches=N wall_ns=W
 *                            busy_ns=B share_pm=S delay_ns=D": launches as fast as the API
 *                            returns until MS ms have passed since the first;
 *                            N = successful launches
 *   pace API DUR_US COUNT HOST_US
 *                         -> "pace API DUR_US COUNT HOST_US -> RESULT
 *                            ns_per_iter=X delay_ns=D": COUNT times (HOST_US µs of
 *                            busy-waiting on the host, then one launch);
 *                            X = W / COUNT (0 when COUNT is 0); W starts
 *                            after one warm-up launch and a synchronize
 *   shapes N DUR_US COUNT HOST_US
 *                         -> "shapes N DUR_US COUNT HOST_US -> RESULT
 *                            ns_per_iter=X busy_ns=B share_pm=S delay_ns=D": as
 *                            pace (warm-up included) with
 *                            cuLaunchKernel, but launch i has a grid of
 *                            1 + (i * 7919) % N blocks of 128 threads (N
 *                            distinct shapes; every block spins DUR_US, so on
 *                            the double a kernel lasts DUR_US per wave of
 *                            132 * 16 blocks); HOST_US 0 launches back to back
 *   functions F DUR_US COUNT HOST_US
 *                         -> "functions F DUR_US COUNT HOST_US -> RESULT
 *                            ns_per_iter=X busy_ns=B share_pm=S delay_ns=D": as
 *                            pace with cuLaunchKernel of 1x1 grids, but launch i runs
 *                            function i % F, each a distinct handle named
 *                            gpushare_spin_f<k> (the double's modules hold any
 *                            name; a real driver answers NOT_FOUND); the
 *                            warm-up launch runs another function
 *   periodic K DUR_US PERIOD_US N
 *                         -> "periodic K DUR_US PERIOD_US N -> RESULT
 *                            late_max_ns=L at=a,b,c": N requests on a fixed
 *                            schedule, request i due PERIOD_US * i after the
 *                            first (an absolute sleep until then): K
 *                            cuLaunchKernel of DUR_US µs kernels, then
 *                            cuCtxSynchronize, as an inference server's
 *                            step; `at` lists each request's arrival (the
 *                            clock just before its first launch), L the
 *                            latest an arrival was behind its due time. It
 *                            counts as a run for series, idle and maxstall.
 *                            (The double keeps one timeline per process, so
 *                            whether another process's kernel was running at
 *                            an arrival is for the caller to read from that
 *                            process's idle output.)
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
 *   settled               -> "settled ns=N from_start_ns=S": when the device
 *                            finished the work of the last spin, run, pace or
 *                            periodic: the end of its last busy stretch on
 *                            the double's timeline, CLOCK_MONOTONIC ns, and
 *                            S = N - the start of W (both 0 when it had none,
 *                            or without the double's accessor).
 *                            A clock read after the command can be later
 *                            by any delay in waking the process once the
 *                            device is idle
 *   clock                 -> "clock ns=N": CLOCK_MONOTONIC now
 *
 * Driver-held memory: what the driver takes on the GPU without an allocation
 * call (the double's model is in its cuda.c). IDs of images, graph execs,
 * contexts and kernels count 0, 1, 2, ... in a table of each kind; an
 * unknown ID exits with status 2. KIND is stack, fifo or heap
 * (CU_LIMIT_STACK_SIZE, CU_LIMIT_PRINTF_FIFO_SIZE, CU_LIMIT_MALLOC_HEAP_SIZE).
 *   setlimit KIND SIZE    -> "setlimit KIND SIZE -> RESULT"   (cuCtxSetLimit)
 *   getlimit KIND         -> "getlimit KIND -> RESULT VALUE"  (cuCtxGetLimit)
 *   module SIZE           -> "module SIZE -> RESULT ID" (ID "-" on failure):
 *                            cuModuleLoadData of the image
 *                            "gpushare-double-module globals=<SIZE in bytes>\n",
 *                            whose globals the double holds while loaded
 *   module_ex SIZE        -> the same through cuModuleLoadDataEx, no options
 *   library SIZE          -> the same through cuLibraryLoadData, no options
 *   library_file SIZE     -> the same through cuLibraryLoadFromFile of the
 *                            image written to a temporary file (removed once
 *                            loaded)
 *   unload ID             -> "unload ID -> RESULT": cuModuleUnload or
 *                            cuLibraryUnload, as ID was loaded
 *   fatlib SIZE           -> "fatlib SIZE -> RESULT ID" (ID "-" on failure;
 *                            an image ID, for unload): cuLibraryLoadData
 *                            of a __fatBinC_Wrapper_t, as the CUDA runtime
 *                            registers a translation unit, whose fat binary
 *                            holds one uncompressed ELF cubin for the device's
 *                            arch (cuDeviceGetAttribute's compute capability,
 *                            90 for 9.0) defining one global,
 *                            gpushare_global, of SIZE bytes in a NOBITS
 *                            .nv.global section, and no code; the image
 *                            stays in memory for the process's life. The
 *                            double and driver 580 take those globals at the
 *                            library's first use in a context
 *   libkernel ID NAME     -> "libkernel ID NAME -> RESULT KID" (KID "-" on
 *                            failure): cuLibraryGetKernel(library ID, NAME);
 *                            the ID of a module exits with status 2; a real
 *                            driver finds no kernel in fatlib's cubin
 *                            (CUDA_ERROR_NOT_FOUND), the double any name
 *   libglobal ID          -> "libglobal ID -> RESULT BYTES": cuLibraryGetGlobal
 *                            (library ID, "gpushare_global"), BYTES its size
 *                            (0 on failure): a first use on a real driver too
 *   launchk KID           -> "launchk KID -> RESULT": cuLaunchKernel of the
 *                            kernel handle as a function, grid and block
 *                            1x1x1, no parameters, on the legacy stream
 *   kernelfunc KID        -> "kernelfunc KID -> RESULT"   (cuKernelGetFunction)
 *   kernellib KID         -> "kernellib KID -> RESULT"    (cuKernelGetLibrary)
 *   graph_alloc SIZE      -> "graph_alloc SIZE -> RESULT ID" (ID "-" on
 *                            failure): cuGraphCreate, cuGraphAddMemAllocNode
 *                            (SIZE, pinned, device N, no dependencies),
 *                            cuGraphInstantiateWithFlags(0), then
 *                            cuGraphDestroy; RESULT the first failure
 *   capture_alloc SIZE    -> "capture_alloc SIZE -> RESULT ID": on a new
 *                            stream, cuStreamBeginCapture_v2 (GLOBAL),
 *                            cuMemAllocAsync(SIZE), cuStreamEndCapture,
 *                            cuGraphInstantiateWithFlags(0), then
 *                            cuGraphDestroy and cuStreamDestroy_v2
 *   graph_launch ID       -> "graph_launch ID -> RESULT": cuGraphLaunch on the
 *                            probe's stream (created at first use, non-blocking),
 *                            then cuStreamSynchronize
 *   graph_upload ID       -> "graph_upload ID -> RESULT": cuGraphUpload on it
 *   graph_destroy ID      -> "graph_destroy ID -> RESULT": cuGraphExecDestroy
 *   graph_trim            -> "graph_trim -> RESULT": cuDeviceGraphMemTrim(N)
 *   pool_create SIZE      -> "pool_create SIZE -> RESULT": cuMemPoolCreate on
 *                            device N with release threshold SIZE (may be
 *                            max); the pool API and the pool commands below
 *                            use it from then on
 *   pool_destroy          -> "pool_destroy -> RESULT": cuMemPoolDestroy of it;
 *                            the default pool is the probe's again
 *   pool_threshold SIZE   -> "pool_threshold SIZE -> RESULT": the release
 *                            threshold of the probe's pool, else of device N's
 *                            default pool (cuDeviceGetDefaultMemPool,
 *                            cuMemPoolSetAttribute); SIZE may be max (UINT64_MAX)
 *   pool_trim SIZE        -> "pool_trim SIZE -> RESULT": cuMemPoolTrimTo(SIZE)
 *                            of that pool
 *   pool_reserved         -> "pool_reserved RESULT reserved=R used=U": that
 *                            pool's CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT and
 *                            CU_MEMPOOL_ATTR_USED_MEM_CURRENT
 *   sync                  -> "sync RESULT"                    (cuCtxSynchronize)
 *   context               -> "context -> RESULT ID": cuCtxCreate_v2(0, device
 *                            N), then cuCtxSetCurrent of the primary context,
 *                            so later commands run where they did
 *   green_context         -> "green_context -> RESULT ID": cuGreenCtxCreate(
 *                            NULL descriptor, device N, 0), in the same table
 *   context_destroy ID    -> "context_destroy ID -> RESULT"   (cuCtxDestroy_v2,
 *                            or cuGreenCtxDestroy for a green one)
 *
 * Copies, sets and streams (their entry points always found with dlsym in
 * the loaded libcuda.so.1; one the driver lacks fails its command with
 * CUDA_ERROR_NOT_FOUND, 500). They work on scratch device memory of their
 * own, outside the allocation IDs: two blocks of SIZE bytes from
 * cuMemAlloc_v2, made by the first command that needs more than the blocks
 * hold (the smaller ones freed first) and kept until exit, so a later
 * command of no larger SIZE calls only its copy or set. RESULT is the
 * first failure among those calls, else 0. DIR is h2d (a zeroed host
 * buffer to the first block), d2h (the first block to a host buffer) or
 * d2d (the first block to the second).
 *   copy DIR SIZE         -> "copy DIR SIZE -> RESULT": cuMemcpyHtoD_v2,
 *                            cuMemcpyDtoH_v2 or cuMemcpyDtoD_v2
 *   copy_async DIR SIZE   -> "copy_async DIR SIZE -> RESULT": their Async_v2
 *                            on the legacy default stream (NULL), then
 *                            cuStreamSynchronize(NULL)
 *   set SIZE              -> "set SIZE -> RESULT": cuMemsetD8_v2 of the first
 *                            block's SIZE bytes
 *   set_async SIZE        -> "set_async SIZE -> RESULT": cuMemsetD8Async on
 *                            stream NULL, then cuStreamSynchronize(NULL)
 *   stream_sync           -> "stream_sync RESULT"   (cuStreamSynchronize(NULL))
 *   stream_query          -> "stream_query RESULT"  (cuStreamQuery(NULL))
 *
 * Numbers are printed in decimal; on a failed query the figures are 0. Exit
 * status 0, or 2 with a message on stderr for a malformed script (checked in
 * full before anything runs; series, idle, settled and maxstall need an
 * earlier spin, run, pace or periodic, and series a WINDOW_MS of 1 or more) or an unknown ID.
 */
#include "probe.h"

#ifndef CUDAPROBE_LINKED
struct probe_driver drv;
#endif

gpushare_double_busy_fn busy_fn;
int device_ordinal;
CUdevice device;
CUcontext context;

/* Exit status 1: the environment failed us; 2: the script is malformed. */
void die(int status, const char *fmt, ...) {
    va_list ap;
    fputs("cudaprobe: ", stderr);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(status);
}

void emit(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    putchar('\n');
    fflush(stdout);
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
        CU_HELD_FUNCS(CU_GETPROC_OPT)
        CU_SHARE_FUNCS(CU_GETPROC_OPT)
#undef CU_GETPROC_OPT
    } else {
#define CU_DLSYM(name, base, version, flags) drv.name = (__typeof__(&name))symbol(cuda, #name);
        CU_FUNCS(CU_DLSYM)
#undef CU_DLSYM
#define CU_DLSYM_OPT(name, base, version, flags) drv.name = (__typeof__(&name))dlsym(cuda, #name);
        CU_COMPUTE_FUNCS(CU_DLSYM_OPT)
        CU_HELD_FUNCS(CU_DLSYM_OPT)
        CU_SHARE_FUNCS(CU_DLSYM_OPT)
#undef CU_DLSYM_OPT
    }
    busy = dlsym(cuda, GPUSHARE_DOUBLE_BUSY_SYMBOL);
    memcpy(&busy_fn, &busy, sizeof busy_fn);
#define NVML_DLSYM(name) drv.name = (__typeof__(&name))symbol(nvml, #name);
    NVML_FUNCS(NVML_DLSYM)
#undef NVML_DLSYM
}
#endif

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

/*
 * libcuda.so.1 of the test double: a fake GPU with memory accounting and a
 * simulated clock for compute, behind entry points that start with the real
 * driver's prologue (cuda_entry.S). Each exported `cuX` tail-jumps to
 * `impl_cuX`, in the file of its family (double_internal.h lists them); this
 * file holds the model below, the process state and its lock, the devices,
 * and NVML's view of them.
 *
 * Model (per process, one mutex):
 * - GPUSHARE_DOUBLE_DEVICES fake GPUs of GPUSHARE_DOUBLE_TOTAL bytes each
 *   (double_common.h), the process's own unless a node file (below) shares
 *   them with other processes.
 * - Contexts: one primary context per GPU (reference counted) and up to
 *   DOUBLE_MAX_CREATED created ones. Destroying a context (or releasing a
 *   primary one to zero) frees the allocations made in it and unloads its
 *   modules, as the real driver does; cuMemCreate handles belong to no
 *   context.
 * - Allocations get fake addresses (never dereferenced) from a bump pointer in
 *   the lower half of a 1 TiB region per GPU, 512-byte aligned, in address
 *   space reserved at load (PROT_NONE), so that no host mapping can share an
 *   address with a device allocation (pinned host memory is addressed by its
 *   host address, as under UVA); the bump restarts when the GPU has no live
 *   allocation. Arrays, mipmapped arrays and cuMemCreate handles take their
 *   values from the same space; graph allocations (third quarter) and module
 *   globals (last quarter) from bumps of their own that never restart.
 *   A GPU is charged exactly the computed size of each allocation; an
 *   allocation that does not fit fails with CUDA_ERROR_OUT_OF_MEMORY.
 * - Before cuInit every call fails with CUDA_ERROR_NOT_INITIALIZED, except
 *   cuInit, cuDriverGetVersion, cuGetProcAddress(_v2), the cuCheckpointProcess*
 *   calls (they act on another process) and, as in the real driver,
 *   cuGetErrorString/cuGetErrorName.
 * - Stream-ordered allocations and frees complete at once, on the stream's
 *   GPU (or the pool's).
 * - Pinned host memory (cuMemHostAlloc, cuMemAllocHost_v2,
 *   cuMemHostRegister_v2/cuMemHostUnregister, cuMemHostGetDevicePointer_v2,
 *   cuMemFreeHost, cuPointerGetAttribute): host_memory.c. It is never charged
 *   to a GPU; cuMemGetAddressRange_v2 answers for it too.
 * - Virtual memory management (cuMemAddressReserve/Free, cuMemCreate/
 *   Release, cuMemMap/Unmap, cuMemSetAccess/GetAccess,
 *   cuMemRetainAllocationHandle, cuMemExportToShareableHandle/
 *   ImportFromShareableHandle) and legacy IPC (cuIpc*, refused): vmm.c.
 *   Created memory is charged like an allocation until its last reference
 *   and mapping go, and a mapped range holds real bytes; imported memory
 *   shares the exporter's bytes and is charged to the exporter only.
 * - Copies and sets (cuMemcpy*, cuMemsetD8/D32*, copies.c) move no byte but
 *   into and out of VMM memory (vmm.c), and take no time on the simulated clock: each checks init, the current
 *   context (the stream, for the async ones, as launches do), then that its
 *   device range lies within one live linear allocation of the process (or
 *   mapped pinned host memory) and its host pointer is non-NULL, else
 *   CUDA_ERROR_INVALID_VALUE; zero bytes succeed unchecked. cuMemcpy(Async)
 *   take a device or host address on either side (unified addressing). On a
 *   capturing stream an async one is a node of the graph.
 *   cuStreamWaitEvent(_ptsz) checks the stream, the event
 *   (CUDA_ERROR_INVALID_HANDLE) and the flags (0 or CU_EVENT_WAIT_EXTERNAL)
 *   and orders nothing: a device's work is one queue already.
 *
 * Driver-held memory: what the real driver takes on a GPU without an
 * allocation call. Each byte of it counts in what the process uses on the
 * GPU (cuMemGetInfo, NVML's device and per-process figures) as allocations
 * do, so allocations fail with CUDA_ERROR_OUT_OF_MEMORY when it fills the
 * GPU; an operation whose driver-held bytes do not fit fails with
 * CUDA_ERROR_OUT_OF_MEMORY and changes nothing. When a GPU's last context
 * goes, its limits return to their defaults and its retained pool and graph
 * memory is released; loaded libraries and live graph execs keep theirs.
 * - Contexts: each live context charges GPUSHARE_DOUBLE_CONTEXT_BYTES on its
 *   GPU: the primary one while retained, each created one (cuCtxCreate_v2)
 *   while alive; a green context (cuGreenCtxCreate, not made current)
 *   charges GPUSHARE_DOUBLE_GREEN_CONTEXT_BYTES while alive.
 * - Context limits (cuCtxSetLimit/cuCtxGetLimit of the current context's
 *   GPU, kept per GPU): CU_LIMIT_MALLOC_HEAP_SIZE (default 8 MiB) and
 *   CU_LIMIT_PRINTF_FIFO_SIZE (default 1 MiB) hold what they are set above
 *   their defaults, CU_LIMIT_STACK_SIZE (default 1024) what it is set above
 *   its default times DOUBLE_STACK_THREADS (every resident thread: SMs
 *   times threads per SM). The other limits below CU_LIMIT_MAX are stored and hold
 *   nothing (CUDA_ERROR_UNSUPPORTED_LIMIT past it). A set that does not fit
 *   leaves the limit as it was.
 * - Modules and libraries: an image (cuModuleLoadData(Ex),
 *   cuModuleLoadFatBinary, cuLibraryLoadData; the file's first bytes for
 *   cuModuleLoad and cuLibraryLoadFromFile) whose text begins with
 *   "gpushare-double-module globals=N" (N in decimal) holds N bytes of module
 *   globals on the current context's GPU while loaded; cuModuleGetGlobal_v2
 *   answers, for any name, their first address and N (CUDA_ERROR_NOT_FOUND
 *   when there are none). Any other image loads and holds nothing.
 *   cuModuleUnload and cuLibraryUnload give the globals back; a module also
 *   goes with its context, a library (context-independent) only when
 *   unloaded.
 * - Lazily loaded libraries, as the CUDA runtime registers each translation
 *   unit with cuLibraryLoadData (measured on driver 580): a fat binary (the
 *   u32 magic 0xBA55ED50 first, or a __fatBinC_Wrapper_t, magic 0x466243B1,
 *   whose data points at one) loads holding nothing, with or without a
 *   current context. Its globals are the sizes of the sections named
 *   .nv.global* in its first uncompressed ELF entry for arch 90 (the compute
 *   capability 9.0 that cuDeviceGetAttribute reports); none without such an
 *   entry or in a malformed container, of which nothing past its stated
 *   size is read. The library's first use in a context takes them on that
 *   context's GPU, once per (library, context), or fails with
 *   CUDA_ERROR_OUT_OF_MEMORY taking nothing: the first launch of one of its
 *   kernels there (the launch then does not run), cuKernelGetFunction,
 *   cuLibraryGetModule or cuLibraryGetGlobal. cuLibraryUnload or the
 *   context's end gives them back. cuLibraryGetKernel gives one CUkernel
 *   per (library, name), any name; every launch API takes it as a function
 *   of the library in the launch's context (the stream's, else the current
 *   one); cuKernelGetLibrary answers its library, and
 *   CUDA_ERROR_INVALID_HANDLE for anything else (a module's function);
 *   cuKernelGetFunction gives its function in the current context.
 *   cuLibraryGetModule gives the library's module in the current context,
 *   which goes only with the library or the context (cuModuleUnload refuses
 *   it); cuLibraryGetGlobal answers as cuModuleGetGlobal_v2. A text-image
 *   library has kernels and modules too; its globals stay with the library.
 *   To every other load (modules, cuLibraryLoadFromFile) a fat binary is any
 *   other image.
 * - Graph memory: a mem alloc node (cuGraphAddMemAllocNode, or a
 *   cuMemAllocAsync/cuMemAllocFromPoolAsync captured on a stream) gets a
 *   fixed fake address and charges nothing; a mem free node
 *   (cuGraphAddMemFreeNode, or a captured cuMemFreeAsync) takes only such an
 *   address and changes no charge. A graph exec needs, on each GPU, the sum
 *   of its graph's alloc node sizes there, as instantiated. Its first
 *   cuGraphUpload or cuGraphLaunch (or cuGraphInstantiateWithParams with
 *   CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD) reserves that need, taking the GPU's
 *   retained graph memory first, or fails with CUDA_ERROR_OUT_OF_MEMORY and
 *   leaves the exec unreserved; the reservation stays while the exec lives.
 *   cuGraphExecDestroy moves it to the GPU's retained graph memory, which
 *   cuDeviceGraphMemTrim gives back; cuDeviceGetGraphMemAttribute reports
 *   the live execs' reservations (USED_MEM_CURRENT) and those plus the
 *   retained bytes (RESERVED_MEM_CURRENT). cuGraphGetNodes lists a graph's kernel
 *   nodes (one per captured launch), child graph nodes (a captured graph
 *   launch) and memory nodes.
 * - Memory pools: one default pool per GPU (cuDeviceGetDefaultMemPool and
 *   cuDeviceGetMemPool give it; a NULL pool means the current GPU's). A pool
 *   allocation (cuMemAllocAsync/cuMemAllocFromPoolAsync, not captured) takes
 *   the pool's retained bytes when there are at least its size, else is new;
 *   either way it is charged as an allocation. cuMemFreeAsync of a pool
 *   allocation ends that charge; with the pool's release threshold
 *   (CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, default 0) at 0 its bytes are
 *   released at once, else the pool retains them (driver-held) until a
 *   successful cuStreamSynchronize, cuCtxSynchronize or cuEventSynchronize on
 *   the GPU releases retained bytes down to reserved (live pool allocations
 *   + retained) <= max(threshold, live pool allocations). cuMemPoolTrimTo
 *   releases them down to reserved <= max(minBytesToKeep, live pool
 *   allocations). CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT and
 *   CU_MEMPOOL_ATTR_USED_MEM_CURRENT read reserved and live pool
 *   allocations; the CU_MEMPOOL_ATTR_REUSE_* flags are stored and change
 *   nothing; other attributes fail with CUDA_ERROR_INVALID_VALUE.
 *   cuMemFree_v2 of a pool allocation, or its context's end, releases it at
 *   once.
 *
 * Compute, on a simulated clock (CLOCK_MONOTONIC nanoseconds):
 * - Kernels run nowhere; each occupies its device's one timeline, as kernels
 *   that fill every SM would: launched at host time t for d ns, it runs from
 *   max(t, busy_until) to busy_until = that + d. Every executed interval is
 *   kept (back-to-back ones merged, the latest 2^20 per device) for the
 *   exported gpushare_double_busy_ns(device, from, to). Streams do not
 *   overlap each other: the device's work is one queue.
 * - A kernel lasts *(unsigned long long *)kernelParams[0] ns (the spin
 *   kernel's only parameter, in the probe); with kernelParams NULL (or its
 *   first entry NULL), and always for cuLaunch/cuLaunchGrid(Async),
 *   GPUSHARE_DOUBLE_KERNEL_NS (default 100000). Any module image loads, and
 *   every name is a function of it.
 * - GPUSHARE_DOUBLE_EVENT_RAMP_NS (default 0): the first kernel after an
 *   event record on its device takes that much longer, as a real kernel
 *   whose launch ramp overlaps the kernel before it, except after an event.
 * - Launches return at once, unless GPUSHARE_DOUBLE_QUEUE_DEPTH (default
 *   1024) submissions are still running or queued on the device: then the
 *   launch sleeps until the oldest completes, like a full launch queue.
 * - Stream capture (cuStreamBeginCapture_v2 .. cuStreamEndCapture on a
 *   created or per-thread stream; the legacy stream refuses with
 *   CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) records launches into the graph
 *   without running them; a graph exec launch then occupies the sum of its
 *   captured kernels, as one submission. The capture rules are those measured
 *   on driver 580: while a capture is under way, a potentially unsafe call
 *   (cuEventQuery, cuEventSynchronize, cuStreamQuery/Synchronize of another
 *   stream) fails with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates
 *   the capture when the capture was begun in GLOBAL mode (from any thread)
 *   or THREAD_LOCAL mode (from its own thread), unless the calling thread's
 *   mode (cuThreadExchangeStreamCaptureMode) is RELAXED; cuCtxSynchronize and
 *   waiting for the capturing stream itself always do. An invalidated capture
 *   reports CU_STREAM_CAPTURE_STATUS_INVALIDATED, refuses launches and event
 *   records with CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, and its
 *   cuStreamEndCapture returns that with a NULL graph. cuEventRecord,
 *   cuEventElapsedTime and launches on other streams are safe.
 * - cuEventRecord stamps the event with max(now, busy_until): when all work
 *   submitted so far on the device completes. cuEventQuery answers
 *   CUDA_ERROR_NOT_READY until then, cuEventSynchronize sleeps until then; an
 *   event never recorded is complete, as in the real driver.
 *   cuEventElapsedTime(_v2) is end - start in ms: CUDA_ERROR_NOT_READY while
 *   either is pending, CUDA_ERROR_INVALID_HANDLE when either was never
 *   recorded or has CU_EVENT_DISABLE_TIMING. Recording into a capturing
 *   stream is accepted (a graph node) and leaves the event as it was.
 * - cuStreamSynchronize/cuCtxSynchronize sleep until the device's
 *   busy_until; cuStreamQuery answers CUDA_ERROR_NOT_READY until then. NULL
 *   is the legacy stream (the per-thread one for _ptsz entry points);
 *   CU_STREAM_LEGACY, CU_STREAM_PER_THREAD and created streams are accepted.
 *
 * Checkpoints (checkpoint.c, the cuCheckpointProcess* calls, as driver 580
 * does them for the process with the given pid):
 * - Only a process whose first cuInit saw GPUSHARE_DOUBLE_CHECKPOINT_DIR
 *   naming a folder can be checkpointed: it creates <dir>/<pid>, its control
 *   block (layout in checkpoint.c; the file stays when the process ends),
 *   and one service thread, asleep on a futex, that serves the requests
 *   callers write into the block. A caller finds the block through the same
 *   variable in its own environment; it needs no cuInit. Unset: no file, no
 *   thread, and no process of the caller's can be checkpointed.
 * - States: RUNNING -lock-> LOCKED -checkpoint-> CHECKPOINTED -restore->
 *   LOCKED -unlock-> RUNNING; any other call is CUDA_ERROR_ILLEGAL_STATE
 *   and changes nothing. FAILED never occurs. A state reads as it was until
 *   its move completes (CUDA 13.0 has no in-between states).
 * - Lock: every call of the process (all but cuDriverGetVersion,
 *   cuGetProcAddress(_v2), the error strings, cuThreadExchangeStreamCaptureMode
 *   and the checkpoint calls) waits inside the driver until the unlock,
 *   then goes on with its normal result; a call under way finishes
 *   first, and a synchronize already sleeping until its device drains
 *   returns. NVML's view of the process keeps answering. With timeoutMs a
 *   lock the target has not taken by then fails with CUDA_ERROR_TIMEOUT and
 *   leaves it running; a caller waits 30 s otherwise.
 * - Checkpoint: refused with CUDA_ERROR_NOT_SUPPORTED, the process staying
 *   locked, while a managed allocation (cuMemAllocManaged) is live; the
 *   double has no IPC memory to refuse. Otherwise, device by device, all
 *   the process holds there (contexts, allocations, driver-held bytes, as
 *   cuMemGetInfo counts them) moves to the host: the block counts it in
 *   host_bytes and moved_bytes, the device's figures (the block's, NVML's)
 *   read 0, and every record is kept.
 * - Restore: brings the charges back. Without gpu pairs onto the same GPUs;
 *   with pairs (UUIDs: old a GPU the process runs on, new any GPU of the
 *   double, each named once; every GPU the checkpoint took among the old
 *   ones) each ordinal on an old GPU runs on its new one from then on:
 *   cuDeviceGetUuid(_v2) of the ordinal answers the new UUID and NVML shows
 *   the charges there; the process keeps its device numbering. Bad pairs
 *   fail with CUDA_ERROR_INVALID_VALUE and leave it checkpointed.
 * - GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES=N (the target's): its first N
 *   restores with valid arguments fail with CUDA_ERROR_UNKNOWN and leave it
 *   checkpointed. GPUSHARE_DOUBLE_CHECKPOINT_US_PER_GIB (default 0): the
 *   service thread takes that long per GiB a checkpoint or restore moves.
 * - A pid that names no such process (none, a zombie, a process without a
 *   block, a stale block of a dead one or of an earlier process with its
 *   pid), or a caller without the variable: CUDA_ERROR_INVALID_VALUE at
 *   once; a target that dies while a caller waits, the same. Arguments
 *   whose reserved fields are not zero, a pair count without pairs or above
 *   16: CUDA_ERROR_INVALID_VALUE. A process checkpointing itself is not
 *   modelled.
 *
 * Shared GPUs (node.c, which gives the file's layout):
 * - A process whose first cuInit sees GPUSHARE_DOUBLE_NODE_FILE naming a
 *   path maps that file (created if missing) and from then on adds every
 *   byte it charges to a GPU (all that cuMemGetInfo counts: allocations,
 *   contexts, limits, module globals, graph and pool memory) to that GPU's
 *   shared used bytes there (by GPU, as NVML numbers them), and takes it off
 *   when the charge goes. A charge fits only when the shared used plus it
 *   is within GPUSHARE_DOUBLE_TOTAL too; otherwise it fails as one that does
 *   not fit the process's own GPU (CUDA_ERROR_OUT_OF_MEMORY, nothing
 *   changed), once the charges of dead processes are reclaimed (the file
 *   keeps a table of the processes: pid, start time, bytes per GPU). An
 *   exiting process takes its charges off; a killed one's are reclaimed.
 *   Unset: nothing is shared.
 * - A checkpoint takes the process's charges off the shared GPUs; a restore
 *   adds them back onto the GPUs it restores to (the new ones of its
 *   pairs), all devices or none, or fails with CUDA_ERROR_OUT_OF_MEMORY and
 *   leaves the process checkpointed when they do not fit there.
 * - nvmlDeviceGetMemoryInfo(_v2), in a process whose environment names a
 *   node file, report the node's used bytes of the GPU (free = total -
 *   used), as the real NVML does; cuMemGetInfo and NVML's process figures
 *   stay the process's own.
 */
#include "double_internal.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

/* ---------------------------------------------------------------- state */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
unsigned long long g_region_base = FALLBACK_REGION_BASE;
struct double_config g_config;
unsigned long long g_config_kernel_ns;
unsigned long long g_config_queue_depth;
unsigned long long g_config_event_ramp_ns;
int g_initialized;
/* Whether cuInit found an MPS control daemon (CU_DEVICE_ATTRIBUTE_MPS_ENABLED). */
static int g_mps_enabled;
struct device g_devices[DOUBLE_MAX_DEVICES];
__thread CUcontext t_current;

/* A plain decimal count from the environment, within [min, max]. */
unsigned long long env_count(const char *name, unsigned long long fallback,
                             unsigned long long min, unsigned long long max) {
    const char *text = getenv(name);
    char *end = NULL;
    unsigned long long value;
    if (text == NULL || *text == '\0') {
        return fallback;
    }
    errno = 0;
    value = strtoull(text, &end, 10);
    if (*text < '0' || *text > '9' || *end != '\0' || errno != 0 || value < min || value > max) {
        fprintf(stderr, "gpushare double: ignoring %s=%s (%llu..%llu)\n", name, text, min, max);
        return fallback;
    }
    return value;
}

/* CUDA_VISIBLE_DEVICES, as indices or UUIDs ("GPU-" and a unique prefix of
 * the rest, as CUDA takes them): CUDA ordinal i is the fake GPU g_visible[i]
 * (its UUID, what NVML calls it); unset, ordinal i is GPU i. The CUDA side
 * then counts only the visible GPUs, and keeps its state by ordinal. Entries
 * past the first invalid one are dropped, as CUDA does. */
static int g_visible[DOUBLE_MAX_DEVICES];
/* The GPU each ordinal named at start: a restore onto other GPUs changes
 * g_visible, but the driver keeps the PCI bus id it read at start (measured
 * on a 580 driver: cuDeviceGetPCIBusId answers the old GPU's after such a
 * restore, cuDeviceGetUuid the new one's). */
static int g_bus_gpu[DOUBLE_MAX_DEVICES];
/* The fake GPUs of the machine, visible or not (NVML sees them all). */
static int g_physical_devices;

/* Of the n fake GPUs gpus[], the one whose UUID the entry at text names
 * (up to ',' or the end), *end after it; -1 when none or several match. */
static long visible_uuid(const char *text, char **end, const int *gpus, int n) {
    size_t len = strcspn(text, ",");
    long found = -1;
    int i;
    char uuid[DOUBLE_UUID_STRING_LEN + 1];
    *end = (char *)text + len;
    for (i = 0; i < n; i++) {
        double_uuid_string(gpus[i], uuid);
        if (len > 4 && len <= DOUBLE_UUID_STRING_LEN && strncasecmp(uuid, text, len) == 0) {
            if (found >= 0) {
                return -1;
            }
            found = gpus[i];
        }
    }
    return found;
}

/* A CUDA_VISIBLE_DEVICES value over the n fake GPUs gpus[] (the GPUs this
 * process could see without it): an index k names gpus[k], a UUID the GPU
 * among them it names alone. Writes the GPUs named, in order, to out and
 * returns how many; stops at the first entry that names none. */
static int parse_visible(const char *text, const int *gpus, int n, int *out) {
    int count = 0;
    while (*text != '\0' && count < n) {
        char *end;
        long named;
        if (strncmp(text, "GPU-", 4) == 0) {
            named = visible_uuid(text, &end, gpus, n);
        } else {
            long index = strtol(text, &end, 10);
            named = index >= 0 && index < n ? gpus[index] : -1;
        }
        if (end == text || named < 0) {
            break;
        }
        out[count++] = (int)named;
        if (*end != ',') {
            break;
        }
        text = end + 1;
    }
    return count;
}

/* Makes CUDA ordinal i the fake GPU gpus[i], for the n of them. */
static void set_visible(const int *gpus, int n) {
    int i;
    for (i = 0; i < DOUBLE_MAX_DEVICES; i++) {
        g_visible[i] = g_bus_gpu[i] = i < n ? gpus[i] : i;
    }
    g_config.devices = n;
}

static void load_visible(void) {
    const char *text = getenv("CUDA_VISIBLE_DEVICES");
    int all[DOUBLE_MAX_DEVICES], named[DOUBLE_MAX_DEVICES];
    int i;
    g_physical_devices = g_config.devices;
    for (i = 0; i < DOUBLE_MAX_DEVICES; i++) {
        all[i] = i;
    }
    if (text == NULL) {
        set_visible(all, g_physical_devices);
        return;
    }
    set_visible(named, parse_visible(text, all, g_physical_devices, named));
}

unsigned long long region_start(int dev) {
    return REGION_BASE + (unsigned long long)dev * REGION_SIZE;
}

void reset_limits(struct device *d) {
    memset(d->limits, 0, sizeof d->limits);
    d->limits[CU_LIMIT_STACK_SIZE] = (size_t)DEFAULT_STACK_SIZE;
    d->limits[CU_LIMIT_PRINTF_FIFO_SIZE] = (size_t)DEFAULT_PRINTF_FIFO_SIZE;
    d->limits[CU_LIMIT_MALLOC_HEAP_SIZE] = (size_t)DEFAULT_MALLOC_HEAP_SIZE;
}

static void load_config(void) {
    int i;
    g_config = double_config_from_env();
    load_visible();
    g_config_kernel_ns = env_count("GPUSHARE_DOUBLE_KERNEL_NS", DEFAULT_KERNEL_NS, 0, ~0ULL);
    g_config_queue_depth =
        env_count("GPUSHARE_DOUBLE_QUEUE_DEPTH", DEFAULT_QUEUE_DEPTH, 1, MAX_QUEUE_DEPTH);
    g_config_event_ramp_ns = env_count("GPUSHARE_DOUBLE_EVENT_RAMP_NS", 0, 0, 1000000000ULL);
    {
        /* One region per GPU, then the region of VMM address ranges (vmm.c). */
        void *reserved = mmap(NULL, (size_t)((DOUBLE_MAX_DEVICES + 1) * REGION_SIZE), PROT_NONE,
                              MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (reserved != MAP_FAILED) {
            g_region_base = (unsigned long long)(uintptr_t)reserved;
        }
    }
    for (i = 0; i < DOUBLE_MAX_DEVICES; i++) {
        g_primary[i].device = i;
        g_primary[i].primary = 1;
        g_devices[i].next = region_start(i);
        g_devices[i].graph_next = region_start(i) + GRAPH_OFFSET;
        g_devices[i].globals_next = region_start(i) + GLOBALS_OFFSET;
        reset_limits(&g_devices[i]);
        g_pools[i].live = 1;
        g_pools[i].device = i;
        g_pools[i].reuse[0] = g_pools[i].reuse[1] = g_pools[i].reuse[2] = 1;
    }
}

/* While a checkpoint lock holds the process (checkpoint.c), lock() waits
 * for its unlock; lock_raw() does not. */
static pthread_cond_t g_thaw = PTHREAD_COND_INITIALIZER;
static int g_frozen;

void lock_raw(void) {
    pthread_once(&g_once, load_config);
    pthread_mutex_lock(&g_lock);
}

void lock(void) {
    lock_raw();
    while (g_frozen) {
        pthread_cond_wait(&g_thaw, &g_lock);
    }
}

/* The lock unless another thread holds it; whether it was taken. */
int lock_try(void) {
    pthread_once(&g_once, load_config);
    return pthread_mutex_trylock(&g_lock) == 0;
}

void unlock(void) {
    node_sync_locked();
    checkpoint_publish_locked();
    pthread_mutex_unlock(&g_lock);
}

void freeze_locked(int frozen) {
    g_frozen = frozen;
    if (!frozen) {
        pthread_cond_broadcast(&g_thaw);
    }
}

int device_gpu(int ordinal) {
    return g_visible[ordinal];
}

void set_device_gpu(int ordinal, int gpu) {
    g_visible[ordinal] = gpu;
}

int physical_devices(void) {
    return g_physical_devices;
}

int valid_device(CUdevice dev) {
    return dev >= 0 && dev < g_config.devices;
}

int context_alive(CUcontext ctx) {
    return ctx != NULL && ctx->refs > 0;
}

CUresult current_device_locked(CUdevice *dev) {
    if (!g_initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (!context_alive(t_current)) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    *dev = t_current->device;
    return CUDA_SUCCESS;
}

/* Index of p in an array of count elements of size bytes at base, or -1. */
long slot_of(const void *base, size_t size, size_t count, const void *p) {
    uintptr_t b = (uintptr_t)base, q = (uintptr_t)p;
    if (q < b || q >= b + size * count || (q - b) % size != 0) {
        return -1;
    }
    return (long)((q - b) / size);
}

/* ---------------------------------------------------------------- init, devices */

/* The MPS model: like the real driver, cuInit tries to reach an MPS control
 * daemon and runs as its client when it can, alone (without MPS) when it
 * cannot. Here the daemon is up when CUDA_MPS_PIPE_DIRECTORY names a folder
 * whose `control` Unix socket accepts a connection; unset, the double does
 * not look at the driver's default folder, so no test depends on the
 * machine's /tmp. */
static int mps_daemon_reachable(void) {
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    struct sockaddr_un address;
    int fd, written, connected;
    if (dir == NULL || *dir == '\0') {
        return 0;
    }
    memset(&address, 0, sizeof address);
    address.sun_family = AF_UNIX;
    written = snprintf(address.sun_path, sizeof address.sun_path, "%s/control", dir);
    if (written < 0 || (size_t)written >= sizeof address.sun_path) {
        return 0;
    }
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return 0;
    }
    connected = connect(fd, (const struct sockaddr *)&address, sizeof address) == 0;
    close(fd);
    return connected;
}

/* The GPUs the MPS server serves: the real control daemon starts its
 * servers on the GPUs of its own CUDA_VISIBLE_DEVICES, and a client's CUDA
 * enumerates those alone (NVIDIA's MPS documentation: the server remaps the
 * devices). The fake control daemon (crate mps-fake) writes that value to
 * MPS_SERVED_DEVICES_FILE in its pipe folder; read here into `text` (empty:
 * no such file, the server serves every GPU, as a daemon started without
 * the variable does). */
#define MPS_SERVED_DEVICES_FILE "fake-served-devices"
static void mps_served_devices(char *text, size_t size) {
    const char *dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    char path[4096];
    FILE *file;
    text[0] = '\0';
    if (dir == NULL || snprintf(path, sizeof path, "%s/" MPS_SERVED_DEVICES_FILE, dir) >=
                           (int)sizeof path) {
        return;
    }
    file = fopen(path, "re");
    if (file == NULL) {
        return;
    }
    if (fgets(text, (int)size, file) == NULL) {
        text[0] = '\0';
    }
    text[strcspn(text, "\n")] = '\0';
    fclose(file);
}

/* An MPS client's CUDA ordinals: the served GPUs, narrowed by the client's
 * own CUDA_VISIBLE_DEVICES, whose indices count the served GPUs and whose
 * UUIDs must name one of them (an entry that names none ends the list, as
 * an invalid entry does). Under the lock, at the first cuInit. */
static void mps_narrow_locked(const char *served) {
    int all[DOUBLE_MAX_DEVICES], server[DOUBLE_MAX_DEVICES], client[DOUBLE_MAX_DEVICES];
    int i, n;
    const char *own = getenv("CUDA_VISIBLE_DEVICES");
    if (*served == '\0') {
        return;
    }
    for (i = 0; i < DOUBLE_MAX_DEVICES; i++) {
        all[i] = i;
    }
    n = parse_visible(served, all, g_physical_devices, server);
    if (own == NULL) {
        set_visible(server, n);
    } else {
        set_visible(client, parse_visible(own, server, n, client));
    }
}

CUresult impl_cuInit(unsigned int Flags) {
    CUresult rc = CUDA_SUCCESS;
    int mps;
    char served[1024];
    if (Flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    mps = mps_daemon_reachable();
    if (mps) {
        mps_served_devices(served, sizeof served);
    }
    lock();
    if (!g_initialized && mps) {
        mps_narrow_locked(served);
    }
    if (g_config.devices == 0) {
        rc = CUDA_ERROR_NO_DEVICE;
    } else if (!g_initialized) {
        /* Decided by the first cuInit, as the real driver's client is. */
        g_initialized = 1;
        g_mps_enabled = mps;
        checkpoint_start_locked();
        node_start_locked();
        if (mps) {
            /* The share of the SMs the client takes, read here as the real
             * driver reads it; said on stderr for the tests. */
            const char *share = getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
            fprintf(stderr, "driver double: MPS client, active thread percentage %s\n",
                    share != NULL ? share : "unset");
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuDriverGetVersion(int *driverVersion) {
    if (driverVersion == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *driverVersion = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* Checks initialisation and the device under the lock, then releases it. */
CUresult check_device(CUdevice dev) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!valid_device(dev)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    }
    unlock();
    return rc;
}

CUresult impl_cuDeviceGet(CUdevice *device, int ordinal) {
    CUresult rc = check_device(0);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (device == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!valid_device(ordinal)) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceGetCount(int *count) {
    CUresult rc = check_device(0);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (count == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *count = g_config.devices;
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceGetName(char *name, int len, CUdevice dev) {
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (name == NULL || len <= 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    snprintf(name, (size_t)len, "gpushare double (H100 prologues)");
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceGetUuid(CUuuid *uuid, CUdevice dev) {
    unsigned char bytes[16];
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (uuid == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    double_uuid_bytes(g_visible[dev], bytes);
    memcpy(uuid->bytes, bytes, sizeof bytes);
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice dev) {
    return impl_cuDeviceGetUuid(uuid, dev);
}

CUresult impl_cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (pciBusId == NULL || len < 13) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    /* The GPU's that the ordinal named at start (CUDA_VISIBLE_DEVICES),
     * kept through a restore onto another GPU, as the driver does. */
    snprintf(pciBusId, (size_t)len, "0000:%02X:00.0", double_pci_bus(g_bus_gpu[dev]));
    return CUDA_SUCCESS;
}

CUresult impl_cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev) {
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (bytes == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *bytes = (size_t)g_config.total;
    return CUDA_SUCCESS;
}

unsigned int clamp_uint(unsigned long long value) {
    return value > UINT_MAX ? UINT_MAX : (unsigned int)value;
}

CUresult impl_cuDeviceTotalMem(unsigned int *bytes, CUdevice dev) {
    size_t total = 0;
    CUresult rc = impl_cuDeviceTotalMem_v2(bytes == NULL ? NULL : &total, dev);
    if (rc == CUDA_SUCCESS) {
        *bytes = clamp_uint(total);
    }
    return rc;
}

/* ---------------------------------------------------------------- device attributes */

CUresult impl_cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
    CUresult rc = check_device(dev);
    int value;
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (pi == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    switch (attrib) { /* an H100 SXM */
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: value = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: value = 0x7fffffff; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: value = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: value = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: value = 49152; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: value = 32; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: value = 1980000; break; /* kHz */
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: value = DOUBLE_SM_COUNT; break;
    case CU_DEVICE_ATTRIBUTE_INTEGRATED: value = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_MODE: value = 0; break; /* default */
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: value = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: value = (int)double_pci_bus(g_bus_gpu[dev]); break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: value = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: value = DOUBLE_THREADS_PER_SM; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: value = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: value = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: value = DOUBLE_CC_MAJOR; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: value = DOUBLE_CC_MINOR; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: value = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: value = 1; break;
    case CU_DEVICE_ATTRIBUTE_MPS_ENABLED: value = g_mps_enabled; break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pi = value;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- for libnvidia-ml */

/* NVML's view: every fake GPU, by physical index; a GPU this process does
 * not see through CUDA_VISIBLE_DEVICES shows nothing of it, nor does one
 * whose charges a checkpoint moved to the host. It answers while a
 * checkpoint lock holds the process, as NVML does. */
EXPORT int gpushare_double_state(int device, struct gpushare_double_snapshot *out) {
    int count, ordinal;
    lock_raw();
    count = g_physical_devices;
    if (out != NULL && device >= 0 && device < count) {
        memset(out, 0, sizeof *out);
        out->total = g_config.total;
        /* Several ordinals may run on one GPU after a restore onto other GPUs. */
        for (ordinal = 0; ordinal < g_config.devices; ordinal++) {
            if (g_visible[ordinal] != device || g_devices[ordinal].parked) {
                continue;
            }
            out->has_context |= g_devices[ordinal].live_contexts > 0;
            out->context_bytes += context_bytes(ordinal);
            out->alloc_bytes += g_devices[ordinal].alloc_bytes;
            out->driver_bytes = add_sat(out->driver_bytes, held_bytes(ordinal));
        }
    }
    unlock();
    return count;
}

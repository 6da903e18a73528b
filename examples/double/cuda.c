/*
 * libcuda.so.1 of the test double: a fake GPU with memory accounting and a
 * simulated clock for compute, behind entry points that start with the real
 * driver's prologue (cuda_entry.S). Each exported `cuX` tail-jumps to
 * `impl_cuX` here.
 *
 * Model (per process, one mutex):
 * - GPUSHARE_DOUBLE_DEVICES fake GPUs of GPUSHARE_DOUBLE_TOTAL bytes each
 *   (double_common.h).
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
 *   cuInit, cuDriverGetVersion, cuGetProcAddress(_v2) and, as in the real
 *   driver, cuGetErrorString/cuGetErrorName.
 * - Stream-ordered allocations and frees complete at once, on the stream's
 *   GPU (or the pool's).
 * - Pinned host memory (cuMemHostAlloc, cuMemHostGetDevicePointer_v2,
 *   cuMemFreeHost, cuPointerGetAttribute): host_memory.c. It is never charged
 *   to a GPU; cuMemGetAddressRange_v2 answers for it too.
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
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <time.h>

#include "cuda_min.h"
#include "double_common.h"

#define EXPORT __attribute__((visibility("default")))

/*
 * Each implementation is declared with the type of its entry point in
 * cuda_min.h, so a definition below with another signature does not compile.
 */
#define CU_ENTRY(name) extern __typeof__(name) impl_##name __attribute__((visibility("hidden")));
#include "cuda_entries.def"
#undef CU_ENTRY

static const char *const exported_names[] = {
#define CU_ENTRY(name) #name,
#include "cuda_entries.def"
#undef CU_ENTRY
};

#define DOUBLE_MAX_CREATED 64
/* Where the regions start when the reservation cannot be had. */
#define FALLBACK_REGION_BASE 0x7f0000000000ULL
static unsigned long long g_region_base = FALLBACK_REGION_BASE;
#define REGION_BASE g_region_base
#define REGION_SIZE (1ULL << 40)
/* Within a GPU's region: allocations below GRAPH_OFFSET, graph allocations
 * below GLOBALS_OFFSET, module globals above. */
#define GRAPH_OFFSET (REGION_SIZE / 2)
#define GLOBALS_OFFSET (REGION_SIZE / 4 * 3)
#define ADDRESS_ALIGN 512ULL
#define GRANULARITY (2ULL << 20)
#define DRIVER_VERSION 13000
#define DEFAULT_KERNEL_NS 100000ULL
#define DEFAULT_QUEUE_DEPTH 1024ULL
#define MAX_QUEUE_DEPTH (1ULL << 20)
/* Context limits: the defaults of an H100, and the threads the device keeps
 * a stack for (each byte of stack above the default is held this many times):
 * every resident thread, its SMs times threads per SM (an H100's, as
 * cuDeviceGetAttribute reports them), as driver 580 holds them. */
#define DEFAULT_STACK_SIZE 1024ULL
#define DEFAULT_PRINTF_FIFO_SIZE (1ULL << 20)
#define DEFAULT_MALLOC_HEAP_SIZE (8ULL << 20)
#define DOUBLE_SM_COUNT 132
#define DOUBLE_THREADS_PER_SM 2048
#define DOUBLE_STACK_THREADS ((unsigned long long)DOUBLE_SM_COUNT * DOUBLE_THREADS_PER_SM)
/* An H100's compute capability: the arch of the fat binary entries it loads. */
#define DOUBLE_CC_MAJOR 9
#define DOUBLE_CC_MINOR 0
#define DOUBLE_ARCH (DOUBLE_CC_MAJOR * 10 + DOUBLE_CC_MINOR)

enum kind { KIND_POINTER = 1, KIND_HANDLE = 2, KIND_ARRAY = 4, KIND_MIPMAP = 8 };

struct CUctx_st {
    int device;
    int primary;
    int green;     /* a green context: charges the green bytes */
    unsigned refs; /* primary: retain count; created: 1 while alive */
};

struct record {
    unsigned long long addr;
    unsigned long long size;
    CUcontext ctx; /* NULL for cuMemCreate handles */
    unsigned char kind;
    unsigned char live;
    unsigned char pooled; /* from the GPU's default pool */
};

struct device {
    unsigned live_contexts;
    unsigned live_green;     /* of which green contexts */
    unsigned long long alloc_bytes;
    /* Driver-held, besides the contexts (the pool's retained bytes are in
     * g_pools): */
    size_t limits[CU_LIMIT_MAX];
    unsigned long long module_bytes;   /* globals of loaded modules and libraries */
    unsigned long long graph_bytes;    /* reserved by live graph execs */
    unsigned long long graph_retained; /* of destroyed execs, until trimmed */
    unsigned long long next;           /* bump pointer */
    unsigned long long graph_next;     /* bump of graph allocation addresses */
    unsigned long long globals_next;   /* bump of module globals addresses */
    /* Sorted by addr (the bump only grows); dead entries are compacted away. */
    struct record *records;
    size_t len, cap, live;
};

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct double_config g_config;
static unsigned long long g_config_kernel_ns;
static unsigned long long g_config_queue_depth;
static int g_initialized;
static struct device g_devices[DOUBLE_MAX_DEVICES];
static struct CUctx_st g_primary[DOUBLE_MAX_DEVICES];
static struct CUctx_st g_created[DOUBLE_MAX_CREATED];
static __thread CUcontext t_current;

/* The default memory pool of each GPU (by ordinal). */
struct CUmemPoolHandle_st {
    int device;
    unsigned long long threshold; /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
    unsigned long long used;      /* its live allocations */
    unsigned long long retained;  /* freed into it and kept: driver-held */
    int reuse[3];                 /* the CU_MEMPOOL_ATTR_REUSE_* flags: stored only */
};
static struct CUmemPoolHandle_st g_pools[DOUBLE_MAX_DEVICES];

/* Pinned mapped host memory, in host_memory.c. */
int double_host_range(unsigned long long addr, unsigned long long *base, unsigned long long *size);

/* The simulated GPU clock, further down. */
static unsigned long long now_ns(void);
static void sleep_until(unsigned long long ns);
static unsigned long long device_busy_until(int dev);
static CUresult context_sync_locked(int dev);
/* Modules, further down: those of a context go with it, and a library's
 * kernel launches as its function in a context. */
static void unload_context_modules_locked(CUcontext ctx);
static CUresult kernel_launch_function(CUfunction *f, CUstream h, int ptsz);

/* A plain decimal count from the environment, within [min, max]. */
static unsigned long long env_count(const char *name, unsigned long long fallback,
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
/* The fake GPUs of the machine, visible or not (NVML sees them all). */
static int g_physical_devices;

/* The GPU whose UUID the entry at text names (up to ',' or the end), *end
 * after it; -1 when none or several match. */
static long visible_uuid(const char *text, char **end) {
    size_t len = strcspn(text, ",");
    long found = -1;
    int device;
    char uuid[DOUBLE_UUID_STRING_LEN + 1];
    *end = (char *)text + len;
    for (device = 0; device < g_config.devices; device++) {
        double_uuid_string(device, uuid);
        if (len > 4 && len <= DOUBLE_UUID_STRING_LEN && strncasecmp(uuid, text, len) == 0) {
            if (found >= 0) {
                return -1;
            }
            found = device;
        }
    }
    return found;
}

static void load_visible(void) {
    const char *text = getenv("CUDA_VISIBLE_DEVICES");
    int i, count = 0;
    g_physical_devices = g_config.devices;
    for (i = 0; i < DOUBLE_MAX_DEVICES; i++) {
        g_visible[i] = i;
    }
    if (text == NULL) {
        return;
    }
    while (*text != '\0' && count < g_config.devices) {
        char *end;
        long index = strncmp(text, "GPU-", 4) == 0 ? visible_uuid(text, &end)
                                                   : strtol(text, &end, 10);
        if (end == text || index < 0 || index >= g_config.devices) {
            break;
        }
        g_visible[count++] = (int)index;
        text = *end == ',' ? end + 1 : end;
        if (*end != ',') {
            break;
        }
    }
    g_config.devices = count;
}

static unsigned long long region_start(int dev) {
    return REGION_BASE + (unsigned long long)dev * REGION_SIZE;
}

static void reset_limits(struct device *d) {
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
    {
        void *reserved = mmap(NULL, (size_t)(DOUBLE_MAX_DEVICES * REGION_SIZE), PROT_NONE,
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
        g_pools[i].device = i;
        g_pools[i].reuse[0] = g_pools[i].reuse[1] = g_pools[i].reuse[2] = 1;
    }
}

static void lock(void) {
    pthread_once(&g_once, load_config);
    pthread_mutex_lock(&g_lock);
}

static void unlock(void) {
    pthread_mutex_unlock(&g_lock);
}

static int valid_device(CUdevice dev) {
    return dev >= 0 && dev < g_config.devices;
}

static int context_alive(CUcontext ctx) {
    return ctx != NULL && ctx->refs > 0;
}

/* a + b, or ~0 when that overflows (then it fits nowhere). */
static unsigned long long add_sat(unsigned long long a, unsigned long long b) {
    return a > ~0ULL - b ? ~0ULL : a + b;
}

/* What the limits hold above their defaults (see the model above). */
static unsigned long long limit_bytes(const size_t *limits) {
    unsigned long long held = 0, stack = limits[CU_LIMIT_STACK_SIZE];
    if (limits[CU_LIMIT_MALLOC_HEAP_SIZE] > DEFAULT_MALLOC_HEAP_SIZE) {
        held = limits[CU_LIMIT_MALLOC_HEAP_SIZE] - DEFAULT_MALLOC_HEAP_SIZE;
    }
    if (limits[CU_LIMIT_PRINTF_FIFO_SIZE] > DEFAULT_PRINTF_FIFO_SIZE) {
        held = add_sat(held, limits[CU_LIMIT_PRINTF_FIFO_SIZE] - DEFAULT_PRINTF_FIFO_SIZE);
    }
    if (stack > DEFAULT_STACK_SIZE) {
        stack -= DEFAULT_STACK_SIZE;
        held = add_sat(held, stack > ~0ULL / DOUBLE_STACK_THREADS ? ~0ULL
                                                                  : stack * DOUBLE_STACK_THREADS);
    }
    return held;
}

static unsigned long long context_bytes(int dev) {
    const struct device *d = &g_devices[dev];
    return (unsigned long long)(d->live_contexts - d->live_green) * g_config.context_bytes +
           (unsigned long long)d->live_green * g_config.green_context_bytes;
}

/* Driver-held bytes on dev besides the contexts'. */
static unsigned long long held_bytes(int dev) {
    const struct device *d = &g_devices[dev];
    unsigned long long held = add_sat(limit_bytes(d->limits), d->module_bytes);
    held = add_sat(held, d->graph_bytes);
    held = add_sat(held, d->graph_retained);
    return add_sat(held, g_pools[dev].retained);
}

static unsigned long long used_bytes(int dev) {
    return add_sat(add_sat(context_bytes(dev), g_devices[dev].alloc_bytes), held_bytes(dev));
}

/* Whether `size` more bytes fit on dev. */
static int fits(int dev, unsigned long long size) {
    return size <= g_config.total && used_bytes(dev) <= g_config.total - size;
}

/* Releases the pool's retained bytes until reserved <= max(keep, used). */
static void pool_release_locked(struct CUmemPoolHandle_st *p, unsigned long long keep) {
    unsigned long long reserved = p->used + p->retained;
    if (keep < p->used) {
        keep = p->used;
    }
    if (reserved > keep) {
        p->retained -= reserved - keep < p->retained ? reserved - keep : p->retained;
    }
}

/* A synchronize on dev: its pool gives back what is above its threshold. */
static void pool_settle_locked(int dev) {
    pool_release_locked(&g_pools[dev], g_pools[dev].threshold);
}

/* Everything below that ends in _locked runs under g_lock. */

static CUresult current_device_locked(CUdevice *dev) {
    if (!g_initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (!context_alive(t_current)) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    *dev = t_current->device;
    return CUDA_SUCCESS;
}

static void compact_locked(struct device *d) {
    size_t i, j = 0;
    for (i = 0; i < d->len; i++) {
        if (d->records[i].live) {
            d->records[j++] = d->records[i];
        }
    }
    d->len = j;
}

static void forget_locked(int dev, struct record *r) {
    struct device *d = &g_devices[dev];
    r->live = 0;
    d->alloc_bytes -= r->size;
    d->live--;
    if (r->pooled) {
        g_pools[dev].used -= r->size;
    }
}

/* After frees: restart the bump when nothing is left, or drop dead records. */
static void tidy_locked(int dev) {
    struct device *d = &g_devices[dev];
    if (d->live == 0) {
        d->len = 0;
        d->next = region_start(dev);
    } else if (d->len > 64 && d->live < d->len / 2) {
        compact_locked(d);
    }
}

static CUresult alloc_locked(int dev, CUcontext ctx, unsigned long long size, enum kind kind,
                             unsigned long long *addr) {
    struct device *d = &g_devices[dev];
    unsigned long long end = region_start(dev) + GRAPH_OFFSET;
    unsigned long long span;
    if (size == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!fits(dev, size)) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    span = (size + ADDRESS_ALIGN - 1) & ~(ADDRESS_ALIGN - 1);
    if (span < size || span > end - d->next) {
        return CUDA_ERROR_OUT_OF_MEMORY; /* the fake address space is used up */
    }
    if (d->len == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 64;
        struct record *grown = realloc(d->records, cap * sizeof *grown);
        if (grown == NULL) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        d->records = grown;
        d->cap = cap;
    }
    d->records[d->len].addr = d->next;
    d->records[d->len].size = size;
    d->records[d->len].ctx = ctx;
    d->records[d->len].kind = (unsigned char)kind;
    d->records[d->len].live = 1;
    d->records[d->len].pooled = 0;
    d->len++;
    d->live++;
    d->alloc_bytes += size;
    *addr = d->next;
    d->next += span;
    return CUDA_SUCCESS;
}

/* The live record that starts at (exact) or contains addr, or NULL. */
static struct record *find_locked(unsigned long long addr, int exact, int *dev_out) {
    struct device *d;
    size_t lo = 0, hi;
    int dev;
    if (addr < REGION_BASE) {
        return NULL;
    }
    dev = (int)((addr - REGION_BASE) / REGION_SIZE);
    if (dev >= g_config.devices) {
        return NULL;
    }
    d = &g_devices[dev];
    hi = d->len;
    while (lo < hi) { /* first record with records[i].addr > addr */
        size_t mid = lo + (hi - lo) / 2;
        if (d->records[mid].addr <= addr) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if (lo == 0) {
        return NULL;
    }
    {
        struct record *r = &d->records[lo - 1];
        if (!r->live || (exact ? r->addr != addr : addr - r->addr >= r->size)) {
            return NULL;
        }
        *dev_out = dev;
        return r;
    }
}

static CUresult free_locked(unsigned long long addr, unsigned kinds, CUresult unknown) {
    int dev = 0;
    struct record *r;
    if (!g_initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    r = find_locked(addr, 1, &dev);
    if (r == NULL || !(r->kind & kinds)) {
        return unknown;
    }
    forget_locked(dev, r);
    tidy_locked(dev);
    return CUDA_SUCCESS;
}

/* Allocation through the current context; the common path of most APIs. */
static CUresult alloc_current(unsigned long long size, enum kind kind, unsigned long long *addr) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS) {
        rc = alloc_locked(dev, t_current, size, kind, addr);
    }
    unlock();
    return rc;
}

/* A malformed allocation call: the init or context error first, else INVALID_VALUE. */
static CUresult reject_current(void) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    unlock();
    return rc == CUDA_SUCCESS ? CUDA_ERROR_INVALID_VALUE : rc;
}

static CUresult free_any(unsigned long long addr, unsigned kinds, CUresult unknown) {
    CUresult rc;
    lock();
    rc = free_locked(addr, kinds, unknown);
    unlock();
    return rc;
}

/* A fake address for `size` bytes from the bump at *next, below end. */
static CUresult bump_locked(unsigned long long *next, unsigned long long end,
                            unsigned long long size, unsigned long long *addr) {
    unsigned long long span = (size + ADDRESS_ALIGN - 1) & ~(ADDRESS_ALIGN - 1);
    if (span < size || span > end - *next) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *addr = *next;
    *next += span;
    return CUDA_SUCCESS;
}

/* A new context on dev (green or not): its bytes, if they fit. */
static CUresult context_up_locked(int dev, int green) {
    if (!fits(dev, green ? g_config.green_context_bytes : g_config.context_bytes)) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_devices[dev].live_contexts++;
    g_devices[dev].live_green += green ? 1 : 0;
    return CUDA_SUCCESS;
}

static void context_down_locked(CUcontext ctx) {
    struct device *d = &g_devices[ctx->device];
    size_t i;
    for (i = 0; i < d->len; i++) {
        if (d->records[i].live && d->records[i].ctx == ctx) {
            forget_locked(ctx->device, &d->records[i]);
        }
    }
    tidy_locked(ctx->device);
    unload_context_modules_locked(ctx);
    d->live_green -= ctx->green ? 1 : 0;
    if (--d->live_contexts == 0) {
        /* What only the driver keeps for the GPU goes with its last context. */
        reset_limits(d);
        d->graph_retained = 0;
        g_pools[ctx->device].retained = 0;
    }
}

/* ---------------------------------------------------------------- init, devices */

CUresult impl_cuInit(unsigned int Flags) {
    CUresult rc = CUDA_SUCCESS;
    if (Flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    lock();
    if (g_config.devices == 0) {
        rc = CUDA_ERROR_NO_DEVICE;
    } else {
        g_initialized = 1;
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
static CUresult check_device(CUdevice dev) {
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
    snprintf(pciBusId, (size_t)len, "0000:%02X:00.0", double_pci_bus(dev));
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

static unsigned int clamp_uint(unsigned long long value) {
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

/* ---------------------------------------------------------------- contexts */

CUresult impl_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (!valid_device(dev)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (g_primary[dev].refs > 0 || (rc = context_up_locked(dev, 0)) == CUDA_SUCCESS) {
        g_primary[dev].refs++;
        *pctx = &g_primary[dev];
    }
    unlock();
    return rc;
}

CUresult impl_cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!valid_device(dev)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (g_primary[dev].refs == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--g_primary[dev].refs == 0) {
        context_down_locked(&g_primary[dev]);
    }
    unlock();
    return rc;
}

/* A created context on dev in *pctx, made current when `current`. */
/* A created context on dev; a green one is not made current. */
static CUresult create_context(CUcontext *pctx, CUdevice dev, int green) {
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    int i;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (!valid_device(dev)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else {
        for (i = 0; i < DOUBLE_MAX_CREATED; i++) {
            if (g_created[i].refs == 0) {
                rc = context_up_locked(dev, green);
                if (rc == CUDA_SUCCESS) {
                    g_created[i].device = dev;
                    g_created[i].primary = 0;
                    g_created[i].green = green;
                    g_created[i].refs = 1;
                    *pctx = &g_created[i];
                    if (!green) {
                        t_current = &g_created[i];
                    }
                }
                break;
            }
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return create_context(pctx, dev, 0);
}

/*
 * A green context is a created context that is not made current; any
 * resource descriptor is accepted (the double has no SM partitions).
 */
CUresult impl_cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev,
                               unsigned int flags) {
    (void)desc;
    (void)flags;
    return create_context((CUcontext *)phCtx, dev, 1);
}

static int is_created_context(CUcontext ctx) {
    uintptr_t p = (uintptr_t)ctx;
    uintptr_t base = (uintptr_t)&g_created[0];
    return p >= base && p < (uintptr_t)&g_created[DOUBLE_MAX_CREATED] &&
           (p - base) % sizeof g_created[0] == 0;
}

static int is_primary_context(CUcontext ctx) {
    uintptr_t p = (uintptr_t)ctx;
    uintptr_t base = (uintptr_t)&g_primary[0];
    return p >= base && p < (uintptr_t)&g_primary[DOUBLE_MAX_DEVICES] &&
           (p - base) % sizeof g_primary[0] == 0;
}

CUresult impl_cuCtxDestroy_v2(CUcontext ctx) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!is_created_context(ctx) || ctx->refs == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT; /* primary contexts are released, not destroyed */
    } else {
        ctx->refs = 0;
        context_down_locked(ctx);
        if (t_current == ctx) {
            t_current = NULL;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuGreenCtxDestroy(CUgreenCtx hCtx) {
    return impl_cuCtxDestroy_v2((CUcontext)hCtx);
}

CUresult impl_cuCtxSetCurrent(CUcontext ctx) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (ctx != NULL && !((is_primary_context(ctx) || is_created_context(ctx)) &&
                                context_alive(ctx))) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else {
        t_current = ctx;
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxGetCurrent(CUcontext *pctx) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        *pctx = t_current;
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxGetDevice(CUdevice *device) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    unlock();
    if (rc == CUDA_SUCCESS) {
        if (device == NULL) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *device = dev;
    }
    return rc;
}

/* Sleeps until the device's simulated timeline has drained. */
CUresult impl_cuCtxSynchronize(void) {
    CUdevice dev = 0;
    CUresult rc;
    unsigned long long at = 0;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS) {
        rc = context_sync_locked(dev);
    }
    if (rc == CUDA_SUCCESS) {
        at = device_busy_until(dev);
        pool_settle_locked(dev);
    }
    unlock();
    if (at > now_ns()) {
        sleep_until(at);
    }
    return rc;
}

/* Limits of the current context's GPU; those with a cost hold it while set. */
CUresult impl_cuCtxSetLimit(CUlimit limit, size_t value) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && (unsigned)limit >= CU_LIMIT_MAX) {
        rc = CUDA_ERROR_UNSUPPORTED_LIMIT;
    } else if (rc == CUDA_SUCCESS) {
        struct device *d = &g_devices[dev];
        size_t old = d->limits[limit];
        unsigned long long before = limit_bytes(d->limits), after;
        d->limits[limit] = value;
        after = limit_bytes(d->limits);
        d->limits[limit] = old;
        /* The check runs with the old limit charged, so it asks only for the growth. */
        if (after > before && !fits(dev, after - before)) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            d->limits[limit] = value;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxGetLimit(size_t *pvalue, CUlimit limit) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && pvalue == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && (unsigned)limit >= CU_LIMIT_MAX) {
        rc = CUDA_ERROR_UNSUPPORTED_LIMIT;
    } else if (rc == CUDA_SUCCESS) {
        *pvalue = g_devices[dev].limits[limit];
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- memory info */

CUresult impl_cuMemGetInfo_v2(size_t *free, size_t *total) {
    CUdevice dev = 0;
    CUresult rc;
    unsigned long long used;
    lock();
    rc = current_device_locked(&dev);
    used = rc == CUDA_SUCCESS ? used_bytes(dev) : 0;
    unlock();
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (free == NULL || total == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *total = (size_t)g_config.total;
    *free = (size_t)(used >= g_config.total ? 0 : g_config.total - used);
    return CUDA_SUCCESS;
}

CUresult impl_cuMemGetInfo(unsigned int *free, unsigned int *total) {
    size_t f = 0, t = 0;
    CUresult rc;
    if (free == NULL || total == NULL) {
        return impl_cuMemGetInfo_v2(NULL, NULL);
    }
    rc = impl_cuMemGetInfo_v2(&f, &t);
    if (rc == CUDA_SUCCESS) {
        *free = clamp_uint(f);
        *total = clamp_uint(t);
    }
    return rc;
}

/* ---------------------------------------------------------------- allocation */

CUresult impl_cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
    if (dptr == NULL) {
        return reject_current();
    }
    return alloc_current(bytesize, KIND_POINTER, dptr);
}

CUresult impl_cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t WidthInBytes,
                                 size_t Height, unsigned int ElementSizeBytes) {
    unsigned long long pitch = ((unsigned long long)WidthInBytes + 511ULL) & ~511ULL;
    unsigned long long bytes = pitch * Height;
    CUresult rc;
    if (dptr == NULL || pPitch == NULL || WidthInBytes == 0 || Height == 0 ||
        (ElementSizeBytes != 4 && ElementSizeBytes != 8 && ElementSizeBytes != 16) ||
        pitch < WidthInBytes || bytes / Height != pitch) {
        return reject_current();
    }
    rc = alloc_current(bytes, KIND_POINTER, dptr);
    if (rc == CUDA_SUCCESS) {
        *pPitch = (size_t)pitch;
    }
    return rc;
}

CUresult impl_cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    if (dptr == NULL || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)) {
        return reject_current();
    }
    return alloc_current(bytesize, KIND_POINTER, dptr);
}

/* GPUSHARE_DOUBLE_FAIL_FREES=N: the first N cuMemFree_v2 and (uncaptured)
 * cuMemFreeAsync calls of the process fail with CUDA_ERROR_ILLEGAL_ADDRESS
 * and free nothing (a sticky error in the real driver), so tests can see a
 * failed free keep its charge. */
static long g_fail_frees = -1;

/* Whether this free is one of the first N (cuMemFreeAsync counts too). */
static int free_fails(void) {
    long left = __atomic_load_n(&g_fail_frees, __ATOMIC_ACQUIRE);
    if (left < 0) {
        const char *text = getenv("GPUSHARE_DOUBLE_FAIL_FREES");
        left = text != NULL ? strtol(text, NULL, 10) : 0;
        __atomic_store_n(&g_fail_frees, left, __ATOMIC_RELEASE);
    }
    while (left > 0) {
        if (__atomic_compare_exchange_n(&g_fail_frees, &left, left - 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            return 1;
        }
    }
    return 0;
}

CUresult impl_cuMemFree_v2(CUdeviceptr dptr) {
    if (free_fails()) {
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    return free_any(dptr, KIND_POINTER, CUDA_ERROR_INVALID_VALUE);
}

CUresult impl_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                          const CUmemAllocationProp *prop, unsigned long long flags) {
    CUresult rc;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (handle == NULL || prop == NULL || flags != 0 ||
               prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
               prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || size % GRANULARITY != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (!valid_device(prop->location.id)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else {
        rc = alloc_locked(prop->location.id, NULL, size, KIND_HANDLE, handle);
    }
    unlock();
    return rc;
}

CUresult impl_cuMemRelease(CUmemGenericAllocationHandle handle) {
    return free_any(handle, KIND_HANDLE, CUDA_ERROR_INVALID_VALUE);
}

CUresult impl_cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                            CUmemAllocationGranularity_flags option) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (granularity == NULL || prop == NULL ||
               (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        *granularity = (size_t)GRANULARITY;
    }
    unlock();
    return rc;
}

/* Bytes per element, or 0 for an unknown format or channel count. */
static unsigned long long element_bytes(CUarray_format format, unsigned channels) {
    unsigned long long bytes;
    switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
        bytes = 1;
        break;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
        bytes = 2;
        break;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
        bytes = 4;
        break;
    default:
        return 0;
    }
    if (channels != 1 && channels != 2 && channels != 4) {
        return 0;
    }
    return bytes * channels;
}

static unsigned long long at_least_one(size_t n) {
    return n == 0 ? 1 : (unsigned long long)n;
}

/* element × W × max(H,1) × max(D,1), or 0 when invalid or overflowing. */
static unsigned long long array_bytes(CUarray_format format, unsigned channels, size_t width,
                                      size_t height, size_t depth) {
    unsigned long long bytes = element_bytes(format, channels);
    unsigned long long dims[3];
    int i;
    dims[0] = width;
    dims[1] = at_least_one(height);
    dims[2] = at_least_one(depth);
    for (i = 0; i < 3; i++) {
        if (dims[i] != 0 && bytes > ~0ULL / dims[i]) {
            return 0;
        }
        bytes *= dims[i];
    }
    return bytes;
}

CUresult impl_cuArrayCreate_v2(CUarray *pHandle, const CUDA_ARRAY_DESCRIPTOR *pAllocateArray) {
    unsigned long long addr = 0, bytes;
    CUresult rc;
    if (pHandle == NULL || pAllocateArray == NULL) {
        return reject_current();
    }
    bytes = array_bytes(pAllocateArray->Format, pAllocateArray->NumChannels,
                        pAllocateArray->Width, pAllocateArray->Height, 0);
    rc = alloc_current(bytes, KIND_ARRAY, &addr);
    if (rc == CUDA_SUCCESS) {
        *pHandle = (CUarray)(uintptr_t)addr;
    }
    return rc;
}

CUresult impl_cuArray3DCreate_v2(CUarray *pHandle, const CUDA_ARRAY3D_DESCRIPTOR *pAllocateArray) {
    unsigned long long addr = 0, bytes;
    CUresult rc;
    if (pHandle == NULL || pAllocateArray == NULL) {
        return reject_current();
    }
    bytes = array_bytes(pAllocateArray->Format, pAllocateArray->NumChannels,
                        pAllocateArray->Width, pAllocateArray->Height, pAllocateArray->Depth);
    rc = alloc_current(bytes, KIND_ARRAY, &addr);
    if (rc == CUDA_SUCCESS) {
        *pHandle = (CUarray)(uintptr_t)addr;
    }
    return rc;
}

CUresult impl_cuArrayDestroy(CUarray hArray) {
    return free_any((uintptr_t)hArray, KIND_ARRAY, CUDA_ERROR_INVALID_HANDLE);
}

static size_t half_level(size_t n, unsigned level) {
    size_t shifted;
    if (n == 0) {
        return 0; /* an absent dimension stays absent */
    }
    shifted = level >= sizeof n * CHAR_BIT ? 0 : n >> level;
    return shifted == 0 ? 1 : shifted;
}

CUresult impl_cuMipmappedArrayCreate(CUmipmappedArray *pHandle,
                                     const CUDA_ARRAY3D_DESCRIPTOR *pMipmappedArrayDesc,
                                     unsigned int numMipmapLevels) {
    const CUDA_ARRAY3D_DESCRIPTOR *desc = pMipmappedArrayDesc;
    unsigned long long addr = 0, total = 0;
    unsigned level;
    CUresult rc;
    if (pHandle == NULL || desc == NULL || numMipmapLevels == 0) {
        return reject_current();
    }
    for (level = 0; level < numMipmapLevels; level++) {
        unsigned long long bytes =
            array_bytes(desc->Format, desc->NumChannels, half_level(desc->Width, level),
                        half_level(desc->Height, level), half_level(desc->Depth, level));
        if (bytes == 0 || total + bytes < total) {
            total = 0;
            break;
        }
        total += bytes;
    }
    rc = alloc_current(total, KIND_MIPMAP, &addr);
    if (rc == CUDA_SUCCESS) {
        *pHandle = (CUmipmappedArray)(uintptr_t)addr;
    }
    return rc;
}

CUresult impl_cuMipmappedArrayDestroy(CUmipmappedArray hMipmappedArray) {
    return free_any((uintptr_t)hMipmappedArray, KIND_MIPMAP, CUDA_ERROR_INVALID_HANDLE);
}

/* For host_memory.c: whether cuInit ran, and the device allocation holding addr. */
int double_initialized(void) {
    int initialized;
    lock();
    initialized = g_initialized;
    unlock();
    return initialized;
}

int double_device_range(unsigned long long addr, unsigned long long *base,
                        unsigned long long *size, int *device) {
    struct record *r;
    int dev = 0, found = 0;
    lock();
    if ((r = find_locked(addr, 0, &dev)) != NULL && r->kind == KIND_POINTER) {
        *base = r->addr;
        *size = r->size;
        *device = dev;
        found = 1;
    }
    unlock();
    return found;
}

CUresult impl_cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    unsigned long long base = 0, size = 0;
    int dev = 0;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    /* Mapped pinned host memory has a range too (its device pointer is its address). */
    if (!double_device_range(dptr, &base, &size, &dev) && !double_host_range(dptr, &base, &size)) {
        return CUDA_ERROR_NOT_FOUND;
    }
    if (pbase != NULL) {
        *pbase = base;
    }
    if (psize != NULL) {
        *psize = (size_t)size;
    }
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- simulated GPU clock */

/*
 * One timeline per device: every kernel of the process on the device runs
 * alone, from max(submission, busy_until) for its duration (a kernel that
 * fills all SMs). Times are CLOCK_MONOTONIC nanoseconds.
 */
#define SPAN_CAPACITY ((size_t)1 << 20)
#define DOUBLE_MAX_STREAMS 256
#define DOUBLE_MAX_EVENTS 4096
#define DOUBLE_MAX_GRAPHS 256
#define DOUBLE_MAX_EXECS 256
/* Modules, and libraries' modules in each context, share the slots. */
#define DOUBLE_MAX_MODULES 256
#define DOUBLE_MAX_FUNCTIONS 8192
#define DOUBLE_MAX_KERNELS 4096
#define FUNCTION_NAME_MAX 128

struct span {
    unsigned long long start, end;
};

struct timeline {
    unsigned long long busy_until;
    /* Ring of SPAN_CAPACITY busy intervals in time order; back-to-back ones merged. */
    struct span *spans;
    size_t span_head, span_len;
    /* Ring of g_queue_depth end times of the latest submissions. */
    unsigned long long *pending;
    size_t pending_head, pending_len;
};

struct node {
    CUgraphNodeType type;
    int device;               /* memory nodes */
    unsigned long long bytes; /* alloc nodes */
    unsigned long long addr;  /* memory nodes */
};

struct CUgraph_st {
    int live;
    unsigned serial; /* names the graph in its nodes' handles; never 0 */
    unsigned long long ns; /* the captured kernels, back to back */
    unsigned long long kernels;
    struct node *nodes;
    size_t node_len, node_cap;
    /* While a stream captures into the graph: */
    int capturing;
    int invalidated;          /* a prohibited call broke the capture */
    CUstreamCaptureMode mode; /* of cuStreamBeginCapture */
    const void *owner;        /* the thread that began it (its t_thread_token) */
    int device;
};

struct CUgraphExec_st {
    int live;
    int reserved; /* its need is charged */
    unsigned long long ns;
    unsigned long long kernels;
    unsigned long long need[DOUBLE_MAX_DEVICES]; /* its graph's alloc nodes, per GPU */
};

struct CUstream_st {
    int live;
    int device;                 /* created streams only */
    struct CUgraph_st *capture; /* non-NULL while capturing */
    CUcontext ctx;              /* created streams only */
};

struct CUevent_st {
    int live;
    int recorded;
    unsigned flags;
    int device;            /* where it was created, then last recorded */
    unsigned long long at; /* when the work captured by the last record completes */
};

/* A loaded module, the image of a library, or a library's module in a context. */
struct CUmod_st {
    int live;
    int device;
    CUcontext ctx;                 /* a module's; NULL for a library's image */
    unsigned long long globals;    /* bytes of module globals held */
    unsigned long long globals_at; /* their first fake address */
    struct CUlib_st *library;      /* the library whose module in ctx this is, or NULL */
};

struct CUlib_st {
    struct CUmod_st image;
    int lazy;                        /* a fat binary: its globals come at first use */
    unsigned long long lazy_globals; /* what its first use in each context takes */
};

struct CUfunc_st {
    struct CUmod_st *module; /* NULL: free slot */
    char name[FUNCTION_NAME_MAX];
    int launched; /* lazy loading: the first launch loads the module */
};

/* A library's kernel: context-independent, one per (library, name). */
struct CUkern_st {
    struct CUlib_st *library; /* NULL: free slot */
    char name[FUNCTION_NAME_MAX];
};

static struct timeline g_timelines[DOUBLE_MAX_DEVICES];
static struct CUstream_st g_streams[DOUBLE_MAX_STREAMS];
static struct CUevent_st g_events[DOUBLE_MAX_EVENTS];
static struct CUgraph_st g_graphs[DOUBLE_MAX_GRAPHS];
static struct CUgraphExec_st g_execs[DOUBLE_MAX_EXECS];
static struct CUmod_st g_modules[DOUBLE_MAX_MODULES];
static struct CUlib_st g_libraries[DOUBLE_MAX_MODULES];
static unsigned g_graph_serial;
static struct CUfunc_st g_functions[DOUBLE_MAX_FUNCTIONS];
static struct CUkern_st g_kernels[DOUBLE_MAX_KERNELS];
/* The per-thread default stream of this thread (its capture state). */
static __thread struct CUstream_st t_per_thread = {1, 0, NULL, NULL};
/* This thread's capture interaction mode (cuThreadExchangeStreamCaptureMode). */
static __thread CUstreamCaptureMode t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
/* Its address identifies this thread as the owner of a capture. */
static __thread char t_thread_token;

static unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

static void sleep_until(unsigned long long ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000ULL);
    ts.tv_nsec = (long)(ns % 1000000000ULL);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* Index of p in an array of count elements of size bytes at base, or -1. */
static long slot_of(const void *base, size_t size, size_t count, const void *p) {
    uintptr_t b = (uintptr_t)base, q = (uintptr_t)p;
    if (q < b || q >= b + size * count || (q - b) % size != 0) {
        return -1;
    }
    return (long)((q - b) / size);
}

#define SLOT(array, p) slot_of((array), sizeof (array)[0], sizeof(array) / sizeof (array)[0], (p))

static struct CUfunc_st *function_locked(CUfunction f) {
    long i = SLOT(g_functions, f);
    return i >= 0 && g_functions[i].module != NULL ? &g_functions[i] : NULL;
}

/* A kernel handle; launches take one where they take a function. */
static struct CUkern_st *kernel_locked(const void *k) {
    long i = SLOT(g_kernels, k);
    return i >= 0 && g_kernels[i].library != NULL ? &g_kernels[i] : NULL;
}

static struct CUevent_st *event_locked(CUevent e) {
    long i = SLOT(g_events, e);
    return i >= 0 && g_events[i].live ? &g_events[i] : NULL;
}

static struct CUgraph_st *graph_locked(CUgraph g) {
    long i = SLOT(g_graphs, g);
    return i >= 0 && g_graphs[i].live ? &g_graphs[i] : NULL;
}

static struct CUgraphExec_st *exec_locked(CUgraphExec e) {
    long i = SLOT(g_execs, e);
    return i >= 0 && g_execs[i].live ? &g_execs[i] : NULL;
}

static struct CUstream_st *created_stream_locked(CUstream s) {
    long i = SLOT(g_streams, s);
    return i >= 0 && g_streams[i].live ? &g_streams[i] : NULL;
}

/* A new empty graph on dev, or NULL when every slot is taken. */
static struct CUgraph_st *graph_new_locked(int dev) {
    size_t i;
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        struct CUgraph_st *g = &g_graphs[i];
        if (!g->live) {
            memset(g, 0, sizeof *g);
            g->live = 1;
            if (++g_graph_serial == 0) {
                g_graph_serial = 1;
            }
            g->serial = g_graph_serial;
            g->device = dev;
            return g;
        }
    }
    return NULL;
}

static void graph_free_locked(struct CUgraph_st *g) {
    free(g->nodes);
    memset(g, 0, sizeof *g);
}

/* A node's handle: its graph's serial and its index + 1, never dereferenced. */
static CUgraphNode node_handle(const struct CUgraph_st *g, size_t index) {
    return (CUgraphNode)(uintptr_t)((unsigned long long)g->serial << 32 | (index + 1));
}

/* The node a handle names (its graph in *graph), or NULL. */
static struct node *node_locked(CUgraphNode h, struct CUgraph_st **graph) {
    unsigned long long v = (uintptr_t)h;
    unsigned serial = (unsigned)(v >> 32);
    unsigned long long index = v & 0xffffffffULL;
    size_t i;
    if (serial == 0 || index == 0) {
        return NULL;
    }
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        struct CUgraph_st *g = &g_graphs[i];
        if (g->live && g->serial == serial) {
            if (index > g->node_len) {
                return NULL;
            }
            *graph = g;
            return &g->nodes[index - 1];
        }
    }
    return NULL;
}

/* Appends n to g; its handle in *out unless out is NULL. */
static CUresult graph_add_locked(struct CUgraph_st *g, struct node n, CUgraphNode *out) {
    if (g->node_len == g->node_cap) {
        size_t cap = g->node_cap ? g->node_cap * 2 : 16;
        struct node *grown = realloc(g->nodes, cap * sizeof *grown);
        if (grown == NULL) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = grown;
        g->node_cap = cap;
    }
    g->nodes[g->node_len++] = n;
    if (out != NULL) {
        *out = node_handle(g, g->node_len - 1);
    }
    return CUDA_SUCCESS;
}

/* An alloc node of `size` bytes on dev: a fixed address, nothing charged. */
static CUresult graph_alloc_node_locked(struct CUgraph_st *g, int dev, unsigned long long size,
                                        unsigned long long *addr, CUgraphNode *out) {
    struct node n = {CU_GRAPH_NODE_TYPE_MEM_ALLOC, dev, size, 0};
    CUresult rc;
    if (size == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    rc = bump_locked(&g_devices[dev].graph_next, region_start(dev) + GLOBALS_OFFSET, size,
                     &n.addr);
    if (rc == CUDA_SUCCESS) {
        rc = graph_add_locked(g, n, out);
    }
    if (rc == CUDA_SUCCESS) {
        *addr = n.addr;
    }
    return rc;
}

/* A free node of addr, which must come from an alloc node. */
static CUresult graph_free_node_locked(struct CUgraph_st *g, unsigned long long addr,
                                       CUgraphNode *out) {
    struct node n = {CU_GRAPH_NODE_TYPE_MEM_FREE, 0, 0, addr};
    int dev;
    if (addr < REGION_BASE) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    dev = (int)((addr - REGION_BASE) / REGION_SIZE);
    if (dev >= g_config.devices || addr < region_start(dev) + GRAPH_OFFSET ||
        addr >= g_devices[dev].graph_next) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    n.device = dev;
    return graph_add_locked(g, n, out);
}

/* Charges an exec's need at its first upload or launch, if it fits. */
static CUresult exec_reserve_locked(struct CUgraphExec_st *e) {
    int dev;
    if (e->reserved) {
        return CUDA_SUCCESS;
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        unsigned long long retained = g_devices[dev].graph_retained;
        unsigned long long reuse = retained < e->need[dev] ? retained : e->need[dev];
        if (e->need[dev] > 0 && !fits(dev, e->need[dev] - reuse)) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        struct device *d = &g_devices[dev];
        d->graph_retained -= d->graph_retained < e->need[dev] ? d->graph_retained : e->need[dev];
        d->graph_bytes += e->need[dev];
    }
    e->reserved = 1;
    return CUDA_SUCCESS;
}

/*
 * The stream a call names and the device it runs on. *out is NULL for the
 * legacy default stream (NULL without _ptsz, or CU_STREAM_LEGACY), this
 * thread's per-thread stream for NULL with _ptsz or CU_STREAM_PER_THREAD.
 * Needs an initialised driver and a current context.
 */
static CUresult stream_locked(CUstream h, int ptsz, struct CUstream_st **out, CUdevice *dev) {
    CUresult rc = current_device_locked(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (h == NULL) {
        *out = ptsz ? &t_per_thread : NULL;
    } else if (h == CU_STREAM_LEGACY) {
        *out = NULL;
    } else if (h == CU_STREAM_PER_THREAD) {
        *out = &t_per_thread;
    } else {
        *out = created_stream_locked(h);
        if (*out == NULL) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        *dev = (*out)->device;
    }
    return CUDA_SUCCESS;
}

/*
 * The capture rules measured on driver 580 (CUDA 13): a potentially unsafe
 * call (event query/synchronize, stream query/synchronize) from this thread
 * is prohibited, unless the thread's interaction mode is RELAXED, while this
 * thread has a capture begun in another mode than RELAXED or another thread
 * one begun in GLOBAL mode. A prohibited call fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates those captures.
 */
static CUresult unsafe_call_locked(void) {
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    if (t_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) {
        return rc;
    }
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        struct CUgraph_st *g = &g_graphs[i];
        int own = g->owner == &t_thread_token;
        if (g->live && g->capturing &&
            ((own && g->mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
             (!own && g->mode == CU_STREAM_CAPTURE_MODE_GLOBAL))) {
            g->invalidated = 1;
            rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return rc;
}

/* Whatever the modes: synchronizing a context invalidates its captures. */
static CUresult context_sync_locked(int dev) {
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        if (g_graphs[i].live && g_graphs[i].capturing && g_graphs[i].device == dev) {
            g_graphs[i].invalidated = 1;
            rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return rc;
}

/* The timeline of dev with its rings, or NULL when host memory ran out. */
static struct timeline *timeline_locked(int dev) {
    struct timeline *t = &g_timelines[dev];
    if (t->spans == NULL) {
        /* calloc: the pages of the 16 MiB ring are touched only as it fills. */
        t->spans = calloc(SPAN_CAPACITY, sizeof *t->spans);
    }
    if (t->pending == NULL) {
        t->pending = calloc((size_t)g_config_queue_depth, sizeof *t->pending);
    }
    return t->spans != NULL && t->pending != NULL ? t : NULL;
}

/*
 * Queues `ns` of work on dev's timeline, unless the queue is full: then
 * *wait gets the time the oldest queued submission completes, and nothing
 * is queued.
 */
static CUresult submit_locked(int dev, unsigned long long ns, unsigned long long *wait) {
    struct timeline *t = timeline_locked(dev);
    unsigned long long now = now_ns(), start, end;
    size_t depth = (size_t)g_config_queue_depth;
    if (t == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    while (t->pending_len > 0 && t->pending[t->pending_head] <= now) {
        t->pending_head = (t->pending_head + 1) % depth;
        t->pending_len--;
    }
    if (t->pending_len == depth) {
        *wait = t->pending[t->pending_head];
        return CUDA_ERROR_NOT_READY;
    }
    start = t->busy_until > now ? t->busy_until : now;
    end = start + ns;
    t->pending[(t->pending_head + t->pending_len) % depth] = end;
    t->pending_len++;
    if (ns == 0) {
        return CUDA_SUCCESS;
    }
    t->busy_until = end;
    if (t->span_len > 0) {
        struct span *last = &t->spans[(t->span_head + t->span_len - 1) % SPAN_CAPACITY];
        if (last->end == start) {
            last->end = end;
            return CUDA_SUCCESS;
        }
    }
    if (t->span_len == SPAN_CAPACITY) {
        t->span_head = (t->span_head + 1) % SPAN_CAPACITY; /* the oldest is forgotten */
        t->span_len--;
    }
    t->spans[(t->span_head + t->span_len) % SPAN_CAPACITY] = (struct span){start, end};
    t->span_len++;
    return CUDA_SUCCESS;
}

static unsigned long long device_busy_until(int dev) {
    return g_timelines[dev].busy_until;
}

/* When all work submitted so far on dev completes (at the earliest, now). */
static unsigned long long drained_at_locked(int dev, unsigned long long now) {
    unsigned long long busy = g_timelines[dev].busy_until;
    return busy > now ? busy : now;
}

/* The duration a launch asks for: *(unsigned long long *)kernelParams[0] ns. */
static unsigned long long kernel_ns(void **kernelParams) {
    if (kernelParams == NULL || kernelParams[0] == NULL) {
        return g_config_kernel_ns;
    }
    return *(const unsigned long long *)kernelParams[0];
}

/*
 * Runs `ns` of work (`kernels` kernels) on the stream h: recorded into the
 * graph as a node of `type` when the stream is capturing, else queued on the
 * device's timeline, after sleeping while the queue is full. Under the lock,
 * after the stream,
 * `check` vets the launched object (NULL: nothing to vet), then `args_ok`
 * the other arguments (CUDA_ERROR_INVALID_VALUE when 0).
 */
static CUresult enqueue(CUstream h, int ptsz, unsigned long long ns, unsigned long long kernels,
                        CUgraphNodeType type, CUresult (*check)(const void *),
                        const void *object, int args_ok) {
    for (;;) {
        struct CUstream_st *s = NULL;
        CUdevice dev = 0;
        unsigned long long wait = 0;
        CUresult rc;
        lock();
        rc = stream_locked(h, ptsz, &s, &dev);
        if (rc == CUDA_SUCCESS && check != NULL) {
            rc = check(object);
        }
        if (rc == CUDA_SUCCESS && !args_ok) {
            rc = CUDA_ERROR_INVALID_VALUE;
        }
        if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
            struct node n = {type, dev, 0, 0};
            if (s->capture->invalidated) {
                rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
            } else if ((rc = graph_add_locked(s->capture, n, NULL)) == CUDA_SUCCESS) {
                s->capture->ns += ns;
                s->capture->kernels += kernels;
            }
        } else if (rc == CUDA_SUCCESS) {
            rc = submit_locked(dev, ns, &wait);
        }
        unlock();
        if (rc != CUDA_ERROR_NOT_READY) {
            return rc;
        }
        sleep_until(wait); /* the launch queue is full: block, as a real launch does */
    }
}

static CUresult check_function(const void *f) {
    return function_locked((CUfunction)(uintptr_t)f) != NULL || kernel_locked(f) != NULL
               ? CUDA_SUCCESS
               : CUDA_ERROR_INVALID_HANDLE;
}

static CUresult check_exec(const void *e) {
    return exec_locked((CUgraphExec)(uintptr_t)e) != NULL ? CUDA_SUCCESS
                                                         : CUDA_ERROR_INVALID_HANDLE;
}

/* Launch dimensions within an H100's limits (see cuDeviceGetAttribute). */
static int valid_dims(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                      unsigned bz) {
    return gx >= 1 && gy >= 1 && gz >= 1 && gx <= 0x7fffffffU && gy <= 65535 && gz <= 65535 &&
           bx >= 1 && by >= 1 && bz >= 1 && bx <= 1024 && by <= 1024 && bz <= 64 &&
           (unsigned long long)bx * by * bz <= 1024;
}

/* Resident blocks per SM for blocks of `threads` threads: an H100's thread
 * and block limits (2048 and 32 per SM), as if nothing else limited occupancy. */
static unsigned blocks_per_sm(unsigned long long threads) {
    unsigned long long fit = threads == 0 ? 32 : DOUBLE_THREADS_PER_SM / threads;
    return fit == 0 ? 1 : fit > 32 ? 32 : (unsigned)fit;
}

/* A kernel of `blocks` blocks runs in waves of DOUBLE_SM_COUNT * blocks_per_sm
 * blocks; each block lasts the kernel's parameter, so the kernel lasts that
 * times its waves (1 for grids that fit at once, as every 1x1 launch does). */
static unsigned long long waves(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz) {
    unsigned long long blocks = (unsigned long long)gx * gy * gz;
    unsigned long long per_wave =
        (unsigned long long)DOUBLE_SM_COUNT * blocks_per_sm((unsigned long long)bx * by * bz);
    return blocks <= per_wave ? 1 : (blocks + per_wave - 1) / per_wave;
}

/* CUDA's lazy module loading: a function's first launch loads its module
 * inside the call, GPUSHARE_DOUBLE_LAZY_LOAD_US of host time (0 by default). */
static void load_lazily(CUfunction f) {
    unsigned long long load_us = env_count("GPUSHARE_DOUBLE_LAZY_LOAD_US", 0, 0, 10000000);
    struct CUfunc_st *fn;
    int first = 0;
    if (load_us == 0) {
        return;
    }
    lock();
    fn = function_locked(f);
    if (fn != NULL && !fn->launched) {
        fn->launched = 1;
        first = 1;
    }
    unlock();
    if (first) {
        sleep_until(now_ns() + load_us * 1000ULL);
    }
}

/* A launch with valid dimensions of a kernel handle runs its library's
 * function in the launch's context, after the library's first use there (a
 * first use that does not fit fails the launch). */
static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, CUstream h, int ptsz, unsigned long long ns) {
    int ok = valid_dims(gx, gy, gz, bx, by, bz);
    if (ok) {
        CUresult rc = kernel_launch_function(&f, h, ptsz);
        if (rc != CUDA_SUCCESS) {
            return rc;
        }
    }
    load_lazily(f);
    return enqueue(h, ptsz, ok ? ns * waves(gx, gy, gz, bx, by, bz) : ns, 1,
                   CU_GRAPH_NODE_TYPE_KERNEL, check_function, (const void *)f, ok);
}

CUresult impl_cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func,
                                                          int blockSize,
                                                          size_t dynamicSMemSize) {
    CUresult rc;
    (void)dynamicSMemSize;
    if (numBlocks == NULL || blockSize <= 0 || blockSize > 1024) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    lock();
    rc = function_locked(func) != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
    unlock();
    if (rc == CUDA_SUCCESS) {
        *numBlocks = (int)blocks_per_sm((unsigned long long)blockSize);
    }
    return rc;
}

CUresult impl_cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra) {
    (void)sharedMemBytes;
    (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                  unsigned int gridDimZ, unsigned int blockDimX,
                                  unsigned int blockDimY, unsigned int blockDimZ,
                                  unsigned int sharedMemBytes, CUstream hStream,
                                  void **kernelParams, void **extra) {
    (void)sharedMemBytes;
    (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernel_ns(kernelParams));
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          int ptsz) {
    if (config == NULL) {
        return enqueue(NULL, ptsz, 0, 0, CU_GRAPH_NODE_TYPE_KERNEL, check_function,
                       (const void *)f, 0);
    }
    if (config->numAttrs > 0 && config->attrs == NULL) {
        return enqueue(config->hStream, ptsz, 0, 0, CU_GRAPH_NODE_TYPE_KERNEL, check_function,
                       (const void *)f, 0);
    }
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->hStream, ptsz,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra) {
    (void)extra;
    return launch_ex(config, f, kernelParams, 0);
}

CUresult impl_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                    void **kernelParams, void **extra) {
    (void)extra;
    return launch_ex(config, f, kernelParams, 1);
}

CUresult impl_cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX,
                                        unsigned int gridDimY, unsigned int gridDimZ,
                                        unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes,
                                        CUstream hStream, void **kernelParams) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                             unsigned int gridDimY, unsigned int gridDimZ,
                                             unsigned int blockDimX, unsigned int blockDimY,
                                             unsigned int blockDimZ, unsigned int sharedMemBytes,
                                             CUstream hStream, void **kernelParams) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunch(CUfunction f) {
    return launch(f, 1, 1, 1, 1, 1, 1, NULL, 0, g_config_kernel_ns);
}

static unsigned grid_dim(int n) {
    return n < 1 ? 0 : (unsigned)n;
}

CUresult impl_cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
    return launch(f, grid_dim(grid_width), grid_dim(grid_height), 1, 1, 1, 1, NULL, 0,
                  g_config_kernel_ns);
}

CUresult impl_cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream) {
    return launch(f, grid_dim(grid_width), grid_dim(grid_height), 1, 1, 1, 1, hStream, 0,
                  g_config_kernel_ns);
}

/* ---------------------------------------------------------------- graphs */

/*
 * Before an exec first runs on the stream h, its need is reserved (not when
 * its launch is captured into another graph). Bad handles are left for the
 * launch to report.
 */
static CUresult exec_prepare(CUgraphExec e, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    struct CUgraphExec_st *x;
    CUdevice dev = 0;
    CUresult rc = CUDA_SUCCESS;
    lock();
    x = exec_locked(e);
    if (x != NULL && stream_locked(h, ptsz, &s, &dev) == CUDA_SUCCESS &&
        (s == NULL || s->capture == NULL)) {
        rc = exec_reserve_locked(x);
    }
    unlock();
    return rc;
}

static CUresult graph_launch(CUgraphExec e, CUstream h, int ptsz) {
    unsigned long long ns = 0, kernels = 0;
    CUresult rc = exec_prepare(e, h, ptsz);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    lock();
    if (exec_locked(e) != NULL) {
        ns = e->ns;
        kernels = e->kernels;
    }
    unlock();
    return enqueue(h, ptsz, ns, kernels, CU_GRAPH_NODE_TYPE_GRAPH, check_exec, (const void *)e, 1);
}

CUresult impl_cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream, 0);
}

CUresult impl_cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream, 1);
}

/* An upload runs nothing: it reserves the exec's graph memory. */
static CUresult graph_upload(CUgraphExec e, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && exec_locked(e) == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (rc == CUDA_SUCCESS) {
        rc = exec_reserve_locked(e);
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_upload(hGraphExec, hStream, 0);
}

CUresult impl_cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_upload(hGraphExec, hStream, 1);
}

/* A new exec of g: its kernels, and the need of its alloc nodes per GPU. */
static CUresult instantiate_locked(CUgraphExec *out, const struct CUgraph_st *g) {
    size_t i, k;
    for (i = 0; i < DOUBLE_MAX_EXECS; i++) {
        struct CUgraphExec_st *e = &g_execs[i];
        if (!e->live) {
            memset(e, 0, sizeof *e);
            e->live = 1;
            e->ns = g->ns;
            e->kernels = g->kernels;
            for (k = 0; k < g->node_len; k++) {
                const struct node *n = &g->nodes[k];
                if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
                    e->need[n->device] = add_sat(e->need[n->device], n->bytes);
                }
            }
            *out = e;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult impl_cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                          unsigned long long flags) {
    CUresult rc;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphExec == NULL || (flags & ~0xfULL) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = instantiate_locked(phGraphExec, g);
    }
    unlock();
    return rc;
}

/* With CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD the exec's need is reserved at
 * once; when it does not fit, no exec is made. */
CUresult impl_cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    CUDA_GRAPH_INSTANTIATE_PARAMS *params = instantiateParams;
    CUresult rc;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphExec == NULL || params == NULL || (params->flags & ~0xfULL) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = instantiate_locked(phGraphExec, g);
        if (rc == CUDA_SUCCESS && (params->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)) {
            rc = exec_reserve_locked(*phGraphExec);
            if (rc != CUDA_SUCCESS) {
                (*phGraphExec)->live = 0;
                *phGraphExec = NULL;
            }
        }
        params->hErrNode_out = NULL;
        params->result_out =
            rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    }
    unlock();
    return rc;
}

/* A reserved exec's graph memory stays with its GPU, retained for reuse. */
CUresult impl_cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraphExec_st *e;
    int dev;
    lock();
    e = exec_locked(hGraphExec);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        for (dev = 0; e->reserved && dev < g_config.devices; dev++) {
            g_devices[dev].graph_bytes -= e->need[dev];
            g_devices[dev].graph_retained += e->need[dev];
        }
        e->live = 0;
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphDestroy(CUgraph hGraph) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        graph_free_locked(g);
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraph == NULL || flags != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((g = graph_new_locked(context_alive(t_current) ? t_current->device : 0)) == NULL) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        *phGraph = g;
    }
    unlock();
    return rc;
}

/* A node's dependencies must be nodes of its graph. */
static CUresult dependencies_locked(const struct CUgraph_st *g, const CUgraphNode *deps,
                                    size_t count) {
    struct CUgraph_st *owner = NULL;
    size_t i;
    if (count > 0 && deps == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (i = 0; i < count; i++) {
        if (node_locked(deps[i], &owner) == NULL || owner != g) {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}

CUresult impl_cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                     const CUgraphNode *dependencies, size_t numDependencies,
                                     CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams) {
    CUDA_MEM_ALLOC_NODE_PARAMS *p = nodeParams;
    CUresult rc;
    struct CUgraph_st *g;
    unsigned long long addr = 0;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphNode == NULL || p == NULL ||
               p->poolProps.allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
               p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (!valid_device(p->poolProps.location.id)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if ((rc = dependencies_locked(g, dependencies, numDependencies)) == CUDA_SUCCESS) {
        rc = graph_alloc_node_locked(g, p->poolProps.location.id, p->bytesize, &addr,
                                     phGraphNode);
        if (rc == CUDA_SUCCESS) {
            p->dptr = addr;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                    const CUgraphNode *dependencies, size_t numDependencies,
                                    CUdeviceptr dptr) {
    CUresult rc;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphNode == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if ((rc = dependencies_locked(g, dependencies, numDependencies)) == CUDA_SUCCESS) {
        rc = graph_free_node_locked(g, dptr, phGraphNode);
    }
    unlock();
    return rc;
}

/* In the order they were added; past the graph's nodes, NULL entries. */
CUresult impl_cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g;
    size_t i, n;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (numNodes == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (nodes == NULL) {
        *numNodes = g->node_len;
    } else {
        n = *numNodes < g->node_len ? *numNodes : g->node_len;
        for (i = 0; i < *numNodes; i++) {
            nodes[i] = i < n ? node_handle(g, i) : NULL;
        }
        *numNodes = n;
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g = NULL;
    struct node *n;
    lock();
    n = node_locked(hNode, &g);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (type == NULL || n == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        *type = n->type;
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphMemAllocNodeGetParams(CUgraphNode hNode,
                                           CUDA_MEM_ALLOC_NODE_PARAMS *params_out) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g = NULL;
    struct node *n;
    lock();
    n = node_locked(hNode, &g);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (params_out == NULL || n == NULL || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        memset(params_out, 0, sizeof *params_out);
        params_out->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        params_out->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        params_out->poolProps.location.id = n->device;
        params_out->bytesize = (size_t)n->bytes;
        params_out->dptr = n->addr;
    }
    unlock();
    return rc;
}

/* Gives back the GPU's retained graph memory; reservations stay. */
CUresult impl_cuDeviceGraphMemTrim(CUdevice device) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!valid_device(device)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else {
        g_devices[device].graph_retained = 0;
    }
    unlock();
    return rc;
}

/*
 * CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT (0) and RESERVED_MEM_CURRENT (2): what
 * live execs reserved, and that plus what destroyed ones left until trimmed
 * (a cuuint64_t through value). The high watermarks are not kept.
 */
CUresult impl_cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!valid_device(device)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (value == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT) {
        *(unsigned long long *)value = g_devices[device].graph_bytes;
    } else if (attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) {
        *(unsigned long long *)value =
            add_sat(g_devices[device].graph_bytes, g_devices[device].graph_retained);
    } else {
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- stream capture */

static CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && mode != CU_STREAM_CAPTURE_MODE_GLOBAL &&
        mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL && mode != CU_STREAM_CAPTURE_MODE_RELAXED) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && s == NULL) {
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot capture */
    } else if (rc == CUDA_SUCCESS && s->capture != NULL) {
        rc = CUDA_ERROR_ILLEGAL_STATE;
    } else if (rc == CUDA_SUCCESS) {
        struct CUgraph_st *g = graph_new_locked(dev);
        if (g == NULL) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            g->capturing = 1;
            g->mode = mode;
            g->owner = &t_thread_token;
            s->capture = g;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 0);
}

CUresult impl_cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 1);
}

static CUresult end_capture(CUstream h, CUgraph *phGraph, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && phGraph == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && (s == NULL || s->capture == NULL)) {
        rc = CUDA_ERROR_ILLEGAL_STATE; /* not capturing */
    } else if (rc == CUDA_SUCCESS && s->capture->invalidated) {
        graph_free_locked(s->capture); /* no graph comes out of a broken capture */
        s->capture = NULL;
        *phGraph = NULL;
        rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else if (rc == CUDA_SUCCESS) {
        s->capture->capturing = 0;
        *phGraph = s->capture;
        s->capture = NULL;
    }
    unlock();
    return rc;
}

CUresult impl_cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    return end_capture(hStream, phGraph, 0);
}

CUresult impl_cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    return end_capture(hStream, phGraph, 1);
}

static CUresult is_capturing(CUstream h, CUstreamCaptureStatus *status, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && status == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        *status = s == NULL || s->capture == NULL ? CU_STREAM_CAPTURE_STATUS_NONE
                  : s->capture->invalidated       ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                                  : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    }
    unlock();
    return rc;
}

CUresult impl_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    CUstreamCaptureMode old;
    if (mode == NULL) {
        return CUDA_ERROR_INVALID_VALUE; /* any value is taken, as by driver 580 */
    }
    old = t_capture_mode;
    t_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

CUresult impl_cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 0);
}

CUresult impl_cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 1);
}

/* ---------------------------------------------------------------- streams */

CUresult impl_cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && (phStream == NULL || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING))) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_STREAMS; i++) {
            if (!g_streams[i].live) {
                g_streams[i] = (struct CUstream_st){1, dev, NULL, t_current};
                *phStream = &g_streams[i];
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
    unlock();
    return rc;
}

/* A created stream's context; the current one for the default streams. */
static CUresult stream_get_ctx(CUstream h, CUcontext *pctx, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        *pctx = s != NULL && s->ctx != NULL ? s->ctx : t_current;
    }
    unlock();
    return rc;
}

CUresult impl_cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    return stream_get_ctx(hStream, pctx, 0);
}

CUresult impl_cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx) {
    return stream_get_ctx(hStream, pctx, 1);
}

CUresult impl_cuStreamDestroy_v2(CUstream hStream) {
    CUresult rc = CUDA_SUCCESS;
    struct CUstream_st *s;
    lock();
    s = created_stream_locked(hStream);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (s == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        if (s->capture != NULL) {
            graph_free_locked(s->capture); /* the capture is abandoned */
        }
        s->live = 0;
        s->capture = NULL;
    }
    unlock();
    return rc;
}

/*
 * When the work submitted so far on the stream h completes (one timeline per
 * device: all of the device's work). Waiting for a capturing stream breaks
 * its capture, in any mode; for another, the capture rules apply. A
 * synchronize (settle) lets the device's pool release what it holds over
 * its threshold.
 */
static CUresult stream_done_at(CUstream h, int ptsz, unsigned long long *at, int settle) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        s->capture->invalidated = 1;
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (rc == CUDA_SUCCESS) {
        rc = unsafe_call_locked();
    }
    if (rc == CUDA_SUCCESS) {
        *at = g_timelines[dev].busy_until;
        if (settle) {
            pool_settle_locked(dev);
        }
    }
    unlock();
    return rc;
}

static CUresult stream_synchronize(CUstream h, int ptsz) {
    unsigned long long at = 0;
    CUresult rc = stream_done_at(h, ptsz, &at, 1);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        sleep_until(at);
    }
    return rc;
}

static CUresult stream_query(CUstream h, int ptsz) {
    unsigned long long at = 0;
    CUresult rc = stream_done_at(h, ptsz, &at, 0);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        rc = CUDA_ERROR_NOT_READY;
    }
    return rc;
}

CUresult impl_cuStreamSynchronize(CUstream hStream) {
    return stream_synchronize(hStream, 0);
}

CUresult impl_cuStreamSynchronize_ptsz(CUstream hStream) {
    return stream_synchronize(hStream, 1);
}

CUresult impl_cuStreamQuery(CUstream hStream) {
    return stream_query(hStream, 0);
}

CUresult impl_cuStreamQuery_ptsz(CUstream hStream) {
    return stream_query(hStream, 1);
}

/* ---------------------------------------------------------------- stream-ordered memory, pools */

/* The pool a call names; NULL is the current GPU's default pool. */
static CUresult pool_locked(CUmemoryPool pool, struct CUmemPoolHandle_st **out) {
    CUdevice dev = 0;
    long i;
    if (pool == NULL) {
        CUresult rc = current_device_locked(&dev);
        if (rc == CUDA_SUCCESS) {
            *out = &g_pools[dev];
        }
        return rc;
    }
    if (!g_initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    i = SLOT(g_pools, pool);
    if (i < 0 || i >= g_config.devices) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *out = &g_pools[i];
    return CUDA_SUCCESS;
}

/*
 * From `pool` (NULL: the default pool of the stream's GPU). On a capturing
 * stream, an alloc node of the capture's graph; else served by the pool's
 * retained bytes when there are enough, and charged as an allocation.
 */
static CUresult pool_alloc(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h,
                           int ptsz) {
    struct CUstream_st *s = NULL;
    struct CUmemPoolHandle_st *p = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && pool != NULL) {
        rc = pool_locked(pool, &p);
    } else if (rc == CUDA_SUCCESS) {
        p = &g_pools[dev];
    }
    if (rc == CUDA_SUCCESS && dptr == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        rc = s->capture->invalidated
                 ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                 : graph_alloc_node_locked(s->capture, p->device, size, dptr, NULL);
    } else if (rc == CUDA_SUCCESS) {
        struct device *d = &g_devices[p->device];
        CUcontext ctx = s != NULL && s->ctx != NULL ? s->ctx : t_current;
        unsigned long long reuse = size > 0 && p->retained >= size ? size : 0;
        p->retained -= reuse;
        rc = alloc_locked(p->device, ctx, size, KIND_POINTER, dptr);
        if (rc == CUDA_SUCCESS) {
            d->records[d->len - 1].pooled = 1;
            p->used += size;
        } else {
            p->retained += reuse;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, 0);
}

CUresult impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, 1);
}

CUresult impl_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    return pool_alloc(dptr, bytesize, pool, hStream, 0);
}

CUresult impl_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                           CUstream hStream) {
    return pool_alloc(dptr, bytesize, pool, hStream, 1);
}

/*
 * On a capturing stream, a free node of a graph allocation; else the end of
 * an allocation's charge. A pool allocation's bytes stay with its pool
 * (retained) unless the pool's release threshold is 0.
 */
static CUresult pool_free(CUdeviceptr dptr, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    struct record *r;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        rc = s->capture->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                                     : graph_free_node_locked(s->capture, dptr, NULL);
        unlock();
        return rc;
    }
    unlock();
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (free_fails()) {
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    lock();
    r = find_locked(dptr, 1, &dev);
    if (r == NULL || !(r->kind & KIND_POINTER)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        int retain = r->pooled && g_pools[dev].threshold > 0;
        unsigned long long size = r->size;
        forget_locked(dev, r);
        tidy_locked(dev);
        if (retain) {
            g_pools[dev].retained += size;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    return pool_free(dptr, hStream, 0);
}

CUresult impl_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return pool_free(dptr, hStream, 1);
}

CUresult impl_cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (pool_out == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pool_out = &g_pools[dev];
    return CUDA_SUCCESS;
}

/* No cuDeviceSetMemPool: the current pool is the default one. */
CUresult impl_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    return impl_cuDeviceGetDefaultMemPool(pool, dev);
}

/* The release threshold (cuuint64_t) and the reuse flags (int, no effect). */
CUresult impl_cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    struct CUmemPoolHandle_st *p = NULL;
    CUresult rc;
    lock();
    rc = pool_locked(pool, &p);
    if (rc == CUDA_SUCCESS && value == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            p->threshold = *(const cuuint64_t *)value;
            break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
            p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES] =
                *(const int *)value;
            break;
        default:
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    struct CUmemPoolHandle_st *p = NULL;
    CUresult rc;
    lock();
    rc = pool_locked(pool, &p);
    if (rc == CUDA_SUCCESS && value == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            *(cuuint64_t *)value = p->threshold;
            break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
            *(cuuint64_t *)value = p->used + p->retained;
            break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
            *(cuuint64_t *)value = p->used;
            break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
            *(int *)value = p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES];
            break;
        default:
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    struct CUmemPoolHandle_st *p = NULL;
    CUresult rc;
    lock();
    rc = pool_locked(pool, &p);
    if (rc == CUDA_SUCCESS) {
        pool_release_locked(p, minBytesToKeep);
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- events */

CUresult impl_cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS &&
        (phEvent == NULL || (Flags & ~known) != 0 ||
         ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)))) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_EVENTS; i++) {
            if (!g_events[i].live) {
                g_events[i] = (struct CUevent_st){1, 0, Flags, dev, 0};
                *phEvent = &g_events[i];
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
    unlock();
    return rc;
}

/* Records the completion time of all work submitted so far on the device. */
static CUresult event_record(CUevent hEvent, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    struct CUevent_st *e;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    e = event_locked(hEvent);
    if (rc == CUDA_SUCCESS && e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        /* Into a capturing stream: a node of the graph; the event is left as it was. */
        if (s->capture->invalidated) {
            rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        }
    } else if (rc == CUDA_SUCCESS) {
        e->recorded = 1;
        e->device = dev;
        e->at = drained_at_locked(dev, now_ns());
    }
    unlock();
    return rc;
}

CUresult impl_cuEventRecord(CUevent hEvent, CUstream hStream) {
    return event_record(hEvent, hStream, 0);
}

CUresult impl_cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) {
    return event_record(hEvent, hStream, 1);
}

/* The completion time of the event's last record; 0 when never recorded. A
 * synchronize (settle) lets the event's device's pool release what it holds
 * over its threshold. */
static CUresult event_at(CUevent hEvent, unsigned long long *at, int settle) {
    struct CUevent_st *e;
    CUresult rc = CUDA_SUCCESS;
    lock();
    e = event_locked(hEvent);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if ((rc = unsafe_call_locked()) == CUDA_SUCCESS) {
        *at = e->recorded ? e->at : 0;
        if (settle) {
            pool_settle_locked(e->device);
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuEventQuery(CUevent hEvent) {
    unsigned long long at = 0;
    CUresult rc = event_at(hEvent, &at, 0);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        rc = CUDA_ERROR_NOT_READY;
    }
    return rc;
}

CUresult impl_cuEventSynchronize(CUevent hEvent) {
    unsigned long long at = 0;
    CUresult rc = event_at(hEvent, &at, 1);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        sleep_until(at);
    }
    return rc;
}

CUresult impl_cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    struct CUevent_st *start, *end;
    CUresult rc = CUDA_SUCCESS;
    unsigned long long now = now_ns();
    lock();
    start = event_locked(hStart);
    end = event_locked(hEnd);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pMilliseconds == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (start == NULL || end == NULL || !start->recorded || !end->recorded ||
               ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING)) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (start->at > now || end->at > now) {
        rc = CUDA_ERROR_NOT_READY;
    } else {
        *pMilliseconds = (float)((double)((long long)(end->at - start->at)) / 1e6);
    }
    unlock();
    return rc;
}

CUresult impl_cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return impl_cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

CUresult impl_cuEventDestroy_v2(CUevent hEvent) {
    struct CUevent_st *e;
    CUresult rc = CUDA_SUCCESS;
    lock();
    e = event_locked(hEvent);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        e->live = 0;
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- modules */

#define MODULE_HEADER "gpushare-double-module globals="

/* N of an image that begins with MODULE_HEADER and N, else 0. Any other
 * image differs from the header within its first bytes, so nothing past
 * them is read. */
static unsigned long long image_globals(const void *image) {
    const char *text = image;
    const size_t len = sizeof MODULE_HEADER - 1;
    char *end = NULL;
    unsigned long long n;
    if (strncmp(text, MODULE_HEADER, len) != 0 || text[len] < '0' || text[len] > '9') {
        return 0;
    }
    errno = 0;
    n = strtoull(text + len, &end, 10);
    return errno == 0 ? n : 0;
}

/* The first bytes of the file at path, NUL-terminated: enough for the header. */
static CUresult read_image(const char *path, char *buf, size_t size) {
    FILE *f;
    size_t n;
    if (path == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    f = fopen(path, "rb");
    if (f == NULL) {
        return CUDA_ERROR_FILE_NOT_FOUND;
    }
    n = fread(buf, 1, size - 1, f);
    fclose(f);
    buf[n] = '\0';
    return CUDA_SUCCESS;
}

/*
 * Fat binaries, as nvcc 13 writes them (little endian): a 16-byte header
 * {u32 magic, u16 version 1, u16 header size 16, u64 bytes of entries},
 * then entries back to back, each a header of at least 64 bytes {u16 kind,
 * u16 version, u32 header size, u64 payload size, u32 compressed size, u32,
 * u16 minor, u16 major, u32 arch, u32 name offset, u32 name length, u64
 * flags, u64, u64 decompressed size} and its payload. The runtime passes a
 * __fatBinC_Wrapper_t {int magic, int version, data, filename} whose data
 * is the header.
 */
#define FATBIN_MAGIC 0xBA55ED50U
#define FATBIN_WRAPPER_MAGIC 0x466243B1U
#define FATBIN_HEADER_SIZE 16
#define FATBIN_ENTRY_SIZE 64
#define FATBIN_KIND_ELF 2
#define FATBIN_COMPRESSED (0x8000ULL | 0x2000ULL) /* zstd, LZ4 */
#define ELF_HEADER_SIZE 64
#define ELF_SECTION_SIZE 64
#define GLOBALS_SECTION ".nv.global"

static unsigned le16(const unsigned char *p) {
    return (unsigned)p[0] | (unsigned)p[1] << 8;
}

static unsigned long long le32(const unsigned char *p) {
    return (unsigned long long)le16(p) | (unsigned long long)le16(p + 2) << 16;
}

static unsigned long long le64(const unsigned char *p) {
    return le32(p) | le32(p + 4) << 32;
}

/* Whether p begins with the little-endian magic, read a byte at a time so
 * that an image differing in its first byte is read no further. */
static int has_magic(const unsigned char *p, unsigned magic) {
    int i;
    for (i = 0; i < 4; i++) {
        if (p[i] != (unsigned char)(magic >> (8 * i))) {
            return 0;
        }
    }
    return 1;
}

/* The sizes of the sections named .nv.global* (uninitialised globals, and
 * .nv.global.init's initialised ones) of the ELF64 cubin in the len bytes at
 * elf; 0 when it is not one, or anything it points at lies outside them. */
static unsigned long long elf_globals(const unsigned char *elf, unsigned long long len) {
    const size_t prefix = sizeof GLOBALS_SECTION - 1;
    unsigned long long shoff, shentsize, shnum, shstrndx, names, names_size, total = 0, i;
    const unsigned char *sh;
    if (len < ELF_HEADER_SIZE || memcmp(elf, "\177ELF", 4) != 0 || elf[4] != 2 || elf[5] != 1) {
        return 0; /* not ELF64 little endian */
    }
    shoff = le64(elf + 0x28);
    shentsize = le16(elf + 0x3a);
    shnum = le16(elf + 0x3c);
    shstrndx = le16(elf + 0x3e);
    if (shentsize < ELF_SECTION_SIZE || shstrndx >= shnum || shoff > len ||
        shnum * shentsize > len - shoff) {
        return 0;
    }
    sh = elf + shoff + shstrndx * shentsize;
    names = le64(sh + 0x18);
    names_size = le64(sh + 0x20);
    if (names > len || names_size > len - names) {
        return 0;
    }
    for (i = 0; i < shnum; i++) {
        unsigned long long name;
        sh = elf + shoff + i * shentsize;
        name = le32(sh);
        if (name < names_size && names_size - name >= prefix &&
            memcmp(elf + names + name, GLOBALS_SECTION, prefix) == 0) {
            total = add_sat(total, le64(sh + 0x20));
        }
    }
    return total;
}

/*
 * Whether image is a fat binary (or its wrapper). If so, *globals gets the
 * .nv.global* bytes of its first uncompressed ELF entry for DOUBLE_ARCH (0
 * when there is none, or the container is malformed). No byte past the
 * header's count of entry bytes is read.
 */
static int fatbin_globals(const void *image, unsigned long long *globals) {
    const unsigned char *fat = image;
    unsigned long long size, pos = 0;
    *globals = 0;
    if (has_magic(fat, FATBIN_WRAPPER_MAGIC)) {
        const void *data;
        memcpy(&data, fat + 8, sizeof data);
        fat = data;
        if (fat == NULL || !has_magic(fat, FATBIN_MAGIC)) {
            return 1;
        }
    } else if (!has_magic(fat, FATBIN_MAGIC)) {
        return 0;
    }
    if (le16(fat + 4) != 1 || le16(fat + 6) != FATBIN_HEADER_SIZE) {
        return 1;
    }
    size = le64(fat + 8);
    fat += FATBIN_HEADER_SIZE;
    while (size - pos >= FATBIN_ENTRY_SIZE) {
        const unsigned char *entry = fat + pos;
        unsigned long long header = le32(entry + 4), payload = le64(entry + 8);
        if (header < FATBIN_ENTRY_SIZE || header > size - pos || payload > size - pos - header) {
            return 1;
        }
        if (le16(entry) == FATBIN_KIND_ELF && le32(entry + 28) == DOUBLE_ARCH &&
            le32(entry + 16) == 0 && (le64(entry + 40) & FATBIN_COMPRESSED) == 0) {
            *globals = elf_globals(entry + header, payload);
            return 1;
        }
        pos += header + payload;
    }
    return 1;
}

/* Fills the free slot m on dev (for ctx; NULL for a library's image),
 * charging `globals` bytes of module globals if they fit. */
static CUresult load_locked(struct CUmod_st *m, int dev, CUcontext ctx,
                            unsigned long long globals) {
    struct device *d = &g_devices[dev];
    unsigned long long at = 0;
    if (globals > 0) {
        CUresult rc = fits(dev, globals) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
        if (rc == CUDA_SUCCESS) {
            rc = bump_locked(&d->globals_next, region_start(dev) + REGION_SIZE, globals, &at);
        }
        if (rc != CUDA_SUCCESS) {
            return rc;
        }
    }
    *m = (struct CUmod_st){1, dev, ctx, globals, at, NULL};
    d->module_bytes += globals;
    return CUDA_SUCCESS;
}

static void unload_locked(struct CUmod_st *m) {
    size_t i;
    g_devices[m->device].module_bytes -= m->globals;
    m->live = 0;
    for (i = 0; i < DOUBLE_MAX_FUNCTIONS; i++) {
        if (g_functions[i].module == m) {
            g_functions[i].module = NULL;
        }
    }
}

/* A context's modules go with it, libraries' modules in it included. */
static void unload_context_modules_locked(CUcontext ctx) {
    size_t i;
    for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
        if (g_modules[i].live && g_modules[i].ctx == ctx) {
            unload_locked(&g_modules[i]);
        }
    }
}

/* A module of the current context. */
static CUresult module_load(CUmodule *module, const void *image) {
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && (module == NULL || image == NULL)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
            if (!g_modules[i].live) {
                rc = load_locked(&g_modules[i], dev, t_current, image_globals(image));
                if (rc == CUDA_SUCCESS) {
                    *module = &g_modules[i];
                }
                break;
            }
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuModuleLoadData(CUmodule *module, const void *image) {
    return module_load(module, image);
}

CUresult impl_cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                 CUjit_option *options, void **optionValues) {
    (void)numOptions;
    (void)options;
    (void)optionValues;
    return module_load(module, image);
}

CUresult impl_cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    return module_load(module, fatCubin);
}

CUresult impl_cuModuleLoad(CUmodule *module, const char *fname) {
    char image[128];
    CUresult rc;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    rc = read_image(fname, image, sizeof image);
    return rc == CUDA_SUCCESS ? module_load(module, image) : rc;
}

static struct CUmod_st *module_locked(CUmodule m) {
    long i = SLOT(g_modules, m);
    return i >= 0 && g_modules[i].live ? &g_modules[i] : NULL;
}

/* A library's module in a context goes with the library or the context only. */
CUresult impl_cuModuleUnload(CUmodule hmod) {
    struct CUmod_st *m;
    CUresult rc = CUDA_SUCCESS;
    lock();
    m = module_locked(hmod);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (m == NULL || m->library != NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        unload_locked(m);
    }
    unlock();
    return rc;
}

/* Every name is a global of a module with globals: all of them. */
static CUresult global_locked(const struct CUmod_st *m, const char *name, CUdeviceptr *dptr,
                              size_t *bytes) {
    if (name == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (m->globals == 0) {
        return CUDA_ERROR_NOT_FOUND;
    }
    if (dptr != NULL) {
        *dptr = m->globals_at;
    }
    if (bytes != NULL) {
        *bytes = (size_t)m->globals;
    }
    return CUDA_SUCCESS;
}

CUresult impl_cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod,
                                   const char *name) {
    struct CUmod_st *m;
    CUresult rc;
    lock();
    m = module_locked(hmod);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (m == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = global_locked(m, name, dptr, bytes);
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- libraries */

/*
 * A library: context-independent. A text image's globals are charged to the
 * current context's GPU at once; a fat binary (when fat is set) takes
 * nothing, and needs no current context.
 */
static CUresult library_load(CUlibrary *library, const void *code, int fat) {
    unsigned long long globals = 0;
    int lazy = fat && code != NULL && fatbin_globals(code, &globals);
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_ERROR_INVALID_CONTEXT && lazy) {
        rc = CUDA_SUCCESS;
        dev = 0; /* the image holds nothing on any GPU */
    }
    if (rc == CUDA_SUCCESS && (library == NULL || code == NULL)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
            struct CUlib_st *lib = &g_libraries[i];
            if (!lib->image.live) {
                rc = load_locked(&lib->image, dev, NULL, lazy ? 0 : image_globals(code));
                if (rc == CUDA_SUCCESS) {
                    lib->lazy = lazy;
                    lib->lazy_globals = globals;
                    *library = lib;
                }
                break;
            }
        }
    }
    unlock();
    return rc;
}

static struct CUlib_st *library_locked(CUlibrary library) {
    long i = SLOT(g_libraries, library);
    return i >= 0 && g_libraries[i].image.live ? &g_libraries[i] : NULL;
}

/* Its modules in every context and its kernels go with it. */
static void library_unload_locked(struct CUlib_st *lib) {
    size_t i;
    for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
        if (g_modules[i].live && g_modules[i].library == lib) {
            unload_locked(&g_modules[i]);
        }
    }
    for (i = 0; i < DOUBLE_MAX_KERNELS; i++) {
        if (g_kernels[i].library == lib) {
            g_kernels[i].library = NULL;
        }
    }
    unload_locked(&lib->image);
}

/*
 * The library's module in ctx, made at its first use there: that takes a
 * fat binary's globals on ctx's GPU, or fails with CUDA_ERROR_OUT_OF_MEMORY
 * and takes nothing. A text image's globals stay with the library's image.
 */
static CUresult library_module_locked(struct CUlib_st *lib, CUcontext ctx,
                                      struct CUmod_st **out) {
    size_t i, free_slot = DOUBLE_MAX_MODULES;
    CUresult rc;
    if (!context_alive(ctx)) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
        if (g_modules[i].live && g_modules[i].library == lib && g_modules[i].ctx == ctx) {
            *out = &g_modules[i];
            return CUDA_SUCCESS;
        }
        if (!g_modules[i].live && free_slot == DOUBLE_MAX_MODULES) {
            free_slot = i;
        }
    }
    if (free_slot == DOUBLE_MAX_MODULES) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    rc = load_locked(&g_modules[free_slot], ctx->device, ctx, lib->lazy ? lib->lazy_globals : 0);
    if (rc == CUDA_SUCCESS) {
        g_modules[free_slot].library = lib;
        *out = &g_modules[free_slot];
    }
    return rc;
}

/* Every name is a function of m; the same name gives the same handle. */
static CUresult function_get_locked(struct CUmod_st *m, const char *name, CUfunction *out) {
    size_t i, free_slot = DOUBLE_MAX_FUNCTIONS;
    if (*name == '\0' || strlen(name) >= FUNCTION_NAME_MAX) {
        return CUDA_ERROR_NOT_FOUND;
    }
    for (i = 0; i < DOUBLE_MAX_FUNCTIONS; i++) {
        if (g_functions[i].module == m && strcmp(g_functions[i].name, name) == 0) {
            *out = &g_functions[i];
            return CUDA_SUCCESS;
        }
        if (g_functions[i].module == NULL && free_slot == DOUBLE_MAX_FUNCTIONS) {
            free_slot = i;
        }
    }
    if (free_slot == DOUBLE_MAX_FUNCTIONS) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_functions[free_slot].module = m;
    g_functions[free_slot].launched = 0;
    snprintf(g_functions[free_slot].name, FUNCTION_NAME_MAX, "%s", name);
    *out = &g_functions[free_slot];
    return CUDA_SUCCESS;
}

/* The function of kernel k in ctx, after its library's first use there. */
static CUresult kernel_function_locked(const struct CUkern_st *k, CUcontext ctx,
                                       CUfunction *out) {
    struct CUmod_st *m = NULL;
    CUresult rc = library_module_locked(k->library, ctx, &m);
    return rc == CUDA_SUCCESS ? function_get_locked(m, k->name, out) : rc;
}

/* A kernel handle launched on h becomes its function in the stream's context
 * (the current one for the default streams). Anything else, a bad stream
 * included, is left for the launch to report. */
static CUresult kernel_launch_function(CUfunction *f, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    const struct CUkern_st *k;
    CUdevice dev = 0;
    CUresult rc = CUDA_SUCCESS;
    lock();
    k = kernel_locked(*f);
    if (k != NULL && stream_locked(h, ptsz, &s, &dev) == CUDA_SUCCESS) {
        rc = kernel_function_locked(k, s != NULL && s->ctx != NULL ? s->ctx : t_current, f);
    }
    unlock();
    return rc;
}

CUresult impl_cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                void **jitOptionsValues, unsigned int numJitOptions,
                                CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                unsigned int numLibraryOptions) {
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    return library_load(library, code, 1);
}

/* Only the file's first bytes are read: a text image's header. */
CUresult impl_cuLibraryLoadFromFile(CUlibrary *library, const char *fileName,
                                    CUjit_option *jitOptions, void **jitOptionsValues,
                                    unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                                    void **libraryOptionValues, unsigned int numLibraryOptions) {
    char image[128];
    CUresult rc;
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    rc = read_image(fileName, image, sizeof image);
    return rc == CUDA_SUCCESS ? library_load(library, image, 0) : rc;
}

CUresult impl_cuLibraryUnload(CUlibrary library) {
    struct CUlib_st *lib;
    CUresult rc = CUDA_SUCCESS;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        library_unload_locked(lib);
    }
    unlock();
    return rc;
}

/* Every name is a kernel of every library; the same name gives the same handle. */
CUresult impl_cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    struct CUlib_st *lib;
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    size_t i, free_slot = DOUBLE_MAX_KERNELS;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pKernel == NULL || name == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (*name == '\0' || strlen(name) >= FUNCTION_NAME_MAX) {
        rc = CUDA_ERROR_NOT_FOUND;
    } else {
        for (i = 0; i < DOUBLE_MAX_KERNELS; i++) {
            if (g_kernels[i].library == lib && strcmp(g_kernels[i].name, name) == 0) {
                free_slot = i;
                break;
            }
            if (g_kernels[i].library == NULL && free_slot == DOUBLE_MAX_KERNELS) {
                free_slot = i;
            }
        }
        if (free_slot < DOUBLE_MAX_KERNELS) {
            g_kernels[free_slot].library = lib;
            snprintf(g_kernels[free_slot].name, FUNCTION_NAME_MAX, "%s", name);
            *pKernel = &g_kernels[free_slot];
            rc = CUDA_SUCCESS;
        }
    }
    unlock();
    return rc;
}

/* The library's module in the current context: its first use there. */
CUresult impl_cuLibraryGetModule(CUmodule *pMod, CUlibrary library) {
    struct CUlib_st *lib;
    struct CUmod_st *m = NULL;
    CUresult rc;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pMod == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if ((rc = library_module_locked(lib, t_current, &m)) == CUDA_SUCCESS) {
        *pMod = m;
    }
    unlock();
    return rc;
}

/* As cuModuleGetGlobal_v2, after the library's first use in the current
 * context: a fat binary's globals there, a text image's with the library. */
CUresult impl_cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library,
                                 const char *name) {
    struct CUlib_st *lib;
    struct CUmod_st *m = NULL;
    CUresult rc;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (name == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((rc = library_module_locked(lib, t_current, &m)) == CUDA_SUCCESS) {
        rc = global_locked(lib->lazy ? m : &lib->image, name, dptr, bytes);
    }
    unlock();
    return rc;
}

/* A kernel's library; anything else, a module's function included, is not a kernel. */
CUresult impl_cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel) {
    const struct CUkern_st *k;
    CUresult rc = CUDA_SUCCESS;
    lock();
    k = kernel_locked(kernel);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pLib == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (k == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        *pLib = k->library;
    }
    unlock();
    return rc;
}

/* The kernel's function in the current context: its library's first use there. */
CUresult impl_cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    const struct CUkern_st *k;
    CUresult rc;
    lock();
    k = kernel_locked(kernel);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pFunc == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (k == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = kernel_function_locked(k, t_current, pFunc);
    }
    unlock();
    return rc;
}

CUresult impl_cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    struct CUmod_st *m;
    CUresult rc;
    lock();
    m = module_locked(hmod);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (hfunc == NULL || name == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (m == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = function_get_locked(m, name, hfunc);
    }
    unlock();
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
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: value = (int)double_pci_bus(dev); break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: value = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: value = DOUBLE_THREADS_PER_SM; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: value = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: value = 0; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: value = DOUBLE_CC_MAJOR; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: value = DOUBLE_CC_MINOR; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: value = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: value = 1; break;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pi = value;
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- errors */

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_UNSUPPORTED_LIMIT, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
};

static CUresult describe(CUresult error, const char **pStr, int want_name) {
    size_t i;
    if (pStr == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == error) {
            *pStr = want_name ? g_errors[i].name : g_errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult impl_cuGetErrorString(CUresult error, const char **pStr) {
    return describe(error, pStr, 0);
}

CUresult impl_cuGetErrorName(CUresult error, const char **pStr) {
    return describe(error, pStr, 1);
}

/* ---------------------------------------------------------------- cuGetProcAddress */

/* Base name → exported symbol, as the measured driver maps them. */
static const struct {
    const char *base;
    const char *exported; /* cudaVersion >= since, default stream */
    const char *ptsz;     /* with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
    const char *older;    /* cudaVersion < since, where the older version is exported */
    int since;
} g_proc_map[] = {
    {"cuMemAlloc", "cuMemAlloc_v2", NULL, NULL, 0},
    {"cuMemGetInfo", "cuMemGetInfo_v2", NULL, "cuMemGetInfo", 3020},
    {"cuMemFree", "cuMemFree_v2", NULL, NULL, 0},
    {"cuDeviceTotalMem", "cuDeviceTotalMem_v2", NULL, "cuDeviceTotalMem", 3020},
    {"cuCtxCreate", "cuCtxCreate_v2", NULL, NULL, 0},
    {"cuCtxDestroy", "cuCtxDestroy_v2", NULL, NULL, 0},
    {"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", NULL, NULL, 0},
    {"cuMemAllocPitch", "cuMemAllocPitch_v2", NULL, NULL, 0},
    {"cuArrayCreate", "cuArrayCreate_v2", NULL, NULL, 0},
    {"cuArray3DCreate", "cuArray3DCreate_v2", NULL, NULL, 0},
    {"cuMemGetAddressRange", "cuMemGetAddressRange_v2", NULL, NULL, 0},
    {"cuGetProcAddress", "cuGetProcAddress_v2", NULL, NULL, 0},
    {"cuDeviceGetUuid", "cuDeviceGetUuid_v2", NULL, NULL, 0},
    {"cuMemAllocAsync", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", NULL, 0},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", NULL, 0},
    {"cuMemFreeAsync", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", NULL, 0},
    {"cuLaunchKernel", "cuLaunchKernel", "cuLaunchKernel_ptsz", NULL, 0},
    {"cuLaunchKernelEx", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", NULL, 0},
    {"cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz",
     NULL, 0},
    {"cuGraphLaunch", "cuGraphLaunch", "cuGraphLaunch_ptsz", NULL, 0},
    {"cuGraphInstantiate", "cuGraphInstantiateWithFlags", NULL, NULL, 0},
    {"cuGraphUpload", "cuGraphUpload", "cuGraphUpload_ptsz", NULL, 0},
    {"cuModuleGetGlobal", "cuModuleGetGlobal_v2", NULL, NULL, 0},
    {"cuStreamBeginCapture", "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz", NULL, 0},
    {"cuStreamEndCapture", "cuStreamEndCapture", "cuStreamEndCapture_ptsz", NULL, 0},
    {"cuStreamIsCapturing", "cuStreamIsCapturing", "cuStreamIsCapturing_ptsz", NULL, 0},
    {"cuStreamSynchronize", "cuStreamSynchronize", "cuStreamSynchronize_ptsz", NULL, 0},
    {"cuStreamQuery", "cuStreamQuery", "cuStreamQuery_ptsz", NULL, 0},
    {"cuStreamGetCtx", "cuStreamGetCtx", "cuStreamGetCtx_ptsz", NULL, 0},
    {"cuStreamDestroy", "cuStreamDestroy_v2", NULL, NULL, 0},
    {"cuEventRecord", "cuEventRecord", "cuEventRecord_ptsz", NULL, 0},
    {"cuEventDestroy", "cuEventDestroy_v2", NULL, NULL, 0},
    {"cuEventElapsedTime", "cuEventElapsedTime_v2", NULL, "cuEventElapsedTime", 12080},
};

static void *g_self;

static void open_self(void) {
    Dl_info info;
    /* The double's own handle, however it was loaded (path, soname, preload). */
    if (dladdr((void *)&impl_cuInit, &info) != 0 && info.dli_fname != NULL) {
        g_self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    }
}

static void *own_handle(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, open_self);
    return g_self;
}

static const char *resolve_name(const char *symbol, int cudaVersion, cuuint64_t flags) {
    size_t i;
    for (i = 0; i < sizeof g_proc_map / sizeof g_proc_map[0]; i++) {
        if (strcmp(symbol, g_proc_map[i].base) != 0) {
            continue;
        }
        if (cudaVersion < g_proc_map[i].since && g_proc_map[i].older != NULL) {
            return g_proc_map[i].older;
        }
        if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && g_proc_map[i].ptsz != NULL) {
            return g_proc_map[i].ptsz;
        }
        return g_proc_map[i].exported;
    }
    /* Any other exported name that is itself a base name (no _v2 / _ptsz). */
    for (i = 0; i < sizeof exported_names / sizeof exported_names[0]; i++) {
        if (strcmp(symbol, exported_names[i]) == 0) {
            size_t n = strlen(symbol);
            if ((n > 3 && strcmp(symbol + n - 3, "_v2") == 0) ||
                (n > 5 && strcmp(symbol + n - 5, "_ptsz") == 0)) {
                return NULL;
            }
            return exported_names[i];
        }
    }
    return NULL;
}

CUresult impl_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                  cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus) {
    const char *name;
    void *address = NULL;
    if (symbol == NULL || pfn == NULL || (flags & ~(cuuint64_t)3) != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pfn = NULL;
    name = resolve_name(symbol, cudaVersion, flags);
    if (name != NULL) {
        void *self = own_handle();
        if (self != NULL) {
            address = dlsym(self, name);
        }
    }
    if (symbolStatus != NULL) {
        *symbolStatus =
            address != NULL ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    if (address == NULL) {
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = address;
    return CUDA_SUCCESS;
}

CUresult impl_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return impl_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}

/* ---------------------------------------------------------------- for libnvidia-ml */

/* NVML's view: every fake GPU, by physical index; a GPU this process does
 * not see through CUDA_VISIBLE_DEVICES shows nothing of it. */
EXPORT int gpushare_double_state(int device, struct gpushare_double_snapshot *out) {
    int count, ordinal;
    lock();
    count = g_physical_devices;
    if (out != NULL && device >= 0 && device < count) {
        memset(out, 0, sizeof *out);
        out->total = g_config.total;
        for (ordinal = 0; ordinal < g_config.devices; ordinal++) {
            if (g_visible[ordinal] != device) {
                continue;
            }
            out->has_context = g_devices[ordinal].live_contexts > 0;
            out->context_bytes = context_bytes(ordinal);
            out->alloc_bytes = g_devices[ordinal].alloc_bytes;
            out->driver_bytes = held_bytes(ordinal);
        }
    }
    unlock();
    return count;
}

/* ---------------------------------------------------------------- busy time */

EXPORT unsigned long long gpushare_double_busy_ns(int device, unsigned long long from_ns,
                                                  unsigned long long to_ns) {
    const struct timeline *t;
    unsigned long long busy = 0;
    size_t lo = 0, hi, i;
    lock();
    if (device < 0 || device >= g_config.devices || from_ns >= to_ns) {
        unlock();
        return 0;
    }
    t = &g_timelines[device];
    hi = t->span_len;
#define SPAN_AT(k) (t->spans[(t->span_head + (k)) % SPAN_CAPACITY])
    while (lo < hi) { /* the first span that ends after from_ns */
        size_t mid = lo + (hi - lo) / 2;
        if (SPAN_AT(mid).end <= from_ns) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    for (i = lo; i < t->span_len && SPAN_AT(i).start < to_ns; i++) {
        unsigned long long start = SPAN_AT(i).start > from_ns ? SPAN_AT(i).start : from_ns;
        unsigned long long end = SPAN_AT(i).end < to_ns ? SPAN_AT(i).end : to_ns;
        busy += end - start;
    }
#undef SPAN_AT
    unlock();
    return busy;
}

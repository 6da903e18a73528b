/*
 * What the files of the double's libcuda.so.1 share: the parameters of the
 * model, the state behind the handles that more than one file reads, and the
 * helpers one concern lends the others. The model itself is described once,
 * at the top of cuda.c. One file per concern:
 *
 *   cuda.c         the model, the process state, locking, configuration,
 *                  init and devices, device attributes, NVML's snapshot
 *   contexts.c     primary, created and green contexts, context limits
 *   memory.c       a GPU's accounting, the allocation records and their fake
 *                  addresses, memory info, allocations, VMM, arrays
 *   pools.c        stream-ordered allocations and frees, memory pools
 *   copies.c       copies and sets: checks of their ranges and streams
 *   launch.c       the simulated clock (one timeline per device), launches,
 *                  the busy-time accessor
 *   streams.c      streams, stream capture and its rules
 *   events.c       events
 *   graphs.c       graphs, their nodes and execs, graph memory
 *   images.c       what a module image holds: text headers, fat binaries
 *   modules.c      modules, libraries, their functions and kernels
 *   lookup.c       cuGetProcAddress and the error strings
 *   checkpoint.c   the checkpoint API, across processes: the control block,
 *                  the service thread of a target, the caller's requests
 *   node.c         the node file: GPUs that processes share, their shared
 *                  used bytes and the table of the processes charging them
 *   host_memory.c  pinned host memory (its own state and lock)
 *   vmm.c          the virtual memory management API: reserved ranges,
 *                  physical memory with contents, mappings and access,
 *                  shareable handles; legacy IPC, refused
 *
 * Nothing declared here is exported: the library is built with
 * -fvisibility=hidden, and these declarations are hidden as well, so that
 * libcuda.map exports only the entry points of cuda_entry.S and the two
 * accessors (EXPORT) of double_common.h.
 */
#ifndef GPUSHARE_DOUBLE_INTERNAL_H
#define GPUSHARE_DOUBLE_INTERNAL_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
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
 * cuda_min.h, so a definition with another signature does not compile.
 */
#define CU_ENTRY(name) extern __typeof__(name) impl_##name __attribute__((visibility("hidden")));
#include "cuda_entries.def"
#undef CU_ENTRY

/* Hidden from here on. cuda_min.h stays outside: a hidden declaration of an
 * entry point would hide the stub cuda_entry.S exports. */
#pragma GCC visibility push(hidden)

/* Where the regions start when the reservation cannot be had. */
#define FALLBACK_REGION_BASE 0x7f0000000000ULL
extern unsigned long long g_region_base; /* cuda.c */
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

/* The sizes of tables that more than one file reads; the others are with
 * their tables. Stream capture (streams.c) walks the graphs too. */
#define DOUBLE_MAX_GRAPHS 256
#define FUNCTION_NAME_MAX 128 /* names of functions and kernels */

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
    unsigned char pool; /* from g_pools[pool - 1]; 0: from no pool */
    unsigned char managed; /* cuMemAllocManaged: refuses a checkpoint */
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
    int parked; /* a checkpoint moved its charges to the host */
};

/* A memory pool: each GPU's default one, or one made by cuMemPoolCreate. */
struct CUmemPoolHandle_st {
    int live;                     /* a made pool, until destroyed (default pools: 1) */
    int device;
    unsigned long long threshold; /* CU_MEMPOOL_ATTR_RELEASE_THRESHOLD */
    unsigned long long used;      /* its live allocations */
    unsigned long long retained;  /* freed into it and kept: driver-held */
    int reuse[3];                 /* the CU_MEMPOOL_ATTR_REUSE_* flags: stored only */
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

struct CUstream_st {
    int live;
    int device;                 /* created streams only */
    struct CUgraph_st *capture; /* non-NULL while capturing */
    CUcontext ctx;              /* created streams only */
};

struct CUfunc_st {
    struct CUmod_st *module; /* NULL: free slot */
    char name[FUNCTION_NAME_MAX];
    int launched; /* lazy loading: the first launch loads the module */
};

/* Every function whose name ends in _locked runs under g_lock (lock()). */

/* cuda.c: the process state, its lock, and devices. */
extern struct double_config g_config;
extern unsigned long long g_config_kernel_ns;
extern unsigned long long g_config_queue_depth;
extern unsigned long long g_config_event_ramp_ns;
extern int g_initialized;
extern struct device g_devices[DOUBLE_MAX_DEVICES];
/* The current context of this thread. */
extern __thread CUcontext t_current;
unsigned long long env_count(const char *name, unsigned long long fallback,
                             unsigned long long min, unsigned long long max);
unsigned long long region_start(int dev);
void reset_limits(struct device *d);
void lock(void);
void lock_raw(void);
int lock_try(void);
void unlock(void);
void freeze_locked(int frozen);
/* The fake GPU (its index, what NVML and the UUID name) an ordinal runs on. */
int device_gpu(int ordinal);
void set_device_gpu(int ordinal, int gpu);
int physical_devices(void);
int valid_device(CUdevice dev);
int context_alive(CUcontext ctx);
CUresult current_device_locked(CUdevice *dev);
CUresult check_device(CUdevice dev);
unsigned int clamp_uint(unsigned long long value);
long slot_of(const void *base, size_t size, size_t count, const void *p);
/* The index of p in the array (a handle table), or -1. */
#define SLOT(array, p) slot_of((array), sizeof (array)[0], sizeof(array) / sizeof (array)[0], (p))

/* contexts.c: the primary context of each GPU (by ordinal). */
extern struct CUctx_st g_primary[DOUBLE_MAX_DEVICES];

/* memory.c: what a GPU holds, and the records of its allocations. */
unsigned long long add_sat(unsigned long long a, unsigned long long b);
unsigned long long limit_bytes(const size_t *limits);
unsigned long long context_bytes(int dev);
unsigned long long held_bytes(int dev);
unsigned long long used_bytes(int dev);
int managed_live_locked(void);
int fits(int dev, unsigned long long size);
void forget_locked(int dev, struct record *r);
void tidy_locked(int dev);
CUresult alloc_locked(int dev, CUcontext ctx, unsigned long long size, enum kind kind,
                      unsigned long long *addr);
struct record *find_locked(unsigned long long addr, int exact, int *dev_out);
CUresult bump_locked(unsigned long long *next, unsigned long long end, unsigned long long size,
                     unsigned long long *addr);
int free_fails(void);
/* For host_memory.c too: whether cuInit ran, and the device allocation holding addr. */
int double_initialized(void);
int double_device_range(unsigned long long addr, unsigned long long *base,
                        unsigned long long *size, int *device);

/* checkpoint.c: started by the first cuInit when GPUSHARE_DOUBLE_CHECKPOINT_DIR
 * is set; publish writes the process's figures into its control block. */
void checkpoint_start_locked(void);
void checkpoint_publish_locked(void);
/* What /proc/<pid>/stat says: 1 alive (its start time, field 22, in *start),
 * 0 gone or a zombie, -1 unreadable; and whether pid, started at start_time
 * (0: any), still runs. */
int proc_stat(int pid, unsigned long long *start);
int process_alive(int pid, unsigned long long start_time);

/* node.c: GPUs shared through GPUSHARE_DOUBLE_NODE_FILE. Started by the first
 * cuInit; fits() reserves a charge's growth in the file (0: it does not fit
 * there), every unlock() settles the file to what the process holds, and a
 * restore adds its charges onto the GPUs of gpu[] (by ordinal) or fails with
 * CUDA_ERROR_OUT_OF_MEMORY changing nothing. */
void node_start_locked(void);
int node_reserve_locked(int dev, unsigned long long need);
void node_sync_locked(void);
CUresult node_restore_locked(const int *gpu);

/* vmm.c: whether addr lies in the region of reserved ranges; the mapping
 * holding addr (its base, size and GPU); whether [addr, addr + bytes) is
 * mapped with read (write == 0) or read-write access for GPU dev (CUDA_SUCCESS,
 * CUDA_ERROR_INVALID_VALUE where unmapped, CUDA_ERROR_ILLEGAL_ADDRESS without
 * access); and, once checked, the bytes moved in (write) or out, or set. */
int vmm_space(unsigned long long addr);
int vmm_range_locked(unsigned long long addr, unsigned long long *base, unsigned long long *size,
                     int *device);
CUresult vmm_check_locked(unsigned long long addr, unsigned long long bytes, int dev, int write);
void vmm_move_locked(unsigned long long addr, void *host, unsigned long long bytes, int write);
void vmm_fill_locked(unsigned long long addr, unsigned value, unsigned width,
                     unsigned long long bytes);

/* host_memory.c: pinned mapped host memory. */
int double_host_range(unsigned long long addr, unsigned long long *base, unsigned long long *size);

/* pools.c: the default memory pool of each GPU (by ordinal), then the pools
 * cuMemPoolCreate made. */
#define DOUBLE_MAX_POOLS (DOUBLE_MAX_DEVICES + 16)
extern struct CUmemPoolHandle_st g_pools[DOUBLE_MAX_POOLS];
void pool_settle_locked(int dev);
unsigned long long pools_retained(int dev);
void pools_forget_retained(int dev);

/* launch.c: the simulated GPU clock, and launches. */
unsigned long long now_ns(void);
void sleep_until(unsigned long long ns);
unsigned long long device_busy_until(int dev);
unsigned long long drained_at_locked(int dev, unsigned long long now);
void event_recorded_locked(int dev);
CUresult enqueue(CUstream h, int ptsz, unsigned long long ns, unsigned long long kernels,
                 CUgraphNodeType type, CUresult (*check)(const void *), const void *object,
                 int args_ok);

/* streams.c: the stream a call names, and the capture rules. */
CUresult stream_locked(CUstream h, int ptsz, struct CUstream_st **out, CUdevice *dev);
CUresult unsafe_call_locked(void);
CUresult context_sync_locked(int dev);

/* graphs.c: graphs and their nodes, made by the graph API and by capture. */
extern struct CUgraph_st g_graphs[DOUBLE_MAX_GRAPHS];
struct CUgraph_st *graph_new_locked(int dev);
void graph_free_locked(struct CUgraph_st *g);
CUresult graph_add_locked(struct CUgraph_st *g, struct node n, CUgraphNode *out);
CUresult graph_alloc_node_locked(struct CUgraph_st *g, int dev, unsigned long long size,
                                 unsigned long long *addr, CUgraphNode *out);
CUresult graph_free_node_locked(struct CUgraph_st *g, unsigned long long addr, CUgraphNode *out);

/* images.c: what an image holds. */
unsigned long long image_globals(const void *image);
CUresult read_image(const char *path, char *buf, size_t size);
int fatbin_globals(const void *image, unsigned long long *globals);

/* modules.c: functions and kernels for launches; those of a context go with
 * it, and a library's kernel launches as its function in a context. */
struct CUfunc_st *function_locked(CUfunction f);
struct CUkern_st *kernel_locked(const void *k);
void unload_context_modules_locked(CUcontext ctx);
CUresult kernel_launch_function(CUfunction *f, CUstream h, int ptsz);

#pragma GCC visibility pop

#endif

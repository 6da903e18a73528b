/*
 * What the probe's files share: the driver entry points it calls (through
 * drv in the dlopen build, directly in the linked one), the device it runs
 * on, its output and failure helpers, the script runner of probe_script.c
 * that cudaprobe.c's main calls, and the commands of probe_memory.c,
 * probe_launch.c, probe_held.c and probe_sharing.c that the runner calls.
 * The script format is described in cudaprobe.c.
 */
#ifndef CUDAPROBE_PROBE_H
#define CUDAPROBE_PROBE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
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
/* Before cuCtxCreate_v3 (11.4): the version that names cuCtxCreate_v2. */
#define CUDA_VERSION_CTX_V2 11000

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

/*
 * The entry points of driver-held memory (probe_held.c), optional like the
 * compute ones: a command that needs a missing one reports
 * CUDA_ERROR_NOT_FOUND (500).
 */
#define CU_HELD_FUNCS(X)                                                                \
    X(cuCtxCreate_v2, "cuCtxCreate", CUDA_VERSION_CTX_V2, 0)                            \
    X(cuCtxDestroy_v2, "cuCtxDestroy", CUDA_VERSION_USED, 0)                            \
    X(cuCtxSetLimit, "cuCtxSetLimit", CUDA_VERSION_USED, 0)                             \
    X(cuCtxGetLimit, "cuCtxGetLimit", CUDA_VERSION_USED, 0)                             \
    X(cuModuleLoadDataEx, "cuModuleLoadDataEx", CUDA_VERSION_USED, 0)                   \
    X(cuModuleUnload, "cuModuleUnload", CUDA_VERSION_USED, 0)                           \
    X(cuLibraryLoadData, "cuLibraryLoadData", CUDA_VERSION_USED, 0)                     \
    X(cuLibraryLoadFromFile, "cuLibraryLoadFromFile", CUDA_VERSION_USED, 0)             \
    X(cuGreenCtxCreate, "cuGreenCtxCreate", CUDA_VERSION_USED, 0)                       \
    X(cuGreenCtxDestroy, "cuGreenCtxDestroy", CUDA_VERSION_USED, 0)                     \
    X(cuLibraryUnload, "cuLibraryUnload", CUDA_VERSION_USED, 0)                         \
    X(cuGraphCreate, "cuGraphCreate", CUDA_VERSION_USED, 0)                             \
    X(cuGraphAddMemAllocNode, "cuGraphAddMemAllocNode", CUDA_VERSION_USED, 0)           \
    X(cuGraphUpload, "cuGraphUpload", CUDA_VERSION_USED, 0)                             \
    X(cuDeviceGraphMemTrim, "cuDeviceGraphMemTrim", CUDA_VERSION_USED, 0)               \
    X(cuStreamSynchronize, "cuStreamSynchronize", CUDA_VERSION_USED, 0)                 \
    X(cuDeviceGetDefaultMemPool, "cuDeviceGetDefaultMemPool", CUDA_VERSION_USED, 0)     \
    X(cuMemPoolSetAttribute, "cuMemPoolSetAttribute", CUDA_VERSION_USED, 0)             \
    X(cuMemPoolGetAttribute, "cuMemPoolGetAttribute", CUDA_VERSION_USED, 0)             \
    X(cuMemPoolTrimTo, "cuMemPoolTrimTo", CUDA_VERSION_USED, 0)                         \
    X(cuMemPoolCreate, "cuMemPoolCreate", CUDA_VERSION_USED, 0)                         \
    X(cuMemPoolDestroy, "cuMemPoolDestroy", CUDA_VERSION_USED, 0)                       \
    X(cuDeviceGetAttribute, "cuDeviceGetAttribute", CUDA_VERSION_USED, 0)               \
    X(cuLibraryGetKernel, "cuLibraryGetKernel", CUDA_VERSION_USED, 0)                   \
    X(cuKernelGetLibrary, "cuKernelGetLibrary", CUDA_VERSION_USED, 0)                   \
    X(cuKernelGetFunction, "cuKernelGetFunction", CUDA_VERSION_USED, 0)                 \
    X(cuLibraryGetGlobal, "cuLibraryGetGlobal", CUDA_VERSION_USED, 0)                   \
    X(cuDeviceGetCount, "cuDeviceGetCount", CUDA_VERSION_USED, 0)                       \
    X(cuDeviceGetUuid_v2, "cuDeviceGetUuid", CUDA_VERSION_USED, 0)

/*
 * The entry points of shared memory (probe_sharing.c: legacy IPC, VMM and
 * its shareable handles), optional like the compute ones: a command that
 * needs a missing one reports CUDA_ERROR_NOT_FOUND (500).
 */
#define CU_SHARE_FUNCS(X)                                                               \
    X(cuIpcGetMemHandle, "cuIpcGetMemHandle", CUDA_VERSION_USED, 0)                     \
    X(cuIpcOpenMemHandle_v2, "cuIpcOpenMemHandle", CUDA_VERSION_USED, 0)                \
    X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle", CUDA_VERSION_USED, 0)                 \
    X(cuMemAddressReserve, "cuMemAddressReserve", CUDA_VERSION_USED, 0)                 \
    X(cuMemAddressFree, "cuMemAddressFree", CUDA_VERSION_USED, 0)                       \
    X(cuMemMap, "cuMemMap", CUDA_VERSION_USED, 0)                                       \
    X(cuMemUnmap, "cuMemUnmap", CUDA_VERSION_USED, 0)                                   \
    X(cuMemSetAccess, "cuMemSetAccess", CUDA_VERSION_USED, 0)                           \
    X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle", CUDA_VERSION_USED, 0) \
    X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle", CUDA_VERSION_USED, 0)

#define NVML_FUNCS(X)                                                                   \
    X(nvmlInit_v2)                                                                      \
    X(nvmlShutdown)                                                                     \
    X(nvmlDeviceGetHandleByIndex_v2)                                                    \
    X(nvmlDeviceGetMemoryInfo)                                                          \
    X(nvmlDeviceGetMemoryInfo_v2)                                                       \
    X(nvmlDeviceGetComputeRunningProcesses_v3)                                          \
    X(nvmlDeviceGetCount_v2)                                                            \
    X(nvmlDeviceGetUUID)

#ifdef CUDAPROBE_LINKED
#define CU(name) name
#define CU_OPT(name, ...) name(__VA_ARGS__)
#define NVML(name) name
#else
struct probe_driver {
#define CU_SLOT(name, base, version, flags) __typeof__(&name) name;
    CU_FUNCS(CU_SLOT)
    CU_COMPUTE_FUNCS(CU_SLOT)
    CU_HELD_FUNCS(CU_SLOT)
    CU_SHARE_FUNCS(CU_SLOT)
#undef CU_SLOT
#define NVML_SLOT(name) __typeof__(&name) name;
    NVML_FUNCS(NVML_SLOT)
#undef NVML_SLOT
};
extern struct probe_driver drv;
#define CU(name) drv.name
#define CU_OPT(name, ...) (drv.name == NULL ? CUDA_ERROR_NOT_FOUND : drv.name(__VA_ARGS__))
#define NVML(name) drv.name
#endif

/* The double's busy-time accessor; NULL on a real driver. */
extern gpushare_double_busy_fn busy_fn;
/* The device the script runs on (--device), and its primary context. */
extern int device_ordinal;
extern CUdevice device;
extern CUcontext context;

/* Exit status 1: the environment failed us; 2: the script is malformed. */
void die(int status, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));
/* One output line, flushed at once: tests read it while we run. */
void emit(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* probe_script.c: runs (execute) or only checks (!execute) the script of
 * argc words at argv; returns at its end. */
void run_script(int argc, char **argv, int execute);
/* A plain decimal number; dies (status 2) on anything else. */
unsigned long long arg_number(const char *text);

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
    API_COUNT,    /* the APIs alloc names; the slots of other commands follow */
    API_IPC_OPEN, /* ipc-open: cuIpcOpenMemHandle_v2 */
    API_VMM_MAP   /* vmm-alloc, vmm-import: a mapping of memory held by its handle */
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


/* What pace, shapes and functions share after their first argument: the
 * kernel's duration, the iterations, the host work per iteration. */
struct paced {
    const char *dur_text, *count_text, *host_text;
    unsigned long long dur_us, count, host_us;
};

/* The arguments of periodic, as written and as numbers. */
struct periodic {
    const char *kernels_text, *dur_text, *period_text, *count_text;
    unsigned long long kernels, dur_us, period_us, count;
};

/* probe_memory.c: allocations, memory queries, NVML. */
void cmd_alloc(const char *api_text, enum api_kind api, const char *size_text, size_t size);
void cmd_free(const char *id_text, unsigned long long id);
void cmd_ptr(const char *id_text, unsigned long long id);
/* The pointer and size asked for of live allocation ID; 0 if there is none. */
int probe_allocation(unsigned long long id, unsigned long long *pointer, size_t *size);
/* A new live allocation ID of another command than alloc: its pointer and
 * size, and for API_VMM_MAP the allocation handle mapped there. */
size_t probe_remember(enum api_kind api, unsigned long long pointer, size_t size,
                      unsigned long long memory);
/* Whether ID was ever allocated (else the script names an unknown ID); its
 * API, and the allocation handle of an API_CREATE or API_VMM_MAP ID (else 0). */
int probe_slot(unsigned long long id, enum api_kind *api, unsigned long long *memory);
/* Marks live ID freed, without a driver call. */
void probe_forget(unsigned long long id);
void cmd_info(const char *cmd);
void cmd_totalmem(const char *cmd);
void cmd_fill(const char *size_text, size_t size);
void cmd_freeall(void);
void cmd_hammer(unsigned long long threads, unsigned long long iters, size_t size);
void cmd_nvml(const char *name, int v2);
void cmd_nvml_procs(void);
void cmd_gpus(void);

/* probe_launch.c: kernels on the simulated clock, and what it reports. */
unsigned long long now_ns(void);
void cmd_spin(const char *api_text, enum launch_api api, const char *dur_text,
              unsigned long long dur_us, const char *count_text, unsigned long long count);
void cmd_run(const char *api_text, enum launch_api api, const char *dur_text,
             unsigned long long dur_us, const char *ms_text, unsigned long long ms);
void cmd_pace(const char *api_text, enum launch_api api, const struct paced *p);
void cmd_shapes(const char *n_text, unsigned long long n, const struct paced *p);
void cmd_functions(const char *f_text, unsigned long long f, const struct paced *p);
void cmd_periodic(const struct periodic *p);
void cmd_series(const char *window_text, unsigned long long window_ms);
void cmd_idle(const char *step_text, unsigned long long step_us);
void cmd_settled(void);
void cmd_maxstall(void);

/* probe_sharing.c: legacy IPC handles and VMM shareable handles; their
 * allocations take IDs as alloc's do. */
#define IPC_HEX_DIGITS (2 * CU_IPC_HANDLE_SIZE)
/* Whether text is IPC_HEX_DIGITS hex digits; their bytes into *handle. */
int parse_ipc_handle(const char *text, CUipcMemHandle *handle);
void cmd_ipc_export(const char *id_text, unsigned long long id);
void cmd_ipc_open(const CUipcMemHandle *handle);
void cmd_ipc_close(const char *id_text, unsigned long long id);
void cmd_vmm_alloc(const char *size_text, size_t size);
void cmd_vmm_export(const char *id_text, unsigned long long id);
/* FROM: a descriptor's number, a path (opened, imported, closed) or "last". */
void cmd_vmm_import(const char *from);
/* Unmaps, releases and frees the range of an API_VMM_MAP ID; the first failure. */
CUresult vmm_unmap_slot(unsigned long long pointer, size_t size, unsigned long long memory);

/* probe_held.c: memory the driver takes without an allocation call. */
enum held_limit { HELD_STACK, HELD_FIFO, HELD_HEAP, HELD_LIMIT_COUNT };
enum held_image {
    HELD_MODULE,
    HELD_MODULE_EX,
    HELD_LIBRARY,
    HELD_LIBRARY_FILE,
    HELD_FAT_LIBRARY,
    HELD_IMAGE_COUNT
};
enum held_kernel_op { HELD_KERNEL_LAUNCH, HELD_KERNEL_FUNCTION, HELD_KERNEL_LIBRARY };
enum held_graph { HELD_LAUNCH, HELD_UPLOAD, HELD_DESTROY };
void cmd_setlimit(const char *kind_text, enum held_limit kind, const char *size_text, size_t size);
void cmd_getlimit(const char *kind_text, enum held_limit kind);
void cmd_load(const char *cmd, enum held_image kind, const char *size_text, size_t size);
void cmd_unload(const char *id_text, unsigned long long id);
void cmd_fatlib(const char *size_text, size_t size);
void cmd_libkernel(const char *id_text, unsigned long long id, const char *name);
void cmd_libglobal(const char *id_text, unsigned long long id);
void cmd_kernel(const char *cmd, enum held_kernel_op op, const char *id_text,
                unsigned long long id);
void cmd_graph_alloc(const char *cmd, int captured, const char *size_text, size_t size);
void cmd_graph(const char *cmd, enum held_graph op, const char *id_text, unsigned long long id);
void cmd_graph_trim(void);
void cmd_pool_threshold(const char *size_text, unsigned long long size);
void cmd_pool_trim(const char *size_text, size_t size);
void cmd_pool_reserved(void);
void cmd_pool_create(const char *size_text, unsigned long long threshold);
void cmd_pool_destroy(void);
/* The pool of the pool API and the pool commands: the one pool_create made,
 * else NULL (the double's default pool of the current GPU). */
extern CUmemoryPool probe_pool;
void cmd_sync(void);
void cmd_context(void);
void cmd_green_context(void);
void cmd_context_destroy(const char *id_text, unsigned long long id);

#endif

/*
 * libcuda.so.1 of the test double: a fake GPU with memory accounting and no
 * compute, behind entry points that start with the real driver's prologue
 * (cuda_entry.S). Each exported `cuX` tail-jumps to `impl_cuX` here.
 *
 * Model (per process, one mutex):
 * - GPUSHARE_DOUBLE_DEVICES fake GPUs of GPUSHARE_DOUBLE_TOTAL bytes each
 *   (double_common.h).
 * - Contexts: one primary context per GPU (reference counted) and up to
 *   DOUBLE_MAX_CREATED created ones. While a GPU has at least one live context,
 *   the process is charged GPUSHARE_DOUBLE_CONTEXT_BYTES on it: the driver's
 *   own memory, seen in cuMemGetInfo and NVML, never through an allocation.
 *   Destroying a context (or releasing a primary one to zero) frees the
 *   allocations made in it, as the real driver does; cuMemCreate handles
 *   belong to no context.
 * - Allocations get fake addresses (never dereferenced) from a bump pointer in
 *   a 1 TiB region per GPU starting at 0x7f0000000000, 512-byte aligned; the
 *   bump restarts when the GPU has no live allocation. Arrays, mipmapped
 *   arrays and cuMemCreate handles take their values from the same space.
 *   A GPU is charged exactly the computed size of each allocation; an
 *   allocation that does not fit fails with CUDA_ERROR_OUT_OF_MEMORY.
 * - Before cuInit every call fails with CUDA_ERROR_NOT_INITIALIZED, except
 *   cuInit, cuDriverGetVersion, cuGetProcAddress(_v2) and, as in the real
 *   driver, cuGetErrorString/cuGetErrorName.
 * - Stream-ordered allocations and frees complete at once; pools and streams
 *   are not checked (a NULL pool means the GPU's default pool).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
#define REGION_BASE 0x7f0000000000ULL
#define REGION_SIZE (1ULL << 40)
#define ADDRESS_ALIGN 512ULL
#define GRANULARITY (2ULL << 20)
#define DRIVER_VERSION 13000

enum kind { KIND_POINTER = 1, KIND_HANDLE = 2, KIND_ARRAY = 4, KIND_MIPMAP = 8 };

struct CUctx_st {
    int device;
    int primary;
    unsigned refs; /* primary: retain count; created: 1 while alive */
};

struct record {
    unsigned long long addr;
    unsigned long long size;
    CUcontext ctx; /* NULL for cuMemCreate handles */
    unsigned char kind;
    unsigned char live;
};

struct device {
    unsigned live_contexts;
    unsigned long long alloc_bytes;
    unsigned long long next; /* bump pointer */
    /* Sorted by addr (the bump only grows); dead entries are compacted away. */
    struct record *records;
    size_t len, cap, live;
};

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static struct double_config g_config;
static int g_initialized;
static struct device g_devices[DOUBLE_MAX_DEVICES];
static struct CUctx_st g_primary[DOUBLE_MAX_DEVICES];
static struct CUctx_st g_created[DOUBLE_MAX_CREATED];
static __thread CUcontext t_current;

static void load_config(void) {
    int i;
    g_config = double_config_from_env();
    for (i = 0; i < DOUBLE_MAX_DEVICES; i++) {
        g_primary[i].device = i;
        g_primary[i].primary = 1;
        g_devices[i].next = REGION_BASE + (unsigned long long)i * REGION_SIZE;
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

static unsigned long long used_bytes(int dev) {
    const struct device *d = &g_devices[dev];
    return (d->live_contexts > 0 ? g_config.context_bytes : 0) + d->alloc_bytes;
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
}

/* After frees: restart the bump when nothing is left, or drop dead records. */
static void tidy_locked(int dev) {
    struct device *d = &g_devices[dev];
    if (d->live == 0) {
        d->len = 0;
        d->next = REGION_BASE + (unsigned long long)dev * REGION_SIZE;
    } else if (d->len > 64 && d->live < d->len / 2) {
        compact_locked(d);
    }
}

static CUresult alloc_locked(int dev, CUcontext ctx, unsigned long long size, enum kind kind,
                             unsigned long long *addr) {
    struct device *d = &g_devices[dev];
    unsigned long long end = REGION_BASE + (unsigned long long)(dev + 1) * REGION_SIZE;
    unsigned long long span;
    if (size == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (size > g_config.total || used_bytes(dev) > g_config.total - size) {
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

static void context_up_locked(int dev) {
    g_devices[dev].live_contexts++;
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
    d->live_contexts--;
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
    double_uuid_bytes(dev, bytes);
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
    } else {
        if (g_primary[dev].refs++ == 0) {
            context_up_locked(dev);
        }
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

CUresult impl_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    int i;
    (void)flags;
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
                g_created[i].device = dev;
                g_created[i].primary = 0;
                g_created[i].refs = 1;
                context_up_locked(dev);
                *pctx = &g_created[i];
                t_current = &g_created[i];
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
    unlock();
    return rc;
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

CUresult impl_cuCtxSynchronize(void) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
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

CUresult impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    (void)hStream;
    return impl_cuMemAlloc_v2(dptr, bytesize);
}

CUresult impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return impl_cuMemAllocAsync(dptr, bytesize, hStream);
}

CUresult impl_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    (void)pool;
    return impl_cuMemAllocAsync(dptr, bytesize, hStream);
}

CUresult impl_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                           CUstream hStream) {
    return impl_cuMemAllocFromPoolAsync(dptr, bytesize, pool, hStream);
}

CUresult impl_cuMemFree_v2(CUdeviceptr dptr) {
    return free_any(dptr, KIND_POINTER, CUDA_ERROR_INVALID_VALUE);
}

CUresult impl_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    (void)hStream;
    return impl_cuMemFree_v2(dptr);
}

CUresult impl_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return impl_cuMemFreeAsync(dptr, hStream);
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

CUresult impl_cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
    CUresult rc = CUDA_ERROR_NOT_FOUND;
    struct record *r;
    int dev = 0;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if ((r = find_locked(dptr, 0, &dev)) != NULL && r->kind == KIND_POINTER) {
        if (pbase != NULL) {
            *pbase = r->addr;
        }
        if (psize != NULL) {
            *psize = (size_t)r->size;
        }
        rc = CUDA_SUCCESS;
    }
    unlock();
    return rc;
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
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
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
    const char *exported;      /* cudaVersion >= 3020, default stream */
    const char *ptsz;          /* with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
    const char *before_v3020;  /* cudaVersion < 3020, where the v1 is exported */
} g_proc_map[] = {
    {"cuMemAlloc", "cuMemAlloc_v2", NULL, NULL},
    {"cuMemGetInfo", "cuMemGetInfo_v2", NULL, "cuMemGetInfo"},
    {"cuMemFree", "cuMemFree_v2", NULL, NULL},
    {"cuDeviceTotalMem", "cuDeviceTotalMem_v2", NULL, "cuDeviceTotalMem"},
    {"cuCtxCreate", "cuCtxCreate_v2", NULL, NULL},
    {"cuCtxDestroy", "cuCtxDestroy_v2", NULL, NULL},
    {"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", NULL, NULL},
    {"cuMemAllocPitch", "cuMemAllocPitch_v2", NULL, NULL},
    {"cuArrayCreate", "cuArrayCreate_v2", NULL, NULL},
    {"cuArray3DCreate", "cuArray3DCreate_v2", NULL, NULL},
    {"cuMemGetAddressRange", "cuMemGetAddressRange_v2", NULL, NULL},
    {"cuGetProcAddress", "cuGetProcAddress_v2", NULL, NULL},
    {"cuDeviceGetUuid", "cuDeviceGetUuid_v2", NULL, NULL},
    {"cuMemAllocAsync", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", NULL},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", NULL},
    {"cuMemFreeAsync", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", NULL},
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
        if (cudaVersion < 3020 && g_proc_map[i].before_v3020 != NULL) {
            return g_proc_map[i].before_v3020;
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

EXPORT int gpushare_double_state(int device, struct gpushare_double_snapshot *out) {
    int count;
    lock();
    count = g_config.devices;
    if (out != NULL && device >= 0 && device < count) {
        out->total = g_config.total;
        out->has_context = g_devices[device].live_contexts > 0;
        out->context_bytes = out->has_context ? g_config.context_bytes : 0;
        out->alloc_bytes = g_devices[device].alloc_bytes;
    }
    unlock();
    return count;
}

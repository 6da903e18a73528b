/*
 * Pinned host memory of the test double, as the limiter's oversubscription
 * (limiter/src/spill.rs) and its swap of VMM-backed memory use it:
 *
 * - cuMemHostAlloc(pp, size, flags): real, lazily backed host memory (an
 *   anonymous mapping, so a test may "spill" gigabytes without touching
 *   them); flags PORTABLE | DEVICEMAP | WRITECOMBINED, anything else
 *   CUDA_ERROR_INVALID_VALUE; size 0 CUDA_ERROR_INVALID_VALUE. Never charged
 *   to a GPU: cuMemGetInfo and NVML do not see it, as on the real driver.
 * - cuMemHostGetDevicePointer_v2(pdptr, p, 0): as on a 64-bit UVA platform,
 *   the device pointer of mapped memory is its host address (an interior
 *   pointer maps to itself); memory allocated without DEVICEMAP, unknown
 *   pointers and non-zero flags are CUDA_ERROR_INVALID_VALUE.
 * - cuMemAllocHost_v2(pp, size): as cuMemHostAlloc with PORTABLE |
 *   DEVICEMAP, which is what memory it allocates is on a 64-bit UVA platform.
 * - cuMemHostRegister_v2(p, size, flags): pins the caller's own memory
 *   (flags PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY, anything else
 *   CUDA_ERROR_INVALID_VALUE; NULL or size 0 CUDA_ERROR_INVALID_VALUE); a
 *   range that overlaps pinned memory is
 *   CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED. cuMemHostUnregister(p) takes
 *   the registration that starts at p back, leaving the memory to its
 *   owner (else CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED). Registered memory
 *   is mapped as allocated memory is (with DEVICEMAP) and counts against
 *   the same limit.
 * - cuMemFreeHost(p): p must start an allocation, not a registration (else
 *   CUDA_ERROR_INVALID_VALUE); cuMemFree_v2 of it is CUDA_ERROR_INVALID_VALUE,
 *   as on the real driver (memory.c knows only device records).
 * - cuPointerGetAttribute: MEMORY_TYPE (HOST for this memory, DEVICE for
 *   memory.c's linear allocations), DEVICE_POINTER, HOST_POINTER (host memory
 *   only), IS_MANAGED (0), DEVICE_ORDINAL, RANGE_START_ADDR, RANGE_SIZE,
 *   MAPPED (1); any other attribute, and an unknown pointer,
 *   CUDA_ERROR_INVALID_VALUE.
 *
 * GPUSHARE_DOUBLE_HOST_LIMIT (a size, default unlimited) caps the process's
 * pinned memory: past it cuMemHostAlloc fails with CUDA_ERROR_OUT_OF_MEMORY,
 * as pinning fails on a real node that is out of memory.
 */
/* double_initialized and double_device_range come from memory.c. */
#include "double_internal.h"

#define HOST_MAX_ALLOCATIONS 4096
#define HOST_FLAGS                                                                             \
    (CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_WRITECOMBINED)

struct host_block {
    unsigned long long addr; /* 0: free entry */
    unsigned long long size;
    unsigned flags;
    int registered; /* the caller's memory (cuMemHostRegister_v2), not ours */
};

static pthread_mutex_t g_host_lock = PTHREAD_MUTEX_INITIALIZER;
static struct host_block g_host[HOST_MAX_ALLOCATIONS];
static unsigned long long g_host_bytes;

/* Under g_host_lock. */
static unsigned long long host_limit_locked(void) {
    static unsigned long long limit;
    static int read;
    if (!read) {
        limit = double_env_bytes("GPUSHARE_DOUBLE_HOST_LIMIT", ~0ULL);
        read = 1;
    }
    return limit;
}

/* The block holding addr (exact: starting at it), under g_host_lock. */
static struct host_block *host_find_locked(unsigned long long addr, int exact) {
    size_t i;
    for (i = 0; i < HOST_MAX_ALLOCATIONS; i++) {
        struct host_block *b = &g_host[i];
        if (b->addr != 0 && (exact ? addr == b->addr : addr - b->addr < b->size)) {
            return b;
        }
    }
    return NULL;
}

int double_host_range(unsigned long long addr, unsigned long long *base, unsigned long long *size) {
    struct host_block *b;
    int found = 0;
    pthread_mutex_lock(&g_host_lock);
    if ((b = host_find_locked(addr, 0)) != NULL && (b->flags & CU_MEMHOSTALLOC_DEVICEMAP)) {
        *base = b->addr;
        *size = b->size;
        found = 1;
    }
    pthread_mutex_unlock(&g_host_lock);
    return found;
}

/* A free entry for `bytes` more pinned bytes, or NULL past the limit. */
static struct host_block *host_slot_locked(unsigned long long bytes) {
    size_t i;
    if (bytes > host_limit_locked() - g_host_bytes) {
        return NULL;
    }
    for (i = 0; i < HOST_MAX_ALLOCATIONS; i++) {
        if (g_host[i].addr == 0) {
            return &g_host[i];
        }
    }
    return NULL;
}

CUresult impl_cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
    struct host_block *slot;
    CUresult rc = CUDA_SUCCESS;
    void *p;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (pp == NULL || bytesize == 0 || (Flags & ~HOST_FLAGS) != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_host_lock);
    slot = host_slot_locked(bytesize);
    if (slot == NULL) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            slot->addr = (uintptr_t)p;
            slot->size = bytesize;
            slot->flags = Flags;
            slot->registered = 0;
            g_host_bytes += bytesize;
            *pp = p;
        }
    }
    pthread_mutex_unlock(&g_host_lock);
    return rc;
}

CUresult impl_cuMemAllocHost_v2(void **pp, size_t bytesize) {
    return impl_cuMemHostAlloc(pp, bytesize, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
}

#define REGISTER_FLAGS                                                                         \
    (CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_IOMEMORY | \
     CU_MEMHOSTREGISTER_READ_ONLY)

CUresult impl_cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
    unsigned long long addr = (uintptr_t)p;
    struct host_block *slot;
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (p == NULL || bytesize == 0 || (Flags & ~REGISTER_FLAGS) != 0 || addr + bytesize < addr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_host_lock);
    for (i = 0; i < HOST_MAX_ALLOCATIONS; i++) {
        struct host_block *b = &g_host[i];
        if (b->addr != 0 && addr < b->addr + b->size && b->addr < addr + bytesize) {
            rc = CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
        }
    }
    slot = rc == CUDA_SUCCESS ? host_slot_locked(bytesize) : NULL;
    if (rc == CUDA_SUCCESS && slot == NULL) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (rc == CUDA_SUCCESS) {
        slot->addr = addr;
        slot->size = bytesize;
        /* The DEVICEMAP bits of both APIs are the same: the range is mapped. */
        slot->flags = Flags & CU_MEMHOSTREGISTER_DEVICEMAP ? CU_MEMHOSTALLOC_DEVICEMAP : 0;
        slot->registered = 1;
        g_host_bytes += bytesize;
    }
    pthread_mutex_unlock(&g_host_lock);
    return rc;
}

CUresult impl_cuMemHostUnregister(void *p) {
    struct host_block *b;
    CUresult rc = CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    pthread_mutex_lock(&g_host_lock);
    b = host_find_locked((uintptr_t)p, 1);
    if (b != NULL && b->registered) {
        g_host_bytes -= b->size;
        memset(b, 0, sizeof *b);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_host_lock);
    return rc;
}

CUresult impl_cuMemHostGetDevicePointer_v2(CUdeviceptr *pdptr, void *p, unsigned int Flags) {
    struct host_block *b;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (pdptr == NULL || Flags != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&g_host_lock);
    b = host_find_locked((uintptr_t)p, 0);
    if (b != NULL && (b->flags & CU_MEMHOSTALLOC_DEVICEMAP)) {
        *pdptr = (uintptr_t)p;
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_host_lock);
    return rc;
}

CUresult impl_cuMemFreeHost(void *p) {
    struct host_block *b;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    pthread_mutex_lock(&g_host_lock);
    b = host_find_locked((uintptr_t)p, 1);
    if (b != NULL && !b->registered) {
        munmap(p, b->size);
        g_host_bytes -= b->size;
        memset(b, 0, sizeof *b);
        rc = CUDA_SUCCESS;
    }
    pthread_mutex_unlock(&g_host_lock);
    return rc;
}

/* Writes an attribute of `width` bytes. */
static void put(void *data, unsigned long long value, size_t width) {
    if (width == sizeof(unsigned int)) {
        unsigned int v = (unsigned int)value;
        memcpy(data, &v, sizeof v);
    } else {
        memcpy(data, &value, sizeof value);
    }
}

CUresult impl_cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    unsigned long long base = 0, size = 0;
    int device = 0, host;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    if (data == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    host = double_host_range(ptr, &base, &size);
    if (!host && !double_device_range(ptr, &base, &size, &device)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    switch (attribute) {
    case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
        put(data, host ? CU_MEMORYTYPE_HOST : CU_MEMORYTYPE_DEVICE, sizeof(unsigned int));
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_POINTER:
    case CU_POINTER_ATTRIBUTE_RANGE_START_ADDR:
        put(data, attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER ? ptr : base, 8);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_HOST_POINTER:
        if (!host) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        put(data, ptr, 8);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_RANGE_SIZE:
        put(data, size, 8);
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_IS_MANAGED:
    case CU_POINTER_ATTRIBUTE_MAPPED:
        put(data, attribute == CU_POINTER_ATTRIBUTE_MAPPED, sizeof(int));
        return CUDA_SUCCESS;
    case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
        put(data, (unsigned long long)device, sizeof(int));
        return CUDA_SUCCESS;
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

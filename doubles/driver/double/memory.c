/*
 * Device memory of the double (the model is in cuda.c): what each GPU holds
 * for the process and whether more fits, the records of its allocations at
 * their fake addresses, and the allocation entry points: memory info, linear
 * allocations, arrays and mipmapped arrays, and the address ranges
 * host_memory.c asks about (VMM memory, mapped by vmm.c, answers too).
 */
#include "double_internal.h"

/* a + b, or ~0 when that overflows (then it fits nowhere). */
unsigned long long add_sat(unsigned long long a, unsigned long long b) {
    return a > ~0ULL - b ? ~0ULL : a + b;
}

/* What the limits hold above their defaults (see the model in cuda.c). */
unsigned long long limit_bytes(const size_t *limits) {
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

unsigned long long context_bytes(int dev) {
    const struct device *d = &g_devices[dev];
    return (unsigned long long)(d->live_contexts - d->live_green) * g_config.context_bytes +
           (unsigned long long)d->live_green * g_config.green_context_bytes;
}

/* Driver-held bytes on dev besides the contexts'. */
unsigned long long held_bytes(int dev) {
    const struct device *d = &g_devices[dev];
    unsigned long long held = add_sat(limit_bytes(d->limits), d->module_bytes);
    held = add_sat(held, d->graph_bytes);
    held = add_sat(held, d->graph_retained);
    return add_sat(held, pools_retained(dev));
}

/* Everything the process holds on dev. */
unsigned long long used_bytes(int dev) {
    return add_sat(add_sat(context_bytes(dev), g_devices[dev].alloc_bytes), held_bytes(dev));
}

/* Whether `size` more bytes fit on dev: the one check of every charge, each
 * made right after it. With the node file (node.c) the growth must fit the
 * GPU's shared used too, and is reserved there; the unlock settles it. */
int fits(int dev, unsigned long long size) {
    return size <= g_config.total && used_bytes(dev) <= g_config.total - size &&
           node_reserve_locked(dev, used_bytes(dev) + size);
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

void forget_locked(int dev, struct record *r) {
    struct device *d = &g_devices[dev];
    r->live = 0;
    d->alloc_bytes -= r->size;
    d->live--;
    if (r->pool) {
        g_pools[r->pool - 1].used -= r->size;
    }
}

/* After frees: restart the bump when nothing is left, or drop dead records. */
void tidy_locked(int dev) {
    struct device *d = &g_devices[dev];
    if (d->live == 0) {
        d->len = 0;
        d->next = region_start(dev);
    } else if (d->len > 64 && d->live < d->len / 2) {
        compact_locked(d);
    }
}

CUresult alloc_locked(int dev, CUcontext ctx, unsigned long long size, enum kind kind,
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
    d->records[d->len].pool = 0;
    d->records[d->len].managed = 0;
    d->len++;
    d->live++;
    d->alloc_bytes += size;
    *addr = d->next;
    d->next += span;
    return CUDA_SUCCESS;
}

/* The live record that starts at (exact) or contains addr, or NULL. */
struct record *find_locked(unsigned long long addr, int exact, int *dev_out) {
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
CUresult bump_locked(unsigned long long *next, unsigned long long end,
                     unsigned long long size, unsigned long long *addr) {
    unsigned long long span = (size + ADDRESS_ALIGN - 1) & ~(ADDRESS_ALIGN - 1);
    if (span < size || span > end - *next) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *addr = *next;
    *next += span;
    return CUDA_SUCCESS;
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
    CUdevice dev = 0;
    CUresult rc;
    if (dptr == NULL || (flags != CU_MEM_ATTACH_GLOBAL && flags != CU_MEM_ATTACH_HOST)) {
        return reject_current();
    }
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS) {
        rc = alloc_locked(dev, t_current, bytesize, KIND_POINTER, dptr);
    }
    if (rc == CUDA_SUCCESS) {
        g_devices[dev].records[g_devices[dev].len - 1].managed = 1; /* the one just added */
    }
    unlock();
    return rc;
}

/* Whether a managed allocation is live (checkpoint.c refuses then). */
int managed_live_locked(void) {
    int dev;
    size_t i;
    for (dev = 0; dev < g_config.devices; dev++) {
        for (i = 0; i < g_devices[dev].len; i++) {
            if (g_devices[dev].records[i].live && g_devices[dev].records[i].managed) {
                return 1;
            }
        }
    }
    return 0;
}

/* GPUSHARE_DOUBLE_FAIL_FREES=N: the first N cuMemFree_v2 and (uncaptured)
 * cuMemFreeAsync calls of the process fail with CUDA_ERROR_ILLEGAL_ADDRESS
 * and free nothing (a sticky error in the real driver), so tests can see a
 * failed free keep its charge. */
static long g_fail_frees = -1;

/* Whether this free is one of the first N (cuMemFreeAsync counts too). */
int free_fails(void) {
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
    } else {
        found = vmm_range_locked(addr, base, size, device);
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

/*
 * The driver's virtual memory management (VMM) API in the double (the model
 * is in cuda.c): address ranges reserved, physical memory created on a GPU,
 * mapped into a range and made accessible, with real contents.
 *
 * - cuMemAddressReserve(ptr, size, alignment, addr, flags): size a multiple
 *   of the granularity (2 MiB), alignment 0 or a power of two, flags 0;
 *   the range comes from a 1 TiB region of its own, after the GPUs' regions
 *   in the address space reserved at load (so copies tell it from host
 *   memory), at the hint `addr` when that is free there, else at the
 *   lowest free address. cuMemAddressFree(ptr, size) takes back exactly a
 *   reserved range, once nothing is mapped in it.
 * - cuMemCreate(handle, size, prop, 0): pinned device memory of a multiple
 *   of the granularity on the GPU prop names, charged to the process on
 *   that GPU like an allocation (cuMemGetInfo, NVML), with host pages that
 *   hold its contents (lazily backed). cuMemRelease drops a reference; the
 *   memory and its charge go with the last reference and the last mapping,
 *   as the real driver keeps released memory while it is mapped.
 *   cuMemRetainAllocationHandle(handle, addr) takes one more reference on
 *   the memory mapped at addr.
 * - Shareable handles: prop->requestedHandleTypes 0, or
 *   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (1), whose memory keeps its
 *   contents in a memfd named MEMFD_NAME<GPU> (the fake GPU's NVML index),
 *   mapped shared; any other type is CUDA_ERROR_NOT_SUPPORTED.
 *   cuMemExportToShareableHandle(&fd, handle, 1, 0) writes a new
 *   close-on-exec descriptor of that memfd (memory made without type 1, any
 *   other type, flags or an unknown handle: CUDA_ERROR_INVALID_VALUE, as
 *   the driver refuses). cuMemImportFromShareableHandle(&handle,
 *   (void *)(intptr_t)fd, 1) takes such a descriptor, from this process or
 *   another (its size from fstat, its GPU from the name, which must be
 *   ours: else CUDA_ERROR_INVALID_VALUE, or CUDA_ERROR_INVALID_DEVICE for a
 *   GPU this process does not see), and makes memory of one reference that
 *   maps, copies, exports again and releases like created memory, over the
 *   same bytes as the exporter's. It is not charged here: the real driver
 *   charges the exporter, and NVML shows it there; the exporter's charge
 *   goes with the exporter's last reference and mapping, the bytes with the
 *   last holder. The caller keeps its descriptor (the import takes a
 *   duplicate); imported handles are IMPORTED_HANDLE_BASE + n, no record.
 *   The Windows and fabric types are CUDA_ERROR_NOT_SUPPORTED to import.
 * - Legacy IPC (cuIpcGetMemHandle, cuIpcOpenMemHandle(_v2),
 *   cuIpcCloseMemHandle) is not modelled: after the init and NULL checks,
 *   cuIpcGetMemHandle answers CUDA_ERROR_INVALID_VALUE for an address in
 *   the VMM region (the real driver refuses VMM memory) and
 *   CUDA_ERROR_NOT_SUPPORTED for any other, so no handle of it exists, and
 *   cuIpcOpenMemHandle(_v2) and cuIpcCloseMemHandle answer
 *   CUDA_ERROR_INVALID_VALUE.
 * - cuMemMap(ptr, size, offset, handle, 0): size and offset multiples of the
 *   granularity, within the memory; [ptr, ptr + size) within one reserved
 *   range and over no other mapping. A new mapping has no access.
 *   cuMemUnmap(ptr, size) takes whole mappings (a range that cuts one, or
 *   holds an unmapped byte, is CUDA_ERROR_INVALID_VALUE) and their access.
 * - cuMemSetAccess(ptr, size, desc, count): read (1) or read-write (3), or
 *   none (0), per GPU, on whole mappings as cuMemUnmap takes them;
 *   cuMemGetAccess answers a GPU's flags at an address.
 * - Copies and sets (copies.c) into or out of a mapped range move real
 *   bytes; one that touches an unmapped byte of the region is
 *   CUDA_ERROR_INVALID_VALUE (no memory there, as for any unknown address),
 *   one that reads without read access or writes without read-write access
 *   for the calling context's GPU is CUDA_ERROR_ILLEGAL_ADDRESS (the copy
 *   engine faults). cuMemGetAddressRange_v2 and cuPointerGetAttribute answer
 *   for a mapped address with its mapping, as device memory of its GPU.
 *
 * GPUSHARE_DOUBLE_FAIL_VMM names calls that fail, comma-separated: `cuMemMap`
 * (every call) or `cuMemMap@3` (its third call only, counted from 1), for
 * cuMemAddressReserve, cuMemCreate (CUDA_ERROR_OUT_OF_MEMORY), cuMemMap,
 * cuMemSetAccess and cuMemUnmap (CUDA_ERROR_NOT_SUPPORTED; the mapping
 * stays), so that tests see a caller cope with a driver that cannot back
 * its memory, or give it back.
 */
#include "double_internal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define VMM_MAX_RANGES 4096
#define VA_BASE (REGION_BASE + DOUBLE_MAX_DEVICES * REGION_SIZE)
#define VA_SIZE REGION_SIZE
#define ACCESS_READ 1
#define ACCESS_READWRITE 3
/* The memfd of shareable memory: this, then the GPU's NVML index. */
#define MEMFD_NAME "gpushare-double-vmm-dev"
/* Handles of imported memory: above every user-space address, so never a
 * record's address in memory.c. */
#define IMPORTED_HANDLE_BASE (1ULL << 63)

struct reserved {
    unsigned long long addr; /* 0: free entry */
    unsigned long long size;
};

struct physical {
    unsigned long long handle; /* 0: free entry; else the record's address in
                                  memory.c, or an imported handle */
    unsigned long long size;
    int device;
    int fd;            /* the memfd of shareable memory; -1: none */
    int imported;      /* charged to its exporter, not to this process */
    unsigned refs;     /* cuMemCreate's (or the import's), plus each
                          cuMemRetainAllocationHandle */
    unsigned mappings; /* live mappings of it */
    unsigned char *bytes;
};

struct mapped {
    unsigned long long addr; /* 0: free entry */
    unsigned long long size;
    unsigned long long offset; /* into the physical memory */
    struct physical *memory;
    unsigned char access[DOUBLE_MAX_DEVICES]; /* per GPU: 0, ACCESS_READ, ACCESS_READWRITE */
};

/* All under g_lock (lock()). */
static struct reserved g_reserved[VMM_MAX_RANGES];
static struct physical g_physical[VMM_MAX_RANGES];
static struct mapped g_mapped[VMM_MAX_RANGES];
static unsigned long long g_imports; /* imports so far: the next handle */

/* ---------------------------------------------------------------- injected failures */

enum vmm_call { CALL_RESERVE, CALL_CREATE, CALL_MAP, CALL_SET_ACCESS, CALL_UNMAP, CALL_COUNT };

static const char *const g_call_names[CALL_COUNT] = {"cuMemAddressReserve", "cuMemCreate",
                                                     "cuMemMap", "cuMemSetAccess", "cuMemUnmap"};
static const CUresult g_call_errors[CALL_COUNT] = {
    CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_SUPPORTED};

/* Per call: -1 not read yet, 0 never fails, ~0 always, N the N-th call only. */
static long long g_fail_at[CALL_COUNT] = {-1, -1, -1, -1, -1};
static unsigned long long g_calls[CALL_COUNT];

static void read_failures_locked(void) {
    const char *text = getenv("GPUSHARE_DOUBLE_FAIL_VMM");
    int i;
    for (i = 0; i < CALL_COUNT; i++) {
        g_fail_at[i] = 0;
    }
    while (text != NULL && *text != '\0') {
        size_t len = strcspn(text, ",");
        for (i = 0; i < CALL_COUNT; i++) {
            size_t name = strlen(g_call_names[i]);
            if (len >= name && strncmp(text, g_call_names[i], name) == 0) {
                if (len == name) {
                    g_fail_at[i] = ~0LL;
                } else if (text[name] == '@') {
                    g_fail_at[i] = strtoll(text + name + 1, NULL, 10);
                }
            }
        }
        text += len + (text[len] == ',');
    }
}

/* CUDA_SUCCESS, or the injected failure of this call of `call`. */
static CUresult injected_locked(enum vmm_call call) {
    unsigned long long n;
    if (g_fail_at[call] < 0) {
        read_failures_locked();
    }
    n = ++g_calls[call];
    if (g_fail_at[call] == ~0LL || (g_fail_at[call] > 0 && n == (unsigned long long)g_fail_at[call])) {
        return g_call_errors[call];
    }
    return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- lookups */

static int overlaps(unsigned long long a, unsigned long long a_size, unsigned long long b,
                    unsigned long long b_size) {
    return a < b + b_size && b < a + a_size;
}

static struct reserved *reserved_holding_locked(unsigned long long addr,
                                                unsigned long long size) {
    size_t i;
    for (i = 0; i < VMM_MAX_RANGES; i++) {
        struct reserved *r = &g_reserved[i];
        if (r->addr != 0 && addr >= r->addr && size <= r->size &&
            addr - r->addr <= r->size - size) {
            return r;
        }
    }
    return NULL;
}

static struct physical *physical_locked(unsigned long long handle) {
    size_t i;
    for (i = 0; i < VMM_MAX_RANGES; i++) {
        if (handle != 0 && g_physical[i].handle == handle && g_physical[i].refs > 0) {
            return &g_physical[i];
        }
    }
    return NULL;
}

static struct mapped *mapped_at_locked(unsigned long long addr) {
    size_t i;
    for (i = 0; i < VMM_MAX_RANGES; i++) {
        struct mapped *m = &g_mapped[i];
        if (m->addr != 0 && addr >= m->addr && addr - m->addr < m->size) {
            return m;
        }
    }
    return NULL;
}

/* Whether [addr, addr + size) is exactly whole mappings, back to back. */
static int whole_mappings_locked(unsigned long long addr, unsigned long long size) {
    unsigned long long at = addr;
    size_t i;
    if (size == 0 || addr + size < addr) {
        return 0;
    }
    while (at < addr + size) {
        struct mapped *m = mapped_at_locked(at);
        if (m == NULL || m->addr != at || m->size > addr + size - at) {
            return 0;
        }
        at += m->size;
    }
    for (i = 0; i < VMM_MAX_RANGES; i++) { /* nothing sticks out at either end */
        struct mapped *m = &g_mapped[i];
        if (m->addr != 0 && overlaps(m->addr, m->size, addr, size) &&
            (m->addr < addr || m->addr + m->size > addr + size)) {
            return 0;
        }
    }
    return 1;
}

int vmm_space(unsigned long long addr) {
    return addr >= VA_BASE && addr - VA_BASE < VA_SIZE;
}

/* ---------------------------------------------------------------- physical memory */

/* Takes back the charge of the handle's record in memory.c. */
static void forget_handle_locked(unsigned long long handle) {
    int dev = 0;
    struct record *r = find_locked(handle, 1, &dev);
    if (r != NULL) {
        forget_locked(dev, r);
        tidy_locked(dev);
    }
}

static void destroy_locked(struct physical *p) {
    if (!p->imported) {
        forget_handle_locked(p->handle);
    }
    munmap(p->bytes, p->size);
    if (p->fd >= 0) {
        close(p->fd);
    }
    memset(p, 0, sizeof *p);
}

static struct physical *free_physical_locked(void) {
    size_t i;
    for (i = 0; i < VMM_MAX_RANGES; i++) {
        if (g_physical[i].handle == 0) {
            return &g_physical[i];
        }
    }
    return NULL;
}

/* Host pages for the contents of size bytes on GPU gpu: private and
 * anonymous, or (shareable) a new memfd's, whose descriptor goes to *fd
 * (else -1). NULL when the host has none. */
static unsigned char *contents_new(unsigned long long size, int shareable, int gpu, int *fd) {
    char name[64];
    void *bytes;
    *fd = -1;
    if (!shareable) {
        bytes = mmap(NULL, size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        return bytes == MAP_FAILED ? NULL : bytes;
    }
    snprintf(name, sizeof name, MEMFD_NAME "%d", gpu);
    *fd = memfd_create(name, MFD_CLOEXEC);
    if (*fd < 0) {
        return NULL;
    }
    bytes = ftruncate(*fd, (off_t)size) != 0
                ? MAP_FAILED
                : mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, *fd, 0);
    if (bytes == MAP_FAILED) {
        close(*fd);
        *fd = -1;
        return NULL;
    }
    return bytes;
}

CUresult impl_cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                          const CUmemAllocationProp *prop, unsigned long long flags) {
    struct physical *slot = NULL;
    unsigned long long addr = 0;
    CUresult rc;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (handle == NULL || prop == NULL || flags != 0 || size == 0 ||
               prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
               prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || size % GRANULARITY != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (!valid_device(prop->location.id)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE &&
               prop->requestedHandleTypes != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        rc = CUDA_ERROR_NOT_SUPPORTED;
    } else if ((rc = injected_locked(CALL_CREATE)) != CUDA_SUCCESS) {
        /* the injected failure */
    } else {
        slot = free_physical_locked();
        rc = slot == NULL ? CUDA_ERROR_OUT_OF_MEMORY
                          : alloc_locked(prop->location.id, NULL, size, KIND_HANDLE, &addr);
    }
    if (rc == CUDA_SUCCESS) {
        int shareable = prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        int fd;
        unsigned char *bytes = contents_new(size, shareable, device_gpu(prop->location.id), &fd);
        if (bytes == NULL) {
            forget_handle_locked(addr);
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            slot->handle = addr;
            slot->size = size;
            slot->device = prop->location.id;
            slot->fd = fd;
            slot->imported = 0;
            slot->refs = 1;
            slot->mappings = 0;
            slot->bytes = bytes;
            *handle = addr;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemRelease(CUmemGenericAllocationHandle handle) {
    struct physical *p;
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if ((p = physical_locked(handle)) == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (--p->refs == 0 && p->mappings == 0) {
        destroy_locked(p);
    }
    unlock();
    return rc;
}

CUresult impl_cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *handle, void *addr) {
    struct mapped *m;
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (handle == NULL || (m = mapped_at_locked((uintptr_t)addr)) == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        m->memory->refs++;
        *handle = m->memory->handle;
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- shareable handles */

CUresult impl_cuMemExportToShareableHandle(void *shareableHandle,
                                           CUmemGenericAllocationHandle handle,
                                           CUmemAllocationHandleType handleType,
                                           unsigned long long flags) {
    struct physical *p;
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (shareableHandle == NULL || flags != 0 ||
               handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
               (p = physical_locked(handle)) == NULL || p->fd < 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        int fd = fcntl(p->fd, F_DUPFD_CLOEXEC, 0);
        if (fd < 0) {
            rc = CUDA_ERROR_OPERATING_SYSTEM; /* out of descriptors */
        } else {
            memcpy(shareableHandle, &fd, sizeof fd);
        }
    }
    unlock();
    return rc;
}

/* The ordinal of the GPU that the memfd fd was made for, from its name
 * (CUDA_SUCCESS); CUDA_ERROR_INVALID_VALUE for any other descriptor,
 * CUDA_ERROR_INVALID_DEVICE for a GPU this process does not see. */
static CUresult memfd_device(int fd, int *device) {
    static const char prefix[] = "/memfd:" MEMFD_NAME;
    char path[64], target[256];
    const char *digits = target + sizeof prefix - 1;
    char *end = NULL;
    ssize_t n;
    long gpu;
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    n = readlink(path, target, sizeof target - 1);
    if (n < 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    target[n] = '\0';
    if (strncmp(target, prefix, sizeof prefix - 1) != 0 || *digits < '0' || *digits > '9') {
        return CUDA_ERROR_INVALID_VALUE;
    }
    gpu = strtol(digits, &end, 10);
    if (strcmp(end, " (deleted)") != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (*device = 0; valid_device(*device); (*device)++) {
        if (device_gpu(*device) == gpu) {
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_INVALID_DEVICE;
}

/* Imported memory over the bytes of the memfd fd (the caller's, kept open). */
static CUresult import_locked(int fd, CUmemGenericAllocationHandle *handle) {
    struct physical *slot;
    struct stat st;
    int device = 0, own;
    void *bytes;
    CUresult rc;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= 0 ||
        (unsigned long long)st.st_size % GRANULARITY != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if ((rc = memfd_device(fd, &device)) != CUDA_SUCCESS) {
        return rc;
    }
    if ((slot = free_physical_locked()) == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    own = fcntl(fd, F_DUPFD_CLOEXEC, 0); /* to export it again */
    if (own < 0) {
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    bytes = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, own, 0);
    if (bytes == MAP_FAILED) {
        close(own);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    slot->handle = IMPORTED_HANDLE_BASE + ++g_imports;
    slot->size = (unsigned long long)st.st_size;
    slot->device = device;
    slot->fd = own;
    slot->imported = 1;
    slot->refs = 1;
    slot->mappings = 0;
    slot->bytes = bytes;
    *handle = slot->handle;
    return CUDA_SUCCESS;
}

CUresult impl_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                             CUmemAllocationHandleType shHandleType) {
    CUresult rc;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (handle == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (shHandleType == CU_MEM_HANDLE_TYPE_WIN32 ||
               shHandleType == CU_MEM_HANDLE_TYPE_WIN32_KMT ||
               shHandleType == CU_MEM_HANDLE_TYPE_FABRIC) {
        rc = CUDA_ERROR_NOT_SUPPORTED;
    } else if (shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        rc = import_locked((int)(intptr_t)osHandle, handle);
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- legacy IPC */

CUresult impl_cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr) {
    CUresult rc;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pHandle == NULL || dptr == 0 || vmm_space(dptr)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        rc = CUDA_ERROR_NOT_SUPPORTED;
    }
    unlock();
    return rc;
}

/* No handle was made here (cuIpcGetMemHandle makes none), so none opens. */
static CUresult ipc_open(CUdeviceptr *pdptr) {
    CUresult rc;
    lock();
    (void)pdptr;
    rc = !g_initialized ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    unlock();
    return rc;
}

CUresult impl_cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int Flags) {
    (void)handle;
    (void)Flags;
    return ipc_open(pdptr);
}

CUresult impl_cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle,
                                    unsigned int Flags) {
    (void)handle;
    (void)Flags;
    return ipc_open(pdptr);
}

CUresult impl_cuIpcCloseMemHandle(CUdeviceptr dptr) {
    CUresult rc;
    (void)dptr;
    lock();
    rc = !g_initialized ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    unlock();
    return rc;
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

/* ---------------------------------------------------------------- address ranges */

/* The lowest free address of the region for size bytes aligned to align, or 0. */
static unsigned long long free_range_locked(unsigned long long size, unsigned long long align) {
    unsigned long long at = VA_BASE;
    size_t i;
    int moved = 1;
    while (moved) {
        moved = 0;
        if (size > VA_SIZE || at - VA_BASE > VA_SIZE - size) {
            return 0;
        }
        for (i = 0; i < VMM_MAX_RANGES; i++) {
            struct reserved *r = &g_reserved[i];
            if (r->addr != 0 && overlaps(r->addr, r->size, at, size)) {
                at = (r->addr + r->size + align - 1) & ~(align - 1);
                moved = 1;
            }
        }
    }
    return at;
}

static int range_free_locked(unsigned long long addr, unsigned long long size) {
    size_t i;
    if (!vmm_space(addr) || size > VA_SIZE || addr - VA_BASE > VA_SIZE - size) {
        return 0;
    }
    for (i = 0; i < VMM_MAX_RANGES; i++) {
        if (g_reserved[i].addr != 0 && overlaps(g_reserved[i].addr, g_reserved[i].size, addr, size)) {
            return 0;
        }
    }
    return 1;
}

CUresult impl_cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                  CUdeviceptr addr, unsigned long long flags) {
    unsigned long long align = alignment > GRANULARITY ? alignment : GRANULARITY;
    struct reserved *slot = NULL;
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (ptr == NULL || size == 0 || size % GRANULARITY != 0 || flags != 0 ||
               (alignment & (alignment - 1)) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((rc = injected_locked(CALL_RESERVE)) == CUDA_SUCCESS) {
        unsigned long long at =
            addr != 0 && addr % align == 0 && range_free_locked(addr, size)
                ? addr
                : free_range_locked(size, align);
        for (i = 0; i < VMM_MAX_RANGES && slot == NULL; i++) {
            if (g_reserved[i].addr == 0) {
                slot = &g_reserved[i];
            }
        }
        if (at == 0 || slot == NULL) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            slot->addr = at;
            slot->size = size;
            *ptr = at;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    struct reserved *r;
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    lock();
    r = reserved_holding_locked(ptr, size);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (r == NULL || r->addr != ptr || r->size != size) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (i = 0; i < VMM_MAX_RANGES; i++) {
            if (g_mapped[i].addr != 0 && overlaps(g_mapped[i].addr, g_mapped[i].size, ptr, size)) {
                rc = CUDA_ERROR_INVALID_VALUE; /* still mapped */
            }
        }
        if (rc == CUDA_SUCCESS) {
            memset(r, 0, sizeof *r);
        }
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- mappings */

CUresult impl_cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                       CUmemGenericAllocationHandle handle, unsigned long long flags) {
    struct physical *p;
    struct mapped *slot = NULL;
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    lock();
    p = physical_locked(handle);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (flags != 0 || size == 0 || size % GRANULARITY != 0 || ptr % GRANULARITY != 0 ||
               offset % GRANULARITY != 0 || reserved_holding_locked(ptr, size) == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (p == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (offset > p->size || size > p->size - offset) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (i = 0; i < VMM_MAX_RANGES; i++) {
            if (g_mapped[i].addr == 0) {
                slot = slot == NULL ? &g_mapped[i] : slot;
            } else if (overlaps(g_mapped[i].addr, g_mapped[i].size, ptr, size)) {
                rc = CUDA_ERROR_INVALID_VALUE; /* already mapped */
            }
        }
        if (rc == CUDA_SUCCESS) {
            rc = slot == NULL ? CUDA_ERROR_OUT_OF_MEMORY : injected_locked(CALL_MAP);
        }
        if (rc == CUDA_SUCCESS) {
            memset(slot, 0, sizeof *slot);
            slot->addr = ptr;
            slot->size = size;
            slot->offset = offset;
            slot->memory = p;
            p->mappings++;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemUnmap(CUdeviceptr ptr, size_t size) {
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!whole_mappings_locked(ptr, size)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((rc = injected_locked(CALL_UNMAP)) == CUDA_SUCCESS) {
        for (i = 0; i < VMM_MAX_RANGES; i++) {
            struct mapped *m = &g_mapped[i];
            if (m->addr != 0 && overlaps(m->addr, m->size, ptr, size)) {
                struct physical *p = m->memory;
                memset(m, 0, sizeof *m);
                if (--p->mappings == 0 && p->refs == 0) {
                    destroy_locked(p);
                }
            }
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                             size_t count) {
    CUresult rc = CUDA_SUCCESS;
    size_t i, k;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (desc == NULL || count == 0 || !whole_mappings_locked(ptr, size)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        for (k = 0; k < count && rc == CUDA_SUCCESS; k++) {
            if (desc[k].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
                !valid_device(desc[k].location.id) ||
                (desc[k].flags != 0 && desc[k].flags != ACCESS_READ &&
                 desc[k].flags != ACCESS_READWRITE)) {
                rc = CUDA_ERROR_INVALID_VALUE;
            }
        }
        if (rc == CUDA_SUCCESS) {
            rc = injected_locked(CALL_SET_ACCESS);
        }
        for (i = 0; i < VMM_MAX_RANGES && rc == CUDA_SUCCESS; i++) {
            struct mapped *m = &g_mapped[i];
            if (m->addr != 0 && overlaps(m->addr, m->size, ptr, size)) {
                for (k = 0; k < count; k++) {
                    m->access[desc[k].location.id] = (unsigned char)desc[k].flags;
                }
            }
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemGetAccess(unsigned long long *flags, const CUmemLocation *location,
                             CUdeviceptr ptr) {
    struct mapped *m;
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (flags == NULL || location == NULL ||
               location->type != CU_MEM_LOCATION_TYPE_DEVICE || !valid_device(location->id) ||
               (m = mapped_at_locked(ptr)) == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        *flags = m->access[location->id];
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- for the other files */

int vmm_range_locked(unsigned long long addr, unsigned long long *base, unsigned long long *size,
                     int *device) {
    struct mapped *m = mapped_at_locked(addr);
    if (m == NULL) {
        return 0;
    }
    *base = m->addr;
    *size = m->size;
    *device = m->memory->device;
    return 1;
}

CUresult vmm_check_locked(unsigned long long addr, unsigned long long bytes, int dev, int write) {
    unsigned long long at = addr;
    unsigned char need = write ? ACCESS_READWRITE : ACCESS_READ;
    if (addr + bytes < addr) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    while (at < addr + bytes) {
        struct mapped *m = mapped_at_locked(at);
        if (m == NULL) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if ((m->access[dev] & need) != need) {
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
        at = m->addr + m->size;
    }
    return CUDA_SUCCESS;
}

void vmm_move_locked(unsigned long long addr, void *host, unsigned long long bytes, int write) {
    unsigned char *h = host;
    while (bytes > 0) {
        struct mapped *m = mapped_at_locked(addr);
        unsigned long long into = addr - m->addr;
        unsigned long long n = m->size - into < bytes ? m->size - into : bytes;
        unsigned char *d = m->memory->bytes + m->offset + into;
        if (write) {
            memcpy(d, h, n);
        } else {
            memcpy(h, d, n);
        }
        addr += n;
        h += n;
        bytes -= n;
    }
}

void vmm_fill_locked(unsigned long long addr, unsigned value, unsigned width,
                     unsigned long long bytes) {
    unsigned char pattern[4];
    unsigned char chunk[4096];
    unsigned long long i;
    memcpy(pattern, &value, sizeof pattern);
    for (i = 0; i < sizeof chunk; i++) {
        chunk[i] = pattern[i % width];
    }
    while (bytes > 0) {
        unsigned long long n = bytes < sizeof chunk ? bytes : sizeof chunk;
        vmm_move_locked(addr, chunk, n, 1);
        addr += n;
        bytes -= n;
    }
}

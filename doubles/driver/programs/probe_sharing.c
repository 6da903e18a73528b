/*
 * cudaprobe's shared memory commands: legacy IPC handles (ipc-export,
 * ipc-open, ipc-close) and VMM memory with POSIX file descriptor handles
 * (vmm-alloc, vmm-export, vmm-import). What they open, allocate or import
 * takes an allocation ID of probe_memory.c, so write, check, ptr, free and
 * freeall work on it. The format is described in cudaprobe.c.
 */
#include "probe.h"

#include <fcntl.h>
#include <sys/stat.h>

/* The descriptor the last vmm-export printed: vmm-import's "last". */
static int last_exported = -1;

/* ---------------------------------------------------------------- legacy IPC */

static int hex_digit(char c, unsigned *value) {
    if (c >= '0' && c <= '9') {
        *value = (unsigned)(c - '0');
    } else if (c >= 'a' && c <= 'f') {
        *value = (unsigned)(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
        *value = (unsigned)(c - 'A' + 10);
    } else {
        return 0;
    }
    return 1;
}

int parse_ipc_handle(const char *text, CUipcMemHandle *handle) {
    size_t i;
    if (text == NULL || strlen(text) != IPC_HEX_DIGITS) {
        return 0;
    }
    for (i = 0; i < CU_IPC_HANDLE_SIZE; i++) {
        unsigned high, low;
        if (!hex_digit(text[2 * i], &high) || !hex_digit(text[2 * i + 1], &low)) {
            return 0;
        }
        handle->reserved[i] = (char)(high << 4 | low);
    }
    return 1;
}

/* The pointer of live ID; dies (status 2) when there is none. */
static unsigned long long live_pointer(const char *id_text, unsigned long long id) {
    unsigned long long pointer = 0;
    size_t size = 0;
    if (!probe_allocation(id, &pointer, &size)) {
        die(2, "unknown ID '%s'", id_text);
    }
    return pointer;
}

void cmd_ipc_export(const char *id_text, unsigned long long id) {
    unsigned long long pointer = live_pointer(id_text, id);
    char hex[IPC_HEX_DIGITS + 1];
    CUipcMemHandle handle;
    CUresult rc;
    size_t i;
    memset(&handle, 0, sizeof handle);
    rc = CU_OPT(cuIpcGetMemHandle, &handle, pointer);
    for (i = 0; i < CU_IPC_HANDLE_SIZE; i++) {
        snprintf(hex + 2 * i, 3, "%02x", (unsigned char)handle.reserved[i]);
    }
    emit("ipc-export %s -> %d handle=%s", id_text, (int)rc, hex);
}

void cmd_ipc_open(const CUipcMemHandle *handle) {
    CUdeviceptr pointer = 0, base = 0;
    size_t size = 0;
    CUresult rc =
        CU_OPT(cuIpcOpenMemHandle_v2, &pointer, *handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (rc != CUDA_SUCCESS) {
        emit("ipc-open -> %d", (int)rc);
        return;
    }
    if (CU_OPT(cuMemGetAddressRange_v2, &base, &size, pointer) != CUDA_SUCCESS || base > pointer ||
        pointer - base > size) {
        size = 0;
    } else {
        size -= (size_t)(pointer - base);
    }
    emit("ipc-open -> %d id=%zu at=0x%llx size=%zu", (int)rc,
         probe_remember(API_IPC_OPEN, pointer, size, 0), pointer, size);
}

void cmd_ipc_close(const char *id_text, unsigned long long id) {
    CUresult rc = CU_OPT(cuIpcCloseMemHandle, live_pointer(id_text, id));
    if (rc == CUDA_SUCCESS) {
        probe_forget(id);
    }
    emit("ipc-close %s -> %d", id_text, (int)rc);
}

/* ---------------------------------------------------------------- VMM */

/* A new range for the size bytes of memory, mapped, the probe's device
 * given read-write access; the first failure, with what it did undone. */
static CUresult map_new(CUmemGenericAllocationHandle memory, size_t size, CUdeviceptr *va) {
    CUmemAccessDesc access;
    CUresult rc = CU_OPT(cuMemAddressReserve, va, size, 0, 0, 0);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    rc = CU_OPT(cuMemMap, *va, size, 0, memory, 0);
    if (rc == CUDA_SUCCESS) {
        memset(&access, 0, sizeof access);
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = device;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        rc = CU_OPT(cuMemSetAccess, *va, size, &access, 1);
        if (rc != CUDA_SUCCESS) {
            (void)CU_OPT(cuMemUnmap, *va, size);
        }
    }
    if (rc != CUDA_SUCCESS) {
        (void)CU_OPT(cuMemAddressFree, *va, size);
    }
    return rc;
}

/* Maps memory, which the command `cmd ARG` got with rc, into a new ID (its
 * reference released when that fails), and reports it. */
static void map_and_report(const char *cmd, const char *arg, CUresult rc,
                           CUmemGenericAllocationHandle memory, size_t size) {
    CUdeviceptr va = 0;
    if (rc == CUDA_SUCCESS) {
        rc = map_new(memory, size, &va);
        if (rc != CUDA_SUCCESS) {
            (void)CU(cuMemRelease)(memory);
        }
    }
    if (rc != CUDA_SUCCESS) {
        emit("%s %s -> %d", cmd, arg, (int)rc);
        return;
    }
    emit("%s %s -> %d id=%zu at=0x%llx size=%zu", cmd, arg, (int)rc,
         probe_remember(API_VMM_MAP, va, size, memory), va, size);
}

void cmd_vmm_alloc(const char *size_text, size_t size) {
    CUmemAllocationProp prop;
    CUmemGenericAllocationHandle memory = 0;
    CUresult rc;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    rc = CU(cuMemCreate)(&memory, size, &prop, 0);
    map_and_report("vmm-alloc", size_text, rc, memory, size);
}

void cmd_vmm_export(const char *id_text, unsigned long long id) {
    enum api_kind api = API_COUNT;
    unsigned long long memory = 0;
    int fd = -1;
    CUresult rc;
    if (!probe_slot(id, &api, &memory)) {
        die(2, "unknown ID '%s'", id_text);
    }
    if (api != API_CREATE && api != API_VMM_MAP) {
        die(2, "vmm-export needs an ID of alloc create, vmm-alloc or vmm-import, not '%s'",
            id_text);
    }
    rc = CU_OPT(cuMemExportToShareableHandle, &fd, memory,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (rc == CUDA_SUCCESS) {
        /* Left open for the process's life, and for a child it starts. */
        int flags = fcntl(fd, F_GETFD);
        if (flags >= 0) {
            (void)fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC);
        }
        last_exported = fd;
    } else {
        fd = -1;
    }
    emit("vmm-export %s -> %d fd=%d", id_text, (int)rc, fd);
}

void cmd_vmm_import(const char *from) {
    CUmemGenericAllocationHandle memory = 0;
    struct stat st;
    size_t size = 0;
    int opened = -1, fd;
    CUresult rc;
    if (strcmp(from, "last") == 0) {
        fd = last_exported;
    } else if (from[0] == '/') {
        fd = opened = open(from, O_RDWR | O_CLOEXEC);
    } else {
        fd = (int)arg_number(from);
    }
    /* The double's memfd has the memory's size; a real driver's descriptor
     * has none, and the mapping then fails. */
    if (fd >= 0 && fstat(fd, &st) == 0 && st.st_size > 0) {
        size = (size_t)st.st_size;
    }
    rc = CU_OPT(cuMemImportFromShareableHandle, &memory, (void *)(intptr_t)fd,
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (opened >= 0) {
        close(opened); /* the caller's to close: the driver keeps its own */
    }
    map_and_report("vmm-import", from, rc, memory, size);
}

CUresult vmm_unmap_slot(unsigned long long pointer, size_t size, unsigned long long memory) {
    /* Released while mapped, as applications do: the unmap lets it go. */
    CUresult rc = CU(cuMemRelease)(memory);
    CUresult unmapped = CU_OPT(cuMemUnmap, pointer, size);
    CUresult freed = CU_OPT(cuMemAddressFree, pointer, size);
    return rc != CUDA_SUCCESS ? rc : unmapped != CUDA_SUCCESS ? unmapped : freed;
}

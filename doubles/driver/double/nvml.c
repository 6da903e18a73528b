/*
 * libnvidia-ml.so.1 of the test double. Each exported `nvmlX` (nvml_entry.S)
 * tail-jumps to `impl_nvmlX` here.
 *
 * The fake GPUs are libcuda.so.1's: when the double's libcuda is loaded in the
 * process, memory and process figures come from its hidden accessor
 * `gpushare_double_state`; otherwise NVML sees the same environment
 * (double_common.h) and reports every GPU unused. Figures are those of this
 * process only: used = its context bytes + its live allocations + its other
 * driver-held bytes, free = total - used, and one compute process (this one)
 * while it holds a context, an allocation or driver-held bytes on the GPU.
 * Except where GPUSHARE_DOUBLE_NODE_FILE names a node file (node.c) that
 * holds the GPU: nvmlDeviceGetMemoryInfo(_v2) then report what the whole
 * node uses, as the real NVML does (used = the file's used bytes of the GPU,
 * free = total - used); the process figures stay this process's.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_min.h"
#include "double_common.h"

/* Each implementation has the type of its entry point in cuda_min.h. */
#define NVML_ENTRIES(X)                                                                 \
    X(nvmlInitWithFlags)                                                                \
    X(nvmlShutdown)                                                                     \
    X(nvmlErrorString)                                                                  \
    X(nvmlDeviceGetCount_v2)                                                            \
    X(nvmlDeviceGetHandleByIndex_v2)                                                    \
    X(nvmlDeviceGetHandleByUUID)                                                        \
    X(nvmlDeviceGetHandleByPciBusId_v2)                                                 \
    X(nvmlDeviceGetUUID)                                                                \
    X(nvmlDeviceGetIndex)                                                               \
    X(nvmlDeviceGetMemoryInfo)                                                          \
    X(nvmlDeviceGetMemoryInfo_v2)                                                       \
    X(nvmlDeviceGetComputeRunningProcesses_v3)
#define DECLARE_IMPL(name) extern __typeof__(name) impl_##name __attribute__((visibility("hidden")));
NVML_ENTRIES(DECLARE_IMPL)
#undef DECLARE_IMPL

/* What NVML reports when a value does not apply (no MIG here). */
#define NVML_VALUE_NOT_AVAILABLE 0xFFFFFFFFU

struct nvmlDevice_st {
    int index;
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned g_init_refs;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static struct double_config g_config;
static struct nvmlDevice_st g_handles[DOUBLE_MAX_DEVICES];
static gpushare_double_state_fn g_cuda_state;
static const char *g_node_path; /* GPUSHARE_DOUBLE_NODE_FILE, NULL when unset */

static void load_config(void) {
    const char *node = getenv(DOUBLE_NODE_FILE_VAR);
    int i;
    g_config = double_config_from_env();
    g_node_path = node != NULL && *node != '\0' ? strdup(node) : NULL;
    for (i = 0; i < DOUBLE_MAX_DEVICES; i++) {
        g_handles[i].index = i;
    }
}

/* libcuda's accessor, once libcuda is loaded; NULL before. */
static gpushare_double_state_fn cuda_state(void) {
    gpushare_double_state_fn fn = __atomic_load_n(&g_cuda_state, __ATOMIC_ACQUIRE);
    void *lib, *sym;
    if (fn != NULL) {
        return fn;
    }
    /* NOLOAD finds it by soname even when it was dlopen'ed RTLD_LOCAL by path;
       the handle is kept, so the accessor stays mapped. */
    lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    sym = dlsym(lib != NULL ? lib : RTLD_DEFAULT, GPUSHARE_DOUBLE_STATE_SYMBOL);
    if (sym == NULL) {
        if (lib != NULL) {
            dlclose(lib);
        }
        return NULL;
    }
    fn = (gpushare_double_state_fn)sym;
    __atomic_store_n(&g_cuda_state, fn, __ATOMIC_RELEASE);
    return fn;
}

/* Device count, and *out for device when it exists. */
static int snapshot(int device, struct gpushare_double_snapshot *out) {
    gpushare_double_state_fn fn = cuda_state();
    pthread_once(&g_once, load_config);
    if (fn != NULL) {
        return fn(device, out);
    }
    if (out != NULL && device >= 0 && device < g_config.devices) {
        memset(out, 0, sizeof *out);
        out->total = g_config.total;
    }
    return g_config.devices;
}

static int initialized(void) {
    unsigned refs;
    pthread_mutex_lock(&g_lock);
    refs = g_init_refs;
    pthread_mutex_unlock(&g_lock);
    return refs > 0;
}

/* The index behind a handle this library handed out, or -1. */
static int handle_index(nvmlDevice_t device) {
    uintptr_t p = (uintptr_t)device, base = (uintptr_t)&g_handles[0];
    if (p < base || p >= (uintptr_t)&g_handles[DOUBLE_MAX_DEVICES] ||
        (p - base) % sizeof g_handles[0] != 0) {
        return -1;
    }
    if (device->index >= snapshot(-1, NULL)) {
        return -1;
    }
    return device->index;
}

/* Common start of the device queries: initialised, known handle, snapshot. */
static nvmlReturn_t device_snapshot(nvmlDevice_t device, struct gpushare_double_snapshot *out) {
    int index;
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    index = handle_index(device);
    if (index < 0) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    snapshot(index, out);
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_once(&g_once, load_config);
    pthread_mutex_lock(&g_lock);
    g_init_refs++;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlShutdown(void) {
    nvmlReturn_t rc = NVML_SUCCESS;
    pthread_mutex_lock(&g_lock);
    if (g_init_refs == 0) {
        rc = NVML_ERROR_UNINITIALIZED;
    } else {
        g_init_refs--;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

const char *impl_nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS:
        return "Success";
    case NVML_ERROR_UNINITIALIZED:
        return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
        return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
        return "Not Supported";
    case NVML_ERROR_NOT_FOUND:
        return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
        return "Insufficient Size";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH:
        return "Argument version mismatch";
    default:
        return "Unknown Error";
    }
}

nvmlReturn_t impl_nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (deviceCount == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *deviceCount = (unsigned int)snapshot(-1, NULL);
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (device == NULL || index >= (unsigned int)snapshot(-1, NULL)) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *device = &g_handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    char text[DOUBLE_UUID_STRING_LEN + 1];
    int i, count;
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (uuid == NULL || device == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    count = snapshot(-1, NULL);
    for (i = 0; i < count; i++) {
        double_uuid_string(i, text);
        if (strcmp(uuid, text) == 0) {
            *device = &g_handles[i];
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t impl_nvmlDeviceGetHandleByPciBusId_v2(const char *pciBusId, nvmlDevice_t *device) {
    int index;
    if (!initialized()) {
        return NVML_ERROR_UNINITIALIZED;
    }
    if (pciBusId == NULL || device == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    index = double_device_from_pci(pciBusId, snapshot(-1, NULL));
    if (index < 0) {
        return NVML_ERROR_NOT_FOUND;
    }
    *device = &g_handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    nvmlReturn_t rc = device_snapshot(device, NULL);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (uuid == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (length < DOUBLE_UUID_STRING_LEN + 1) {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    double_uuid_string(device->index, uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    nvmlReturn_t rc = device_snapshot(device, NULL);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (index == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *index = device->index;
    return NVML_SUCCESS;
}

/* Whether the node file gives GPU gpu's used bytes (into *used): not when
 * it is unset, missing, not a node file, or without such a GPU. */
static int node_used(int gpu, unsigned long long *used) {
    const unsigned char *header;
    struct stat st;
    int fd, found = 0;
    if (g_node_path == NULL || gpu < 0 || gpu >= DOUBLE_NODE_SLOTS) {
        return 0;
    }
    fd = open(g_node_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return 0;
    }
    header = fstat(fd, &st) == 0 && st.st_size >= 4096
                 ? mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0)
                 : MAP_FAILED;
    close(fd);
    if (header == MAP_FAILED) {
        return 0;
    }
    if (__atomic_load_n((const uint64_t *)header, __ATOMIC_ACQUIRE) == DOUBLE_NODE_MAGIC &&
        __atomic_load_n((const uint32_t *)(header + 8), __ATOMIC_ACQUIRE) ==
            DOUBLE_NODE_VERSION &&
        (uint32_t)gpu < __atomic_load_n((const uint32_t *)(header + DOUBLE_NODE_DEVICES_OFFSET),
                                        __ATOMIC_ACQUIRE)) {
        *used = __atomic_load_n((const uint64_t *)(header + DOUBLE_NODE_USED_OFFSET) + gpu,
                                __ATOMIC_ACQUIRE);
        found = 1;
    }
    munmap((void *)header, 4096);
    return found;
}

/* total, free, used of GPU index: the node's with a node file, else this
 * process's. */
static void memory_figures(int index, const struct gpushare_double_snapshot *s,
                           unsigned long long *total, unsigned long long *free,
                           unsigned long long *used) {
    *total = s->total;
    if (!node_used(index, used)) {
        *used = s->context_bytes + s->alloc_bytes + s->driver_bytes;
    }
    *free = *used >= s->total ? 0 : s->total - *used;
}

nvmlReturn_t impl_nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct gpushare_double_snapshot s;
    nvmlReturn_t rc = device_snapshot(device, &s);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (memory == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    memory_figures(device->index, &s, &memory->total, &memory->free, &memory->used);
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    struct gpushare_double_snapshot s;
    nvmlReturn_t rc = device_snapshot(device, &s);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (memory == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (memory->version == 0) {
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    memory->reserved = 0;
    memory_figures(device->index, &s, &memory->total, &memory->free, &memory->used);
    return NVML_SUCCESS;
}

nvmlReturn_t impl_nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device,
                                                          unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos) {
    struct gpushare_double_snapshot s;
    unsigned int needed;
    nvmlReturn_t rc = device_snapshot(device, &s);
    if (rc != NVML_SUCCESS) {
        return rc;
    }
    if (infoCount == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    needed = (s.has_context || s.alloc_bytes > 0 || s.driver_bytes > 0) ? 1 : 0;
    if (*infoCount < needed) {
        *infoCount = needed;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (needed > 0 && infos == NULL) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    *infoCount = needed;
    if (needed > 0) {
        infos[0].pid = (unsigned int)getpid();
        /* GPUSHARE_DOUBLE_NVML_UNAVAILABLE=1: the figure NVML gives when it
         * cannot tell (NVML_VALUE_NOT_AVAILABLE for unsigned long long). */
        const char *unavailable = getenv("GPUSHARE_DOUBLE_NVML_UNAVAILABLE");
        infos[0].usedGpuMemory = unavailable != NULL && unavailable[0] == '1'
                                     ? ~0ULL
                                     : s.context_bytes + s.alloc_bytes + s.driver_bytes;
        infos[0].gpuInstanceId = NVML_VALUE_NOT_AVAILABLE;
        infos[0].computeInstanceId = NVML_VALUE_NOT_AVAILABLE;
    }
    return NVML_SUCCESS;
}

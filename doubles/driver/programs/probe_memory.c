/*
 * cudaprobe's memory commands: alloc, free, ptr, info, totalmem, fill,
 * freeall and hammer through every allocation API, and the NVML queries;
 * the allocation IDs, which probe_sharing.c's commands take too.
 */
#include "probe.h"

struct record {
    enum api_kind api;
    unsigned long long handle; /* CUdeviceptr, allocation handle, or array */
    size_t size;               /* as asked for */
    unsigned long long memory; /* API_VMM_MAP: the allocation handle mapped at handle */
    int live;
};

static struct record *records;
static size_t record_count, record_cap;

size_t probe_remember(enum api_kind api, unsigned long long handle, size_t size,
                      unsigned long long memory) {
    if (record_count == record_cap) {
        size_t cap = record_cap ? record_cap * 2 : 64;
        struct record *grown = realloc(records, cap * sizeof *grown);
        if (grown == NULL) {
            die(1, "out of host memory");
        }
        records = grown;
        record_cap = cap;
    }
    records[record_count].api = api;
    records[record_count].handle = handle;
    records[record_count].size = size;
    records[record_count].memory = memory;
    records[record_count].live = 1;
    return record_count++;
}

static CUresult do_alloc(enum api_kind api, size_t size, unsigned long long *handle) {
    CUdeviceptr dptr = 0;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    switch (api) {
    case API_MEM:
        rc = CU(cuMemAlloc_v2)(&dptr, size);
        break;
    case API_PITCH: {
        size_t pitch = 0;
        rc = CU(cuMemAllocPitch_v2)(&dptr, &pitch, size, 1, 4);
        break;
    }
    case API_MANAGED:
        rc = CU(cuMemAllocManaged)(&dptr, size, CU_MEM_ATTACH_GLOBAL);
        break;
    case API_ASYNC:
        rc = CU(cuMemAllocAsync)(&dptr, size, NULL);
        break;
    case API_ASYNC_PTSZ:
        rc = CU(cuMemAllocAsync_ptsz)(&dptr, size, NULL);
        break;
    case API_POOL:
        rc = CU(cuMemAllocFromPoolAsync)(&dptr, size, probe_pool, NULL);
        break;
    case API_POOL_PTSZ:
        rc = CU(cuMemAllocFromPoolAsync_ptsz)(&dptr, size, probe_pool, NULL);
        break;
    case API_CREATE: {
        CUmemAllocationProp prop;
        CUmemGenericAllocationHandle h = 0;
        memset(&prop, 0, sizeof prop);
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        rc = CU(cuMemCreate)(&h, size, &prop, 0);
        dptr = h;
        break;
    }
    case API_ARRAY: {
        CUDA_ARRAY_DESCRIPTOR desc;
        CUarray array = NULL;
        memset(&desc, 0, sizeof desc);
        desc.Width = size;
        desc.Height = 1;
        desc.Format = CU_AD_FORMAT_UNSIGNED_INT8;
        desc.NumChannels = 1;
        rc = CU(cuArrayCreate_v2)(&array, &desc);
        dptr = (uintptr_t)array;
        break;
    }
    case API_ARRAY3D:
    case API_MIPMAP: {
        CUDA_ARRAY3D_DESCRIPTOR desc;
        memset(&desc, 0, sizeof desc);
        desc.Width = size;
        desc.Height = 1;
        desc.Depth = 1;
        desc.Format = CU_AD_FORMAT_UNSIGNED_INT8;
        desc.NumChannels = 1;
        if (api == API_ARRAY3D) {
            CUarray array = NULL;
            rc = CU(cuArray3DCreate_v2)(&array, &desc);
            dptr = (uintptr_t)array;
        } else {
            CUmipmappedArray mipmap = NULL;
            rc = CU(cuMipmappedArrayCreate)(&mipmap, &desc, 1);
            dptr = (uintptr_t)mipmap;
        }
        break;
    }
    case API_COUNT:
    case API_IPC_OPEN:
    case API_VMM_MAP:
        break;
    }
    *handle = dptr;
    return rc;
}

static CUresult do_free(const struct record *r) {
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    switch (r->api) {
    case API_MEM:
    case API_PITCH:
    case API_MANAGED:
        rc = CU(cuMemFree_v2)(r->handle);
        break;
    case API_ASYNC:
    case API_POOL:
        rc = CU(cuMemFreeAsync)(r->handle, NULL);
        if (rc == CUDA_SUCCESS) {
            rc = CU(cuCtxSynchronize)();
        }
        break;
    case API_ASYNC_PTSZ:
    case API_POOL_PTSZ:
        rc = CU(cuMemFreeAsync_ptsz)(r->handle, NULL);
        if (rc == CUDA_SUCCESS) {
            rc = CU(cuCtxSynchronize)();
        }
        break;
    case API_CREATE:
        rc = CU(cuMemRelease)(r->handle);
        break;
    case API_ARRAY:
    case API_ARRAY3D:
        rc = CU(cuArrayDestroy)((CUarray)(uintptr_t)r->handle);
        break;
    case API_MIPMAP:
        rc = CU(cuMipmappedArrayDestroy)((CUmipmappedArray)(uintptr_t)r->handle);
        break;
    case API_IPC_OPEN:
        rc = CU_OPT(cuIpcCloseMemHandle, r->handle);
        break;
    case API_VMM_MAP:
        rc = vmm_unmap_slot(r->handle, r->size, r->memory);
        break;
    case API_COUNT:
        break;
    }
    return rc;
}

void cmd_alloc(const char *api_text, enum api_kind api, const char *size_text, size_t size) {
    unsigned long long handle = 0;
    CUresult rc = do_alloc(api, size, &handle);
    if (rc == CUDA_SUCCESS) {
        size_t id = probe_remember(api, handle, size, 0);
        emit("alloc %s %s -> %d %zu", api_text, size_text, (int)rc, id);
    } else {
        emit("alloc %s %s -> %d -", api_text, size_text, (int)rc);
    }
}

void cmd_free(const char *id_text, unsigned long long id) {
    CUresult rc;
    if (id >= record_count) {
        die(2, "unknown ID '%s'", id_text);
    }
    rc = do_free(&records[id]);
    if (rc == CUDA_SUCCESS) {
        records[id].live = 0;
    }
    emit("free %s -> %d", id_text, (int)rc);
}

int probe_allocation(unsigned long long id, unsigned long long *pointer, size_t *size) {
    if (id >= record_count || !records[id].live) {
        return 0;
    }
    *pointer = records[id].handle;
    *size = records[id].size;
    return 1;
}

int probe_slot(unsigned long long id, enum api_kind *api, unsigned long long *memory) {
    if (id >= record_count) {
        return 0;
    }
    *api = records[id].api;
    *memory = records[id].api == API_CREATE    ? records[id].handle
              : records[id].api == API_VMM_MAP ? records[id].memory
                                               : 0;
    return 1;
}

void probe_forget(unsigned long long id) {
    if (id < record_count) {
        records[id].live = 0;
    }
}

void cmd_ptr(const char *id_text, unsigned long long id) {
    unsigned int type = 0;
    CUdeviceptr base = 0;
    size_t range = 0;
    CUresult rc, rc2;
    if (id >= record_count) {
        die(2, "unknown ID '%s'", id_text);
    }
    rc = CU_OPT(cuPointerGetAttribute, &type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                records[id].handle);
    rc2 = CU_OPT(cuMemGetAddressRange_v2, &base, &range, records[id].handle + 1);
    emit("ptr %s -> %d type=%u size=%zu start=%d", id_text,
         (int)(rc != CUDA_SUCCESS ? rc : rc2), type, range, base == records[id].handle);
}

/* info or info_v1. */
void cmd_info(const char *cmd) {
    unsigned long long f = 0, t = 0;
    CUresult rc;
    if (cmd[4] == '\0') {
        size_t f2 = 0, t2 = 0;
        rc = CU(cuMemGetInfo_v2)(&f2, &t2);
        f = f2;
        t = t2;
    } else {
        unsigned int f1 = 0, t1 = 0;
        rc = CU(cuMemGetInfo)(&f1, &t1);
        f = f1;
        t = t1;
    }
    if (rc != CUDA_SUCCESS) {
        f = t = 0;
    }
    emit("%s %d free=%llu total=%llu", cmd, (int)rc, f, t);
}

/* totalmem or totalmem_v1. */
void cmd_totalmem(const char *cmd) {
    unsigned long long t = 0;
    CUresult rc;
    if (cmd[8] == '\0') {
        size_t t2 = 0;
        rc = CU(cuDeviceTotalMem_v2)(&t2, device);
        t = t2;
    } else {
        unsigned int t1 = 0;
        rc = CU(cuDeviceTotalMem)(&t1, device);
        t = t1;
    }
    emit("%s %d %llu", cmd, (int)rc, rc == CUDA_SUCCESS ? t : 0);
}

void cmd_fill(const char *size_text, size_t size) {
    unsigned long long count = 0;
    for (;;) {
        CUdeviceptr p = 0;
        CUresult rc = CU(cuMemAlloc_v2)(&p, size);
        if (rc != CUDA_SUCCESS) {
            emit("fill %s count=%llu last=%d", size_text, count, (int)rc);
            break;
        }
        probe_remember(API_MEM, p, size, 0);
        count++;
    }
}

void cmd_freeall(void) {
    CUresult first = CUDA_SUCCESS;
    size_t id;
    for (id = 0; id < record_count; id++) {
        if (records[id].live) {
            CUresult rc = do_free(&records[id]);
            if (rc == CUDA_SUCCESS) {
                records[id].live = 0;
            } else if (first == CUDA_SUCCESS) {
                first = rc;
            }
        }
    }
    emit("freeall %d", (int)first);
}

struct hammer_job {
    unsigned long long iters;
    size_t size;
    unsigned long long ok, oom, other;
};

static void *hammer_thread(void *arg) {
    struct hammer_job *job = arg;
    unsigned long long i;
    if (CU(cuCtxSetCurrent)(context) != CUDA_SUCCESS) {
        job->other += job->iters;
        return NULL;
    }
    for (i = 0; i < job->iters; i++) {
        CUdeviceptr p = 0;
        CUresult rc = CU(cuMemAlloc_v2)(&p, job->size);
        if (rc == CUDA_ERROR_OUT_OF_MEMORY) {
            job->oom++;
        } else if (rc != CUDA_SUCCESS) {
            job->other++;
        } else if (CU(cuMemFree_v2)(p) != CUDA_SUCCESS) {
            job->other++;
        } else {
            job->ok++;
        }
    }
    return NULL;
}

void cmd_hammer(unsigned long long threads, unsigned long long iters, size_t size) {
    pthread_t *ids = calloc(threads, sizeof *ids);
    struct hammer_job *jobs = calloc(threads, sizeof *jobs);
    unsigned long long i, ok = 0, oom = 0, other = 0;
    if (ids == NULL || jobs == NULL) {
        die(1, "out of host memory");
    }
    for (i = 0; i < threads; i++) {
        jobs[i].iters = iters;
        jobs[i].size = size;
        if (pthread_create(&ids[i], NULL, hammer_thread, &jobs[i]) != 0) {
            die(1, "pthread_create failed");
        }
    }
    for (i = 0; i < threads; i++) {
        pthread_join(ids[i], NULL);
        ok += jobs[i].ok;
        oom += jobs[i].oom;
        other += jobs[i].other;
    }
    free(ids);
    free(jobs);
    emit("hammer ok=%llu oom=%llu other=%llu", ok, oom, other);
}

void cmd_nvml(const char *name, int v2) {
    nvmlDevice_t dev = NULL;
    unsigned long long total = 0, free_bytes = 0, used = 0;
    nvmlReturn_t rc = NVML(nvmlInit_v2)();
    if (rc == NVML_SUCCESS) {
        rc = NVML(nvmlDeviceGetHandleByIndex_v2)((unsigned)device_ordinal, &dev);
        if (rc == NVML_SUCCESS && v2) {
            nvmlMemory_v2_t m;
            memset(&m, 0, sizeof m);
            m.version = nvmlMemory_v2;
            rc = NVML(nvmlDeviceGetMemoryInfo_v2)(dev, &m);
            if (rc == NVML_SUCCESS) {
                total = m.total;
                free_bytes = m.free;
                used = m.used;
            }
        } else if (rc == NVML_SUCCESS) {
            nvmlMemory_t m;
            memset(&m, 0, sizeof m);
            rc = NVML(nvmlDeviceGetMemoryInfo)(dev, &m);
            if (rc == NVML_SUCCESS) {
                total = m.total;
                free_bytes = m.free;
                used = m.used;
            }
        }
        {
            nvmlReturn_t down = NVML(nvmlShutdown)();
            if (rc == NVML_SUCCESS) {
                rc = down;
            }
        }
    }
    emit("%s %d free=%llu used=%llu total=%llu", name, (int)rc, free_bytes, used, total);
}

/* gpus: CUDA's devices and NVML's GPUs, by UUID in their orders, and
 * CUDA_VISIBLE_DEVICES as the program reads it. */
void cmd_gpus(void) {
    char cuda[1024] = "", nvml[1024] = "";
    int count = 0, i;
    unsigned int nvml_count = 0, k;
    CUresult rc = CU_OPT(cuDeviceGetCount, &count);
    nvmlReturn_t nrc;
    for (i = 0; rc == CUDA_SUCCESS && i < count; i++) {
        CUuuid uuid;
        int b;
        memset(&uuid, 0, sizeof uuid);
        rc = CU_OPT(cuDeviceGetUuid_v2, &uuid, i);
        if (rc != CUDA_SUCCESS) {
            break;
        }
        /* NVML's form: GPU-8-4-4-4-12 hex digits. */
        snprintf(cuda + strlen(cuda), sizeof cuda - strlen(cuda), "%sGPU-", i > 0 ? "," : "");
        for (b = 0; b < 16; b++) {
            snprintf(cuda + strlen(cuda), sizeof cuda - strlen(cuda), "%s%02x",
                     b == 4 || b == 6 || b == 8 || b == 10 ? "-" : "",
                     (unsigned char)uuid.bytes[b]);
        }
    }
    nrc = NVML(nvmlInit_v2)();
    if (nrc == NVML_SUCCESS) {
        nrc = NVML(nvmlDeviceGetCount_v2)(&nvml_count);
        for (k = 0; nrc == NVML_SUCCESS && k < nvml_count; k++) {
            nvmlDevice_t dev = NULL;
            char uuid[96];
            nrc = NVML(nvmlDeviceGetHandleByIndex_v2)(k, &dev);
            if (nrc == NVML_SUCCESS) {
                nrc = NVML(nvmlDeviceGetUUID)(dev, uuid, sizeof uuid);
            }
            if (nrc == NVML_SUCCESS) {
                snprintf(nvml + strlen(nvml), sizeof nvml - strlen(nvml), "%s%s",
                         k > 0 ? "," : "", uuid);
            }
        }
        NVML(nvmlShutdown)();
    }
    {
        const char *visible = getenv("CUDA_VISIBLE_DEVICES");
        emit("gpus %d cuda=%s nvml %d=%s visible=%s", (int)rc, cuda, (int)nrc, nvml,
             visible != NULL ? visible : "unset");
    }
}

void cmd_nvml_procs(void) {
    nvmlDevice_t dev = NULL;
    unsigned int count = 0, i;
    unsigned long long used = 0;
    nvmlProcessInfo_t *infos = NULL;
    nvmlReturn_t rc = NVML(nvmlInit_v2)();
    if (rc == NVML_SUCCESS) {
        rc = NVML(nvmlDeviceGetHandleByIndex_v2)((unsigned)device_ordinal, &dev);
        if (rc == NVML_SUCCESS) {
            rc = NVML(nvmlDeviceGetComputeRunningProcesses_v3)(dev, &count, NULL);
            if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
                infos = calloc(count, sizeof *infos);
                if (infos == NULL) {
                    die(1, "out of host memory");
                }
                rc = NVML(nvmlDeviceGetComputeRunningProcesses_v3)(dev, &count, infos);
            }
            if (rc != NVML_SUCCESS) {
                count = 0;
            }
            for (i = 0; i < count; i++) {
                if (infos[i].pid == (unsigned int)getpid()) {
                    used = infos[i].usedGpuMemory;
                }
            }
            free(infos);
        }
        {
            nvmlReturn_t down = NVML(nvmlShutdown)();
            if (rc == NVML_SUCCESS) {
                rc = down;
            }
        }
    }
    emit("nvml_procs %d count=%u used=%llu", (int)rc, count, used);
}

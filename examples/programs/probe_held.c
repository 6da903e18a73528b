/*
 * cudaprobe's commands of driver-held memory, what the driver takes on the
 * GPU without an allocation call: context limits, module globals, graph
 * memory, pool memory, created contexts.
 */
#include "probe.h"

/* The handles one kind of command made; an ID is an index. */
struct table {
    void **handles;
    int *kinds;
    size_t len, cap;
};

static struct table images, execs, contexts;

static size_t table_add(struct table *t, void *handle, int kind) {
    if (t->len == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 16;
        void **handles = realloc(t->handles, cap * sizeof *handles);
        int *kinds;
        if (handles == NULL) {
            die(1, "out of host memory");
        }
        t->handles = handles;
        kinds = realloc(t->kinds, cap * sizeof *kinds);
        if (kinds == NULL) {
            die(1, "out of host memory");
        }
        t->kinds = kinds;
        t->cap = cap;
    }
    t->handles[t->len] = handle;
    t->kinds[t->len] = kind;
    return t->len++;
}

/* The handle of ID `id`; exits with status 2 for an ID never handed out. */
static void *table_get(const struct table *t, const char *id_text, unsigned long long id) {
    if (id >= t->len) {
        die(2, "unknown ID '%s'", id_text);
    }
    return t->handles[id];
}

static const CUlimit limits[HELD_LIMIT_COUNT] = {
    CU_LIMIT_STACK_SIZE,
    CU_LIMIT_PRINTF_FIFO_SIZE,
    CU_LIMIT_MALLOC_HEAP_SIZE,
};

void cmd_setlimit(const char *kind_text, enum held_limit kind, const char *size_text, size_t size) {
    CUresult rc = CU_OPT(cuCtxSetLimit, limits[kind], size);
    emit("setlimit %s %s -> %d", kind_text, size_text, (int)rc);
}

void cmd_getlimit(const char *kind_text, enum held_limit kind) {
    size_t value = 0;
    CUresult rc = CU_OPT(cuCtxGetLimit, &value, limits[kind]);
    emit("getlimit %s -> %d %zu", kind_text, (int)rc, rc == CUDA_SUCCESS ? value : 0);
}

/* module, module_ex or library: an image whose globals the double holds. */
void cmd_load(const char *cmd, enum held_image kind, const char *size_text, size_t size) {
    char image[64];
    void *handle = NULL;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    snprintf(image, sizeof image, "gpushare-double-module globals=%zu\n", size);
    switch (kind) {
    case HELD_MODULE: {
        CUmodule module = NULL;
        rc = CU_OPT(cuModuleLoadData, &module, image);
        handle = module;
        break;
    }
    case HELD_MODULE_EX: {
        CUmodule module = NULL;
        rc = CU_OPT(cuModuleLoadDataEx, &module, image, 0, NULL, NULL);
        handle = module;
        break;
    }
    case HELD_LIBRARY: {
        CUlibrary library = NULL;
        rc = CU_OPT(cuLibraryLoadData, &library, image, NULL, NULL, 0, NULL, NULL, 0);
        handle = library;
        break;
    }
    case HELD_LIBRARY_FILE: {
        /* The image in a file of its own, gone once loaded. */
        char path[] = "/tmp/cudaprobe-library-XXXXXX";
        CUlibrary library = NULL;
        int fd = mkstemp(path);
        if (fd < 0) {
            die(1, "mkstemp: %s", strerror(errno));
        }
        if (write(fd, image, strlen(image) + 1) != (ssize_t)(strlen(image) + 1)) {
            die(1, "write %s: %s", path, strerror(errno));
        }
        close(fd);
        rc = CU_OPT(cuLibraryLoadFromFile, &library, path, NULL, NULL, 0, NULL, NULL, 0);
        unlink(path);
        handle = library;
        break;
    }
    case HELD_IMAGE_COUNT:
        break;
    }
    if (rc == CUDA_SUCCESS) {
        emit("%s %s -> %d %zu", cmd, size_text, (int)rc, table_add(&images, handle, (int)kind));
    } else {
        emit("%s %s -> %d -", cmd, size_text, (int)rc);
    }
}

void cmd_unload(const char *id_text, unsigned long long id) {
    void *handle = table_get(&images, id_text, id);
    CUresult rc = images.kinds[id] == HELD_LIBRARY || images.kinds[id] == HELD_LIBRARY_FILE
                      ? CU_OPT(cuLibraryUnload, (CUlibrary)handle)
                      : CU_OPT(cuModuleUnload, (CUmodule)handle);
    emit("unload %s -> %d", id_text, (int)rc);
}

/* A graph of one mem alloc node of `size` on the device, built by hand. */
static CUresult built_graph(size_t size, CUgraph *graph) {
    CUDA_MEM_ALLOC_NODE_PARAMS params;
    CUgraphNode node = NULL;
    CUresult rc = CU_OPT(cuGraphCreate, graph, 0);
    if (rc != CUDA_SUCCESS) {
        *graph = NULL;
        return rc;
    }
    memset(&params, 0, sizeof params);
    params.poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    params.poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    params.poolProps.location.id = device;
    params.bytesize = size;
    return CU_OPT(cuGraphAddMemAllocNode, &node, *graph, NULL, 0, &params);
}

/* The same, captured from cuMemAllocAsync on `stream`. */
static CUresult captured_graph(size_t size, CUstream stream, CUgraph *graph) {
    CUdeviceptr dptr = 0;
    CUresult rc, allocated, ended;
    /* GLOBAL, PyTorch's default, as for the captured launches. */
    rc = CU_OPT(cuStreamBeginCapture_v2, stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    allocated = CU(cuMemAllocAsync)(&dptr, size, stream);
    ended = CU_OPT(cuStreamEndCapture, stream, graph);
    if (ended != CUDA_SUCCESS) {
        *graph = NULL;
    }
    return allocated != CUDA_SUCCESS ? allocated : ended;
}

/* graph_alloc or capture_alloc: an exec whose graph allocates `size`. */
void cmd_graph_alloc(const char *cmd, int captured, const char *size_text, size_t size) {
    CUgraph graph = NULL;
    CUgraphExec exec = NULL;
    CUstream stream = NULL;
    CUresult rc;
    if (captured) {
        rc = CU_OPT(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
        if (rc != CUDA_SUCCESS) {
            stream = NULL;
        } else {
            rc = captured_graph(size, stream, &graph);
        }
    } else {
        rc = built_graph(size, &graph);
    }
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuGraphInstantiateWithFlags, &exec, graph, 0);
        if (rc != CUDA_SUCCESS) {
            exec = NULL;
        }
    }
    if (graph != NULL) {
        CUresult destroyed = CU_OPT(cuGraphDestroy, graph);
        rc = rc != CUDA_SUCCESS ? rc : destroyed;
    }
    if (stream != NULL) {
        CUresult destroyed = CU_OPT(cuStreamDestroy_v2, stream);
        rc = rc != CUDA_SUCCESS ? rc : destroyed;
    }
    if (rc == CUDA_SUCCESS) {
        emit("%s %s -> %d %zu", cmd, size_text, (int)rc, table_add(&execs, exec, 0));
    } else {
        if (exec != NULL) {
            (void)CU_OPT(cuGraphExecDestroy, exec);
        }
        emit("%s %s -> %d -", cmd, size_text, (int)rc);
    }
}

/* The stream graph execs launch and upload on, created at first use. */
static CUresult probe_stream(CUstream *out) {
    static CUstream stream;
    CUresult rc = CUDA_SUCCESS;
    if (stream == NULL) {
        rc = CU_OPT(cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING);
        if (rc != CUDA_SUCCESS) {
            stream = NULL;
        }
    }
    *out = stream;
    return rc;
}

void cmd_graph(const char *cmd, enum held_graph op, const char *id_text, unsigned long long id) {
    CUgraphExec exec = (CUgraphExec)table_get(&execs, id_text, id);
    CUstream stream = NULL;
    CUresult rc = CUDA_SUCCESS;
    if (op != HELD_DESTROY) {
        rc = probe_stream(&stream);
    }
    if (rc == CUDA_SUCCESS) {
        switch (op) {
        case HELD_LAUNCH:
            rc = CU_OPT(cuGraphLaunch, exec, stream);
            if (rc == CUDA_SUCCESS) {
                rc = CU_OPT(cuStreamSynchronize, stream);
            }
            break;
        case HELD_UPLOAD:
            rc = CU_OPT(cuGraphUpload, exec, stream);
            break;
        case HELD_DESTROY:
            rc = CU_OPT(cuGraphExecDestroy, exec);
            break;
        }
    }
    emit("%s %s -> %d", cmd, id_text, (int)rc);
}

void cmd_graph_trim(void) {
    emit("graph_trim -> %d", (int)CU_OPT(cuDeviceGraphMemTrim, device));
}

static CUresult default_pool(CUmemoryPool *pool) {
    return CU_OPT(cuDeviceGetDefaultMemPool, pool, device);
}

void cmd_pool_threshold(const char *size_text, unsigned long long size) {
    CUmemoryPool pool = NULL;
    cuuint64_t threshold = size;
    CUresult rc = default_pool(&pool);
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuMemPoolSetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &threshold);
    }
    emit("pool_threshold %s -> %d", size_text, (int)rc);
}

void cmd_pool_trim(const char *size_text, size_t size) {
    CUmemoryPool pool = NULL;
    CUresult rc = default_pool(&pool);
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuMemPoolTrimTo, pool, size);
    }
    emit("pool_trim %s -> %d", size_text, (int)rc);
}

void cmd_pool_reserved(void) {
    CUmemoryPool pool = NULL;
    cuuint64_t reserved = 0, used = 0;
    CUresult rc = default_pool(&pool);
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuMemPoolGetAttribute, pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved);
    }
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuMemPoolGetAttribute, pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used);
    }
    if (rc != CUDA_SUCCESS) {
        reserved = used = 0;
    }
    emit("pool_reserved %d reserved=%llu used=%llu", (int)rc, (unsigned long long)reserved,
         (unsigned long long)used);
}

void cmd_sync(void) {
    emit("sync %d", (int)CU(cuCtxSynchronize)());
}

/* A created context; the primary one is made current again. */
void cmd_context(void) {
    CUcontext created = NULL;
    CUresult rc = CU_OPT(cuCtxCreate_v2, &created, 0, device);
    if (rc == CUDA_SUCCESS) {
        rc = CU(cuCtxSetCurrent)(context);
        if (rc != CUDA_SUCCESS) {
            (void)CU_OPT(cuCtxDestroy_v2, created);
        }
    }
    if (rc == CUDA_SUCCESS) {
        emit("context -> %d %zu", (int)rc, table_add(&contexts, created, 0));
    } else {
        emit("context -> %d -", (int)rc);
    }
}

/* A green context (kind 1 in the table): never current, so nothing to restore. */
void cmd_green_context(void) {
    CUgreenCtx created = NULL;
    CUresult rc = CU_OPT(cuGreenCtxCreate, &created, NULL, device, 0);
    if (rc == CUDA_SUCCESS) {
        emit("green_context -> %d %zu", (int)rc, table_add(&contexts, created, 1));
    } else {
        emit("green_context -> %d -", (int)rc);
    }
}

void cmd_context_destroy(const char *id_text, unsigned long long id) {
    void *ctx = table_get(&contexts, id_text, id);
    CUresult rc = contexts.kinds[id] == 1 ? CU_OPT(cuGreenCtxDestroy, (CUgreenCtx)ctx)
                                          : CU_OPT(cuCtxDestroy_v2, (CUcontext)ctx);
    emit("context_destroy %s -> %d", id_text, (int)rc);
}

/*
 * cudaprobe's commands of driver-held memory, what the driver takes on the
 * GPU without an allocation call: context limits, module globals (of
 * lazily loaded libraries too), graph memory, pool memory, created contexts.
 */
#include "probe.h"

/* The handles one kind of command made; an ID is an index. */
struct table {
    void **handles;
    int *kinds;
    size_t len, cap;
};

static struct table images, execs, contexts, kernels;

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
    case HELD_FAT_LIBRARY:
    case HELD_IMAGE_COUNT:
        break;
    }
    if (rc == CUDA_SUCCESS) {
        emit("%s %s -> %d %zu", cmd, size_text, (int)rc, table_add(&images, handle, (int)kind));
    } else {
        emit("%s %s -> %d -", cmd, size_text, (int)rc);
    }
}

static int is_library(int kind) {
    return kind == HELD_LIBRARY || kind == HELD_LIBRARY_FILE || kind == HELD_FAT_LIBRARY;
}

void cmd_unload(const char *id_text, unsigned long long id) {
    void *handle = table_get(&images, id_text, id);
    CUresult rc = is_library(images.kinds[id]) ? CU_OPT(cuLibraryUnload, (CUlibrary)handle)
                                               : CU_OPT(cuModuleUnload, (CUmodule)handle);
    emit("unload %s -> %d", id_text, (int)rc);
}

/* What nvcc emits for a translation unit, and the runtime registers. */
struct fatbin_wrapper {
    int magic;
    int version;
    const unsigned long long *data;
    void *filename_or_fatbins;
};

#define FATBIN_WRAPPER_MAGIC 0x466243B1
#define FATBIN_MAGIC 0xBA55ED50U
#define FATBIN_HEADER_SIZE 16
#define FATBIN_ENTRY_SIZE 64
/* The global the cubin defines, and the cubin's layout: ELF header, section
 * names, symbol names, symbols, then 5 section headers. */
#define CUBIN_GLOBAL "gpushare_global"
#define CUBIN_SECTION_NAMES "\0.shstrtab\0.strtab\0.symtab\0.nv.global"
#define CUBIN_SYMBOL_NAMES "\0" CUBIN_GLOBAL
#define CUBIN_SECTION_NAMES_AT 64
#define CUBIN_SYMBOL_NAMES_AT 104
#define CUBIN_SYMBOLS_AT 128
#define CUBIN_SECTIONS_AT 176
#define CUBIN_SIZE (CUBIN_SECTIONS_AT + 5 * 64)

static void put16(unsigned char *p, unsigned v) {
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
}

static void put32(unsigned char *p, unsigned long long v) {
    put16(p, (unsigned)(v & 0xffff));
    put16(p + 2, (unsigned)(v >> 16 & 0xffff));
}

static void put64(unsigned char *p, unsigned long long v) {
    put32(p, v & 0xffffffffULL);
    put32(p + 4, v >> 32);
}

/* An ELF64 section header's fields. */
struct section {
    unsigned name, type;
    unsigned long long flags, offset, size;
    unsigned link, info;
    unsigned long long align, entsize;
};

static void put_section(unsigned char *sh, const struct section *s) {
    put32(sh, s->name);
    put32(sh + 4, s->type);
    put64(sh + 8, s->flags);
    put64(sh + 0x18, s->offset);
    put64(sh + 0x20, s->size);
    put32(sh + 0x28, s->link);
    put32(sh + 0x2c, s->info);
    put64(sh + 0x30, s->align);
    put64(sh + 0x38, s->entsize);
}

/*
 * A fat binary as nvcc 13 lays one out (little endian): its 16-byte header,
 * then one uncompressed ELF entry for sm_<arch> (entry fields as nvcc 13
 * writes them). The cubin defines one global, CUBIN_GLOBAL, of `bytes` in a
 * NOBITS .nv.global (uninitialised __device__ memory), and has no code and
 * no PTX. Measured on driver 580 (H100): it loads this cubin (OS ABI 0x33,
 * ABI version 7, these e_flags), and refuses with CUDA_ERROR_INVALID_IMAGE
 * one without the symbol table, or one with nvcc 13's ELF ABI (0x41,
 * version 8) and no more sections than these. In zeroed memory that is
 * never freed, as the runtime's images are static.
 */
static unsigned char *fat_binary(unsigned arch, unsigned long long bytes) {
    static const char section_names[] = CUBIN_SECTION_NAMES;
    static const char symbol_names[] = CUBIN_SYMBOL_NAMES;
    const struct section sections[4] = {
        {1, 3 /* SHT_STRTAB */, 0, CUBIN_SECTION_NAMES_AT, sizeof section_names, 0, 0, 1, 0},
        {11, 3 /* SHT_STRTAB */, 0, CUBIN_SYMBOL_NAMES_AT, sizeof symbol_names, 0, 0, 1, 0},
        /* A null symbol, then the global: linked to .strtab, the first global at 1. */
        {19, 2 /* SHT_SYMTAB */, 0, CUBIN_SYMBOLS_AT, 2 * 24, 2, 1, 8, 24},
        {27, 8 /* SHT_NOBITS */, 3 /* SHF_WRITE | SHF_ALLOC */, CUBIN_SECTIONS_AT, bytes, 0, 0,
         1, 0},
    };
    unsigned char *fat = calloc(1, FATBIN_HEADER_SIZE + FATBIN_ENTRY_SIZE + CUBIN_SIZE);
    unsigned char *entry, *elf, *symbol;
    int i;
    if (fat == NULL) {
        die(1, "out of host memory");
    }
    entry = fat + FATBIN_HEADER_SIZE;
    elf = entry + FATBIN_ENTRY_SIZE;
    put32(fat, FATBIN_MAGIC);
    put16(fat + 4, 1);
    put16(fat + 6, FATBIN_HEADER_SIZE);
    put64(fat + 8, FATBIN_ENTRY_SIZE + CUBIN_SIZE);
    put16(entry, 2); /* ELF */
    put16(entry + 2, 0x0101);
    put32(entry + 4, FATBIN_ENTRY_SIZE);
    put64(entry + 8, CUBIN_SIZE);
    put16(entry + 24, 8); /* minor and major, as nvcc 13 writes an ELF entry's */
    put16(entry + 26, 1);
    put32(entry + 28, arch);
    put64(entry + 40, 0x11); /* 64-bit, Linux host; neither compression flag */
    memcpy(elf, "\177ELF", 4);
    elf[4] = 2;    /* ELFCLASS64 */
    elf[5] = 1;    /* little endian */
    elf[6] = 1;    /* EV_CURRENT */
    elf[7] = 0x33; /* ELFOSABI_CUDA */
    elf[8] = 7;    /* its ABI version */
    put16(elf + 0x10, 2);   /* ET_EXEC */
    put16(elf + 0x12, 190); /* EM_CUDA */
    put32(elf + 0x14, 1);
    put64(elf + 0x28, CUBIN_SECTIONS_AT);
    /* sm_<arch>, virtual sm_<arch>, 64-bit addresses, unified texture mode */
    put32(elf + 0x30, arch | 0x500 | (unsigned long long)arch << 16);
    put16(elf + 0x34, 64);
    put16(elf + 0x3a, 64);
    put16(elf + 0x3c, 5);
    put16(elf + 0x3e, 1);
    memcpy(elf + CUBIN_SECTION_NAMES_AT, section_names, sizeof section_names);
    memcpy(elf + CUBIN_SYMBOL_NAMES_AT, symbol_names, sizeof symbol_names);
    symbol = elf + CUBIN_SYMBOLS_AT + 24;
    put32(symbol, 1);
    symbol[4] = 0x11; /* STB_GLOBAL, STT_OBJECT */
    put16(symbol + 6, 4);
    put64(symbol + 16, bytes);
    for (i = 0; i < 4; i++) {
        put_section(elf + CUBIN_SECTIONS_AT + 64 * (i + 1), &sections[i]);
    }
    return fat;
}

/* The device's compute capability as an arch: 90 for 9.0. */
static CUresult device_arch(unsigned *arch) {
    int major = 0, minor = 0;
    CUresult rc =
        CU_OPT(cuDeviceGetAttribute, &major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device);
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuDeviceGetAttribute, &minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                    device);
    }
    *arch = (unsigned)(major * 10 + minor);
    return rc;
}

/* A library whose globals a real driver takes at its first use in a context. */
void cmd_fatlib(const char *size_text, size_t size) {
    struct fatbin_wrapper *wrapper = calloc(1, sizeof *wrapper);
    CUlibrary library = NULL;
    unsigned arch = 0;
    CUresult rc = device_arch(&arch);
    if (wrapper == NULL) {
        die(1, "out of host memory");
    }
    if (rc == CUDA_SUCCESS) {
        wrapper->magic = FATBIN_WRAPPER_MAGIC;
        wrapper->version = 1;
        wrapper->data = (const unsigned long long *)(void *)fat_binary(arch, size);
        rc = CU_OPT(cuLibraryLoadData, &library, wrapper, NULL, NULL, 0, NULL, NULL, 0);
    }
    if (rc == CUDA_SUCCESS) {
        emit("fatlib %s -> %d %zu", size_text, (int)rc,
             table_add(&images, library, HELD_FAT_LIBRARY));
    } else {
        emit("fatlib %s -> %d -", size_text, (int)rc);
    }
}

/* The library of image ID `id`; exits with status 2 for a module's. */
static CUlibrary library_get(const char *id_text, unsigned long long id) {
    void *library = table_get(&images, id_text, id);
    if (!is_library(images.kinds[id])) {
        die(2, "ID '%s' is a module, not a library", id_text);
    }
    return (CUlibrary)library;
}

void cmd_libkernel(const char *id_text, unsigned long long id, const char *name) {
    CUlibrary library = library_get(id_text, id);
    CUkernel kernel = NULL;
    CUresult rc = CU_OPT(cuLibraryGetKernel, &kernel, library, name);
    if (rc == CUDA_SUCCESS) {
        emit("libkernel %s %s -> %d %zu", id_text, name, (int)rc, table_add(&kernels, kernel, 0));
    } else {
        emit("libkernel %s %s -> %d -", id_text, name, (int)rc);
    }
}

/* The global fatlib's cubin defines: a first use that a real driver
 * honours too, where the cubin has no kernel to launch. */
void cmd_libglobal(const char *id_text, unsigned long long id) {
    CUlibrary library = library_get(id_text, id);
    CUdeviceptr dptr = 0;
    size_t bytes = 0;
    CUresult rc = CU_OPT(cuLibraryGetGlobal, &dptr, &bytes, library, CUBIN_GLOBAL);
    emit("libglobal %s -> %d %zu", id_text, (int)rc, rc == CUDA_SUCCESS ? bytes : 0);
}

/* launchk, kernelfunc or kernellib of a kernel from libkernel. */
void cmd_kernel(const char *cmd, enum held_kernel_op op, const char *id_text,
                unsigned long long id) {
    CUkernel kernel = (CUkernel)table_get(&kernels, id_text, id);
    CUfunction function = NULL;
    CUlibrary library = NULL;
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    switch (op) {
    case HELD_KERNEL_LAUNCH:
        /* As the runtime launches a kernel: the handle passed as a function. */
        rc = CU_OPT(cuLaunchKernel, (CUfunction)(void *)kernel, 1, 1, 1, 1, 1, 1, 0, NULL, NULL,
                    NULL);
        break;
    case HELD_KERNEL_FUNCTION:
        rc = CU_OPT(cuKernelGetFunction, &function, kernel);
        break;
    case HELD_KERNEL_LIBRARY:
        rc = CU_OPT(cuKernelGetLibrary, &library, kernel);
        break;
    }
    emit("%s %s -> %d", cmd, id_text, (int)rc);
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

CUmemoryPool probe_pool = NULL;

/* The probe's pool, else device N's default one. */
static CUresult default_pool(CUmemoryPool *pool) {
    if (probe_pool != NULL) {
        *pool = probe_pool;
        return CUDA_SUCCESS;
    }
    return CU_OPT(cuDeviceGetDefaultMemPool, pool, device);
}

void cmd_pool_create(const char *size_text, unsigned long long threshold) {
    CUmemPoolProps props;
    CUmemoryPool pool = NULL;
    cuuint64_t keep = threshold;
    CUresult rc;
    memset(&props, 0, sizeof props);
    props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
    props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    props.location.id = device;
    rc = CU_OPT(cuMemPoolCreate, &pool, &props);
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuMemPoolSetAttribute, pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep);
    }
    if (rc == CUDA_SUCCESS) {
        probe_pool = pool;
    }
    emit("pool_create %s -> %d", size_text, (int)rc);
}

void cmd_pool_destroy(void) {
    CUresult rc = probe_pool != NULL ? CU_OPT(cuMemPoolDestroy, probe_pool) : CUDA_ERROR_INVALID_VALUE;
    if (rc == CUDA_SUCCESS) {
        probe_pool = NULL;
    }
    emit("pool_destroy -> %d", (int)rc);
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

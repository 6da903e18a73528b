/*
 * cudaprobe's script: its arguments parsed, and its commands checked in full
 * (before anything runs) or run, left to right; and the copy, set and stream
 * commands, which use no other file's state. The format is described in
 * cudaprobe.c.
 */
#include "probe.h"

static const char *const api_names[API_COUNT] = {
    "mem", "pitch", "managed", "async", "async_ptsz", "pool", "pool_ptsz",
    "create", "array", "array3d", "mipmap",
};

static const char *const launch_names[LAUNCH_COUNT] = {
    "kernel", "kernel_ptsz", "ex",     "ex_ptsz", "coop",      "coop_ptsz",
    "graph",  "graph_ptsz",  "legacy", "grid",    "grid_async",
};

/* ---------------------------------------------------------------- parsing */

static int parse_u64(const char *text, unsigned long long *out, int allow_suffix) {
    char *end = NULL;
    unsigned long long value;
    unsigned shift = 0;
    if (text == NULL || *text < '0' || *text > '9') {
        return -1;
    }
    errno = 0;
    value = strtoull(text, &end, 10);
    if (errno != 0) {
        return -1;
    }
    if (allow_suffix) {
        switch (*end) {
        case 'k': case 'K': shift = 10; end++; break;
        case 'm': case 'M': shift = 20; end++; break;
        case 'g': case 'G': shift = 30; end++; break;
        case 't': case 'T': shift = 40; end++; break;
        default: break;
        }
    }
    if (*end != '\0' || (shift != 0 && value > (~0ULL >> shift))) {
        return -1;
    }
    *out = value << shift;
    return 0;
}

static size_t arg_size(const char *text) {
    unsigned long long v = 0;
    if (parse_u64(text, &v, 1) != 0 || v > SIZE_MAX) {
        die(2, "bad size '%s'", text ? text : "");
    }
    return (size_t)v;
}

unsigned long long arg_number(const char *text) {
    unsigned long long v = 0;
    if (parse_u64(text, &v, 0) != 0) {
        die(2, "bad number '%s'", text ? text : "");
    }
    return v;
}

/* The index of `text` among the `count` names; dies naming `what` if absent. */
static int arg_name(const char *text, const char *const *names, int count, const char *what) {
    int i;
    for (i = 0; i < count; i++) {
        if (text != NULL && strcmp(text, names[i]) == 0) {
            return i;
        }
    }
    die(2, "unknown %s API '%s'", what, text ? text : "");
    return count;
}

static enum api_kind arg_api(const char *text) {
    return (enum api_kind)arg_name(text, api_names, API_COUNT, "allocation");
}

static enum launch_api arg_launch(const char *text) {
    return (enum launch_api)arg_name(text, launch_names, LAUNCH_COUNT, "launch");
}

static enum held_limit arg_limit(const char *text) {
    static const char *const names[HELD_LIMIT_COUNT] = {"stack", "fifo", "heap"};
    int i;
    for (i = 0; i < HELD_LIMIT_COUNT; i++) {
        if (text != NULL && strcmp(text, names[i]) == 0) {
            return (enum held_limit)i;
        }
    }
    die(2, "unknown limit '%s'", text ? text : "");
    return HELD_LIMIT_COUNT;
}

/* Reads DUR COUNT HOST from argv at *i, in that order. */
static struct paced paced_args(int argc, char **argv, int *i) {
    struct paced p;
    p.dur_text = *i < argc ? argv[(*i)++] : NULL;
    p.dur_us = arg_number(p.dur_text);
    p.count_text = *i < argc ? argv[(*i)++] : NULL;
    p.count = arg_number(p.count_text);
    p.host_text = *i < argc ? argv[(*i)++] : NULL;
    p.host_us = arg_number(p.host_text);
    return p;
}

/* Dies if the microseconds of `p` overflow nanoseconds. */
static void check_paced(const char *cmd, const struct paced *p) {
    if (p->dur_us > ~0ULL / 1000 || p->host_us > ~0ULL / 1000) {
        die(2, "%s: number too large", cmd);
    }
}

/* ------------------------------------------- copies, sets and streams */

/* The directions of copy and copy_async. */
enum copy_dir { COPY_H2D, COPY_D2H, COPY_D2D, COPY_DIR_COUNT };

static const char *const copy_names[COPY_DIR_COUNT] = {"h2d", "d2h", "d2d"};

static enum copy_dir arg_copy(const char *text) {
    return (enum copy_dir)arg_name(text, copy_names, COPY_DIR_COUNT, "copy");
}

/* The entry points of the copy, set and stream commands, found with dlsym
 * in the loaded libcuda.so.1 in either build (a missing one fails its
 * command with CUDA_ERROR_NOT_FOUND). */
static struct {
    int loaded;
    __typeof__(&cuMemcpyHtoD_v2) htod;
    __typeof__(&cuMemcpyDtoH_v2) dtoh;
    __typeof__(&cuMemcpyDtoD_v2) dtod;
    __typeof__(&cuMemcpyHtoDAsync_v2) htod_async;
    __typeof__(&cuMemcpyDtoHAsync_v2) dtoh_async;
    __typeof__(&cuMemcpyDtoDAsync_v2) dtod_async;
    __typeof__(&cuMemsetD8_v2) set;
    __typeof__(&cuMemsetD8Async) set_async;
    __typeof__(&cuStreamSynchronize) stream_sync;
    __typeof__(&cuStreamQuery) stream_query;
} xfer;

#define XFER_CALL(field, ...) (xfer.field == NULL ? CUDA_ERROR_NOT_FOUND : xfer.field(__VA_ARGS__))

static void xfer_load(void) {
    void *cuda;
    if (xfer.loaded) {
        return;
    }
    xfer.loaded = 1;
    cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (cuda == NULL) {
        return;
    }
#define XFER_DLSYM(field, name) xfer.field = (__typeof__(xfer.field))dlsym(cuda, #name);
    XFER_DLSYM(htod, cuMemcpyHtoD_v2)
    XFER_DLSYM(dtoh, cuMemcpyDtoH_v2)
    XFER_DLSYM(dtod, cuMemcpyDtoD_v2)
    XFER_DLSYM(htod_async, cuMemcpyHtoDAsync_v2)
    XFER_DLSYM(dtoh_async, cuMemcpyDtoHAsync_v2)
    XFER_DLSYM(dtod_async, cuMemcpyDtoDAsync_v2)
    XFER_DLSYM(set, cuMemsetD8_v2)
    XFER_DLSYM(set_async, cuMemsetD8Async)
    XFER_DLSYM(stream_sync, cuStreamSynchronize)
    XFER_DLSYM(stream_query, cuStreamQuery)
#undef XFER_DLSYM
}

/* The commands' device memory: two blocks of scratch_size bytes, kept
 * between commands so that a later one calls only the copy or set. */
static CUdeviceptr scratch[2];
static size_t scratch_size;

/* Scratch of at least `size` bytes a block: the blocks are freed and
 * allocated again (cuMemAlloc_v2) when smaller. */
static CUresult scratch_for(size_t size) {
    CUresult rc;
    int b;
    size = size ? size : 1;
    if (size <= scratch_size) {
        return CUDA_SUCCESS;
    }
    for (b = 0; b < 2; b++) {
        if (scratch[b] != 0) {
            (void)CU(cuMemFree_v2)(scratch[b]);
            scratch[b] = 0;
        }
    }
    scratch_size = 0;
    for (b = 0; b < 2; b++) {
        rc = CU(cuMemAlloc_v2)(&scratch[b], size);
        if (rc != CUDA_SUCCESS) {
            scratch[b] = 0;
            return rc;
        }
    }
    scratch_size = size;
    return CUDA_SUCCESS;
}

/* copy DIR SIZE, copy_async DIR SIZE (then cuStreamSynchronize). */
static void cmd_copy(const char *cmd, int async, const char *dir_text, enum copy_dir dir,
                     const char *size_text, size_t size) {
    CUresult rc;
    void *host = calloc(size ? size : 1, 1);
    if (host == NULL) {
        die(1, "out of host memory");
    }
    xfer_load();
    rc = scratch_for(size);
    if (rc == CUDA_SUCCESS) {
        switch (dir) {
        case COPY_H2D:
            rc = async ? XFER_CALL(htod_async, scratch[0], host, size, NULL)
                       : XFER_CALL(htod, scratch[0], host, size);
            break;
        case COPY_D2H:
            rc = async ? XFER_CALL(dtoh_async, host, scratch[0], size, NULL)
                       : XFER_CALL(dtoh, host, scratch[0], size);
            break;
        case COPY_D2D:
        case COPY_DIR_COUNT:
            rc = async ? XFER_CALL(dtod_async, scratch[1], scratch[0], size, NULL)
                       : XFER_CALL(dtod, scratch[1], scratch[0], size);
            break;
        }
    }
    if (rc == CUDA_SUCCESS && async) {
        rc = XFER_CALL(stream_sync, NULL);
    }
    free(host);
    emit("%s %s %s -> %d", cmd, dir_text, size_text, (int)rc);
}

/* set SIZE, set_async SIZE (then cuStreamSynchronize). */
static void cmd_set(const char *cmd, int async, const char *size_text, size_t size) {
    CUresult rc;
    xfer_load();
    rc = scratch_for(size);
    if (rc == CUDA_SUCCESS) {
        rc = async ? XFER_CALL(set_async, scratch[0], 0x5a, size, NULL)
                   : XFER_CALL(set, scratch[0], 0x5a, size);
    }
    if (rc == CUDA_SUCCESS && async) {
        rc = XFER_CALL(stream_sync, NULL);
    }
    emit("%s %s -> %d", cmd, size_text, (int)rc);
}

/* The byte at offset i of the contents `seed` names. */
static unsigned char content(unsigned long long seed, size_t i) {
    return (unsigned char)(i * 31 + seed * 7 + (i >> 12));
}

/* write ID SEED: the allocation's bytes from the pattern (cuMemcpyHtoD_v2);
 * check ID SEED: read back (cuMemcpyDtoH_v2) and compared. */
static void cmd_contents(const char *cmd, const char *id_text, unsigned long long id,
                         const char *seed_text, unsigned long long seed) {
    unsigned long long pointer = 0;
    size_t size = 0, i, differ = 0;
    unsigned char *host;
    CUresult rc;
    if (!probe_allocation(id, &pointer, &size)) {
        die(2, "unknown ID '%s'", id_text);
    }
    host = malloc(size ? size : 1);
    if (host == NULL) {
        die(1, "out of host memory");
    }
    xfer_load();
    if (cmd[0] == 'w') {
        for (i = 0; i < size; i++) {
            host[i] = content(seed, i);
        }
        rc = XFER_CALL(htod, pointer, host, size);
        emit("write %s %s -> %d at=0x%llx", id_text, seed_text, (int)rc, pointer);
    } else {
        for (i = 0; i < size; i++) { /* a byte the copy does not bring differs */
            host[i] = (unsigned char)~content(seed, i);
        }
        rc = XFER_CALL(dtoh, host, pointer, size);
        for (i = 0; rc == CUDA_SUCCESS && i < size; i++) {
            differ += host[i] != content(seed, i);
        }
        emit("check %s %s -> %d differ=%zu at=0x%llx", id_text, seed_text, (int)rc, differ,
             pointer);
    }
    free(host);
}

/* stream_sync, stream_query: of the legacy default stream. */
static void cmd_stream(const char *cmd, int query) {
    xfer_load();
    emit("%s %d", cmd,
         (int)(query ? XFER_CALL(stream_query, NULL) : XFER_CALL(stream_sync, NULL)));
}

/* ---------------------------------------------------------------- running */

/* Runs (execute) or only checks (!execute) the script; returns at its end. */
void run_script(int argc, char **argv, int execute) {
    int i = 0;
    int measured = 0; /* a spin, run or pace came earlier */
    int exported = 0; /* a vmm-export came earlier */
#define NEXT() (i < argc ? argv[i++] : NULL)
    while (i < argc) {
        const char *cmd = NEXT();
        if (strcmp(cmd, "alloc") == 0) {
            const char *api_text = NEXT();
            enum api_kind api = arg_api(api_text);
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_alloc(api_text, api, size_text, size);
            }
        } else if (strcmp(cmd, "free") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                cmd_free(id_text, id);
            }
        } else if (strcmp(cmd, "ptr") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                cmd_ptr(id_text, id);
            }
        } else if (strcmp(cmd, "info") == 0 || strcmp(cmd, "info_v1") == 0) {
            if (execute) {
                cmd_info(cmd);
            }
        } else if (strcmp(cmd, "totalmem") == 0 || strcmp(cmd, "totalmem_v1") == 0) {
            if (execute) {
                cmd_totalmem(cmd);
            }
        } else if (strcmp(cmd, "nvml") == 0 || strcmp(cmd, "nvml_v2") == 0) {
            if (execute) {
                cmd_nvml(cmd, cmd[4] != '\0');
            }
        } else if (strcmp(cmd, "gpus") == 0) {
            if (execute) {
                cmd_gpus();
            }
        } else if (strcmp(cmd, "nvml_procs") == 0) {
            if (execute) {
                cmd_nvml_procs();
            }
        } else if (strcmp(cmd, "fill") == 0) {
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_fill(size_text, size);
            }
        } else if (strcmp(cmd, "hammer") == 0) {
            unsigned long long threads = arg_number(NEXT());
            unsigned long long iters = arg_number(NEXT());
            size_t size = arg_size(NEXT());
            if (threads == 0 || threads > 1024) {
                die(2, "hammer needs 1..1024 threads");
            }
            if (execute) {
                cmd_hammer(threads, iters, size);
            }
        } else if (strcmp(cmd, "freeall") == 0) {
            if (execute) {
                cmd_freeall();
            }
        } else if (strcmp(cmd, "sleep") == 0) {
            const char *ms_text = NEXT();
            unsigned long long ms = arg_number(ms_text);
            if (execute) {
                struct timespec ts;
                ts.tv_sec = (time_t)(ms / 1000);
                ts.tv_nsec = (long)(ms % 1000) * 1000000L;
                while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
                }
                emit("sleep %s", ms_text);
            }
        } else if (strcmp(cmd, "wait") == 0) {
            if (execute) {
                char line[256];
                emit("ready");
                if (fgets(line, sizeof line, stdin) == NULL) {
                    clearerr(stdin);
                }
                emit("resumed");
            }
        } else if (strcmp(cmd, "write") == 0 || strcmp(cmd, "check") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            const char *seed_text = NEXT();
            unsigned long long seed = arg_number(seed_text);
            if (execute) {
                cmd_contents(cmd, id_text, id, seed_text, seed);
            }
        } else if (strcmp(cmd, "ipc-export") == 0 || strcmp(cmd, "ipc-close") == 0 ||
                   strcmp(cmd, "vmm-export") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            exported |= cmd[0] == 'v';
            if (execute && cmd[0] == 'v') {
                cmd_vmm_export(id_text, id);
            } else if (execute && cmd[4] == 'e') {
                cmd_ipc_export(id_text, id);
            } else if (execute) {
                cmd_ipc_close(id_text, id);
            }
        } else if (strcmp(cmd, "ipc-open") == 0) {
            CUipcMemHandle handle;
            if (!parse_ipc_handle(NEXT(), &handle)) {
                die(2, "ipc-open needs a handle of %d hex digits", IPC_HEX_DIGITS);
            }
            if (execute) {
                cmd_ipc_open(&handle);
            }
        } else if (strcmp(cmd, "vmm-alloc") == 0) {
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_vmm_alloc(size_text, size);
            }
        } else if (strcmp(cmd, "vmm-import") == 0) {
            const char *from = NEXT();
            if (from == NULL || (strcmp(from, "last") != 0 && from[0] != '/' &&
                                 arg_number(from) > 0x7fffffffULL)) {
                die(2, "vmm-import needs a descriptor, a path or last");
            }
            if (strcmp(from, "last") == 0 && !exported) {
                die(2, "vmm-import last needs an earlier vmm-export");
            }
            if (execute) {
                cmd_vmm_import(from);
            }
        } else if (strcmp(cmd, "pid") == 0) {
            if (execute) {
                emit("pid %ld", (long)getpid());
            }
        } else if (strcmp(cmd, "spin") == 0 || strcmp(cmd, "run") == 0) {
            const char *api_text = NEXT();
            enum launch_api api = arg_launch(api_text);
            const char *dur_text = NEXT();
            unsigned long long dur_us = arg_number(dur_text);
            const char *n_text = NEXT();
            unsigned long long n = arg_number(n_text);
            if (dur_us > ~0ULL / 1000 || (cmd[0] == 'r' && n > ~0ULL / 1000000)) {
                die(2, "%s: number too large", cmd);
            }
            measured = 1;
            if (execute && cmd[0] == 's') {
                cmd_spin(api_text, api, dur_text, dur_us, n_text, n);
            } else if (execute) {
                cmd_run(api_text, api, dur_text, dur_us, n_text, n);
            }
        } else if (strcmp(cmd, "pace") == 0) {
            const char *api_text = NEXT();
            enum launch_api api = arg_launch(api_text);
            struct paced p = paced_args(argc, argv, &i);
            check_paced(cmd, &p);
            measured = 1;
            if (execute) {
                cmd_pace(api_text, api, &p);
            }
        } else if (strcmp(cmd, "shapes") == 0) {
            const char *n_text = NEXT();
            unsigned long long n = arg_number(n_text);
            struct paced p = paced_args(argc, argv, &i);
            if (n == 0 || n > 0x7fffffffULL) {
                die(2, "shapes: N must be 1 to 2^31-1");
            }
            check_paced(cmd, &p);
            measured = 1;
            if (execute) {
                cmd_shapes(n_text, n, &p);
            }
        } else if (strcmp(cmd, "functions") == 0) {
            const char *f_text = NEXT();
            unsigned long long f = arg_number(f_text);
            struct paced p = paced_args(argc, argv, &i);
            if (f == 0 || f > 1000000) {
                die(2, "functions: F must be 1 to 1000000");
            }
            check_paced(cmd, &p);
            measured = 1;
            if (execute) {
                cmd_functions(f_text, f, &p);
            }
        } else if (strcmp(cmd, "periodic") == 0) {
            struct periodic p;
            p.kernels_text = NEXT();
            p.kernels = arg_number(p.kernels_text);
            p.dur_text = NEXT();
            p.dur_us = arg_number(p.dur_text);
            p.period_text = NEXT();
            p.period_us = arg_number(p.period_text);
            p.count_text = NEXT();
            p.count = arg_number(p.count_text);
            if (p.kernels == 0 || p.kernels > 1000000 || p.period_us == 0 ||
                p.dur_us > ~0ULL / 1000 || p.count > 1000000 ||
                p.period_us > ~0ULL / 1000 / (p.count + 1)) {
                die(2, "periodic needs 1 to 1000000 kernels, a period of 1 us or more and "
                       "at most 1000000 requests");
            }
            measured = 1;
            if (execute) {
                cmd_periodic(&p);
            }
        } else if (strcmp(cmd, "series") == 0) {
            const char *window_text = NEXT();
            unsigned long long window_ms = arg_number(window_text);
            if (window_ms == 0 || window_ms > ~0ULL / 1000000) {
                die(2, "series needs a window of 1 ms or more");
            }
            if (!measured) {
                die(2, "series needs an earlier spin, run or pace");
            }
            if (execute) {
                cmd_series(window_text, window_ms);
            }
        } else if (strcmp(cmd, "idle") == 0) {
            const char *step_text = NEXT();
            unsigned long long step_us = arg_number(step_text);
            if (step_us == 0 || step_us > ~0ULL / 1000) {
                die(2, "idle needs a step of 1 us or more");
            }
            if (!measured) {
                die(2, "idle needs an earlier spin, run or pace");
            }
            if (execute) {
                cmd_idle(step_text, step_us);
            }
        } else if (strcmp(cmd, "settled") == 0) {
            if (!measured) {
                die(2, "settled needs an earlier spin, run or pace");
            }
            if (execute) {
                cmd_settled();
            }
        } else if (strcmp(cmd, "setlimit") == 0) {
            const char *kind_text = NEXT();
            enum held_limit kind = arg_limit(kind_text);
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_setlimit(kind_text, kind, size_text, size);
            }
        } else if (strcmp(cmd, "getlimit") == 0) {
            const char *kind_text = NEXT();
            enum held_limit kind = arg_limit(kind_text);
            if (execute) {
                cmd_getlimit(kind_text, kind);
            }
        } else if (strcmp(cmd, "module") == 0 || strcmp(cmd, "module_ex") == 0 ||
                   strcmp(cmd, "library") == 0 || strcmp(cmd, "library_file") == 0) {
            enum held_image kind = strcmp(cmd, "library_file") == 0 ? HELD_LIBRARY_FILE
                                   : cmd[0] == 'l'                  ? HELD_LIBRARY
                                   : cmd[6] != '\0'                 ? HELD_MODULE_EX
                                                                    : HELD_MODULE;
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_load(cmd, kind, size_text, size);
            }
        } else if (strcmp(cmd, "unload") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                cmd_unload(id_text, id);
            }
        } else if (strcmp(cmd, "fatlib") == 0) {
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_fatlib(size_text, size);
            }
        } else if (strcmp(cmd, "libkernel") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            const char *name = NEXT();
            if (name == NULL) {
                die(2, "libkernel needs a library ID and a kernel name");
            }
            if (execute) {
                cmd_libkernel(id_text, id, name);
            }
        } else if (strcmp(cmd, "libglobal") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                cmd_libglobal(id_text, id);
            }
        } else if (strcmp(cmd, "launchk") == 0 || strcmp(cmd, "kernelfunc") == 0 ||
                   strcmp(cmd, "kernellib") == 0) {
            enum held_kernel_op op = cmd[0] == 'l'   ? HELD_KERNEL_LAUNCH
                                     : cmd[6] == 'f' ? HELD_KERNEL_FUNCTION
                                                     : HELD_KERNEL_LIBRARY;
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                cmd_kernel(cmd, op, id_text, id);
            }
        } else if (strcmp(cmd, "graph_alloc") == 0 || strcmp(cmd, "capture_alloc") == 0) {
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_graph_alloc(cmd, cmd[0] == 'c', size_text, size);
            }
        } else if (strcmp(cmd, "graph_launch") == 0 || strcmp(cmd, "graph_upload") == 0 ||
                   strcmp(cmd, "graph_destroy") == 0) {
            enum held_graph op = cmd[6] == 'l'   ? HELD_LAUNCH
                                 : cmd[6] == 'u' ? HELD_UPLOAD
                                                 : HELD_DESTROY;
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                cmd_graph(cmd, op, id_text, id);
            }
        } else if (strcmp(cmd, "graph_trim") == 0) {
            if (execute) {
                cmd_graph_trim();
            }
        } else if (strcmp(cmd, "pool_threshold") == 0) {
            const char *size_text = NEXT();
            unsigned long long size = size_text != NULL && strcmp(size_text, "max") == 0
                                          ? UINT64_MAX
                                          : arg_size(size_text);
            if (execute) {
                cmd_pool_threshold(size_text, size);
            }
        } else if (strcmp(cmd, "pool_create") == 0) {
            const char *size_text = NEXT();
            unsigned long long size = size_text != NULL && strcmp(size_text, "max") == 0
                                          ? UINT64_MAX
                                          : arg_size(size_text);
            if (execute) {
                cmd_pool_create(size_text, size);
            }
        } else if (strcmp(cmd, "pool_destroy") == 0) {
            if (execute) {
                cmd_pool_destroy();
            }
        } else if (strcmp(cmd, "pool_trim") == 0) {
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_pool_trim(size_text, size);
            }
        } else if (strcmp(cmd, "pool_reserved") == 0) {
            if (execute) {
                cmd_pool_reserved();
            }
        } else if (strcmp(cmd, "sync") == 0) {
            if (execute) {
                cmd_sync();
            }
        } else if (strcmp(cmd, "copy") == 0 || strcmp(cmd, "copy_async") == 0) {
            const char *dir_text = NEXT();
            enum copy_dir dir = arg_copy(dir_text);
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_copy(cmd, cmd[4] != '\0', dir_text, dir, size_text, size);
            }
        } else if (strcmp(cmd, "set") == 0 || strcmp(cmd, "set_async") == 0) {
            const char *size_text = NEXT();
            size_t size = arg_size(size_text);
            if (execute) {
                cmd_set(cmd, cmd[3] != '\0', size_text, size);
            }
        } else if (strcmp(cmd, "stream_sync") == 0 || strcmp(cmd, "stream_query") == 0) {
            if (execute) {
                cmd_stream(cmd, cmd[7] == 'q');
            }
        } else if (strcmp(cmd, "context") == 0) {
            if (execute) {
                cmd_context();
            }
        } else if (strcmp(cmd, "green_context") == 0) {
            if (execute) {
                cmd_green_context();
            }
        } else if (strcmp(cmd, "context_destroy") == 0) {
            const char *id_text = NEXT();
            unsigned long long id = arg_number(id_text);
            if (execute) {
                cmd_context_destroy(id_text, id);
            }
        } else if (strcmp(cmd, "clock") == 0) {
            if (execute) {
                emit("clock ns=%llu", now_ns());
            }
        } else if (strcmp(cmd, "maxstall") == 0) {
            if (!measured) {
                die(2, "maxstall needs an earlier spin, run or pace");
            }
            if (execute) {
                cmd_maxstall();
            }
        } else {
            die(2, "unknown command '%s'", cmd);
        }
    }
#undef NEXT
}

/*
 * Compute on the double's simulated clock (the model is in cuda.c): the
 * timeline of each device, launches through every launch API, and the
 * exported busy-time accessor that reads the timeline.
 */
#include "double_internal.h"

/*
 * One timeline per device: every kernel of the process on the device runs
 * alone, from max(submission, busy_until) for its duration (a kernel that
 * fills all SMs). Times are CLOCK_MONOTONIC nanoseconds.
 */
#define SPAN_CAPACITY ((size_t)1 << 20)

struct span {
    unsigned long long start, end;
};

struct timeline {
    unsigned long long busy_until;
    /* Ring of SPAN_CAPACITY busy intervals in time order; back-to-back ones merged. */
    struct span *spans;
    size_t span_head, span_len;
    /* An event was recorded since the last kernel: the next one ramps up
     * alone (GPUSHARE_DOUBLE_EVENT_RAMP_NS longer). */
    int after_event;
    /* Ring of g_queue_depth end times of the latest submissions. */
    unsigned long long *pending;
    size_t pending_head, pending_len;
};

static struct timeline g_timelines[DOUBLE_MAX_DEVICES];

unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

void sleep_until(unsigned long long ns) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000ULL);
    ts.tv_nsec = (long)(ns % 1000000000ULL);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* The timeline of dev with its rings, or NULL when host memory ran out. */
static struct timeline *timeline_locked(int dev) {
    struct timeline *t = &g_timelines[dev];
    if (t->spans == NULL) {
        /* calloc: the pages of the 16 MiB ring are touched only as it fills. */
        t->spans = calloc(SPAN_CAPACITY, sizeof *t->spans);
    }
    if (t->pending == NULL) {
        t->pending = calloc((size_t)g_config_queue_depth, sizeof *t->pending);
    }
    return t->spans != NULL && t->pending != NULL ? t : NULL;
}

/*
 * Queues `ns` of work on dev's timeline, unless the queue is full: then
 * *wait gets the time the oldest queued submission completes, and nothing
 * is queued.
 */
static CUresult submit_locked(int dev, unsigned long long ns, unsigned long long *wait) {
    struct timeline *t = timeline_locked(dev);
    unsigned long long now = now_ns(), start, end;
    size_t depth = (size_t)g_config_queue_depth;
    if (t == NULL) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    while (t->pending_len > 0 && t->pending[t->pending_head] <= now) {
        t->pending_head = (t->pending_head + 1) % depth;
        t->pending_len--;
    }
    if (t->pending_len == depth) {
        *wait = t->pending[t->pending_head];
        return CUDA_ERROR_NOT_READY;
    }
    start = t->busy_until > now ? t->busy_until : now;
    end = start + ns;
    t->pending[(t->pending_head + t->pending_len) % depth] = end;
    t->pending_len++;
    if (ns == 0) {
        return CUDA_SUCCESS;
    }
    if (t->after_event) {
        t->after_event = 0;
        end += g_config_event_ramp_ns;
        t->pending[(t->pending_head + t->pending_len - 1) % depth] = end;
    }
    t->busy_until = end;
    if (t->span_len > 0) {
        struct span *last = &t->spans[(t->span_head + t->span_len - 1) % SPAN_CAPACITY];
        if (last->end == start) {
            last->end = end;
            return CUDA_SUCCESS;
        }
    }
    if (t->span_len == SPAN_CAPACITY) {
        t->span_head = (t->span_head + 1) % SPAN_CAPACITY; /* the oldest is forgotten */
        t->span_len--;
    }
    t->spans[(t->span_head + t->span_len) % SPAN_CAPACITY] = (struct span){start, end};
    t->span_len++;
    return CUDA_SUCCESS;
}

unsigned long long device_busy_until(int dev) {
    return g_timelines[dev].busy_until;
}

/* An event was recorded on dev: its next kernel ramps up alone. */
void event_recorded_locked(int dev) {
    g_timelines[dev].after_event = 1;
}

/* When all work submitted so far on dev completes (at the earliest, now). */
unsigned long long drained_at_locked(int dev, unsigned long long now) {
    unsigned long long busy = g_timelines[dev].busy_until;
    return busy > now ? busy : now;
}

/* The duration a launch asks for: *(unsigned long long *)kernelParams[0] ns. */
static unsigned long long kernel_ns(void **kernelParams) {
    if (kernelParams == NULL || kernelParams[0] == NULL) {
        return g_config_kernel_ns;
    }
    return *(const unsigned long long *)kernelParams[0];
}

/*
 * Runs `ns` of work (`kernels` kernels) on the stream h: recorded into the
 * graph as a node of `type` when the stream is capturing, else queued on the
 * device's timeline, after sleeping while the queue is full. Under the lock,
 * after the stream,
 * `check` vets the launched object (NULL: nothing to vet), then `args_ok`
 * the other arguments (CUDA_ERROR_INVALID_VALUE when 0).
 */
CUresult enqueue(CUstream h, int ptsz, unsigned long long ns, unsigned long long kernels,
                 CUgraphNodeType type, CUresult (*check)(const void *),
                 const void *object, int args_ok) {
    for (;;) {
        struct CUstream_st *s = NULL;
        CUdevice dev = 0;
        unsigned long long wait = 0;
        CUresult rc;
        lock();
        rc = stream_locked(h, ptsz, &s, &dev);
        if (rc == CUDA_SUCCESS && check != NULL) {
            rc = check(object);
        }
        if (rc == CUDA_SUCCESS && !args_ok) {
            rc = CUDA_ERROR_INVALID_VALUE;
        }
        if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
            struct node n = {type, dev, 0, 0};
            if (s->capture->invalidated) {
                rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
            } else if ((rc = graph_add_locked(s->capture, n, NULL)) == CUDA_SUCCESS) {
                s->capture->ns += ns;
                s->capture->kernels += kernels;
            }
        } else if (rc == CUDA_SUCCESS) {
            rc = submit_locked(dev, ns, &wait);
        }
        unlock();
        if (rc != CUDA_ERROR_NOT_READY) {
            return rc;
        }
        sleep_until(wait); /* the launch queue is full: block, as a real launch does */
    }
}

static CUresult check_function(const void *f) {
    return function_locked((CUfunction)(uintptr_t)f) != NULL || kernel_locked(f) != NULL
               ? CUDA_SUCCESS
               : CUDA_ERROR_INVALID_HANDLE;
}

/* Launch dimensions within an H100's limits (see cuDeviceGetAttribute). */
static int valid_dims(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                      unsigned bz) {
    return gx >= 1 && gy >= 1 && gz >= 1 && gx <= 0x7fffffffU && gy <= 65535 && gz <= 65535 &&
           bx >= 1 && by >= 1 && bz >= 1 && bx <= 1024 && by <= 1024 && bz <= 64 &&
           (unsigned long long)bx * by * bz <= 1024;
}

/* Resident blocks per SM for blocks of `threads` threads: an H100's thread
 * and block limits (2048 and 32 per SM), as if nothing else limited occupancy. */
static unsigned blocks_per_sm(unsigned long long threads) {
    unsigned long long fit = threads == 0 ? 32 : DOUBLE_THREADS_PER_SM / threads;
    return fit == 0 ? 1 : fit > 32 ? 32 : (unsigned)fit;
}

/* A kernel of `blocks` blocks runs in waves of DOUBLE_SM_COUNT * blocks_per_sm
 * blocks; each block lasts the kernel's parameter, so the kernel lasts that
 * times its waves (1 for grids that fit at once, as every 1x1 launch does). */
static unsigned long long waves(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz) {
    unsigned long long blocks = (unsigned long long)gx * gy * gz;
    unsigned long long per_wave =
        (unsigned long long)DOUBLE_SM_COUNT * blocks_per_sm((unsigned long long)bx * by * bz);
    return blocks <= per_wave ? 1 : (blocks + per_wave - 1) / per_wave;
}

/* CUDA's lazy module loading: a function's first launch loads its module
 * inside the call, GPUSHARE_DOUBLE_LAZY_LOAD_US of host time (0 by default). */
static void load_lazily(CUfunction f) {
    unsigned long long load_us = env_count("GPUSHARE_DOUBLE_LAZY_LOAD_US", 0, 0, 10000000);
    struct CUfunc_st *fn;
    int first = 0;
    if (load_us == 0) {
        return;
    }
    lock();
    fn = function_locked(f);
    if (fn != NULL && !fn->launched) {
        fn->launched = 1;
        first = 1;
    }
    unlock();
    if (first) {
        sleep_until(now_ns() + load_us * 1000ULL);
    }
}

/* A launch with valid dimensions of a kernel handle runs its library's
 * function in the launch's context, after the library's first use there (a
 * first use that does not fit fails the launch). */
static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, CUstream h, int ptsz, unsigned long long ns) {
    int ok = valid_dims(gx, gy, gz, bx, by, bz);
    if (ok) {
        CUresult rc = kernel_launch_function(&f, h, ptsz);
        if (rc != CUDA_SUCCESS) {
            return rc;
        }
    }
    load_lazily(f);
    return enqueue(h, ptsz, ok ? ns * waves(gx, gy, gz, bx, by, bz) : ns, 1,
                   CU_GRAPH_NODE_TYPE_KERNEL, check_function, (const void *)f, ok);
}

CUresult impl_cuOccupancyMaxActiveBlocksPerMultiprocessor(int *numBlocks, CUfunction func,
                                                          int blockSize,
                                                          size_t dynamicSMemSize) {
    CUresult rc;
    (void)dynamicSMemSize;
    if (numBlocks == NULL || blockSize <= 0 || blockSize > 1024) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    lock();
    rc = function_locked(func) != NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
    unlock();
    if (rc == CUDA_SUCCESS) {
        *numBlocks = (int)blocks_per_sm((unsigned long long)blockSize);
    }
    return rc;
}

CUresult impl_cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                             unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                             unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                             void **kernelParams, void **extra) {
    (void)sharedMemBytes;
    (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                  unsigned int gridDimZ, unsigned int blockDimX,
                                  unsigned int blockDimY, unsigned int blockDimZ,
                                  unsigned int sharedMemBytes, CUstream hStream,
                                  void **kernelParams, void **extra) {
    (void)sharedMemBytes;
    (void)extra;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernel_ns(kernelParams));
}

static CUresult launch_ex(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                          int ptsz) {
    if (config == NULL) {
        return enqueue(NULL, ptsz, 0, 0, CU_GRAPH_NODE_TYPE_KERNEL, check_function,
                       (const void *)f, 0);
    }
    if (config->numAttrs > 0 && config->attrs == NULL) {
        return enqueue(config->hStream, ptsz, 0, 0, CU_GRAPH_NODE_TYPE_KERNEL, check_function,
                       (const void *)f, 0);
    }
    return launch(f, config->gridDimX, config->gridDimY, config->gridDimZ, config->blockDimX,
                  config->blockDimY, config->blockDimZ, config->hStream, ptsz,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                               void **extra) {
    (void)extra;
    return launch_ex(config, f, kernelParams, 0);
}

CUresult impl_cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                    void **kernelParams, void **extra) {
    (void)extra;
    return launch_ex(config, f, kernelParams, 1);
}

CUresult impl_cuLaunchCooperativeKernel(CUfunction f, unsigned int gridDimX,
                                        unsigned int gridDimY, unsigned int gridDimZ,
                                        unsigned int blockDimX, unsigned int blockDimY,
                                        unsigned int blockDimZ, unsigned int sharedMemBytes,
                                        CUstream hStream, void **kernelParams) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 0,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunchCooperativeKernel_ptsz(CUfunction f, unsigned int gridDimX,
                                             unsigned int gridDimY, unsigned int gridDimZ,
                                             unsigned int blockDimX, unsigned int blockDimY,
                                             unsigned int blockDimZ, unsigned int sharedMemBytes,
                                             CUstream hStream, void **kernelParams) {
    (void)sharedMemBytes;
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, hStream, 1,
                  kernel_ns(kernelParams));
}

CUresult impl_cuLaunch(CUfunction f) {
    return launch(f, 1, 1, 1, 1, 1, 1, NULL, 0, g_config_kernel_ns);
}

static unsigned grid_dim(int n) {
    return n < 1 ? 0 : (unsigned)n;
}

CUresult impl_cuLaunchGrid(CUfunction f, int grid_width, int grid_height) {
    return launch(f, grid_dim(grid_width), grid_dim(grid_height), 1, 1, 1, 1, NULL, 0,
                  g_config_kernel_ns);
}

CUresult impl_cuLaunchGridAsync(CUfunction f, int grid_width, int grid_height, CUstream hStream) {
    return launch(f, grid_dim(grid_width), grid_dim(grid_height), 1, 1, 1, 1, hStream, 0,
                  g_config_kernel_ns);
}

/* ---------------------------------------------------------------- busy time */

EXPORT unsigned long long gpushare_double_busy_ns(int device, unsigned long long from_ns,
                                                  unsigned long long to_ns) {
    const struct timeline *t;
    unsigned long long busy = 0;
    size_t lo = 0, hi, i;
    lock_raw(); /* an accessor for tests: it answers while a checkpoint lock holds */
    if (device < 0 || device >= g_config.devices || from_ns >= to_ns) {
        unlock();
        return 0;
    }
    t = &g_timelines[device];
    hi = t->span_len;
#define SPAN_AT(k) (t->spans[(t->span_head + (k)) % SPAN_CAPACITY])
    while (lo < hi) { /* the first span that ends after from_ns */
        size_t mid = lo + (hi - lo) / 2;
        if (SPAN_AT(mid).end <= from_ns) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    for (i = lo; i < t->span_len && SPAN_AT(i).start < to_ns; i++) {
        unsigned long long start = SPAN_AT(i).start > from_ns ? SPAN_AT(i).start : from_ns;
        unsigned long long end = SPAN_AT(i).end < to_ns ? SPAN_AT(i).end : to_ns;
        busy += end - start;
    }
#undef SPAN_AT
    unlock();
    return busy;
}

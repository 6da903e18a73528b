/*
 * cudaprobe's compute commands: the spin kernels launched through every
 * launch API (spin, run, pace, shapes, functions), timed on the double's
 * simulated clock, and what that clock reports (series, idle, maxstall).
 */
#include "probe.h"


/*
 * The spin kernels: gpushare_spin busy-waits on the GPU's global timer for
 * its one parameter, in ns; gpushare_spin_default, for the legacy launches
 * that pass no parameter, for 100 µs (the double's default kernel time). The
 * double runs any image; a real GPU JIT-compiles this.
 */
static const char spin_ptx[] =
    ".version 6.4\n"
    ".target sm_75\n"
    ".address_size 64\n"
    "\n"
    ".visible .entry gpushare_spin(.param .u64 gpushare_spin_ns)\n"
    "{\n"
    "    .reg .pred %p<2>;\n"
    "    .reg .b64 %rd<5>;\n"
    "    ld.param.u64 %rd1, [gpushare_spin_ns];\n"
    "    mov.u64 %rd2, %globaltimer;\n"
    "$L_spin:\n"
    "    mov.u64 %rd3, %globaltimer;\n"
    "    sub.s64 %rd4, %rd3, %rd2;\n"
    "    setp.lt.u64 %p1, %rd4, %rd1;\n"
    "    @%p1 bra $L_spin;\n"
    "    ret;\n"
    "}\n"
    "\n"
    ".visible .entry gpushare_spin_default()\n"
    "{\n"
    "    .reg .pred %p<2>;\n"
    "    .reg .b64 %rd<5>;\n"
    "    mov.u64 %rd1, 100000;\n"
    "    mov.u64 %rd2, %globaltimer;\n"
    "$L_spin_default:\n"
    "    mov.u64 %rd3, %globaltimer;\n"
    "    sub.s64 %rd4, %rd3, %rd2;\n"
    "    setp.lt.u64 %p1, %rd4, %rd1;\n"
    "    @%p1 bra $L_spin_default;\n"
    "    ret;\n"
    "}\n";

static CUfunction spin_function, spin_default_function;

unsigned long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (unsigned long long)ts.tv_sec * 1000000000ULL + (unsigned long long)ts.tv_nsec;
}

/* Loads the spin kernels once per process. */
static CUresult spin_kernel(void) {
    static CUmodule module;
    CUresult rc;
    if (spin_default_function != NULL) {
        return CUDA_SUCCESS;
    }
    if (module == NULL) {
        rc = CU_OPT(cuModuleLoadData, &module, spin_ptx);
        if (rc != CUDA_SUCCESS) {
            module = NULL;
            return rc;
        }
    }
    rc = CU_OPT(cuModuleGetFunction, &spin_function, module, "gpushare_spin");
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuModuleGetFunction, &spin_default_function, module,
                    "gpushare_spin_default");
    }
    if (rc != CUDA_SUCCESS) {
        spin_function = spin_default_function = NULL;
    }
    return rc;
}

/* One API launching kernels of one duration; graphs hold one captured kernel. */
struct launcher {
    enum launch_api api;
    unsigned long long ns;
    void *params[1];
    CUstream stream;
    CUgraph graph;
    CUgraphExec exec;
};

static CUresult launcher_open(struct launcher *l, enum launch_api api, unsigned long long dur_us) {
    CUresult rc;
    memset(l, 0, sizeof *l);
    l->api = api;
    l->ns = dur_us * 1000ULL;
    l->params[0] = &l->ns;
    rc = spin_kernel();
    if (rc != CUDA_SUCCESS || (api != LAUNCH_GRAPH && api != LAUNCH_GRAPH_PTSZ)) {
        return rc;
    }
    rc = CU_OPT(cuStreamCreate, &l->stream, CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) {
        l->stream = NULL;
        return rc;
    }
    /* GLOBAL, PyTorch's default: the mode that any thread's unsafe call breaks. */
    rc = CU_OPT(cuStreamBeginCapture_v2, l->stream, CU_STREAM_CAPTURE_MODE_GLOBAL);
    if (rc == CUDA_SUCCESS) {
        CUresult launched = CU_OPT(cuLaunchKernel, spin_function, 1, 1, 1, 1, 1, 1, 0,
                                   l->stream, l->params, NULL);
        rc = CU_OPT(cuStreamEndCapture, l->stream, &l->graph);
        if (rc != CUDA_SUCCESS) {
            l->graph = NULL;
        } else if (launched != CUDA_SUCCESS) {
            rc = launched;
        }
    }
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuGraphInstantiateWithFlags, &l->exec, l->graph, 0);
        if (rc != CUDA_SUCCESS) {
            l->exec = NULL;
        }
    }
    return rc;
}

static void launcher_close(struct launcher *l) {
    if (l->exec != NULL) {
        (void)CU_OPT(cuGraphExecDestroy, l->exec);
    }
    if (l->graph != NULL) {
        (void)CU_OPT(cuGraphDestroy, l->graph);
    }
    if (l->stream != NULL) {
        (void)CU_OPT(cuStreamDestroy_v2, l->stream);
    }
}

static CUresult launch_once(struct launcher *l) {
    CUfunction f = spin_function;
    switch (l->api) {
    case LAUNCH_KERNEL:
        return CU_OPT(cuLaunchKernel, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params, NULL);
    case LAUNCH_KERNEL_PTSZ:
        return CU_OPT(cuLaunchKernel_ptsz, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params, NULL);
    case LAUNCH_EX:
    case LAUNCH_EX_PTSZ: {
        CUlaunchConfig config;
        memset(&config, 0, sizeof config);
        config.gridDimX = config.gridDimY = config.gridDimZ = 1;
        config.blockDimX = config.blockDimY = config.blockDimZ = 1;
        if (l->api == LAUNCH_EX) {
            return CU_OPT(cuLaunchKernelEx, &config, f, l->params, NULL);
        }
        return CU_OPT(cuLaunchKernelEx_ptsz, &config, f, l->params, NULL);
    }
    case LAUNCH_COOP:
        return CU_OPT(cuLaunchCooperativeKernel, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params);
    case LAUNCH_COOP_PTSZ:
        return CU_OPT(cuLaunchCooperativeKernel_ptsz, f, 1, 1, 1, 1, 1, 1, 0, NULL, l->params);
    case LAUNCH_GRAPH:
        return CU_OPT(cuGraphLaunch, l->exec, NULL);
    case LAUNCH_GRAPH_PTSZ:
        return CU_OPT(cuGraphLaunch_ptsz, l->exec, NULL);
    case LAUNCH_LEGACY:
        return CU_OPT(cuLaunch, spin_default_function);
    case LAUNCH_GRID:
        return CU_OPT(cuLaunchGrid, spin_default_function, 1, 1);
    case LAUNCH_GRID_ASYNC:
        return CU_OPT(cuLaunchGridAsync, spin_default_function, 1, 1, NULL);
    case LAUNCH_COUNT:
        break;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* The last spin, run or pace: its interval, its slowest launch call, how
 * long the launching thread waited for a CPU meanwhile, and when its last
 * launch call returned. */
static struct {
    unsigned long long start, end, max_call, delay, launched;
} last_run;

/* The calling thread's run delay so far: the time it was runnable but not
 * running, the second field of /proc/thread-self/schedstat (0 where the
 * kernel keeps no such account). On a loaded machine this is what the
 * scheduler, not the limiter, took from a timed run. */
static unsigned long long run_delay_ns(void) {
    unsigned long long on_cpu = 0, waited = 0;
    FILE *f = fopen("/proc/thread-self/schedstat", "r");
    if (f == NULL) {
        return 0;
    }
    if (fscanf(f, "%llu %llu", &on_cpu, &waited) != 2) {
        waited = 0;
    }
    fclose(f);
    return waited;
}

/* Opens a measured command's interval: returns its start. */
static unsigned long long begin_run(void) {
    last_run.max_call = 0;
    last_run.delay = run_delay_ns();
    return now_ns();
}

/* Notes how long a launch call made at `before` took, for maxstall. */
static void note_call(unsigned long long before) {
    unsigned long long took = now_ns() - before;
    if (took > last_run.max_call) {
        last_run.max_call = took;
    }
}

/* One launch, timed into last_run.max_call. */
static CUresult timed_launch(struct launcher *l) {
    unsigned long long before = now_ns();
    CUresult rc = launch_once(l);
    note_call(before);
    last_run.launched = now_ns();
    return rc;
}

/* One launch and a synchronize before a paced run's clock starts, as
 * benchmarks warm up: the limiter measures its launch overhead once per
 * context, at its first sample (milliseconds), which a run of a few hundred
 * milliseconds would otherwise count as a cost of every launch. */
static CUresult warm_up(struct launcher *l, CUresult rc) {
    if (rc == CUDA_SUCCESS) {
        rc = launch_once(l);
    }
    if (rc == CUDA_SUCCESS) {
        rc = CU(cuCtxSynchronize)();
    }
    return rc;
}

/* Host work between paced launches: spins for `us` microseconds. */
static void host_work(unsigned long long us) {
    unsigned long long until = now_ns() + us * 1000ULL;
    while (now_ns() < until) {
        /* host work */
    }
}

static unsigned long long busy_between(unsigned long long from, unsigned long long to) {
    return busy_fn != NULL ? busy_fn(device_ordinal, from, to) : 0;
}

/* Ends a measured command: synchronize, close the interval. */
static CUresult finish_run(CUresult rc, unsigned long long start) {
    CUresult sync = CU(cuCtxSynchronize)();
    last_run.start = start;
    last_run.end = now_ns();
    last_run.delay = run_delay_ns() - last_run.delay;
    return rc != CUDA_SUCCESS ? rc : sync;
}

static unsigned long long per_mille(unsigned long long part, unsigned long long whole) {
    return whole == 0 ? 0 : part * 1000ULL / whole;
}

/*
 * spin (count launches) or, with `for_ns`, run (launches until count ns after
 * the first); stops at the first failed launch. Returns the result, with the
 * successful launches in *launches.
 */
static CUresult launch_loop(enum launch_api api, unsigned long long dur_us,
                            unsigned long long count, int for_ns, unsigned long long *launches) {
    struct launcher l;
    CUresult rc = launcher_open(&l, api, dur_us);
    unsigned long long start = begin_run();
    last_run.launched = start;
    *launches = 0;
    while (rc == CUDA_SUCCESS && (for_ns ? now_ns() - start < count : *launches < count)) {
        rc = timed_launch(&l);
        if (rc == CUDA_SUCCESS) {
            ++*launches;
        }
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    return rc;
}

void cmd_spin(const char *api_text, enum launch_api api, const char *dur_text,
              unsigned long long dur_us, const char *count_text, unsigned long long count) {
    unsigned long long launches = 0, wall, busy;
    CUresult rc = launch_loop(api, dur_us, count, 0, &launches);
    wall = last_run.end - last_run.start;
    busy = busy_between(last_run.start, last_run.end);
    emit("spin %s %s %s -> %d wall_ns=%llu busy_ns=%llu share_pm=%llu delay_ns=%llu "
         "launching_ns=%llu",
         api_text, dur_text, count_text, (int)rc, wall, busy, per_mille(busy, wall),
         last_run.delay, last_run.launched - last_run.start);
}

void cmd_run(const char *api_text, enum launch_api api, const char *dur_text,
             unsigned long long dur_us, const char *ms_text, unsigned long long ms) {
    unsigned long long launches = 0, wall, busy;
    CUresult rc = launch_loop(api, dur_us, ms * 1000000ULL, 1, &launches);
    wall = last_run.end - last_run.start;
    busy = busy_between(last_run.start, last_run.end);
    emit("run %s %s %s -> %d launches=%llu wall_ns=%llu busy_ns=%llu share_pm=%llu delay_ns=%llu",
         api_text, dur_text, ms_text, (int)rc, launches, wall, busy, per_mille(busy, wall),
         last_run.delay);
}
/* The closing line of shapes and functions: `what` is the command and its
 * first argument. */
static void emit_paced(const char *cmd, const char *what, const struct paced *p, CUresult rc) {
    unsigned long long wall = last_run.end - last_run.start;
    unsigned long long busy = busy_between(last_run.start, last_run.end);
    emit("%s %s %s %s %s -> %d ns_per_iter=%llu busy_ns=%llu share_pm=%llu delay_ns=%llu", cmd,
         what, p->dur_text, p->count_text, p->host_text, (int)rc,
         p->count == 0 ? 0 : wall / p->count, busy, per_mille(busy, wall), last_run.delay);
}

void cmd_pace(const char *api_text, enum launch_api api, const struct paced *p) {
    struct launcher l;
    CUresult rc = warm_up(&l, launcher_open(&l, api, p->dur_us));
    unsigned long long start = begin_run(), i;
    for (i = 0; rc == CUDA_SUCCESS && i < p->count; i++) {
        host_work(p->host_us);
        rc = timed_launch(&l);
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    emit("pace %s %s %s %s -> %d ns_per_iter=%llu delay_ns=%llu", api_text, p->dur_text,
         p->count_text, p->host_text, (int)rc,
         p->count == 0 ? 0 : (last_run.end - last_run.start) / p->count, last_run.delay);
}

void cmd_shapes(const char *n_text, unsigned long long n, const struct paced *p) {
    struct launcher l;
    CUresult rc = warm_up(&l, launcher_open(&l, LAUNCH_KERNEL, p->dur_us));
    unsigned long long start = begin_run(), i;
    for (i = 0; rc == CUDA_SUCCESS && i < p->count; i++) {
        unsigned grid = (unsigned)(1 + (i * 7919ULL) % n);
        unsigned long long before;
        host_work(p->host_us);
        before = now_ns();
        rc = CU_OPT(cuLaunchKernel, spin_function, grid, 1, 1, 128, 1, 1, 0, NULL, l.params, NULL);
        note_call(before);
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    emit_paced("shapes", n_text, p, rc);
}

void cmd_functions(const char *f_text, unsigned long long f, const struct paced *p) {
    struct launcher l;
    /* Warmed up with the spin function: the F functions stay unseen. */
    CUresult rc = warm_up(&l, launcher_open(&l, LAUNCH_KERNEL, p->dur_us));
    CUfunction *functions = calloc((size_t)f, sizeof *functions);
    CUmodule module = NULL;
    unsigned long long start, i;
    if (functions == NULL) {
        die(1, "out of host memory");
    }
    if (rc == CUDA_SUCCESS) {
        rc = CU_OPT(cuModuleLoadData, &module, spin_ptx);
    }
    for (i = 0; rc == CUDA_SUCCESS && i < f; i++) {
        char name[64];
        snprintf(name, sizeof name, "gpushare_spin_f%llu", i);
        rc = CU_OPT(cuModuleGetFunction, &functions[i], module, name);
    }
    start = begin_run();
    for (i = 0; rc == CUDA_SUCCESS && i < p->count; i++) {
        unsigned long long before;
        host_work(p->host_us);
        before = now_ns();
        rc = CU_OPT(cuLaunchKernel, functions[i % f], 1, 1, 1, 1, 1, 1, 0, NULL, l.params, NULL);
        note_call(before);
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    free(functions);
    emit_paced("functions", f_text, p, rc);
}

/* Sleeps until CLOCK_MONOTONIC reaches `at` ns. */
static void sleep_until(unsigned long long at) {
    struct timespec ts;
    ts.tv_sec = (time_t)(at / 1000000000ULL);
    ts.tv_nsec = (long)(at % 1000000000ULL);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static void append_text(char **text, size_t *len, size_t *cap, const char *item, size_t n);

void cmd_periodic(const struct periodic *p) {
    struct launcher l;
    CUresult rc = launcher_open(&l, LAUNCH_KERNEL, p->dur_us);
    unsigned long long start = begin_run(), late_max = 0, i, k;
    size_t cap = 64, len = 0;
    char *text = malloc(cap);
    if (text == NULL) {
        die(1, "out of host memory");
    }
    text[0] = '\0';
    for (i = 0; rc == CUDA_SUCCESS && i < p->count; i++) {
        unsigned long long due = start + i * p->period_us * 1000ULL, arrival;
        char item[32];
        int n;
        sleep_until(due);
        arrival = now_ns();
        if (arrival - due > late_max) {
            late_max = arrival - due;
        }
        for (k = 0; rc == CUDA_SUCCESS && k < p->kernels; k++) {
            rc = timed_launch(&l);
        }
        if (rc == CUDA_SUCCESS) {
            rc = CU(cuCtxSynchronize)();
        }
        n = snprintf(item, sizeof item, "%s%llu", len == 0 ? "" : ",", arrival);
        append_text(&text, &len, &cap, item, (size_t)n);
    }
    rc = finish_run(rc, start);
    launcher_close(&l);
    emit("periodic %s %s %s %s -> %d late_max_ns=%llu at=%s", p->kernels_text, p->dur_text,
         p->period_text, p->count_text, (int)rc, late_max, text);
    free(text);
}

/* Appends item (n bytes) to the growing NUL-terminated string *text. */
static void append_text(char **text, size_t *len, size_t *cap, const char *item, size_t n) {
    if (*len + n + 1 > *cap) {
        char *grown;
        *cap = 2 * (*len + n + 1);
        grown = realloc(*text, *cap);
        if (grown == NULL) {
            die(1, "out of host memory");
        }
        *text = grown;
    }
    memcpy(*text + *len, item, n + 1);
    *len += n;
}

void cmd_series(const char *window_text, unsigned long long window_ms) {
    unsigned long long window = window_ms * 1000000ULL, from;
    size_t cap = 64, len = 0;
    char *text = malloc(cap);
    if (text == NULL) {
        die(1, "out of host memory");
    }
    text[0] = '\0';
    for (from = last_run.start; window != 0 && last_run.end - from >= window; from += window) {
        char item[32];
        int n = snprintf(item, sizeof item, "%s%llu", len == 0 ? "" : ",",
                         per_mille(busy_between(from, from + window), window));
        append_text(&text, &len, &cap, item, (size_t)n);
    }
    emit("series %s pm=%s", window_text, text);
    free(text);
}

/* Appends an ",a-b" item ("a-b" first) to the growing string *text. */
static void append_span(char **text, size_t *len, size_t *cap, unsigned long long a,
                        unsigned long long b) {
    char item[48];
    int n = snprintf(item, sizeof item, "%s%llu-%llu", *len == 0 ? "" : ",", a, b);
    append_text(text, len, cap, item, (size_t)n);
}

void cmd_idle(const char *step_text, unsigned long long step_us) {
    unsigned long long step = step_us * 1000ULL, from, idle_from = 0;
    int in_idle = 0;
    size_t cap = 64, len = 0;
    char *text = malloc(cap);
    if (text == NULL) {
        die(1, "out of host memory");
    }
    text[0] = '\0';
    for (from = last_run.start; step != 0 && last_run.end - from >= step; from += step) {
        int idle = busy_between(from, from + step) == 0;
        if (idle && !in_idle) {
            idle_from = from;
        } else if (!idle && in_idle) {
            append_span(&text, &len, &cap, idle_from, from);
        }
        in_idle = idle;
    }
    if (in_idle) {
        append_span(&text, &len, &cap, idle_from, from);
    }
    emit("idle %s at=%s", step_text, text);
    free(text);
}

void cmd_settled(void) {
    /* The smallest t with no busy time in [t, end): busy_between(end, end)
     * is 0, so the search starts with a bound that holds. */
    unsigned long long lo = last_run.start, hi = last_run.end;
    while (lo < hi) {
        unsigned long long mid = lo + (hi - lo) / 2;
        if (busy_between(mid, last_run.end) == 0) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    if (busy_between(last_run.start, last_run.end) == 0) {
        lo = last_run.start;
    }
    emit("settled ns=%llu from_start_ns=%llu", lo == last_run.start ? 0ULL : lo,
         lo - last_run.start);
}

void cmd_maxstall(void) {
    emit("maxstall ns=%llu", last_run.max_call);
}


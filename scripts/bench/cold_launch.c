/*
 * The launch path when it runs cold: COUNT x (touch KB of host memory, one
 * byte every STRIDE bytes (default 64, every cache line), with CODE 1 run
 * 64 KB of straight-line code (the L1 instruction cache), with CODE 2 also
 * jump through 2,048 code pages (the TLBs), spin SPIN_US µs on the clock
 * (default 0; 20 is compute_bench's paced loop), then one empty-kernel
 * launch through the driver API), printing the mean time per iteration,
 * and the mean and median time inside the launch call. A
 * host-bound application's own work between launches evicts the limiter's
 * code and data; a tight loop hides that. Run without and with the limiter
 * (LD_PRELOAD, a limit that does not bind) and compare call_median_ns. One
 * launch and a synchronisation come before the timed loop: the limiter's
 * first limited launch measures the context's launch overhead (about 10 ms
 * on the double), which spread over 100,000 launches would add ~95 ns to
 * every call.
 *
 * Against the workspace's driver double (no GPU; DOUBLE = the double's
 * folder, target/release/build/gpushare-examples-HASH/out/double):
 *   cc -O2 -I examples/double -o cold_launch scripts/bench/cold_launch.c -L$DOUBLE -l:libcuda.so.1
 *   LD_LIBRARY_PATH=$DOUBLE [LD_PRELOAD=.../libcuda_limiter.so CUDA_DEVICE_SM_LIMIT=50] \
 *     taskset -c 1 ./cold_launch 100000 64
 * On a real driver: cc ... -l:libcuda.so.1 without -L, and no LD_LIBRARY_PATH;
 * ./cold_launch 20000 0 64 20 is the paced loop of compute_bench (20 µs).
 * Check that the limit does not bind (CUDA_LIMITER_LOG=info prints the exit
 * summary: waited_for_budget_ms must be 0): on the double a kernel lasts
 * 100 ns, so a loop without host work (KB=0, no spin) binds at 50%.
 * On the double, KB=64, taskset -c 1, 3 runs each, call medians:
 * no limiter 107 ns; limiter 170/171/170 without leases, 162/161/167 with
 * them. Two processes of one pod, KB=0, 1 µs spin, one core each:
 * 201-211 ns without leases against 125-129 with them (one process alone:
 * 138-142 and 125-129): the shared bucket's line moving between cores.
 * On the double, KB=3072 CODE=1 SPIN_US=5 (the path runs from the
 * last-level cache), medians of 8 alternated processes: no limiter 500-522
 * ns, an experiment build that bypassed at its admission's start 551-572,
 * the limiter with the device, budget and class resolved and no limit
 * applying (L=100) 636-640, the full path 760-770;
 * KB=64 CODE=2: 368 against 508-521.
 * Each process lands in a layout of its own (per-process call medians on
 * the H100 machine spread from 3.2 to 4.6 µs, a tenth of them near 8), so
 * compare many alternated processes, or the metering against itself in one
 * process.
 */
#include "cuda_min.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* An empty kernel with one parameter (the double reads its duration there). */
static const char ptx[] =
    ".version 6.4\n.target sm_75\n.address_size 64\n"
    ".visible .entry gpushare_empty(.param .u64 ns)\n{\n    ret;\n}\n";

/* 64 KB of straight-line code: run between launches, it leaves the
 * limiter's code out of the L1 instruction cache, as a driver's launch does. */
__attribute__((noinline)) static void evict_code(void) {
    __asm__ volatile(".rept 16384\n\tlea 1(%%rax), %%rax\n\t.endr" ::: "rax");
}

/* A chain of jumps through 2,048 code pages (8 MB): run between launches,
 * it leaves the limiter's code pages out of the TLBs, as a real driver's
 * launch (libcuda is ~100 MB) may. */
__asm__(".text\n.p2align 12\n.globl tlb_chain\ntlb_chain:\n.rept 2048\njmp 1f\n.p2align 12\n1:\n.endr\nret\n");
void tlb_chain(void);

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    unsigned long long x = *(const unsigned long long *)a, y = *(const unsigned long long *)b;
    return (x > y) - (x < y);
}

#define CHECK(call)                                                  \
    do {                                                             \
        CUresult rc_ = (call);                                       \
        if (rc_ != CUDA_SUCCESS) {                                   \
            fprintf(stderr, "%s failed: %d\n", #call, (int)rc_);     \
            return 1;                                                \
        }                                                            \
    } while (0)

int main(int argc, char **argv) {
    if (argc < 3 || argc > 6) {
        fprintf(stderr, "usage: cold_launch COUNT KB [STRIDE [SPIN_US [CODE]]]\n");
        return 2;
    }
    long count = atol(argv[1]);
    size_t bytes = (size_t)atol(argv[2]) * 1024;
    size_t stride = argc >= 4 ? (size_t)atol(argv[3]) : 64;
    int code = argc == 6 ? atoi(argv[5]) : 0;
    unsigned long long spin_ns = argc >= 5 ? (unsigned long long)(atof(argv[4]) * 1000) : 0;
    if (stride == 0 || count < 1) {
        fprintf(stderr, "STRIDE and COUNT must be at least 1\n");
        return 2;
    }
    unsigned long long *calls = malloc((size_t)count * sizeof *calls);
    if (calls == NULL) {
        return 1;
    }
    CUdevice device;
    CUcontext context;
    CUmodule module;
    CUfunction function;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&device, 0));
    CHECK(cuCtxCreate_v2(&context, 0, device));
    CHECK(cuModuleLoadData(&module, ptx));
    CHECK(cuModuleGetFunction(&function, module, "gpushare_empty"));
    unsigned long long kernel_ns = 100; /* on the double: a limit of 50% does not bind */
    void *params[1] = {&kernel_ns};
    volatile char *buffer = malloc(bytes + 1);
    if (buffer == NULL) {
        return 1;
    }
    memset((char *)buffer, 1, bytes + 1);
    /* Warm up outside the timed loop, as compute_bench's modes do: the
     * limiter's first limited launch measures the context's launch overhead
     * (about 10 ms on the double), which would otherwise add ~100 ns to
     * every call of a 100,000-launch run. */
    CHECK(cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
    CHECK(cuCtxSynchronize());
    unsigned long long in_call = 0, start = now_ns();
    for (long i = 0; i < count; i++) {
        for (size_t j = 0; j < bytes; j += stride) {
            buffer[j]++;
        }
        if (code) {
            evict_code();
        }
        if (code > 1) {
            tlb_chain();
        }
        for (unsigned long long until = now_ns() + spin_ns; spin_ns > 0 && now_ns() < until;) {
        }
        unsigned long long before = now_ns();
        CHECK(cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
        calls[i] = now_ns() - before;
        in_call += calls[i];
    }
    CHECK(cuCtxSynchronize());
    double wall = (double)(now_ns() - start);
    qsort(calls, (size_t)count, sizeof *calls, by_value);
    printf("mode=cold kb=%ld launches=%ld ns_per_iter=%.0f call_ns=%.0f call_median_ns=%llu\n",
           atol(argv[2]), count, wall / (double)count, (double)in_call / (double)count,
           calls[count / 2]);
    free(calls);
    return 0;
}

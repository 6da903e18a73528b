/*
 * The launch path when it runs cold: COUNT x (touch KB of host memory, one
 * byte every STRIDE bytes (default 64, every cache line), then one
 * empty-kernel launch through the driver API), printing the mean time per
 * iteration and inside the launch call. A host-bound application's own work
 * between launches evicts the limiter's code and data; a tight loop hides
 * that. Run without and with the limiter (LD_PRELOAD, a limit that does not
 * bind) and compare call_ns.
 *
 * Against the workspace's driver double (no GPU; DOUBLE = the double's
 * folder, target/debug/build/gpushare-examples-HASH/out/double):
 *   cc -O2 -I examples/double -o cold_launch scripts/bench/cold_launch.c -L$DOUBLE -l:libcuda.so.1
 *   LD_LIBRARY_PATH=$DOUBLE [LD_PRELOAD=.../libcuda_limiter.so CUDA_DEVICE_SM_LIMIT=50] \
 *     taskset -c 1 ./cold_launch 100000 4096
 * Check that the limit does not bind (CUDA_LIMITER_LOG=info prints the exit
 * summary: waited_for_budget_ms must be 0): with KB=0 a launch comes every
 * ~0.5 us and a 50% limit binds on the double (charged_share 0.51), so the
 * call time then holds waiting, not the launch path; KB=64 (host work that
 * evicts the L1 caches, about 1 us) does not bind.
 * On the double, a limit of 50%, medians of 9 alternated runs (min):
 *   KB=64:   no limiter 179 ns a call (168); limiter 385 (376), of which
 *            the detour ~30 ns, budget, waves and price ~35, the rest (clock,
 *            admission, class, sampling decision, launch through the
 *            forwarder) ~140; without the bucket's admission 381 (369): its
 *            atomic operations cost next to nothing.
 *   KB=4096: no limiter 517 (397); limiter 1649 (1484): the path's ~20
 *            distinct cold data lines (cachegrind) cost far more than its
 *            ~700 instructions.
 * The launch path's code is now one shared copy (Throttle::admit and
 * ::launched) with the rare branches out of line: 735 instructions a launch
 * on the double (callgrind) against 889 before; in the same runs (9 each)
 * KB=64 408 ns (min 360) against 414 (380), KB=4096 1630 (1443) against
 * 1649 (1484): within the noise.
 * Caches or address translation: KB=128 STRIDE=64 touches 2,048 lines on
 * 32 pages, KB=8320 STRIDE=4160 the same number of lines on 2,048 pages
 * (past the TLBs). Stop 21, a slower day on the same machine, medians of 7
 * alternated runs: no limiter 203 and 411 ns, limiter 611 and 974: the
 * limiter adds 408 ns with its lines evicted from L1, 563 with its pages
 * evicted from the TLBs too (~16 pages a launch, valgrind lackey).
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

static unsigned long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ULL + (unsigned long long)t.tv_nsec;
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
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: cold_launch COUNT KB [STRIDE]\n");
        return 2;
    }
    long count = atol(argv[1]);
    size_t bytes = (size_t)atol(argv[2]) * 1024;
    size_t stride = argc == 4 ? (size_t)atol(argv[3]) : 64;
    if (stride == 0) {
        fprintf(stderr, "STRIDE must be at least 1\n");
        return 2;
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
    unsigned long long in_call = 0, start = now_ns();
    for (long i = 0; i < count; i++) {
        for (size_t j = 0; j < bytes; j += stride) {
            buffer[j]++;
        }
        unsigned long long before = now_ns();
        CHECK(cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL));
        in_call += now_ns() - before;
    }
    CHECK(cuCtxSynchronize());
    printf("mode=cold kb=%ld launches=%ld ns_per_iter=%.0f call_ns=%.0f\n", atol(argv[2]), count,
           (double)(now_ns() - start) / (double)count, (double)in_call / (double)count);
    return 0;
}

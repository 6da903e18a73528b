/*
 * The launch path when it runs cold: COUNT x (touch KB of host memory, one
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
 * On the double (stop 19, a limit of 50%, two runs each): the limiter added
 * about 260 ns to a warm call (KB=0: 152-161 ns without, 419-423 with) and
 * about 480 ns to a call after 4 MiB of host work (KB=4096: 389-437 ns
 * without, 891-913 with), about what it adds to the paced loop on the H100
 * VM. Prefetching the bucket, slot, occupancy and Throttle lines at the top
 * of the launch path did not lower the cold figure (775-856 ns a call
 * before, 751-876 after, 1 us kernels), so the misses that cost are not
 * (only) those data lines: code, TLS, or the lines reached through them.
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
    if (argc != 3) {
        fprintf(stderr, "usage: cold_launch COUNT KB\n");
        return 2;
    }
    long count = atol(argv[1]);
    size_t bytes = (size_t)atol(argv[2]) * 1024;
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
        for (size_t j = 0; j < bytes; j += 64) {
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

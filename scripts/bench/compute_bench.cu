// Compute-limiter benchmarks: the CUDA side. One mode per run; each prints
// one line of key=value pairs. Built by scripts/bench/run.sh with nvcc
// (static cudart, so launches reach the driver's cuLaunchKernel*).
//
//   shapes N SECONDS HOST_US ITERS [BUSY]
//                                   launch i runs a grid of 1 + (i * 7919) % N
//                                   blocks of 128 threads (N distinct shapes),
//                                   each block ITERS dependent FMAs, after
//                                   HOST_US of host busy-work; for SECONDS
//                                   -> launches_per_s; then, unless BUSY is 0,
//                                   the same launches back to back -> gpu_busy
//                                   (a limited run passes 0: there those
//                                   launches bind, and its exit summary's waits
//                                   and charged share would count them)
//   calibrate US                    ITERS for which `fixed` kernels last ~US µs
//   fixed ITERS SECONDS             back-to-back kernels of one 32-thread block
//                                   per SM doing ITERS dependent FMAs (same
//                                   arithmetic every kernel, latency-bound, so
//                                   the clock does not depend on the power
//                                   drawn) -> kernels_per_s, kernel_us
//   tight COUNT                     COUNT empty-kernel launches -> ns_per_launch
//   pace HOST_US COUNT              COUNT x (HOST_US host work, one empty
//                                   launch) -> ns_per_iter
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define CHECK(call)                                                                   \
    do {                                                                              \
        cudaError_t err_ = (call);                                                    \
        if (err_ != cudaSuccess) {                                                    \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,              \
                    cudaGetErrorString(err_));                                        \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

__global__ void empty_kernel() {}

// Dependent FMAs: latency-bound, the same time whatever the grid's neighbours.
__global__ void fma_chain(float *sink, long iters) {
    float x = threadIdx.x * 1e-3f;
    for (long i = 0; i < iters; i++) {
        x = fmaf(x, 0.999999f, 1e-6f);
    }
    if (x == 123456.0f) {
        sink[blockIdx.x] = x;  // never true; keeps the loop
    }
}

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

static void host_work(double us) {
    double until = now_s() + us * 1e-6;
    while (now_s() < until) {
    }
}

static int sm_count() {
    int device = 0, sms = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    return sms;
}

static float *sink() {
    static float *buffer = nullptr;
    if (buffer == nullptr) {
        CHECK(cudaMalloc(&buffer, 1 << 20));
    }
    return buffer;
}

static void shapes(long n, double seconds, double host_us, long iters, bool busy) {
    float *out = sink();
    fma_chain<<<1, 128>>>(out, iters);  // warm up: module load, first launch
    CHECK(cudaDeviceSynchronize());
    long launches = 0;
    double start = now_s();
    while (now_s() - start < seconds) {
        if (host_us > 0) {
            host_work(host_us);
        }
        unsigned grid = (unsigned)(1 + (launches * 7919L) % n);
        fma_chain<<<grid, 128>>>(out, iters);
        launches++;
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGetLastError());
    double wall = now_s() - start;
    if (!busy) {
        printf("mode=shapes shapes=%ld launches=%ld wall_s=%.4f launches_per_s=%.1f\n", n, launches,
               wall, launches / wall);
        return;
    }
    // The GPU time of the same launches back to back: the share of the GPU
    // the paced loop needed (meaningful without a limiter, which may hold
    // launches and so leave gaps inside this bracket).
    long sample = launches < 20000 ? launches : 20000;
    cudaEvent_t first, last;
    CHECK(cudaEventCreate(&first));
    CHECK(cudaEventCreate(&last));
    CHECK(cudaEventRecord(first));
    for (long i = 0; i < sample; i++) {
        fma_chain<<<(unsigned)(1 + (i * 7919L) % n), 128>>>(out, iters);
    }
    CHECK(cudaEventRecord(last));
    CHECK(cudaEventSynchronize(last));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, first, last));
    double gpu_busy = ms * 1e-3 / sample * launches / wall;
    printf("mode=shapes shapes=%ld launches=%ld wall_s=%.4f launches_per_s=%.1f gpu_busy=%.3f\n",
           n, launches, wall, launches / wall, gpu_busy);
}

static double fixed_kernel_us(long iters, int reps) {
    float *out = sink();
    int sms = sm_count();
    cudaEvent_t start, end;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&end));
    fma_chain<<<sms, 32>>>(out, iters);
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < reps; i++) {
        fma_chain<<<sms, 32>>>(out, iters);
    }
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    return ms * 1e3 / reps;
}

static void calibrate(double target_us) {
    long iters = 4096;
    double us = fixed_kernel_us(iters, 20);
    for (int round = 0; round < 3; round++) {
        iters = (long)(iters * target_us / us);
        us = fixed_kernel_us(iters, 20);
    }
    printf("mode=calibrate target_us=%.1f iters=%ld kernel_us=%.2f\n", target_us, iters, us);
}

static void fixed(long iters, double seconds) {
    float *out = sink();
    int sms = sm_count();
    fma_chain<<<sms, 32>>>(out, iters);
    CHECK(cudaDeviceSynchronize());
    long kernels = 0;
    double start = now_s();
    while (now_s() - start < seconds) {
        fma_chain<<<sms, 32>>>(out, iters);
        kernels++;
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaGetLastError());
    double wall = now_s() - start;
    printf("mode=fixed iters=%ld kernels=%ld wall_s=%.4f kernels_per_s=%.2f\n", iters, kernels,
           wall, kernels / wall);
}

static void tight(long count) {
    empty_kernel<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
    double start = now_s();
    for (long i = 0; i < count; i++) {
        empty_kernel<<<1, 1>>>();
    }
    CHECK(cudaDeviceSynchronize());
    double wall = now_s() - start;
    printf("mode=tight launches=%ld ns_per_launch=%.1f\n", count, wall * 1e9 / count);
}

static void pace(double host_us, long count) {
    empty_kernel<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
    double start = now_s(), in_call = 0;
    for (long i = 0; i < count; i++) {
        host_work(host_us);
        double before = now_s();
        empty_kernel<<<1, 1>>>();
        in_call += now_s() - before;
    }
    CHECK(cudaDeviceSynchronize());
    double wall = now_s() - start;
    printf("mode=pace host_us=%.1f launches=%ld ns_per_iter=%.1f call_ns=%.1f\n", host_us, count,
           wall * 1e9 / count, in_call * 1e9 / count);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "shapes") == 0 && (argc == 6 || argc == 7)) {
        shapes(atol(argv[2]), atof(argv[3]), atof(argv[4]), atol(argv[5]),
               argc == 6 || atoi(argv[6]) != 0);
    } else if (strcmp(mode, "calibrate") == 0 && argc == 3) {
        calibrate(atof(argv[2]));
    } else if (strcmp(mode, "fixed") == 0 && argc == 4) {
        fixed(atol(argv[2]), atof(argv[3]));
    } else if (strcmp(mode, "tight") == 0 && argc == 3) {
        tight(atol(argv[2]));
    } else if (strcmp(mode, "pace") == 0 && argc == 4) {
        pace(atof(argv[2]), atol(argv[3]));
    } else {
        fprintf(stderr, "usage: see the comment at the top of compute_bench.cu\n");
        return 2;
    }
    return 0;
}

// Compute-limiter benchmarks: the CUDA side. One mode per run; each prints
// one line of key=value pairs. Built with nvcc by `python3 -m scripts.bench`
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
//   pace HOST_US COUNT [WINDOWS]    COUNT x (HOST_US host work, one empty
//                                   launch) -> ns_per_iter, call_ns; WINDOWS
//                                   (default 1) such runs back to back in the
//                                   process, each also printed (iterK, callK):
//                                   one-time costs land in the first, and a
//                                   process that speeds up as it runs shows it
//   mimic COUNT ROUNDS              a limiter's sample imitated without one:
//                                   ROUNDS x 5 windows of COUNT paced launches
//                                   (20 us host work), window K in mode K:
//                                   0 nothing; 1 every 640th launch bracketed
//                                   like a sample (stream query, two timing
//                                   events) and read by a monitor thread (woken
//                                   by a condition variable, polling every
//                                   100 us); 2 read by the launching thread at
//                                   its next sample instead; 3 as 1 without the
//                                   stream query; 4 as 1 with events without
//                                   timing -> rRmK=ns_per_iter/call_ns
//   pace-ab HOST_US COUNT           the paced loop inside one process, the
//                                   limiter's admission switched off on every
//                                   other pair of launches (ABBA) through
//                                   gpushare_launch_ab_bypass, which only a
//                                   limiter built with the `launch-ab` feature
//                                   exports -> call_full/call_bypass (medians),
//                                   p99_/p999_/mean_full/bypass (the launch
//                                   call's 99th and 99.9th percentiles and
//                                   mean), iter_full/iter_bypass (means), ns
// pace's windows and mimic are run by its launch-cost subcommand, pace-ab
// by launch-ab (scripts/bench/launch.py).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <dlfcn.h>

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

// One window of the paced loop: COUNT x (HOST_US host work, one empty
// launch); returns its wall time and adds the time inside launches to in_call.
static double paced_window(double host_us, long count, double *in_call) {
    double start = now_s();
    for (long i = 0; i < count; i++) {
        host_work(host_us);
        double before = now_s();
        empty_kernel<<<1, 1>>>();
        *in_call += now_s() - before;
    }
    return now_s() - start;
}

static void pace(double host_us, long count, int windows) {
    empty_kernel<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
    double start = now_s(), in_call = 0;
    char each[64 * 32] = "";
    for (int w = 0; w < windows; w++) {
        double window_call = 0;
        double window = paced_window(host_us, count, &window_call);
        in_call += window_call;
        if (windows > 1 && w < 64) {
            size_t used = strlen(each);
            snprintf(each + used, sizeof each - used, " iter%d=%.1f call%d=%.1f", w,
                     window * 1e9 / count, w, window_call * 1e9 / count);
        }
    }
    CHECK(cudaDeviceSynchronize());
    double wall = now_s() - start;
    long launches = count * windows;
    printf("mode=pace host_us=%.1f launches=%ld ns_per_iter=%.1f call_ns=%.1f%s\n", host_us,
           launches, wall * 1e9 / launches, in_call * 1e9 / launches, each);
}

// The paced loop with the limiter's admission on and off in turn (ABBA), so
// that the host's drift and the process's layout are the same for both.
static void pace_ab(double host_us, long count) {
    auto bypass = (void (*)(int))dlsym(RTLD_DEFAULT, "gpushare_launch_ab_bypass");
    if (!bypass) {
        fprintf(stderr, "pace-ab: no gpushare_launch_ab_bypass (a limiter built with "
                        "--features launch-ab must be preloaded)\n");
        exit(2);
    }
    empty_kernel<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
    std::vector<double> call[2];
    double iter[2] = {0, 0};
    for (long i = 0; i < count; i++) {
        int off = (i & 3) == 1 || (i & 3) == 2;
        bypass(off);
        double start = now_s();
        host_work(host_us);
        double before = now_s();
        empty_kernel<<<1, 1>>>();
        double after = now_s();
        call[off].push_back((after - before) * 1e9);
        iter[off] += (after - start) * 1e9;
    }
    bypass(0);
    CHECK(cudaDeviceSynchronize());
    double median[2], p99[2], p999[2], mean[2];
    for (int m = 0; m < 2; m++) {
        std::vector<double> &calls = call[m];
        std::sort(calls.begin(), calls.end());
        median[m] = calls[calls.size() / 2];
        p99[m] = calls[calls.size() * 99 / 100];
        p999[m] = calls[calls.size() * 999 / 1000];
        double sum = 0;
        for (double ns : calls) sum += ns;
        mean[m] = sum / calls.size();
    }
    // Where the mean's difference comes from: the common launch (median) or
    // the rare slow ones (the tail).
    printf("mode=pace-ab host_us=%.1f launches=%ld call_full=%.1f call_bypass=%.1f "
           "p99_full=%.1f p99_bypass=%.1f p999_full=%.1f p999_bypass=%.1f mean_full=%.1f "
           "mean_bypass=%.1f iter_full=%.1f iter_bypass=%.1f\n",
           host_us, count, median[0], median[1], p99[0], p99[1], p999[0], p999[1], mean[0],
           mean[1], iter[0] / call[0].size(), iter[1] / call[1].size());
}

// The monitor of `mimic`: reads each bracket handed to it once its end event
// completed, polling every 100 us, as the limiter's monitor thread does.
struct MimicMonitor {
    std::mutex mu;
    std::condition_variable cv;
    cudaEvent_t start = nullptr, end = nullptr;
    bool pending = false, quit = false;
    std::atomic<long> reads{0};

    void run() {
        std::unique_lock<std::mutex> lock(mu);
        while (true) {
            cv.wait(lock, [this] { return pending || quit; });
            if (quit) {
                return;
            }
            cudaEvent_t a = start, b = end;
            pending = false;
            lock.unlock();
            while (cudaEventQuery(b) == cudaErrorNotReady) {
                std::this_thread::sleep_for(std::chrono::microseconds(100));
            }
            float ms;
            cudaEventElapsedTime(&ms, a, b);
            reads++;
            lock.lock();
        }
    }

    void hand(cudaEvent_t a, cudaEvent_t b) {
        std::lock_guard<std::mutex> guard(mu);
        start = a;
        end = b;
        pending = true;
        cv.notify_one();
    }

    void stop() {
        std::lock_guard<std::mutex> guard(mu);
        quit = true;
        cv.notify_one();
    }
};

static void mimic(long count, int rounds) {
    empty_kernel<<<1, 1>>>();
    CHECK(cudaDeviceSynchronize());
    cudaEvent_t timed[8], untimed[8];
    for (int i = 0; i < 8; i++) {
        CHECK(cudaEventCreate(&timed[i]));
        CHECK(cudaEventCreateWithFlags(&untimed[i], cudaEventDisableTiming));
    }
    MimicMonitor monitor;
    std::thread monitor_thread([&monitor] { monitor.run(); });
    int next = 0;
    cudaEvent_t own_start = nullptr, own_end = nullptr;
    printf("mode=mimic");
    for (int r = 0; r < rounds; r++) {
        for (int mode = 0; mode < 5; mode++) {
            double start = now_s(), in_call = 0;
            for (long i = 0; i < count; i++) {
                host_work(20);
                bool sample = mode != 0 && i % 640 == 320;
                double before = now_s();
                if (sample) {
                    cudaEvent_t *pool = mode == 4 ? untimed : timed;
                    cudaEvent_t a = pool[next % 8], b = pool[(next + 1) % 8];
                    next += 2;
                    if (mode != 3) {
                        cudaStreamQuery(0);
                    }
                    if (mode == 2 && own_end != nullptr) {
                        while (cudaEventQuery(own_end) == cudaErrorNotReady) {
                        }
                        float ms;
                        cudaEventElapsedTime(&ms, own_start, own_end);
                    }
                    cudaEventRecord(a, 0);
                    empty_kernel<<<1, 1>>>();
                    cudaEventRecord(b, 0);
                    if (mode == 2) {
                        own_start = a;
                        own_end = b;
                    } else {
                        monitor.hand(a, b);
                    }
                } else {
                    empty_kernel<<<1, 1>>>();
                }
                in_call += now_s() - before;
            }
            double wall = now_s() - start;
            printf(" r%dm%d=%.1f/%.1f", r, mode, wall * 1e9 / count, in_call * 1e9 / count);
            CHECK(cudaDeviceSynchronize());
        }
    }
    monitor.stop();
    monitor_thread.join();
    printf(" reads=%ld\n", monitor.reads.load());
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
    } else if (strcmp(mode, "pace") == 0 && (argc == 4 || (argc == 5 && atoi(argv[4]) >= 1))) {
        pace(atof(argv[2]), atol(argv[3]), argc == 5 ? atoi(argv[4]) : 1);
    } else if (strcmp(mode, "pace-ab") == 0 && argc == 4 && atol(argv[3]) >= 4) {
        pace_ab(atof(argv[2]), atol(argv[3]));
    } else if (strcmp(mode, "mimic") == 0 && argc == 4) {
        mimic(atol(argv[2]), atoi(argv[3]));
    } else {
        fprintf(stderr, "usage: see the comment at the top of compute_bench.cu\n");
        return 2;
    }
    return 0;
}

// The kernels workload of the packing bench (scripts/bench/packing.py), one
// process a pod; built with nvcc by the bench:
//   packing_kernels calibrate TARGET_US   -> result=1 iters=I grid=G sms=S blocks_per_sm=B kernel_us=K
//   packing_kernels run ITERS GRID SECONDS
//       warms up, prints ready=1, reads the common start time (CLOCK_MONOTONIC
//       seconds) from stdin, launches fixed-work kernels back to back from
//       then until start + SECONDS, and prints
//       -> result=1 count=N per_s=R launched=L drain_s=D
//       N: the kernels that completed by start + SECONDS, R = N / SECONDS,
//       L: those launched, D: how long after the window the last one ended.
//       Then it reads one more line: "done", or "returns AT COUNT PERIOD
//       BURST": COUNT times, from AT on and PERIOD apart, it launches
//       kernels for BURST seconds and waits for them, idle in between
//       -> returns=COUNT
// At most DEPTH kernels are queued behind the host; it waits for the oldest
// on its event, which sleeps the thread (many processes, few CPUs). When a
// kernel completed is read off its event's GPU timestamp, against an event
// whose completion the host saw at a known time before the window.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <unistd.h>

#define CHECK(call)                                                                   \
    do {                                                                              \
        cudaError_t err_ = (call);                                                    \
        if (err_ != cudaSuccess) {                                                    \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,              \
                    cudaGetErrorString(err_));                                        \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

constexpr int THREADS = 256;
constexpr int DEPTH = 4;  // kernels queued at most

// Four dependent FMA chains a thread, every SM at full occupancy: bound by
// the FMA pipes, so clients that share SMs (MPS) share their throughput.
__global__ void burn(float *sink, int iters) {
    float a = threadIdx.x * 1e-3f, b = a + 1.0f, c = a + 2.0f, d = a + 3.0f;
    for (int i = 0; i < iters; i++) {
        a = fmaf(a, 0.999999f, 1e-6f);
        b = fmaf(b, 0.999999f, 1e-6f);
        c = fmaf(c, 0.999999f, 1e-6f);
        d = fmaf(d, 0.999999f, 1e-6f);
    }
    if (a + b + c + d == 123456.0f) {
        sink[blockIdx.x] = a;  // never true; keeps the loop
    }
}

static double mono() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

// Sleeps, then spins, until mono() >= t.
static void wait_until(double t) {
    for (double left = t - mono(); left > 0; left = t - mono()) {
        if (left > 0.001) {
            usleep((useconds_t)((left - 0.0005) * 1e6));
        }
    }
}

static float *sink_for(int grid) {
    float *sink = nullptr;
    CHECK(cudaMalloc(&sink, grid * sizeof(float)));
    return sink;
}

static double kernel_us(float *sink, int grid, int iters, int reps) {
    cudaEvent_t start, end;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&end));
    burn<<<grid, THREADS>>>(sink, iters);
    CHECK(cudaEventRecord(start));
    for (int i = 0; i < reps; i++) {
        burn<<<grid, THREADS>>>(sink, iters);
    }
    CHECK(cudaEventRecord(end));
    CHECK(cudaEventSynchronize(end));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, end));
    return ms * 1e3 / reps;
}

// The iterations that make one full wave last target_us, alone.
static void calibrate(double target_us) {
    int sms = 0, per_sm = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, burn, THREADS, 0));
    int grid = sms * per_sm;
    float *sink = sink_for(grid);
    int iters = 1024;
    double us = kernel_us(sink, grid, iters, 5);
    for (int round = 0; round < 3; round++) {
        iters = (int)(iters * target_us / us);
        us = kernel_us(sink, grid, iters, 20);
    }
    printf("result=1 iters=%d grid=%d sms=%d blocks_per_sm=%d kernel_us=%.2f\n", iters, grid, sms,
           per_sm, us);
}

// The grid comes from the calibration, not from this process's device: an
// MPS client kept to part of the SMs runs the same work as everyone else.
static void run(int iters, int grid, double seconds) {
    float *sink = sink_for(grid);
    // Warm-up: the module, the limiter's calibration and its first measurements.
    for (int i = 0; i < 40; i++) {
        burn<<<grid, THREADS>>>(sink, iters);
    }
    CHECK(cudaDeviceSynchronize());
    cudaEvent_t zero, done[DEPTH];
    CHECK(cudaEventCreate(&zero));
    for (int i = 0; i < DEPTH; i++) {
        CHECK(cudaEventCreateWithFlags(&done[i], cudaEventBlockingSync));
    }
    // The host's clock when `zero` completed: polled, so within microseconds.
    CHECK(cudaEventRecord(zero));
    cudaError_t state;
    while ((state = cudaEventQuery(zero)) == cudaErrorNotReady) {
    }
    CHECK(state);
    double zero_at = mono();
    printf("ready=1\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) {
        fprintf(stderr, "no start time on stdin\n");
        exit(2);
    }
    double start = atof(line), end = start + seconds;
    wait_until(start);
    long launched = 0, completed = 0, waited = 0;
    double last = start;
    // Waits for kernel `k` and counts it when it ended inside the window.
    auto settle = [&](long k) {
        cudaEvent_t ev = done[k % DEPTH];
        CHECK(cudaEventSynchronize(ev));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, zero, ev));
        double at = zero_at + ms * 1e-3;
        completed += at <= end;
        last = at > last ? at : last;
    };
    while (mono() < end) {
        if (launched >= DEPTH) {
            settle(waited++);
        }
        burn<<<grid, THREADS>>>(sink, iters);
        CHECK(cudaEventRecord(done[launched % DEPTH]));
        launched++;
    }
    while (waited < launched) {
        settle(waited++);
    }
    CHECK(cudaGetLastError());
    printf("result=1 count=%ld per_s=%.3f launched=%ld drain_s=%.6f\n", completed, completed / seconds,
           launched, last > end ? last - end : 0.0);
    fflush(stdout);
    double at, period, burst;
    int count;
    if (!fgets(line, sizeof line, stdin) ||
        sscanf(line, "returns %lf %d %lf %lf", &at, &count, &period, &burst) != 4) {
        return;
    }
    for (int c = 0; c < count; c++) {
        double from = at + c * period;
        wait_until(from);
        for (long k = 0; mono() < from + burst; k++) {
            if (k >= DEPTH) {
                CHECK(cudaEventSynchronize(done[k % DEPTH]));
            }
            burn<<<grid, THREADS>>>(sink, iters);
            CHECK(cudaEventRecord(done[k % DEPTH]));
        }
        CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaGetLastError());
    printf("returns=%d\n", count);
    fflush(stdout);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    bool calibrating = strcmp(mode, "calibrate") == 0 && argc == 3;
    bool running = strcmp(mode, "run") == 0 && argc == 5;
    if (!calibrating && !running) {
        fprintf(stderr, "usage: packing_kernels calibrate TARGET_US | packing_kernels run ITERS GRID SECONDS\n");
        return 2;
    }
    // Before anything starts the context: waits sleep the host thread.
    CHECK(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));
    if (calibrating) {
        calibrate(atof(argv[2]));
    } else {
        run(atoi(argv[2]), atoi(argv[3]), atof(argv[4]));
    }
    return 0;
}

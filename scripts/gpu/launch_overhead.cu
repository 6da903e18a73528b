// Check 14: what the limiter adds to a kernel launch.
//
//   launch_overhead throughput [N=200000]
//       N empty kernels (<<<1,1>>>, cudaLaunchKernel on the legacy default
//       stream) back to back, synchronising every 10,000; prints
//       throughput_ns_per_launch (wall time / N, after 10,000 warm-up launches).
//   launch_overhead pace [N=20000] [BUSY_US=20]
//       N iterations of (BUSY_US of host busy-wait on a steady clock, then one
//       empty kernel launch), synchronising at the end; prints
//       pace_ns_per_iter (wall time / N, after 500 warm-up iterations) and
//       pace_launch_ns (mean time inside the launch call).
// Every CUDA call's return code is checked; an error prints error_call=,
// error_name=, error_line= and exits 1. ok=1 last when all went right.
//
// Build: nvcc -O2 -arch=sm_90 -o launch_overhead launch_overhead.cu
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

using Clock = std::chrono::steady_clock;

static void cuda_fail(const char *call, cudaError_t e, int line) {
  printf("error_call=%s\nerror_name=%s\nerror_code=%d\nerror_line=%d\n", call,
         cudaGetErrorName(e), (int)e, line);
  fflush(stdout);
  exit(1);
}

#define CK(call)                                           \
  do {                                                     \
    cudaError_t e_ = (call);                               \
    if (e_ != cudaSuccess) cuda_fail(#call, e_, __LINE__); \
  } while (0)

__global__ void empty_kernel() {}

static void *no_args[1] = {nullptr};

static inline void launch_empty() {
  CK(cudaLaunchKernel((const void *)empty_kernel, dim3(1), dim3(1), no_args, 0, 0));
}

static double throughput(long n) {
  const long sync_every = 10000;
  for (long i = 0; i < 10000; i++) launch_empty();
  CK(cudaDeviceSynchronize());
  const auto t0 = Clock::now();
  for (long i = 1; i <= n; i++) {
    launch_empty();
    if (i % sync_every == 0) CK(cudaDeviceSynchronize());
  }
  CK(cudaDeviceSynchronize());
  const auto t1 = Clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (double)n;
}

static void busy_wait(std::chrono::nanoseconds d) {
  const auto until = Clock::now() + d;
  while (Clock::now() < until) {
  }
}

static double pace(long n, long busy_us, double *launch_ns) {
  const auto busy = std::chrono::microseconds(busy_us);
  for (long i = 0; i < 500; i++) {
    busy_wait(busy);
    launch_empty();
  }
  CK(cudaDeviceSynchronize());
  double in_launch = 0;
  const auto t0 = Clock::now();
  for (long i = 0; i < n; i++) {
    busy_wait(busy);
    const auto a = Clock::now();
    launch_empty();
    in_launch += std::chrono::duration<double, std::nano>(Clock::now() - a).count();
  }
  CK(cudaDeviceSynchronize());
  const auto t1 = Clock::now();
  *launch_ns = in_launch / (double)n;
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / (double)n;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2 || (strcmp(argv[1], "throughput") != 0 && strcmp(argv[1], "pace") != 0)) {
    fprintf(stderr, "usage: %s throughput [N] | pace [N] [BUSY_US]\n", argv[0]);
    return 64;
  }
  const bool tp = strcmp(argv[1], "throughput") == 0;
  const long n = argc > 2 ? atol(argv[2]) : (tp ? 200000 : 20000);
  if (n <= 0) {
    fprintf(stderr, "N must be > 0\n");
    return 64;
  }
  printf("pid=%d\nmode=%s\nn=%ld\n", (int)getpid(), argv[1], n);
  CK(cudaSetDevice(0));
  CK(cudaFree(nullptr));  // creates the context outside the timed part
  if (tp) {
    printf("throughput_ns_per_launch=%.1f\n", throughput(n));
  } else {
    const long busy_us = argc > 3 ? atol(argv[3]) : 20;
    double launch_ns = 0;
    const double per_iter = pace(n, busy_us, &launch_ns);
    printf("busy_us=%ld\npace_ns_per_iter=%.1f\npace_launch_ns=%.1f\n", busy_us, per_iter, launch_ns);
  }
  CK(cudaGetLastError());
  printf("ok=1\n");
  return 0;
}

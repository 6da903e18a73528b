// Check 9: cost of cuMemAlloc_v2(1 MiB) + cuMemFree_v2, driver API.
// Usage: mem_bench [pairs=20000] [warmup=2000]; prints ns_per_pair=<float>.
// Build: nvcc -O2 -arch=sm_90 -o mem_bench mem_bench.cu -lcuda
#include <cuda.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                        \
  do {                                                               \
    CUresult r_ = (x);                                               \
    if (r_ != CUDA_SUCCESS) {                                        \
      printf("error=%s rc=%d line=%d\n", #x, (int)r_, __LINE__);     \
      return 1;                                                      \
    }                                                                \
  } while (0)

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int n = argc > 1 ? atoi(argv[1]) : 20000;
  int warm = argc > 2 ? atoi(argv[2]) : 2000;
  const size_t SZ = 1ull << 20;
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUdeviceptr p;
  for (int i = 0; i < warm; i++) {
    CK(cuMemAlloc(&p, SZ));
    CK(cuMemFree(p));
  }
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; i++) {
    CK(cuMemAlloc(&p, SZ));
    CK(cuMemFree(p));
  }
  auto t1 = std::chrono::steady_clock::now();
  double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
  printf("pairs=%d\nns_per_pair=%.1f\n", n, ns);
  CK(cuDevicePrimaryCtxRelease(dev));
  return 0;
}

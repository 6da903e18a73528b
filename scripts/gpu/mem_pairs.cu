// Check 8: 10,000 cudaMalloc(1 MiB)/cudaFree pairs from 4 threads, then the
// reported free memory must be back where it started (within 2 MiB) and an
// allocation of (free - 64 MiB) must succeed.
// Build: nvcc -O2 -arch=sm_90 -Xcompiler -pthread -o mem_pairs mem_pairs.cu
#include <cuda_runtime.h>
#include <atomic>
#include <cstdio>
#include <thread>
#include <vector>

static const size_t MiB = 1ull << 20;

int main() {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const int THREADS = 4, PER_THREAD = 2500;
  cudaError_t e = cudaFree(0);  // create the context first
  printf("init_rc=%d\n", (int)e);
  size_t f0 = 0, t0 = 0;
  e = cudaMemGetInfo(&f0, &t0);
  printf("info0_rc=%d\nfree0=%zu\ntotal0=%zu\n", (int)e, f0, t0);
  if (e != cudaSuccess) return 1;

  std::atomic<int> alloc_err{0}, free_err{0}, first_err{0}, done{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < THREADS; t++) {
    ts.emplace_back([&]() {
      cudaSetDevice(0);
      for (int i = 0; i < PER_THREAD; i++) {
        void *p = nullptr;
        cudaError_t r = cudaMalloc(&p, MiB);
        if (r != cudaSuccess) {
          int z = 0;
          first_err.compare_exchange_strong(z, (int)r);
          alloc_err++;
          cudaGetLastError();
          continue;
        }
        r = cudaFree(p);
        if (r != cudaSuccess) {
          int z = 0;
          first_err.compare_exchange_strong(z, (int)r);
          free_err++;
          cudaGetLastError();
        }
        done++;
      }
    });
  }
  for (auto &t : ts) t.join();
  printf("pairs=%d\nalloc_errors=%d\nfree_errors=%d\nfirst_err=%d\n", done.load(),
         alloc_err.load(), free_err.load(), first_err.load());

  size_t f1 = 0, t1 = 0;
  e = cudaMemGetInfo(&f1, &t1);
  printf("info1_rc=%d\nfree1=%zu\ntotal1=%zu\n", (int)e, f1, t1);
  long long diff = (long long)f1 - (long long)f0;
  printf("free_diff=%lld\n", diff);

  size_t big = f1 > 64 * MiB ? f1 - 64 * MiB : 0;
  void *p = nullptr;
  e = cudaMalloc(&p, big);
  printf("big_bytes=%zu\nbig_rc=%d\n", big, (int)e);
  if (e == cudaSuccess)
    cudaFree(p);
  else
    cudaGetLastError();
  printf("done=1\n");
  return 0;
}

// Check 7: one cudaMalloc of <bytes>; prints alloc_rc=<cudaError_t>.
// With a <release-file> argument and a successful allocation, keeps the memory
// until that file exists (polls every 100 ms, gives up after <max_s> seconds,
// default 120), then frees it; with "keep" as fourth argument it exits without
// freeing (the driver takes the memory back at exit: check 21's stale case).
// Usage: mem_hold <bytes> [release-file [max_s [free|keep]]]
// Build: nvcc -O2 -arch=sm_90 -o mem_hold mem_hold.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) {
    fprintf(stderr, "usage: %s <bytes> [release-file [max_s [free|keep]]]\n", argv[0]);
    return 64;
  }
  size_t bytes = strtoull(argv[1], nullptr, 10);
  const char *release = argc > 2 ? argv[2] : nullptr;
  int max_s = argc > 3 ? atoi(argv[3]) : 120;
  bool keep = argc > 4 && argv[4][0] == 'k';
  printf("pid=%d\nbytes=%zu\n", (int)getpid(), bytes);

  size_t f0 = 0, t0 = 0;
  cudaError_t e = cudaMemGetInfo(&f0, &t0);
  printf("info_rc=%d\nfree0=%zu\ntotal0=%zu\n", (int)e, f0, t0);

  void *p = nullptr;
  e = cudaMalloc(&p, bytes);
  printf("alloc_name=%s\n", cudaGetErrorName(e));
  printf("alloc_rc=%d\n", (int)e);  // the script waits for this line
  fflush(stdout);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  size_t f1 = 0, t1 = 0;
  cudaMemGetInfo(&f1, &t1);
  printf("free1=%zu\n", f1);
  if (release) {
    printf("holding=1\n");
    fflush(stdout);
    for (int i = 0; i < max_s * 10; i++) {
      if (access(release, F_OK) == 0) break;
      usleep(100 * 1000);
    }
  }
  if (keep) {
    printf("kept=1\ndone=1\n");
    return 0;
  }
  e = cudaFree(p);
  printf("free_rc=%d\ndone=1\n", (int)e);
  return 0;
}

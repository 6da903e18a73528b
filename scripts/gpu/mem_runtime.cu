// Check 1/2: CUDA runtime API under a memory quota.
// Prints key=value lines: cudaMemGetInfo before, then cudaMalloc 256 MiB chunks
// until failure (capped at 60 GiB), the failing error code, cudaMemGetInfo
// again, and the process's real footprint as nvidia-smi sees it (queried
// WITHOUT LD_PRELOAD so the numbers are the driver's, not the limiter's).
// Build: nvcc -O2 -arch=sm_90 [-cudart shared] -o mem_runtime mem_runtime.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <unistd.h>

static const size_t MiB = 1ull << 20;
static const size_t CHUNK = 256 * MiB;
static const size_t CAP = 60ull << 30;

// memory.used of GPU 0 in MiB, from nvidia-smi run without the preload; -1 on error.
static long long smi_gpu_used_mib() {
  FILE *f = popen("env -u LD_PRELOAD nvidia-smi -i 0 --query-gpu=memory.used "
                  "--format=csv,noheader,nounits 2>/dev/null", "r");
  if (!f) return -1;
  long long v = -1;
  if (fscanf(f, "%lld", &v) != 1) v = -1;
  pclose(f);
  return v;
}

// used_memory (MiB) of this pid in nvidia-smi's compute-apps list; -1 if absent.
// Also prints every line so the log shows what nvidia-smi saw.
static long long smi_pid_used_mib(int pid, int *napps) {
  *napps = 0;
  FILE *f = popen("env -u LD_PRELOAD nvidia-smi --query-compute-apps=pid,used_memory "
                  "--format=csv,noheader,nounits 2>/dev/null", "r");
  if (!f) return -1;
  char line[512];
  long long mine = -1;
  while (fgets(line, sizeof line, f)) {
    long long p = -1, m = -1;
    if (sscanf(line, "%lld , %lld", &p, &m) == 2) {
      (*napps)++;
      printf("smi_app_line=%lld,%lld\n", p, m);
      if (p == pid) mine = m;
    }
  }
  pclose(f);
  return mine;
}

int main() {
  setvbuf(stdout, NULL, _IOLBF, 0);
  int pid = (int)getpid();
  printf("pid=%d\n", pid);
  int rtv = 0, drv = 0;
  cudaRuntimeGetVersion(&rtv);
  cudaDriverGetVersion(&drv);
  printf("runtime_version=%d\ndriver_version=%d\n", rtv, drv);
  long long used_before = smi_gpu_used_mib();
  printf("smi_gpu_used_before_mib=%lld\n", used_before);

  size_t free0 = 0, total0 = 0;
  cudaError_t e = cudaMemGetInfo(&free0, &total0);
  printf("info0_rc=%d\nfree0=%zu\ntotal0=%zu\n", (int)e, free0, total0);
  if (e != cudaSuccess) {
    printf("error=cudaMemGetInfo failed: %s\n", cudaGetErrorString(e));
    return 1;
  }

  std::vector<void *> ptrs;
  size_t got = 0;
  int fail = 0;
  while (got + CHUNK <= CAP) {
    void *p = nullptr;
    e = cudaMalloc(&p, CHUNK);
    if (e != cudaSuccess) {
      fail = (int)e;
      printf("fail_name=%s\n", cudaGetErrorName(e));
      cudaGetLastError();  // clear the (non-sticky) error
      break;
    }
    ptrs.push_back(p);
    got += CHUNK;
  }
  printf("chunks=%zu\nobtained=%zu\nfail_code=%d\ncapped=%d\n", ptrs.size(), got, fail,
         got + CHUNK > CAP ? 1 : 0);

  size_t free1 = 0, total1 = 0;
  e = cudaMemGetInfo(&free1, &total1);
  printf("info1_rc=%d\nfree1=%zu\ntotal1=%zu\n", (int)e, free1, total1);

  // Real footprint while holding everything.
  int napps = 0;
  long long mine = smi_pid_used_mib(pid, &napps);
  long long used_hold = smi_gpu_used_mib();
  printf("smi_apps=%d\nfootprint_pid_mib=%lld\nsmi_gpu_used_hold_mib=%lld\n", napps, mine,
         used_hold);
  long long delta = (used_before >= 0 && used_hold >= 0) ? used_hold - used_before : -1;
  printf("footprint_delta_mib=%lld\n", delta);
  // Prefer the per-pid number; fall back to the whole-GPU delta (pid namespaces).
  printf("footprint_mib=%lld\n", mine >= 0 ? mine : delta);

  int free_errs = 0;
  for (void *p : ptrs)
    if (cudaFree(p) != cudaSuccess) free_errs++;
  printf("free_errors=%d\n", free_errs);
  size_t free2 = 0, total2 = 0;
  e = cudaMemGetInfo(&free2, &total2);
  printf("info2_rc=%d\nfree2=%zu\ntotal2=%zu\n", (int)e, free2, total2);
  printf("done=1\n");
  return 0;
}

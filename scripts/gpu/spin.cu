// Checks 11, 12, 15: how much of the GPU's time a process keeps busy.
//
// A kernel that fills every SM (SMs x 2 blocks of 512 threads, or fewer blocks
// per SM when fewer fit) busy-waits on %globaltimer for DUR_US microseconds.
// Each launch gets its own slot: every block takes a ticket from one device
// counter, and since kernels of one stream never overlap, ticket / gridDim.x is
// the launch's index. Thread 0 of each block does atomicMin(start[slot]) with
// its first %globaltimer reading and atomicMax(end[slot]) after the spin, so a
// slot holds [first block start, last block end] of that launch. %globaltimer is
// one clock for the whole GPU, so intervals of two processes can be merged.
//
// Usage:
//   spin runtime DUR_US SECONDS [DUMP|- [GO_FILE|-]]  cudaLaunchKernel back to back
//   spin graph   DUR_US SECONDS [DUMP|- [GO_FILE|-]]  one captured launch, cudaGraphLaunch replays
//   spin union FILE...     merge the interval files (DUMP) of processes that ran at the same time
//
// Launches go back to back for SECONDS of host wall time on one non-blocking
// stream; at most SPIN_INFLIGHT launches (default: 20 ms of kernel time, 2..512)
// are queued ahead of the GPU, through a ring of events, so the run ends soon
// after SECONDS and a launch stall is the launch call's own. Each launch call
// is timed on the host (max_stall_us: the largest stall a launch saw).
// DUMP gets one "start_ns end_ns" line per kernel (%globaltimer values).
// With GO_FILE, the program initialises, warms up, prints ready=1 and waits (up
// to 60 s) for GO_FILE to exist before the timed loop.
//
// Analysis, over [first start, last end] (union mode: over the time every file
// covers, [latest first start, earliest last end]); busy = union of intervals:
//   busy_pct            busy / span
//   share_first1s_pct   busy fraction of the first second
//   share_after1s_pct   busy fraction from 1 s to the end
//   windows100_pm       busy per-mille of each full 100 ms window
//   windows_pm          busy per-mille of each full 1 s window
//   settle_ms           earliest window start t such that every 500 ms sliding
//                       average (of 5 consecutive 100 ms windows) from t on is
//                       within SPIN_SETTLE_PP (default 3) percentage points of
//                       share_after1s_pct; settled=0 when even the last is not
//   sliding_min_pct / sliding_max_pct  the 500 ms averages starting at >= 1 s
//   max_gap_us          the longest idle gap between merged intervals
// Values are key=value lines; ok=1 last when everything went right. Any CUDA
// error prints error_call=, error_name=, error_line= and exits 1.
//
// Build: nvcc -O2 -arch=sm_90 -o spin spin.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <time.h>
#include <unistd.h>
#include <vector>

static const int THREADS = 512;
static const uint64_t NS_PER_S = 1000000000ull;
static const uint64_t WIN_NS = 100000000ull;  // 100 ms

static void cuda_fail(const char *call, cudaError_t e, int line) {
  printf("error_call=%s\nerror_name=%s\nerror_code=%d\nerror_line=%d\n", call,
         cudaGetErrorName(e), (int)e, line);
  fflush(stdout);
  exit(1);
}

#define CK(call)                                       \
  do {                                                 \
    cudaError_t e_ = (call);                           \
    if (e_ != cudaSuccess) cuda_fail(#call, e_, __LINE__); \
  } while (0)

static uint64_t now_ns() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * NS_PER_S + (uint64_t)ts.tv_nsec;
}

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(unsigned long long dur_ns, unsigned long long *starts,
                            unsigned long long *ends, unsigned long long *arrivals,
                            unsigned long long nslots) {
  __shared__ unsigned long long s_t0;
  __shared__ unsigned long long s_slot;
  if (threadIdx.x == 0) {
    unsigned long long t0 = globaltimer();
    unsigned long long slot = atomicAdd(arrivals, 1ull) / gridDim.x;
    s_t0 = t0;
    s_slot = slot;
    if (slot < nslots) atomicMin(&starts[slot], t0);
  }
  __syncthreads();
  const unsigned long long deadline = s_t0 + dur_ns;
  while (globaltimer() < deadline) {
  }
  __syncthreads();
  if (threadIdx.x == 0 && s_slot < nslots) atomicMax(&ends[s_slot], globaltimer());
}

struct Iv {
  uint64_t s, e;
};

// Union of intervals clipped to [lo, hi], with prefix sums for covered().
struct Busy {
  std::vector<Iv> m;
  uint64_t lo = 0, hi = 0;

  Busy(std::vector<Iv> iv, uint64_t lo_, uint64_t hi_) : lo(lo_), hi(hi_) {
    std::vector<Iv> c;
    c.reserve(iv.size());
    for (const Iv &x : iv) {
      uint64_t s = std::max(x.s, lo), e = std::min(x.e, hi);
      if (e > s) c.push_back({s, e});
    }
    std::sort(c.begin(), c.end(), [](const Iv &a, const Iv &b) { return a.s < b.s; });
    for (const Iv &x : c) {
      if (!m.empty() && x.s <= m.back().e) {
        m.back().e = std::max(m.back().e, x.e);
      } else {
        m.push_back(x);
      }
    }
  }

  // busy nanoseconds within [a, b)
  uint64_t covered(uint64_t a, uint64_t b) const {
    if (b <= a) return 0;
    auto it = std::upper_bound(m.begin(), m.end(), a,
                               [](uint64_t v, const Iv &x) { return v < x.e; });
    uint64_t sum = 0;
    for (; it != m.end() && it->s < b; ++it) {
      uint64_t s = std::max(it->s, a), e = std::min(it->e, b);
      if (e > s) sum += e - s;
    }
    return sum;
  }

  double frac(uint64_t a, uint64_t b) const {
    return b > a ? (double)covered(a, b) / (double)(b - a) : NAN;
  }

  uint64_t max_gap() const {
    uint64_t g = 0;
    for (size_t i = 1; i < m.size(); i++) g = std::max(g, m[i].s - m[i - 1].e);
    return g;
  }
};

static double env_double(const char *name, double dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end = nullptr;
  double d = strtod(v, &end);
  return (end && *end == '\0') ? d : dflt;
}

static void print_series(const char *key, const std::vector<double> &w) {
  printf("%s=", key);
  for (size_t i = 0; i < w.size(); i++) printf("%s%d", i ? "," : "", (int)lround(w[i] * 1000.0));
  printf("\n");
}

// Prints the analysis of intervals over [T0, T1].
static void analyse(const std::vector<Iv> &iv, uint64_t T0, uint64_t T1) {
  Busy b(iv, T0, T1);
  const uint64_t span = T1 > T0 ? T1 - T0 : 0;
  printf("span_ms=%.3f\n", span / 1e6);
  printf("busy_pct=%.2f\n", 100.0 * b.frac(T0, T1));
  printf("max_gap_us=%.1f\n", b.max_gap() / 1e3);

  const size_t n100 = span / WIN_NS, n1s = span / NS_PER_S;
  std::vector<double> w100(n100), w1s(n1s);
  for (size_t i = 0; i < n100; i++) w100[i] = b.frac(T0 + i * WIN_NS, T0 + (i + 1) * WIN_NS);
  for (size_t i = 0; i < n1s; i++) w1s[i] = b.frac(T0 + i * NS_PER_S, T0 + (i + 1) * NS_PER_S);

  if (span >= NS_PER_S) {
    printf("share_first1s_pct=%.2f\n", 100.0 * b.frac(T0, T0 + NS_PER_S));
  } else {
    printf("share_first1s_pct=-1\n");
  }
  // at least half a second after the first one, or the "share" means little
  const bool have_after = span >= NS_PER_S + NS_PER_S / 2;
  const double after = have_after ? 100.0 * b.frac(T0 + NS_PER_S, T1) : NAN;
  if (have_after) {
    printf("share_after1s_pct=%.2f\n", after);
  } else {
    printf("share_after1s_pct=-1\n");
  }

  // 500 ms sliding averages: avg[j] = mean(w100[j..j+4])
  const double tol = env_double("SPIN_SETTLE_PP", 3.0);
  std::vector<double> avg;
  for (size_t j = 0; j + 5 <= n100; j++) {
    double s = 0;
    for (size_t k = j; k < j + 5; k++) s += w100[k];
    avg.push_back(100.0 * s / 5.0);
  }
  if (have_after && !avg.empty()) {
    // the last average that is out of tolerance; settled right after it
    long last_bad = -1;
    for (size_t j = 0; j < avg.size(); j++) {
      if (std::fabs(avg[j] - after) > tol) last_bad = (long)j;
    }
    const bool settled = last_bad + 1 < (long)avg.size();
    printf("settle_ms=%ld\n", (last_bad + 1) * (long)(WIN_NS / 1000000));
    printf("settled=%d\n", settled ? 1 : 0);
    printf("settle_tol_pp=%.1f\n", tol);
    double mn = INFINITY, mx = -INFINITY;
    for (size_t j = 10; j < avg.size(); j++) {  // windows starting at >= 1 s
      mn = std::min(mn, avg[j]);
      mx = std::max(mx, avg[j]);
    }
    if (avg.size() > 10) printf("sliding_min_pct=%.2f\nsliding_max_pct=%.2f\n", mn, mx);
  } else {
    printf("settle_ms=-1\nsettled=0\n");
  }
  print_series("windows100_pm", w100);
  print_series("windows_pm", w1s);
}

static int usage(const char *argv0) {
  fprintf(stderr,
          "usage: %s <runtime|graph> DUR_US SECONDS [DUMP|- [GO_FILE|-]]\n"
          "       %s union FILE...\n",
          argv0, argv0);
  return 64;
}

static int run_union(int nfiles, char **files) {
  std::vector<std::vector<Iv>> per(nfiles);
  uint64_t T0 = 0, T1 = UINT64_MAX;
  for (int i = 0; i < nfiles; i++) {
    FILE *f = fopen(files[i], "r");
    if (!f) {
      printf("error_file=%s\nerror_errno=%d\n", files[i], errno);
      return 1;
    }
    unsigned long long s, e;
    uint64_t first = UINT64_MAX, last = 0;
    while (fscanf(f, "%llu %llu", &s, &e) == 2) {
      per[i].push_back({s, e});
      first = std::min<uint64_t>(first, s);
      last = std::max<uint64_t>(last, e);
    }
    fclose(f);
    printf("file%d=%s\nfile%d_kernels=%zu\n", i, files[i], i, per[i].size());
    if (per[i].empty()) {
      printf("error_empty_file=%s\n", files[i]);
      return 1;
    }
    T0 = std::max(T0, first);
    T1 = std::min(T1, last);
  }
  if (T1 <= T0) {
    printf("error_no_overlap=1\n");
    return 1;
  }
  // each file's own busy fraction over the common window, from 1 s on
  std::vector<Iv> all;
  for (int i = 0; i < nfiles; i++) {
    Busy b(per[i], T0, T1);
    const uint64_t from = T1 - T0 >= NS_PER_S + NS_PER_S / 2 ? T0 + NS_PER_S : T0;
    printf("file%d_share_after1s_pct=%.2f\n", i, 100.0 * b.frac(from, T1));
    all.insert(all.end(), per[i].begin(), per[i].end());
  }
  printf("kernels=%zu\n", all.size());
  analyse(all, T0, T1);
  printf("ok=1\n");
  return 0;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (argc < 2) return usage(argv[0]);
  const std::string mode = argv[1];
  if (mode == "union") {
    if (argc < 3) return usage(argv[0]);
    return run_union(argc - 2, argv + 2);
  }
  if ((mode != "runtime" && mode != "graph") || argc < 4) return usage(argv[0]);
  const bool graph = mode == "graph";
  const double dur_us = atof(argv[2]);
  const double secs = atof(argv[3]);
  const char *dump = (argc > 4 && strcmp(argv[4], "-") != 0) ? argv[4] : nullptr;
  const char *go = (argc > 5 && strcmp(argv[5], "-") != 0) ? argv[5] : nullptr;
  if (!(dur_us >= 1) || !(secs > 0)) return usage(argv[0]);
  const unsigned long long dur_ns = (unsigned long long)llround(dur_us * 1000.0);

  int inflight = (int)std::ceil(20000.0 / dur_us);
  inflight = (int)env_double("SPIN_INFLIGHT", inflight);
  inflight = std::max(2, std::min(inflight, 512));
  // enough slots for SECONDS of back-to-back kernels, plus slack
  const unsigned long long nslots =
      (unsigned long long)(secs * 1e6 / dur_us * 1.25) + (unsigned long long)inflight + 4096;

  printf("pid=%d\nmode=%s\ndur_us=%.1f\nseconds=%.3f\n", (int)getpid(), mode.c_str(), dur_us, secs);
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, spin_kernel, THREADS, 0));
  if (occ < 1) {
    printf("error_occupancy=%d\n", occ);
    return 1;
  }
  const int bps = std::min(occ, 2);
  const unsigned grid = (unsigned)(sms * bps);
  printf("device=%s\nsms=%d\nblocks_per_sm=%d\ngrid=%u\nthreads=%d\ninflight=%d\nslots=%llu\n",
         prop.name, sms, bps, grid, THREADS, inflight, nslots);

  unsigned long long *d_starts = nullptr, *d_ends = nullptr, *d_arrivals = nullptr;
  CK(cudaMalloc(&d_starts, nslots * sizeof(unsigned long long)));
  CK(cudaMalloc(&d_ends, nslots * sizeof(unsigned long long)));
  CK(cudaMalloc(&d_arrivals, sizeof(unsigned long long)));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  auto reset = [&]() {
    CK(cudaMemsetAsync(d_starts, 0xff, nslots * sizeof(unsigned long long), s));
    CK(cudaMemsetAsync(d_ends, 0, nslots * sizeof(unsigned long long), s));
    CK(cudaMemsetAsync(d_arrivals, 0, sizeof(unsigned long long), s));
    CK(cudaStreamSynchronize(s));
  };
  reset();

  unsigned long long a_dur = dur_ns, a_nslots = nslots;
  void *args[] = {&a_dur, &d_starts, &d_ends, &d_arrivals, &a_nslots};
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ge = nullptr;
  if (graph) {
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CK(cudaLaunchKernel((const void *)spin_kernel, dim3(grid), dim3(THREADS), args, 0, s));
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0ull));
    CK(cudaGraphUpload(ge, s));
  }
  auto launch = [&]() -> cudaError_t {
    return graph ? cudaGraphLaunch(ge, s)
                 : cudaLaunchKernel((const void *)spin_kernel, dim3(grid), dim3(THREADS), args, 0, s);
  };

  // warm-up: loads the module (lazy loading), then forget its slot
  CK(launch());
  CK(cudaStreamSynchronize(s));
  reset();

  std::vector<cudaEvent_t> ev(inflight);
  for (auto &e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  printf("ready=1\n");
  fflush(stdout);
  if (go) {
    const uint64_t give_up = now_ns() + 60 * NS_PER_S;
    while (access(go, F_OK) != 0 && now_ns() < give_up) usleep(500);
    printf("go_seen=%d\n", access(go, F_OK) == 0 ? 1 : 0);
  }

  std::vector<float> stall_us;
  stall_us.reserve((size_t)nslots);
  uint64_t max_wait = 0;
  unsigned long long launches = 0;
  const uint64_t t_begin = now_ns();
  const uint64_t t_end = t_begin + (uint64_t)(secs * 1e9);
  while (launches < nslots) {
    if (now_ns() >= t_end) break;
    cudaEvent_t &e = ev[launches % (unsigned long long)inflight];
    if (launches >= (unsigned long long)inflight) {
      const uint64_t w0 = now_ns();
      CK(cudaEventSynchronize(e));
      max_wait = std::max(max_wait, now_ns() - w0);
    }
    const uint64_t a = now_ns();
    const cudaError_t rc = launch();
    const uint64_t b = now_ns();
    if (rc != cudaSuccess) cuda_fail(graph ? "cudaGraphLaunch" : "cudaLaunchKernel", rc, __LINE__);
    stall_us.push_back((float)((b - a) / 1e3));
    CK(cudaEventRecord(e, s));
    launches++;
  }
  const uint64_t t_loop = now_ns();
  CK(cudaStreamSynchronize(s));
  CK(cudaGetLastError());
  const uint64_t t_done = now_ns();

  unsigned long long arrivals = 0;
  CK(cudaMemcpy(&arrivals, d_arrivals, sizeof arrivals, cudaMemcpyDeviceToHost));
  const unsigned long long kernels = std::min<unsigned long long>(arrivals / grid, nslots);
  std::vector<unsigned long long> hs(kernels), he(kernels);
  if (kernels) {
    CK(cudaMemcpy(hs.data(), d_starts, kernels * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(he.data(), d_ends, kernels * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  }

  printf("launches=%llu\nkernels=%llu\narrivals_remainder=%llu\n", launches, kernels, arrivals % grid);
  printf("slots_exhausted=%d\n", launches >= nslots ? 1 : 0);
  printf("host_loop_s=%.3f\ndrain_ms=%.3f\n", (t_loop - t_begin) / 1e9, (t_done - t_loop) / 1e6);
  std::vector<float> sorted = stall_us;
  std::sort(sorted.begin(), sorted.end());
  auto pct = [&](double p) -> double {
    if (sorted.empty()) return -1;
    size_t i = (size_t)std::min<double>(sorted.size() - 1, std::floor(p * (sorted.size() - 1) + 0.5));
    return sorted[i];
  };
  size_t over1ms = 0;
  for (float v : stall_us) over1ms += v > 1000.0f;
  printf("max_stall_us=%.1f\nstall_p50_us=%.2f\nstall_p99_us=%.1f\nstalls_over_1ms=%zu\n",
         sorted.empty() ? -1.0 : (double)sorted.back(), pct(0.5), pct(0.99), over1ms);
  printf("max_inflight_wait_us=%.1f\n", max_wait / 1e3);

  std::vector<Iv> iv;
  iv.reserve(kernels);
  size_t bad = 0;
  uint64_t first = UINT64_MAX, last = 0;
  for (unsigned long long i = 0; i < kernels; i++) {
    if (hs[i] == ~0ull || he[i] < hs[i]) {
      bad++;
      continue;
    }
    iv.push_back({hs[i], he[i]});
    first = std::min<uint64_t>(first, hs[i]);
    last = std::max<uint64_t>(last, he[i]);
  }
  printf("bad_slots=%zu\n", bad);
  if (iv.empty()) {
    printf("error_no_intervals=1\n");
    return 1;
  }
  double mean_len = 0;
  for (const Iv &x : iv) mean_len += (double)(x.e - x.s);
  printf("mean_kernel_us=%.2f\n", mean_len / iv.size() / 1e3);

  if (dump) {
    FILE *f = fopen(dump, "w");
    if (!f) {
      printf("error_dump=%s\nerror_errno=%d\n", dump, errno);
      return 1;
    }
    for (const Iv &x : iv) fprintf(f, "%llu %llu\n", (unsigned long long)x.s, (unsigned long long)x.e);
    if (fclose(f) != 0) {
      printf("error_dump_close=%s\n", dump);
      return 1;
    }
    printf("dump=%s\n", dump);
  }

  analyse(iv, first, last);

  for (auto &e : ev) CK(cudaEventDestroy(e));
  if (graph) {
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
  }
  CK(cudaStreamDestroy(s));
  CK(cudaFree(d_starts));
  CK(cudaFree(d_ends));
  CK(cudaFree(d_arrivals));
  printf("ok=%d\n", bad == 0 && arrivals % grid == 0 ? 1 : 0);
  return 0;
}

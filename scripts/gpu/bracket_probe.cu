// Diagnostic: how much of an event bracket around one launch is launch
// latency rather than kernel, for launches into an idle GPU, by launch path
// and grid size. Prints min/median bracket and in-kernel time (globaltimer).
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("error %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1); } } while (0)

__device__ unsigned long long now_ns() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}

__global__ void spin(unsigned long long dur, unsigned long long *span) {
  unsigned long long t0 = now_ns();
  if (threadIdx.x == 0) atomicMin(&span[0], t0);
  if (dur) while (now_ns() - t0 < dur) {}
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&span[1], now_ns());
}

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main() {
  int sms = 0; CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned long long *span; CHECK(cudaMalloc(&span, 16));
  cudaStream_t s; CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b; CHECK(cudaEventCreate(&a)); CHECK(cudaEventCreate(&b));
  struct Case { const char *name; int grid, block; unsigned long long dur; bool graph; };
  Case cases[] = {
    {"empty 1x1", 1, 1, 0, false}, {"empty 1x1 graph", 1, 1, 0, true},
    {"empty full", sms * 2, 512, 0, false}, {"empty full graph", sms * 2, 512, 0, true},
    {"spin50 full", sms * 2, 512, 50000, false}, {"spin50 full graph", sms * 2, 512, 50000, true},
  };
  for (auto &c : cases) {
    cudaGraphExec_t exec = nullptr;
    if (c.graph) {
      cudaGraph_t g;
      CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      spin<<<c.grid, c.block, 0, s>>>(c.dur, span);
      CHECK(cudaStreamEndCapture(s, &g));
      CHECK(cudaGraphInstantiate(&exec, g, 0));
    }
    std::vector<float> bracket, body;
    for (int i = 0; i < 200; i++) {
      unsigned long long init[2] = {~0ull, 0};
      CHECK(cudaMemcpy(span, init, 16, cudaMemcpyHostToDevice));
      CHECK(cudaDeviceSynchronize());
      CHECK(cudaEventRecord(a, s));
      if (c.graph) CHECK(cudaGraphLaunch(exec, s)); else spin<<<c.grid, c.block, 0, s>>>(c.dur, span);
      CHECK(cudaEventRecord(b, s));
      CHECK(cudaEventSynchronize(b));
      float ms; CHECK(cudaEventElapsedTime(&ms, a, b));
      unsigned long long got[2]; CHECK(cudaMemcpy(got, span, 16, cudaMemcpyDeviceToHost));
      bracket.push_back(ms * 1000.f); body.push_back((got[1] - got[0]) / 1000.f);
    }
    printf("%-20s bracket_us min=%.2f med=%.2f  body_us med=%.2f  overhead_us med=%.2f\n", c.name,
           *std::min_element(bracket.begin(), bracket.end()), median(bracket), median(body),
           median(bracket) - median(body));
  }
  return 0;
}

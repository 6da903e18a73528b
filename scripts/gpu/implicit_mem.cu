// Checks 28-36, 38, 39 and 42: the ways the CUDA driver takes device memory
// without an allocation call of the program. Runs one <path>, then shows the process
// still works (64 MiB cudaMalloc + memset + synchronize), then keeps what it
// took until <release-file> exists (polls every 100 ms, gives up after
// <max_s> seconds, default 120) so that its footprint can be read from
// outside, then releases it.
//   graph_node     cudaGraphAddMemAllocNode of <bytes> (+ a memset node),
//                  instantiate, upload, launch: the graph does not free it
//   graph_capture  the same from a captured cudaMallocAsync + cudaMemsetAsync
//   heap           cudaLimitMallocHeapSize=<bytes>, a kernel that malloc()s
//   stack          cudaLimitStackSize for <bytes> over every resident thread
//   printf_fifo    cudaLimitPrintfFifoSize=<bytes>, a kernel that printf()s
//   module         cuModuleLoad of <cubin> (big_global.cu: a 1 GiB global)
//                  until <bytes> are loaded, touch_big on each copy
//   library        the same with cuLibraryLoadFromFile
//   pool           the default pool keeps <bytes>/2 that were freed
//                  (release threshold UINT64_MAX), then cudaMalloc(<bytes>/2);
//                  cudaMemPoolTrimTo(0) and the cudaMalloc again if it failed
//   custom_pool    a pool of its own (cudaMemPoolCreate, release threshold
//                  UINT64_MAX): 1 GiB at a time with cudaMallocFromPoolAsync
//                  on one stream, each written (cudaMemsetAsync), every
//                  third one freeing the one before it (cudaFreeAsync: the
//                  pool keeps it), until one is refused or <bytes> are live
//                  (at most 64 allocations); prints allocations=, live=,
//                  reserved= and used= (what the pool holds, in bytes)
//   contexts       up to 16 more contexts with cuCtxCreate
//   lazy_global    cudaMalloc of <bytes> less 3 GiB (+ a memset), then the
//                  first launch of a kernel of lazy_global.cu, a unit with
//                  a 3 GiB __device__ global that the runtime loads only then
//   green_contexts up to 16 green contexts (CUDA 13 driver API), each on
//                  one group of the fewest SMs the device splits off
// Prints key=value lines: <step>_rc=<int> for each step it ran, op_rc= (the
// first failure of the steps that take the memory, 0 when none), op_name=,
// usable_rc=, usable=1 when the 64 MiB step worked, holding=1, done=1.
// Exit status 0 whatever the driver answered; 64 on a usage error.
// Usage: implicit_mem <path> [bytes [release-file [max_s [cubin]]]]
//        (bytes default 6 GiB; cubin needed by module and library)
// Build: nvcc -O2 -arch=sm_90 -Xcompiler -mcmodel=medium -o implicit_mem implicit_mem.cu lazy_global.cu -lcuda
//        (the host shadow of lazy_global.cu's 3 GiB global needs the medium code model)
#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

static const size_t MiB = 1ull << 20;
static const size_t USABLE = 64 * MiB;
static const int MAX_CONTEXTS = 16;
static const int MAX_LOADS = 64;
static const int MAX_POOL_ALLOCATIONS = 64;
static const size_t GiB = 1ull << 30;
// The SMs asked for each green context's group; the driver rounds it up to
// its granularity (8 on compute capability 9.0).
static const unsigned GREEN_SMS = 8;

// lazy_global.cu, a translation unit of its own (its module is loaded at the
// first launch of its kernel).
size_t lazy_global_bytes();
cudaError_t lazy_global_touch(size_t bytes);

static int op_rc = 0;
static const char *op_name = nullptr;

// Prints <key>_rc=<rc>; when op, the first failure is the path's op_rc.
static bool rt(const char *key, cudaError_t e, bool op = true) {
  printf("%s_rc=%d\n", key, (int)e);
  if (e == cudaSuccess) return true;
  cudaGetLastError();  // a failed call is not sticky: later calls must not see it
  if (op && op_rc == 0) {
    op_rc = (int)e;
    op_name = cudaGetErrorName(e);
  }
  return false;
}

static bool drv(const char *key, CUresult r, bool op = true) {
  printf("%s_rc=%d\n", key, (int)r);
  if (r == CUDA_SUCCESS) return true;
  if (op && op_rc == 0) {
    const char *name = nullptr;
    op_rc = (int)r;
    op_name = cuGetErrorName(r, &name) == CUDA_SUCCESS && name ? name : "?";
  }
  return false;
}

// What the path took, released at the end.
struct Held {
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  void *graph_ptr = nullptr;  // the graph's allocation, once launched
  void *plain = nullptr;
  void *usable = nullptr;
  CUmodule mods[MAX_LOADS] = {};
  CUlibrary libs[MAX_LOADS] = {};
  int loads = 0;
  CUcontext ctxs[MAX_CONTEXTS] = {};
  int contexts = 0;
  CUgreenCtx greens[MAX_CONTEXTS] = {};
  int green = 0;
  cudaMemPool_t pool = nullptr;  // custom_pool's own pool
  void *pooled[MAX_POOL_ALLOCATIONS] = {};
  int pooled_count = 0;
};

__device__ int malloc_ok;

__global__ void heap_kernel() {
  char *p = static_cast<char *>(malloc(1 << 20));
  malloc_ok = p != nullptr;
  if (p) {
    p[0] = 1;
    free(p);
  }
}

__global__ void nop_kernel(int *out) {
  if (out) *out = 1;
}

__global__ void printf_kernel() { printf("device_printf=1\n"); }

// The launch's rc, else the synchronize's.
static cudaError_t launched() {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? cudaDeviceSynchronize() : e;
}

static void run_graph(Held &h, void *ptr) {
  if (!rt("instantiate", cudaGraphInstantiate(&h.exec, h.graph, 0))) return;
  if (!rt("upload", cudaGraphUpload(h.exec, h.stream))) return;
  if (!rt("launch", cudaGraphLaunch(h.exec, h.stream))) return;
  h.graph_ptr = ptr;  // nothing in the graph frees it: cudaFree at the end
  rt("sync", cudaStreamSynchronize(h.stream));
}

static void graph_node(Held &h, size_t bytes) {
  if (!rt("stream", cudaStreamCreateWithFlags(&h.stream, cudaStreamNonBlocking))) return;
  if (!rt("graph", cudaGraphCreate(&h.graph, 0))) return;
  cudaMemAllocNodeParams ap;
  memset(&ap, 0, sizeof ap);
  ap.poolProps.allocType = cudaMemAllocationTypePinned;
  ap.poolProps.location.type = cudaMemLocationTypeDevice;
  ap.poolProps.location.id = 0;
  ap.bytesize = bytes;
  cudaGraphNode_t alloc = nullptr, set = nullptr;
  if (!rt("alloc_node", cudaGraphAddMemAllocNode(&alloc, h.graph, nullptr, 0, &ap))) return;
  cudaMemsetParams mp;
  memset(&mp, 0, sizeof mp);
  mp.dst = ap.dptr;
  mp.value = 0;
  mp.elementSize = 1;
  mp.width = bytes;
  mp.height = 1;
  // The memset only makes the memory used: the graph runs without it too.
  rt("memset_node", cudaGraphAddMemsetNode(&set, h.graph, &alloc, 1, &mp), false);
  run_graph(h, ap.dptr);
}

static void graph_capture(Held &h, size_t bytes) {
  if (!rt("stream", cudaStreamCreateWithFlags(&h.stream, cudaStreamNonBlocking))) return;
  if (!rt("begin_capture", cudaStreamBeginCapture(h.stream, cudaStreamCaptureModeGlobal))) return;
  void *p = nullptr;
  if (rt("capture", cudaMallocAsync(&p, bytes, h.stream))) rt("memset", cudaMemsetAsync(p, 0, bytes, h.stream));
  // Ended whatever happened: the stream leaves capture mode.
  if (!rt("end_capture", cudaStreamEndCapture(h.stream, &h.graph)) || op_rc != 0) return;
  run_graph(h, p);
}

static void print_limit(cudaLimit limit) {
  size_t v = 0;
  if (cudaDeviceGetLimit(&v, limit) == cudaSuccess) printf("limit=%zu\n", v);
}

static void heap(size_t bytes) {
  if (!rt("setlimit", cudaDeviceSetLimit(cudaLimitMallocHeapSize, bytes))) return;
  print_limit(cudaLimitMallocHeapSize);
  heap_kernel<<<1, 1>>>();
  if (!rt("kernel", launched())) return;
  int ok = 0;
  if (cudaMemcpyFromSymbol(&ok, malloc_ok, sizeof ok) == cudaSuccess) printf("malloc_ok=%d\n", ok);
}

static void stack(size_t bytes) {
  int sms = 0, threads = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&threads, cudaDevAttrMaxThreadsPerMultiProcessor, 0);
  if (!rt("attr", e)) return;
  size_t resident = (size_t)sms * (size_t)threads;
  size_t per_thread = resident ? bytes / resident / 16 * 16 : 0;
  printf("sms=%d\nthreads_per_sm=%d\nper_thread=%zu\n", sms, threads, per_thread);
  if (!rt("setlimit", cudaDeviceSetLimit(cudaLimitStackSize, per_thread))) return;
  print_limit(cudaLimitStackSize);
  nop_kernel<<<1, 1>>>(nullptr);
  rt("kernel", launched());
}

static void printf_fifo(size_t bytes) {
  if (!rt("setlimit", cudaDeviceSetLimit(cudaLimitPrintfFifoSize, bytes))) return;
  print_limit(cudaLimitPrintfFifoSize);
  printf_kernel<<<1, 1>>>();
  rt("kernel", launched());
}

// touch_big over the first n MiB of a copy of the global.
static CUresult touch(CUfunction f, size_t global_bytes) {
  size_t n = global_bytes >> 20;
  void *args[] = {&n};
  unsigned blocks = (unsigned)((n + 255) / 256);
  CUresult r = cuLaunchKernel(f, blocks ? blocks : 1, 1, 1, 256, 1, 1, 0, nullptr, args, nullptr);
  return r == CUDA_SUCCESS ? cuCtxSynchronize() : r;
}

// Loads the cubin until <bytes> are loaded (every load has its own copy of
// the global) and touches each copy; stops at the first failure.
static void modules(Held &h, const char *cubin, size_t bytes, bool library) {
  const int NOT_RUN = -1;
  int load = NOT_RUN, global = NOT_RUN, function = NOT_RUN, kernel = NOT_RUN;
  size_t global_bytes = 0, loaded = 0;
  int complete = 0;
  while (loaded < bytes && h.loads < MAX_LOADS) {
    CUdeviceptr g = 0;
    CUfunction f = nullptr;
    global = function = kernel = NOT_RUN;
    if (library) {
      CUlibrary lib = nullptr;
      load = cuLibraryLoadFromFile(&lib, cubin, nullptr, nullptr, 0, nullptr, nullptr, 0);
      if (load != CUDA_SUCCESS) break;
      h.libs[h.loads++] = lib;
      global = cuLibraryGetGlobal(&g, &global_bytes, lib, "big_global");
      if (global != CUDA_SUCCESS) break;
      CUkernel k = nullptr;
      function = cuLibraryGetKernel(&k, lib, "touch_big");
      f = (CUfunction)k;  // cuLaunchKernel takes a CUkernel too, for the current context
    } else {
      CUmodule mod = nullptr;
      load = cuModuleLoad(&mod, cubin);
      if (load != CUDA_SUCCESS) break;
      h.mods[h.loads++] = mod;
      global = cuModuleGetGlobal(&g, &global_bytes, mod, "big_global");
      if (global != CUDA_SUCCESS) break;
      function = cuModuleGetFunction(&f, mod, "touch_big");
    }
    if (function != CUDA_SUCCESS || global_bytes == 0) break;
    kernel = touch(f, global_bytes);
    if (kernel != CUDA_SUCCESS) break;
    loaded += global_bytes;
    complete++;
  }
  printf("modules=%d\nglobal_bytes=%zu\nloaded_bytes=%zu\n", complete, global_bytes, loaded);
  // The steps of the last load, in order: the first failure is op_rc.
  const char *keys[] = {"load", "global", "function", "kernel"};
  int rcs[] = {load, global, function, kernel};
  for (int i = 0; i < 4; i++)
    if (rcs[i] != NOT_RUN) drv(keys[i], (CUresult)rcs[i]);
}

static void pool(Held &h, size_t bytes) {
  size_t half = bytes / 2;
  cudaMemPool_t pool = nullptr;
  if (!rt("stream", cudaStreamCreateWithFlags(&h.stream, cudaStreamNonBlocking))) return;
  if (!rt("pool", cudaDeviceGetDefaultMemPool(&pool, 0))) return;
  uint64_t keep = UINT64_MAX;
  if (!rt("threshold", cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep))) return;
  void *p = nullptr;
  cudaError_t e = cudaMallocAsync(&p, half, h.stream);
  if (e == cudaSuccess) e = cudaFreeAsync(p, h.stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(h.stream);
  if (!rt("kept", e)) return;
  uint64_t reserved = 0;
  if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess)
    printf("reserved=%llu\n", (unsigned long long)reserved);
  e = cudaMalloc(&h.plain, half);
  rt("malloc", e);
  // Trimming gives the kept memory back: the allocation fits then.
  rt("trim", cudaMemPoolTrimTo(pool, 0), false);
  printf("retried=%d\n", e != cudaSuccess);
  if (e != cudaSuccess) {
    h.plain = nullptr;
    e = cudaMalloc(&h.plain, half);
    if (e != cudaSuccess) h.plain = nullptr;
  }
  rt("after_trim", e, false);
}

// What the pool holds (reserved) and what its allocations use, in bytes.
static void print_pool(cudaMemPool_t pool) {
  uint64_t reserved = 0, used = 0;
  if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) == cudaSuccess)
    printf("reserved=%llu\n", (unsigned long long)reserved);
  if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used) == cudaSuccess)
    printf("used=%llu\n", (unsigned long long)used);
}

static void custom_pool(Held &h, size_t bytes) {
  if (!rt("stream", cudaStreamCreateWithFlags(&h.stream, cudaStreamNonBlocking))) return;
  cudaMemPoolProps props;
  memset(&props, 0, sizeof props);
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = 0;
  if (!rt("create", cudaMemPoolCreate(&h.pool, &props))) {
    h.pool = nullptr;
    return;
  }
  uint64_t keep = UINT64_MAX;
  if (!rt("threshold", cudaMemPoolSetAttribute(h.pool, cudaMemPoolAttrReleaseThreshold, &keep))) return;
  size_t live = 0;
  int made = 0;
  cudaError_t e = cudaSuccess;
  while (live < bytes && h.pooled_count < MAX_POOL_ALLOCATIONS) {
    void *p = nullptr;
    e = cudaMallocFromPoolAsync(&p, GiB, h.pool, h.stream);
    if (e != cudaSuccess) break;
    h.pooled[h.pooled_count++] = p;
    made++;
    live += GiB;
    e = cudaMemsetAsync(p, 1, GiB, h.stream);
    if (e != cudaSuccess) break;
    // Every third allocation frees the one before it: the pool keeps it.
    if (made % 3 == 0) {
      void *&before = h.pooled[h.pooled_count - 2];
      e = cudaFreeAsync(before, h.stream);
      if (e != cudaSuccess) break;
      before = nullptr;
      live -= GiB;
    }
  }
  cudaError_t synced = cudaStreamSynchronize(h.stream);
  printf("allocations=%d\nlive=%zu\n", made, live);
  print_pool(h.pool);
  rt("alloc", e);
  rt("sync", synced, false);
}

static void contexts(Held &h) {
  CUcontext primary = nullptr;
  CUdevice dev = 0;
  CUresult r = cuCtxGetCurrent(&primary);
  if (r == CUDA_SUCCESS) r = cuDeviceGet(&dev, 0);
  if (!drv("device", r)) return;
  CUresult create = CUDA_SUCCESS;
  while (h.contexts < MAX_CONTEXTS) {
#if CUDA_VERSION >= 13000
    create = cuCtxCreate(&h.ctxs[h.contexts], nullptr, 0, dev);
#else
    create = cuCtxCreate(&h.ctxs[h.contexts], 0, dev);
#endif
    if (create != CUDA_SUCCESS) break;
    h.contexts++;
  }
  printf("contexts=%d\n", h.contexts);
  drv("create", create);
  // A created context is made current: the runtime's steps use the primary one.
  drv("restore", cuCtxSetCurrent(primary), false);
}

// The plain cudaMalloc first (charged like any allocation), then the launch
// that makes the runtime load lazy_global.cu's module and its 3 GiB global.
static void lazy_global(Held &h, size_t bytes) {
  size_t global = lazy_global_bytes();
  size_t plain = bytes > global ? bytes - global : 0;
  printf("global_bytes=%zu\nplain_bytes=%zu\n", global, plain);
  if (plain) {
    if (!rt("malloc", cudaMalloc(&h.plain, plain))) {
      h.plain = nullptr;
      return;
    }
    cudaError_t e = cudaMemset(h.plain, 1, plain);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (!rt("memset", e)) return;
  }
  if (!rt("launch", lazy_global_touch(global))) return;
  rt("sync", cudaDeviceSynchronize());
}

// Green contexts from one SM group; the same descriptor serves each of them.
// cuGreenCtxCreate does not make the context current.
static void green_contexts(Held &h) {
  CUcontext primary = nullptr;
  CUdevice dev = 0;
  CUresult r = cuCtxGetCurrent(&primary);
  if (r == CUDA_SUCCESS) r = cuDeviceGet(&dev, 0);
  if (!drv("device", r)) return;
  CUdevResource all, group, rest;
  memset(&all, 0, sizeof all);
  memset(&group, 0, sizeof group);
  memset(&rest, 0, sizeof rest);
  if (!drv("resource", cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM))) return;
  unsigned groups = 1;
  if (!drv("split", cuDevSmResourceSplitByCount(&group, &groups, &all, &rest, 0, GREEN_SMS))) return;
  printf("sms=%u\ngroups=%u\ngreen_sms=%u\n", all.sm.smCount, groups, group.sm.smCount);
  CUdevResourceDesc desc = nullptr;
  if (!drv("desc", cuDevResourceGenerateDesc(&desc, &group, 1))) return;
  CUresult create = CUDA_SUCCESS;
  while (h.green < MAX_CONTEXTS) {
    create = cuGreenCtxCreate(&h.greens[h.green], desc, dev, CU_GREEN_CTX_DEFAULT_STREAM);
    if (create != CUDA_SUCCESS) break;
    h.green++;
  }
  printf("contexts=%d\n", h.green);
  drv("create", create);
  // Should a driver make one current, the runtime's steps still use the primary one.
  drv("restore", cuCtxSetCurrent(primary), false);
}

static void release(Held &h) {
  if (h.usable) cudaFree(h.usable);
  if (h.plain) cudaFree(h.plain);
  if (h.graph_ptr) cudaFree(h.graph_ptr);
  if (h.exec) cudaGraphExecDestroy(h.exec);
  if (h.graph) cudaGraphDestroy(h.graph);
  for (int i = 0; i < h.loads; i++) {
    if (h.mods[i]) cuModuleUnload(h.mods[i]);
    if (h.libs[i]) cuLibraryUnload(h.libs[i]);
  }
  for (int i = h.contexts - 1; i >= 0; i--) cuCtxDestroy(h.ctxs[i]);
  for (int i = h.green - 1; i >= 0; i--) cuGreenCtxDestroy(h.greens[i]);
  for (int i = 0; i < h.pooled_count; i++)
    if (h.pooled[i]) cudaFreeAsync(h.pooled[i], h.stream);
  if (h.pool) {
    cudaStreamSynchronize(h.stream);
    cudaMemPoolDestroy(h.pool);
  }
  if (h.stream) cudaStreamDestroy(h.stream);
}

static const char *const PATHS[] = {"graph_node", "graph_capture", "heap", "stack", "printf_fifo",
                                    "module", "library", "pool", "custom_pool", "contexts",
                                    "lazy_global", "green_contexts"};

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *path = argc > 1 ? argv[1] : "";
  bool known = false;
  for (const char *p : PATHS) known = known || strcmp(p, path) == 0;
  size_t bytes = argc > 2 ? strtoull(argv[2], nullptr, 10) : 6ull << 30;
  const char *release_file = argc > 3 ? argv[3] : nullptr;
  int max_s = argc > 4 ? atoi(argv[4]) : 120;
  const char *cubin = argc > 5 ? argv[5] : nullptr;
  bool driver_path = !strcmp(path, "module") || !strcmp(path, "library") || !strcmp(path, "contexts") ||
                     !strcmp(path, "green_contexts");
  bool needs_cubin = !strcmp(path, "module") || !strcmp(path, "library");
  if (!known || bytes == 0 || (needs_cubin && !cubin)) {
    fprintf(stderr, "usage: %s <path> [bytes [release-file [max_s [cubin]]]]\n  paths:", argv[0]);
    for (const char *p : PATHS) fprintf(stderr, " %s", p);
    fprintf(stderr, "\n  module and library need the cubin of big_global.cu\n");
    return 64;
  }
  printf("pid=%d\npath=%s\nbytes=%zu\n", (int)getpid(), path, bytes);
  cudaError_t e = cudaFree(0);
  printf("ctx_rc=%d\n", (int)e);
  cudaGetLastError();

  Held h;
  if (!strcmp(path, "graph_node")) graph_node(h, bytes);
  else if (!strcmp(path, "graph_capture")) graph_capture(h, bytes);
  else if (!strcmp(path, "heap")) heap(bytes);
  else if (!strcmp(path, "stack")) stack(bytes);
  else if (!strcmp(path, "printf_fifo")) printf_fifo(bytes);
  else if (!strcmp(path, "module")) modules(h, cubin, bytes, false);
  else if (!strcmp(path, "library")) modules(h, cubin, bytes, true);
  else if (!strcmp(path, "pool")) pool(h, bytes);
  else if (!strcmp(path, "custom_pool")) custom_pool(h, bytes);
  else if (!strcmp(path, "contexts")) contexts(h);
  else if (!strcmp(path, "lazy_global")) lazy_global(h, bytes);
  else green_contexts(h);
  if (!op_name) op_name = driver_path ? "CUDA_SUCCESS" : "cudaSuccess";
  printf("op_rc=%d\nop_name=%s\n", op_rc, op_name);

  // Whatever the path got, the process goes on working.
  cudaGetLastError();
  e = cudaMalloc(&h.usable, USABLE);
  if (e != cudaSuccess) h.usable = nullptr;
  if (e == cudaSuccess) e = cudaMemset(h.usable, 0, USABLE);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  printf("usable_rc=%d\nusable=%d\n", (int)e, e == cudaSuccess);
  cudaGetLastError();

  if (release_file) {
    printf("holding=1\n");
    fflush(stdout);
    for (int i = 0; i < max_s * 10; i++) {
      if (access(release_file, F_OK) == 0) break;
      usleep(100 * 1000);
    }
  }
  release(h);
  printf("done=1\n");
  return 0;
}

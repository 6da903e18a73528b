// Check 4: every allocation API counts against the quota and frees give back.
// For each API: (a) allocate 1 GiB and check that cuMemGetInfo's free dropped
// by >= 1 GiB - 2 MiB; (b) try 5 GiB (over a 4 GiB quota): expect
// CUDA_ERROR_OUT_OF_MEMORY (2) under the limiter; (c) free and check that free
// came back within 2 MiB.  One line per API:
//   API <name> alloc=<rc> drop=<bytes> over=<rc|n/a> back=<ok|FAIL> ...
// Usage: mem_apis [limited]   ("limited": also try the over-quota managed
// allocation; without the limiter it is skipped and printed as n/a).
// The _ptsz entry points are looked up with dlsym in libcuda.so.1 and called
// explicitly (this file is NOT built with CUDA_API_PER_THREAD_DEFAULT_STREAM).
// Build: nvcc -O2 -arch=sm_90 -o mem_apis mem_apis.cu -lcuda -ldl
#include <cuda.h>
#include <dlfcn.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>

static const size_t MiB = 1ull << 20;
static const size_t GiB = 1ull << 30;
static const size_t SMALL = 1 * GiB;
static const size_t BIG = 5 * GiB;
static const long long SLACK = 2 * (long long)MiB;

typedef CUresult (*AllocAsyncFn)(CUdeviceptr *, size_t, CUstream);
typedef CUresult (*FreeAsyncFn)(CUdeviceptr, CUstream);
typedef CUresult (*PoolAllocFn)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);

static CUdevice g_dev;
static CUmemoryPool g_pool;
static bool g_have_pool = false;
static AllocAsyncFn p_allocAsync_ptsz;
static FreeAsyncFn p_freeAsync_ptsz;
static PoolAllocFn p_poolAlloc_ptsz;
static size_t g_gran = 2 * MiB;

struct Obj {
  CUdeviceptr p = 0;
  size_t pitch = 0;
  CUmemGenericAllocationHandle h = 0;
  CUarray a = nullptr;
  CUmipmappedArray m = nullptr;
};

// Let stream-ordered frees land and give pool memory back to the device.
static void settle() {
  CUresult r1 = cuStreamSynchronize((CUstream)0);
  CUresult r2 = cuStreamSynchronize(CU_STREAM_PER_THREAD);
  CUresult r3 = g_have_pool ? cuMemPoolTrimTo(g_pool, 0) : CUDA_SUCCESS;
  if (r1 || r2 || r3) printf("settle rc=%d,%d,%d\n", (int)r1, (int)r2, (int)r3);
}

static long long free_now() {
  size_t f = 0, t = 0;
  CUresult r = cuMemGetInfo(&f, &t);
  if (r != CUDA_SUCCESS) {
    printf("cuMemGetInfo rc=%d\n", (int)r);
    return -1;
  }
  return (long long)f;
}

// ---- one alloc/free pair per API; `big` selects the over-quota size ----
static CUresult a_memalloc(bool big, Obj &o) { return cuMemAlloc(&o.p, big ? BIG : SMALL); }
static CUresult f_memfree(Obj &o) { return cuMemFree(o.p); }

static CUresult a_pitch(bool big, Obj &o) {
  // 16384-byte rows, 16-byte elements: 65536 rows = 1 GiB, 327680 rows = 5 GiB
  return cuMemAllocPitch(&o.p, &o.pitch, 16384, big ? 327680 : 65536, 16);
}

static CUresult a_managed(bool big, Obj &o) {
  CUresult r = cuMemAllocManaged(&o.p, big ? BIG : SMALL, CU_MEM_ATTACH_GLOBAL);
  if (r == CUDA_SUCCESS && !big) {
    // Touch it on the device so that the driver really backs it (baseline).
    CUresult m = cuMemsetD8(o.p, 0, SMALL);
    CUresult s = cuStreamSynchronize((CUstream)0);
    if (m || s) printf("managed memset rc=%d sync rc=%d\n", (int)m, (int)s);
  }
  return r;
}

static CUresult a_async(bool big, Obj &o) {
  return cuMemAllocAsync(&o.p, big ? BIG : SMALL, (CUstream)0);
}
static CUresult f_async(Obj &o) {
  CUresult r = cuMemFreeAsync(o.p, (CUstream)0);
  CUresult s = cuStreamSynchronize((CUstream)0);
  return r ? r : s;
}

static CUresult a_async_ptsz(bool big, Obj &o) {
  if (!p_allocAsync_ptsz) return CUDA_ERROR_NOT_FOUND;  // symbol or pool missing (printed above)
  return p_allocAsync_ptsz(&o.p, big ? BIG : SMALL, (CUstream)0);
}
static CUresult f_async_ptsz(Obj &o) {
  if (!p_freeAsync_ptsz) return CUDA_ERROR_NOT_FOUND;  // symbol or pool missing (printed above)
  CUresult r = p_freeAsync_ptsz(o.p, (CUstream)0);
  CUresult s = cuStreamSynchronize(CU_STREAM_PER_THREAD);
  return r ? r : s;
}

static CUresult a_pool(bool big, Obj &o) {
  if (!g_have_pool) return CUDA_ERROR_NOT_FOUND;  // symbol or pool missing (printed above)
  return cuMemAllocFromPoolAsync(&o.p, big ? BIG : SMALL, g_pool, (CUstream)0);
}
static CUresult a_pool_ptsz(bool big, Obj &o) {
  if (!g_have_pool || !p_poolAlloc_ptsz) return CUDA_ERROR_NOT_FOUND;  // symbol or pool missing (printed above)
  return p_poolAlloc_ptsz(&o.p, big ? BIG : SMALL, g_pool, (CUstream)0);
}

static CUmemAllocationProp vmm_prop() {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = g_dev;
  return prop;
}
static CUresult a_create(bool big, Obj &o) {
  CUmemAllocationProp prop = vmm_prop();
  size_t sz = big ? BIG : SMALL;
  sz = (sz + g_gran - 1) / g_gran * g_gran;
  return cuMemCreate(&o.h, sz, &prop, 0);
}
static CUresult f_create(Obj &o) { return cuMemRelease(o.h); }

static CUresult a_array(bool big, Obj &o) {
  CUDA_ARRAY_DESCRIPTOR d;
  memset(&d, 0, sizeof d);
  if (big) {  // 16384 x 20480 x float4 = 5 GiB
    d.Width = 16384; d.Height = 20480; d.Format = CU_AD_FORMAT_FLOAT; d.NumChannels = 4;
  } else {    // 16384 x 16384 x float = 1 GiB
    d.Width = 16384; d.Height = 16384; d.Format = CU_AD_FORMAT_FLOAT; d.NumChannels = 1;
  }
  return cuArrayCreate(&o.a, &d);
}
static CUresult f_array(Obj &o) { return cuArrayDestroy(o.a); }

static CUresult a_array3d(bool big, Obj &o) {
  CUDA_ARRAY3D_DESCRIPTOR d;
  memset(&d, 0, sizeof d);
  d.Format = CU_AD_FORMAT_FLOAT;
  d.NumChannels = 1;
  if (big) {  // 2048 x 2048 x 320 x float = 5 GiB
    d.Width = 2048; d.Height = 2048; d.Depth = 320;
  } else {    // 1024 x 1024 x 256 x float = 1 GiB
    d.Width = 1024; d.Height = 1024; d.Depth = 256;
  }
  return cuArray3DCreate(&o.a, &d);
}

static CUresult a_mipmap(bool big, Obj &o) {
  CUDA_ARRAY3D_DESCRIPTOR d;
  memset(&d, 0, sizeof d);
  d.Format = CU_AD_FORMAT_FLOAT;
  d.Depth = 0;  // 2D mipmapped array, one level
  if (big) {    // 16384 x 20480 x float4 = 5 GiB
    d.Width = 16384; d.Height = 20480; d.NumChannels = 4;
  } else {      // 16384 x 16384 x float = 1 GiB
    d.Width = 16384; d.Height = 16384; d.NumChannels = 1;
  }
  return cuMipmappedArrayCreate(&o.m, &d, 1);
}
static CUresult f_mipmap(Obj &o) { return cuMipmappedArrayDestroy(o.m); }

struct Api {
  const char *name;
  CUresult (*alloc)(bool, Obj &);
  CUresult (*release)(Obj &);
  bool over_only_limited;  // managed: no 5 GiB managed request without the limiter
};

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  bool limited = argc > 1 && strcmp(argv[1], "limited") == 0;
  printf("limited=%d\n", limited ? 1 : 0);

  CUresult r = cuInit(0);
  if (r) { printf("error=cuInit rc=%d\n", (int)r); return 1; }
  r = cuDeviceGet(&g_dev, 0);
  if (r) { printf("error=cuDeviceGet rc=%d\n", (int)r); return 1; }
  CUcontext ctx;
  r = cuDevicePrimaryCtxRetain(&ctx, g_dev);
  if (r) { printf("error=cuDevicePrimaryCtxRetain rc=%d\n", (int)r); return 1; }
  r = cuCtxSetCurrent(ctx);
  if (r) { printf("error=cuCtxSetCurrent rc=%d\n", (int)r); return 1; }

  size_t total_dev = 0, f = 0, t = 0;
  r = cuDeviceTotalMem(&total_dev, g_dev);
  printf("device_total_rc=%d\ndevice_total=%zu\n", (int)r, total_dev);
  r = cuMemGetInfo(&f, &t);
  printf("info_rc=%d\nfree=%zu\ntotal=%zu\n", (int)r, f, t);

  r = cuDeviceGetDefaultMemPool(&g_pool, g_dev);
  g_have_pool = (r == CUDA_SUCCESS);
  printf("default_pool_rc=%d\n", (int)r);

  CUmemAllocationProp prop = vmm_prop();
  r = cuMemGetAllocationGranularity(&g_gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  printf("granularity_rc=%d\ngranularity=%zu\n", (int)r, g_gran);
  if (r != CUDA_SUCCESS || g_gran == 0) g_gran = 2 * MiB;

  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib) {
    p_allocAsync_ptsz = (AllocAsyncFn)dlsym(lib, "cuMemAllocAsync_ptsz");
    p_freeAsync_ptsz = (FreeAsyncFn)dlsym(lib, "cuMemFreeAsync_ptsz");
    p_poolAlloc_ptsz = (PoolAllocFn)dlsym(lib, "cuMemAllocFromPoolAsync_ptsz");
  }
  printf("ptsz_symbols=%d,%d,%d\n", p_allocAsync_ptsz != nullptr, p_freeAsync_ptsz != nullptr,
         p_poolAlloc_ptsz != nullptr);

  const Api apis[] = {
      {"cuMemAlloc_v2", a_memalloc, f_memfree, false},
      {"cuMemAllocPitch_v2", a_pitch, f_memfree, false},
      {"cuMemAllocManaged", a_managed, f_memfree, true},
      {"cuMemAllocAsync", a_async, f_async, false},
      {"cuMemAllocAsync_ptsz", a_async_ptsz, f_async_ptsz, false},
      {"cuMemAllocFromPoolAsync", a_pool, f_async, false},
      {"cuMemAllocFromPoolAsync_ptsz", a_pool_ptsz, f_async_ptsz, false},
      {"cuMemCreate", a_create, f_create, false},
      {"cuArrayCreate_v2", a_array, f_array, false},
      {"cuArray3DCreate_v2", a_array3d, f_array, false},
      {"cuMipmappedArrayCreate", a_mipmap, f_mipmap, false},
  };

  for (const Api &api : apis) {
    settle();
    long long f0 = free_now();
    Obj o;
    CUresult ra = api.alloc(false, o);
    settle();
    long long f1 = free_now();
    long long drop = (f0 >= 0 && f1 >= 0) ? f0 - f1 : -1;
    if (ra != CUDA_SUCCESS) drop = 0;

    char over[32];
    long long f_over = -1;
    if (api.over_only_limited && !limited) {
      snprintf(over, sizeof over, "n/a");
    } else {
      Obj ob;
      CUresult ro = api.alloc(true, ob);
      snprintf(over, sizeof over, "%d", (int)ro);
      if (ro == CUDA_SUCCESS) {
        settle();
        f_over = free_now();
        CUresult rf = api.release(ob);
        if (rf) printf("over_free_rc=%d (%s)\n", (int)rf, api.name);
      }
    }

    CUresult rf = CUDA_SUCCESS;
    if (ra == CUDA_SUCCESS) rf = api.release(o);
    settle();
    long long f2 = free_now();
    long long diff = (f2 >= 0 && f0 >= 0) ? f2 - f0 : 1LL << 60;
    bool back = ra == CUDA_SUCCESS && rf == CUDA_SUCCESS && diff <= SLACK && diff >= -SLACK;
    printf("API %s alloc=%d drop=%lld over=%s back=%s free_rc=%d f0=%lld f1=%lld f2=%lld "
           "f_over=%lld pitch=%zu\n",
           api.name, (int)ra, drop, over, back ? "ok" : "FAIL", (int)rf, f0, f1, f2, f_over,
           o.pitch);
  }
  r = cuDevicePrimaryCtxRelease(g_dev);
  printf("release_rc=%d\ndone=1\n", (int)r);
  return 0;
}

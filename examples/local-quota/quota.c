/*
 * A CUDA program that knows nothing of the limiter: it asks the driver how
 * much memory the GPU has, allocates 256 MiB blocks until the driver says
 * no, then runs 200 kernels of 2 ms each and measures how much of the wall
 * time they took. Run alone it sees the whole GPU; run by run.sh, under a
 * memory quota and a compute share, it sees the quota as the GPU's size, is
 * refused past it with CUDA's own out-of-memory error, and gets its share
 * of the GPU's time.
 *
 * It uses the driver API through dlopen("libcuda.so.1"), as PyTorch does,
 * so it builds with a C compiler alone: cc -O2 -o quota quota.c -ldl
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult; /* 0 is CUDA_SUCCESS, 2 CUDA_ERROR_OUT_OF_MEMORY */
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;

#define BLOCK_MIB 256
#define MAX_BLOCKS 1024
#define KERNELS 200
#define KERNEL_NS 2000000ULL

/* A kernel of one thread that spins on the GPU's clock for `ns` nanoseconds. */
static const char SPIN_PTX[] =
    ".version 7.0\n"
    ".target sm_70\n"
    ".address_size 64\n"
    ".visible .entry spin(.param .u64 ns)\n"
    "{\n"
    "    .reg .pred %p;\n"
    "    .reg .b64 %rd<5>;\n"
    "    ld.param.u64 %rd1, [ns];\n"
    "    mov.u64 %rd2, %globaltimer;\n"
    "WAIT:\n"
    "    mov.u64 %rd3, %globaltimer;\n"
    "    sub.u64 %rd4, %rd3, %rd2;\n"
    "    setp.lt.u64 %p, %rd4, %rd1;\n"
    "    @%p bra WAIT;\n"
    "    ret;\n"
    "}\n";

static struct {
    CUresult (*init)(unsigned);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*ctx_synchronize)(void);
    CUresult (*mem_get_info)(size_t *, size_t *);
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
    CUresult (*module_load_data)(CUmodule *, const void *);
    CUresult (*module_get_function)(CUfunction *, CUmodule, const char *);
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              unsigned, CUstream, void **, void **);
} cu;

static void *symbol(void *driver, const char *name) {
    void *found = dlsym(driver, name);
    if (found == NULL) {
        fprintf(stderr, "quota: the driver has no %s\n", name);
        exit(1);
    }
    return found;
}

static void check(CUresult rc, const char *what) {
    if (rc != 0) {
        fprintf(stderr, "quota: %s failed: CUDA error %d\n", what, rc);
        exit(1);
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(void) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (driver == NULL) {
        fprintf(stderr, "quota: %s\n", dlerror());
        return 1;
    }
    *(void **)&cu.init = symbol(driver, "cuInit");
    *(void **)&cu.device_get = symbol(driver, "cuDeviceGet");
    *(void **)&cu.primary_ctx_retain = symbol(driver, "cuDevicePrimaryCtxRetain");
    *(void **)&cu.ctx_set_current = symbol(driver, "cuCtxSetCurrent");
    *(void **)&cu.ctx_synchronize = symbol(driver, "cuCtxSynchronize");
    *(void **)&cu.mem_get_info = symbol(driver, "cuMemGetInfo_v2");
    *(void **)&cu.mem_alloc = symbol(driver, "cuMemAlloc_v2");
    *(void **)&cu.mem_free = symbol(driver, "cuMemFree_v2");
    *(void **)&cu.module_load_data = symbol(driver, "cuModuleLoadData");
    *(void **)&cu.module_get_function = symbol(driver, "cuModuleGetFunction");
    *(void **)&cu.launch_kernel = symbol(driver, "cuLaunchKernel");

    CUdevice device;
    CUcontext context;
    check(cu.init(0), "cuInit");
    check(cu.device_get(&device, 0), "cuDeviceGet");
    check(cu.primary_ctx_retain(&context, device), "cuDevicePrimaryCtxRetain");
    check(cu.ctx_set_current(context), "cuCtxSetCurrent");

    /* Memory: the quota is the GPU's size, and the driver refuses past it. */
    size_t free_bytes, total_bytes;
    check(cu.mem_get_info(&free_bytes, &total_bytes), "cuMemGetInfo");
    printf("device memory: %zu MiB total, %zu MiB free\n", total_bytes >> 20, free_bytes >> 20);
    static CUdeviceptr blocks[MAX_BLOCKS];
    int granted = 0;
    CUresult refused = 0;
    while (granted < MAX_BLOCKS && refused == 0) {
        refused = cu.mem_alloc(&blocks[granted], (size_t)BLOCK_MIB << 20);
        granted += refused == 0;
    }
    printf("allocations of %d MiB: %d granted, then CUDA error %d\n", BLOCK_MIB, granted, refused);
    for (int i = 0; i < granted; i++) {
        check(cu.mem_free(blocks[i]), "cuMemFree");
    }

    /* Compute: the same kernels take longer, the GPU being ours part of the time. */
    CUmodule module;
    CUfunction spin;
    check(cu.module_load_data(&module, SPIN_PTX), "cuModuleLoadData");
    check(cu.module_get_function(&spin, module, "spin"), "cuModuleGetFunction");
    unsigned long long ns = KERNEL_NS;
    void *params[] = {&ns};
    double start = now();
    for (int i = 0; i < KERNELS; i++) {
        check(cu.launch_kernel(spin, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), "cuLaunchKernel");
    }
    check(cu.ctx_synchronize(), "cuCtxSynchronize");
    double wall = now() - start, busy = KERNELS * (double)KERNEL_NS / 1e9;
    printf("kernels: %d x %.0f ms = %.2f s of GPU time in %.2f s: %.0f%% of the GPU's time\n", KERNELS,
           (double)KERNEL_NS / 1e6, busy, wall, 100.0 * busy / wall);
    return 0;
}

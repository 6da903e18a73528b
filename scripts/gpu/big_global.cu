// Checks 33 and 34: a module with a 1 GiB __device__ global, loaded by
// implicit_mem (module: cuModuleLoad, library: cuLibraryLoadFromFile) as many
// times as it takes to reach the bytes asked for; each load has its own copy.
// The driver takes the global's memory when it loads the module: no
// allocation call of the program asks for it. touch_big(n) writes one byte in
// each of the global's first n MiB, so the memory is really used.
// One global stays under 4 GiB: the cubin's section size is 32 bits wide
// (6 GiB is written as 2 GiB).
// Build: nvcc -cubin -arch=sm_90 -o big_global.cubin big_global.cu
//        (-DBIG_GLOBAL_BYTES=N for another size)
#include <cstddef>

#ifndef BIG_GLOBAL_BYTES
#define BIG_GLOBAL_BYTES (1ULL << 30)
#endif

// Names without C++ mangling: implicit_mem looks them up by these names.
extern "C" {
__device__ char big_global[BIG_GLOBAL_BYTES];

__global__ void touch_big(size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) big_global[i << 20] = 1;
}
}

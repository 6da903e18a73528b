// Check 38: a translation unit of implicit_mem with a 3 GiB __device__
// global, linked into implicit_mem (path lazy_global). The CUDA runtime
// registers each translation unit's fat binary lazily: the driver takes the
// global's memory at the first launch of one of this unit's kernels, not
// when the process starts or its context is made (measured on the H100,
// driver 580: 518 MiB before the launch, 3590 MiB after). A unit of its own,
// so that the kernels of implicit_mem's other paths never load it.
// touch_lazy(n) writes one byte in each of the global's first n MiB, so the
// memory is really used.
// The host keeps a shadow of every __device__ variable, 3 GiB of .bss here:
// the whole link needs -Xcompiler -mcmodel=medium (relocation errors without
// it). One module cannot hold more than 4 GiB of globals (the cubin's sizes
// are 32 bits wide and wrap).
// Build: with implicit_mem.cu,
//   nvcc -O2 -arch=sm_90 -Xcompiler -mcmodel=medium -o implicit_mem implicit_mem.cu lazy_global.cu -lcuda
#include <cstddef>
#include <cuda_runtime.h>

static constexpr size_t LAZY_GLOBAL_BYTES = 3ull << 30;

__device__ char lazy_global[LAZY_GLOBAL_BYTES];

__global__ void touch_lazy(size_t n) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (i < n) lazy_global[i << 20] = 1;
}

// The size of the global (bytes).
size_t lazy_global_bytes() { return LAZY_GLOBAL_BYTES; }

// Launches touch_lazy over the first <bytes> of the global: the first launch
// of this unit's kernels, which loads its module. Returns the launch's rc
// (cudaGetLastError); the caller synchronizes.
cudaError_t lazy_global_touch(size_t bytes) {
  size_t n = bytes >> 20;
  unsigned blocks = (unsigned)((n + 255) / 256);
  touch_lazy<<<blocks ? blocks : 1, 256>>>(n);
  return cudaGetLastError();
}

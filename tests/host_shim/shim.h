// Just enough of CUDA for cuda_src/lltm.cu to compile as host C++ and run on the CPU.
// A "launch" runs every (block, thread) pair of the grid one after another; the element-wise
// kernels have no shared memory, barriers or atomics, so that is a faithful execution.
#pragma once
#include <math.h>
#include <string.h>

#define LLTM_HOST_SHIM 1
#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
static dim3 threadIdx, blockIdx, blockDim, gridDim;

// IEEE binary16 <-> float with round-to-nearest-even, as cvt.rn.f16.f32 does.
static inline float lltm_host_half_bits_to_float(unsigned short bits) {
  _Float16 h;
  memcpy(&h, &bits, sizeof h);
  return (float)h;
}
static inline unsigned short lltm_host_float_to_half_bits(float f) {
  _Float16 h = (_Float16)f;
  unsigned short bits;
  memcpy(&bits, &h, sizeof bits);
  return bits;
}

template <typename Kernel>
static void shim_launch(unsigned int grid, unsigned int block, Kernel run) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned int b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned int t = 0; t < block; ++t) {
      threadIdx.x = t;
      run();
    }
  }
}

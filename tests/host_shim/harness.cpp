// C entry points that launch the kernels of cuda_src/lltm.cu on the CPU through shim.h.
// Built by tests/test_host_kernels.py with: g++ -O2 -std=c++17 -shared -fPIC -I<cuda_src> ...
#include "shim.h"
#include "lltm.cu"

#define LLTM_HOST_ENTRY_POINTS(T, I, SUFFIX)                                                   \
  extern "C" void lltm_fwd_##SUFFIX(unsigned grid, unsigned block, T* gates, const T* bias,    \
                                    const T* old_cell, T* new_h, T* new_cell, long long n,     \
                                    int state_size) {                                          \
    shim_launch(grid, block, [&] {                                                             \
      lltm_fwd_kernel<T, I>(gates, bias, old_cell, new_h, new_cell, n, state_size);               \
    });                                                                                        \
  }                                                                                            \
  extern "C" void lltm_bwd_##SUFFIX(unsigned grid, unsigned block, const T* grad_h,            \
                                    const T* grad_cell, const T* gates, const T* new_cell,     \
                                    T* d_gates, T* d_old_cell, int has_grad_h,                 \
                                    int has_grad_cell, long long n, int state_size) {          \
    shim_launch(grid, block, [&] {                                                             \
      lltm_bwd_kernel<T, I>(grad_h, grad_cell, gates, new_cell, d_gates, d_old_cell, has_grad_h,  \
                         has_grad_cell, n, state_size);                                        \
    });                                                                                        \
  }                                                                                            \
  extern "C" void lltm_concat_##SUFFIX(unsigned grid, unsigned block, const T* old_h,          \
                                       const T* input, T* X, long long n, int state_size,      \
                                       int features) {                                         \
    shim_launch(grid, block, [&] {                                                             \
      lltm_concat_kernel<T, I>(old_h, input, X, n, state_size, features);                      \
    });                                                                                        \
  }

LLTM_HOST_ENTRY_POINTS(double, unsigned int, f64)
LLTM_HOST_ENTRY_POINTS(float, unsigned int, f32)
LLTM_HOST_ENTRY_POINTS(lltm_half, unsigned int, f16)
LLTM_HOST_ENTRY_POINTS(double, unsigned long long, f64_wide)
LLTM_HOST_ENTRY_POINTS(float, unsigned long long, f32_wide)
LLTM_HOST_ENTRY_POINTS(lltm_half, unsigned long long, f16_wide)

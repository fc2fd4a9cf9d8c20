// C entry points that launch the kernels of cuda_src/lltm.cu on the CPU through shim.h.
// Built by tests/kernels/test_host_kernels.py with:
// g++ -O2 -std=c++17 -shared -fPIC -I<cuda_src> ...
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
  }                                                                                            \
  extern "C" void lltm_add_##SUFFIX(unsigned grid, unsigned block, T* x, const T* y,           \
                                    long long n) {                                             \
    shim_launch(grid, block, [&] { lltm_add_kernel<T, I>(x, y, n); });                         \
  }

LLTM_HOST_ENTRY_POINTS(double, unsigned int, f64)
LLTM_HOST_ENTRY_POINTS(float, unsigned int, f32)
LLTM_HOST_ENTRY_POINTS(lltm_half, unsigned int, f16)
LLTM_HOST_ENTRY_POINTS(double, unsigned long long, f64_wide)
LLTM_HOST_ENTRY_POINTS(float, unsigned long long, f32_wide)
LLTM_HOST_ENTRY_POINTS(lltm_half, unsigned long long, f16_wide)
LLTM_HOST_ENTRY_POINTS(lltm_bf16, unsigned int, bf16)
LLTM_HOST_ENTRY_POINTS(lltm_bf16, unsigned long long, bf16_wide)

// The bfloat16 conversions of lltm.cu, for the exhaustive conversion test; floats cross as their
// bits (a float passed through Python would have its signaling NaNs quieted).
extern "C" unsigned int lltm_bf16_to_float32_bits(unsigned short bits) {
  lltm_bf16 h;
  h.bits = bits;
  return lltm_float_bits(lltm_bf16_to_float(h));
}
extern "C" unsigned short lltm_float32_bits_to_bf16(unsigned int u) {
  return lltm_float_to_bf16(lltm_bits_float(u)).bits;
}

// The floating-point mode of the calling thread: clear flush-to-zero and denormals-are-zero
// (x86 MXCSR bits 15 and 6), which a library loaded into the process may have set (torch 2.5's
// compiled CPU kernels do), so that the tests run IEEE arithmetic; returns the previous MXCSR
// (0 where there is no MXCSR), for lltm_host_set_mxcsr to restore.
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
extern "C" unsigned int lltm_host_ieee_mode(void) {
  const unsigned int previous = _mm_getcsr();
  _mm_setcsr(previous & ~0x8040u);
  return previous;
}
extern "C" void lltm_host_set_mxcsr(unsigned int value) { _mm_setcsr(value); }
#else
extern "C" unsigned int lltm_host_ieee_mode(void) { return 0; }
extern "C" void lltm_host_set_mxcsr(unsigned int) {}
#endif

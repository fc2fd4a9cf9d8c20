// C entry points that launch the fused sequence kernels of cuda_src/lltm_fused.cu and
// cuda_src/lltm_fused_mma.cu on the CPU
// with real block semantics (shim_launch_block of shim.h). Built by tests/helpers/host_fused.py
// with: g++ -O2 -std=c++17 -shared -fPIC -I<cuda_src> -I<this folder> harness_fused.cpp
#include "shim.h"
#include "lltm.cu"
#include "lltm_fused.cu"
#include "lltm_fused_mma.cu"

#define LLTM_FUSED_ENTRY_POINTS(T, SUFFIX, FWD, BWD)                                         \
  extern "C" void lltm_seq_fwd_##SUFFIX(                                                       \
      unsigned grid, unsigned block, unsigned long long shared, const T* w, long long w_stride,\
      const T* bias, T* gates, const T* h0, const T* c0, T* out, T* cells, T* h_last,          \
      T* c_last, const long long* offsets, int packed, int steps, int batch, int state,        \
      int tile) {                                                                              \
    shim_launch_block(grid, block, shared, [&] {                                               \
      FWD<T>(w, w_stride, bias, gates, h0, c0, out, cells, h_last, c_last, offsets, packed,    \
             steps, batch, state, tile);                                                     \
    });                                                                                        \
  }                                                                                            \
  extern "C" void lltm_seq_bwd_##SUFFIX(                                                       \
      unsigned grid, unsigned block, unsigned long long shared, const T* w, long long w_stride,\
      const T* gates, const T* cells, const T* grad_out, const T* grad_h_n,                    \
      const T* grad_c_n, T* d_gates, T* d_h0, T* d_c0, const long long* offsets, int packed,   \
      int has_grad_out, int has_grad_h_n, int has_grad_c_n, int steps, int batch, int state,   \
      int tile) {                                                                              \
    shim_launch_block(grid, block, shared, [&] {                                               \
      BWD<T>(w, w_stride, gates, cells, grad_out, grad_h_n, grad_c_n, d_gates, d_h0, d_c0,     \
             offsets, packed, has_grad_out, has_grad_h_n, has_grad_c_n, steps, batch, state,  \
             tile);                                                                          \
    });                                                                                        \
  }

LLTM_FUSED_ENTRY_POINTS(double, f64, lltm_seq_fwd_kernel, lltm_seq_bwd_kernel)
LLTM_FUSED_ENTRY_POINTS(float, f32, lltm_seq_fwd_kernel, lltm_seq_bwd_kernel)
LLTM_FUSED_ENTRY_POINTS(lltm_half, f16, lltm_seq_fwd_kernel, lltm_seq_bwd_kernel)
LLTM_FUSED_ENTRY_POINTS(lltm_bf16, bf16, lltm_seq_fwd_kernel, lltm_seq_bwd_kernel)

// The tensor-core kernels (cuda_src/lltm_fused_mma.cu), the 16-bit types only.
LLTM_FUSED_ENTRY_POINTS(lltm_half, mma_f16, lltm_seq_fwd_mma_kernel, lltm_seq_bwd_mma_kernel)
LLTM_FUSED_ENTRY_POINTS(lltm_bf16, mma_bf16, lltm_seq_fwd_mma_kernel, lltm_seq_bwd_mma_kernel)

// The shim's warp-level product itself: one block of 32 * warps threads; lane l of warp w passes
// a[w][l][0..3], b[w][l][0..1] and c[w][l][0..3] (the fragments' registers) to
// lltm_mma_16816_{f16,bf16} and writes its result registers to d[w][l][0..3]. skip >= 0: that
// thread returns without the call (a lane missing from the collective); barrier_lane >= 0: that
// thread waits at __syncthreads() instead (and every other thread after the product).
extern "C" void lltm_host_mma_selftest(unsigned warps, int bf16, const unsigned* a,
                                       const unsigned* b, const float* c, float* d, int skip,
                                       int barrier_lane) {
  shim_launch_block(1, 32 * warps, 0, [&] {
    const unsigned t = threadIdx.x;
    if ((int)t == skip) return;
    if ((int)t == barrier_lane) {
      __syncthreads();
      return;
    }
    float out[4];
    const float* ct = c + 4 * t;
    if (bf16) {
      lltm_mma_16816_bf16(out, a + 4 * t, b + 2 * t, ct);
    } else {
      lltm_mma_16816_f16(out, a + 4 * t, b + 2 * t, ct);
    }
    for (int i = 0; i < 4; ++i) d[4 * t + i] = out[i];
    if (barrier_lane >= 0) __syncthreads();
  });
}

// The shim's scheduling order (0 ascending, 1 descending, 2 random with the seed), the error of
// the last launch (NULL if none) and the barriers it passed.
extern "C" void lltm_host_set_schedule(int order, unsigned long long seed) {
  shim_schedule = order;
  shim_seed = seed;
}
extern "C" const char* lltm_host_last_error(void) { return shim_error; }
extern "C" long long lltm_host_barriers(void) { return shim_barriers; }

// The kernels' own shared-memory layout functions, for the tests to hold the launcher's
// (lltm_cupy/_cuda/fused.py) against: the forward's W_h row stride and the weights' regions.
extern "C" int lltm_host_wt_stride(int state, int item) { return lltm_fused_wt_stride(state, item); }
extern "C" long long lltm_host_w_bytes(int state, int item, int backward) {
  return backward ? lltm_fused_w_bytes(state, item) : lltm_fused_wt_bytes(state, item);
}
extern "C" long long lltm_host_mma_fwd_bytes(int state, int tile) {
  return lltm_mma_fwd_bytes(state, tile);
}
extern "C" long long lltm_host_mma_bwd_bytes(int state, int tile) {
  return lltm_mma_bwd_bytes(state, tile);
}

// Fused element-wise kernels of the LLTM cell.
//
// Compiled at run time by cupy.RawModule (NVRTC) for the GPU, and, in the test suite, as plain
// host C++ with tests/host_shim/shim.h so that the same arithmetic runs on the CPU.
// The file includes no header: the offline NVRTC test
// (lltm_cupy._cuda.elementwise.compile_offline) needs no CUDA toolkit include path. CuPy's own
// compile path still needs the toolkit's headers (cupy-cuda13x[ctk], the `cuda` extra, or a
// system CUDA toolkit).
//
// Layout (all arrays C-contiguous, row-major):
//   gates     (B, 3S)  on entry to the forward: X @ W.T (no bias); on exit: + bias, i.e. the gate
//                      pre-activations [z_input | z_output | z_candidate]. Saved for backward.
//   bias      (3S,)
//   old_cell, new_cell, new_h, grad_h, grad_cell, d_old_cell   (B, S)
//   d_gates   (B, 3S)
//
// Backward recomputes every activation from the saved pre-activations and new_cell, so the
// forward saves only 4*B*S values besides X.
//
// Numerics (alpha = 1 in the ELU):
//   e = exp(-|z|)  ->  sigmoid(z) = (z >= 0 ? 1 : e) / (1 + e),  sigmoid'(z) = e / (1 + e)^2
//   elu(z) = z > 0 ? z : expm1(z),                             elu'(z) = z > 0 ? 1 : exp(z)
//   e2 = exp(-2|c|) ->  tanh'(c) = 1 - tanh(c)^2 = 4 e2 / (1 + e2)^2
// None of these overflows for any finite input, and none loses relative accuracy by cancellation
// (s * (1 - s) and 1 - tanh^2 do, once the activation saturates). tanh' is taken at most 1 (its
// rounded form can exceed 1 by an ulp near c = 0), so that every factor of a gradient bounded by
// 1 is so after rounding too, and a product overflows only where its exact value does.
// elu'(0) = 1, as PyTorch's autograd gives (the tutorial's d_elu gives 0 there).

// ---------------------------------------------------------------------------------------------
// Scalar types. `acc` is the type the arithmetic runs in; float16 and bfloat16 are stored as raw
// bits and converted here, so no cuda_fp16.h / cuda_bf16.h is needed.
struct lltm_half {
  unsigned short bits;
};

// bfloat16: the upper 16 bits of a float32. Widening is exact (bits << 16); narrowing rounds to
// nearest, ties to even, in integer arithmetic (the same on every architecture: sm_75 has no
// cvt.rn.bf16.f32, and this is what that instruction computes), NaN stays a (quiet) NaN with its
// sign, +-inf stays +-inf, and finite values above the largest bfloat16 round to +-inf.
struct lltm_bf16 {
  unsigned short bits;
};

#ifdef LLTM_HOST_SHIM
__device__ __forceinline__ unsigned int lltm_float_bits(float f) {
  unsigned int u;
  memcpy(&u, &f, sizeof u);
  return u;
}
__device__ __forceinline__ float lltm_bits_float(unsigned int u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
#else
__device__ __forceinline__ unsigned int lltm_float_bits(float f) {
  unsigned int u;
  asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f));
  return u;
}
__device__ __forceinline__ float lltm_bits_float(unsigned int u) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(u));
  return f;
}
#endif

__device__ __forceinline__ float lltm_bf16_to_float(lltm_bf16 h) {
  return lltm_bits_float(((unsigned int)h.bits) << 16);
}
__device__ __forceinline__ lltm_bf16 lltm_float_to_bf16(float f) {
  const unsigned int u = lltm_float_bits(f);
  lltm_bf16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {          // NaN: keep sign and payload top, set quiet bit
    h.bits = (unsigned short)((u >> 16) | 0x0040u);
  } else {                                        // round to nearest even (inf stays inf)
    h.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return h;
}

#ifdef LLTM_HOST_SHIM
// Host build of the tests: the shim converts the bits in C++.
__device__ __forceinline__ float lltm_half_to_float(lltm_half h) {
  return lltm_host_half_bits_to_float(h.bits);
}
__device__ __forceinline__ lltm_half lltm_float_to_half(float f) {
  lltm_half h;
  h.bits = lltm_host_float_to_half_bits(f);
  return h;
}
#else
__device__ __forceinline__ float lltm_half_to_float(lltm_half h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  return f;
}
__device__ __forceinline__ lltm_half lltm_float_to_half(float f) {
  lltm_half h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
#endif

template <typename T>
struct lltm_traits;

template <>
struct lltm_traits<double> {
  typedef double acc;
  static __device__ __forceinline__ double load(double x) { return x; }
  static __device__ __forceinline__ double store(double x) { return x; }
};

template <>
struct lltm_traits<float> {
  typedef float acc;
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};

template <>
struct lltm_traits<lltm_half> {
  typedef float acc;
  static __device__ __forceinline__ float load(lltm_half x) { return lltm_half_to_float(x); }
  static __device__ __forceinline__ lltm_half store(float x) { return lltm_float_to_half(x); }
};

template <>
struct lltm_traits<lltm_bf16> {
  typedef float acc;
  static __device__ __forceinline__ float load(lltm_bf16 x) { return lltm_bf16_to_float(x); }
  static __device__ __forceinline__ lltm_bf16 store(float x) { return lltm_float_to_bf16(x); }
};

// Math overloads, spelled out per type so that no float-only function reaches a double.
__device__ __forceinline__ float lltm_exp(float x) { return expf(x); }
__device__ __forceinline__ double lltm_exp(double x) { return exp(x); }
__device__ __forceinline__ float lltm_expm1(float x) { return expm1f(x); }
__device__ __forceinline__ double lltm_expm1(double x) { return expm1(x); }
__device__ __forceinline__ float lltm_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double lltm_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float lltm_abs(float x) { return fabsf(x); }
__device__ __forceinline__ double lltm_abs(double x) { return fabs(x); }

// sigmoid(z) and sigmoid'(z) from one exponential.
template <typename A>
__device__ __forceinline__ void lltm_sigmoid(A z, A* s, A* ds) {
  const A e = lltm_exp(-lltm_abs(z));
  const A r = A(1) / (A(1) + e);
  *s = z >= A(0) ? r : e * r;
  *ds = e * r * r;
}

template <typename A>
__device__ __forceinline__ A lltm_elu(A z) {
  return z > A(0) ? z : lltm_expm1(z);
}

template <typename A>
__device__ __forceinline__ A lltm_d_elu(A z) {
  return z > A(0) ? A(1) : lltm_exp(z);
}

// ---------------------------------------------------------------------------------------------
// The cell of one (row, state) element: the one definition of its numerics, used by the
// element-wise kernels below and by the fused sequence kernels of lltm_fused.cu.

// Forward: g_* are the gate products (X @ W.T, in the storage type), b_* the bias, old_c the
// previous cell in the arithmetic type. Writes the pre-activations (rounded to the storage type
// before use, so that the backward, which recomputes the activations from the stored values,
// sees exactly what the forward saw), the new cell and the new hidden state. The outputs may
// alias the g_* inputs (each input is read before any output is written).
template <typename T>
__device__ __forceinline__ void lltm_cell_forward(T g_i, T g_o, T g_c, T b_i, T b_o, T b_c,
                                                  typename lltm_traits<T>::acc old_c, T* z_i,
                                                  T* z_o, T* z_c, T* new_c, T* new_h) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const T zi_t = tr::store(tr::load(g_i) + tr::load(b_i));
  const T zo_t = tr::store(tr::load(g_o) + tr::load(b_o));
  const T zc_t = tr::store(tr::load(g_c) + tr::load(b_c));
  *z_i = zi_t;
  *z_o = zo_t;
  *z_c = zc_t;

  A input_gate, output_gate, unused;
  lltm_sigmoid(tr::load(zi_t), &input_gate, &unused);
  lltm_sigmoid(tr::load(zo_t), &output_gate, &unused);
  const A candidate_cell = lltm_elu(tr::load(zc_t));

  const A c = old_c + candidate_cell * input_gate;
  const T c_t = tr::store(c);
  *new_c = c_t;
  *new_h = tr::store(lltm_tanh(tr::load(c_t)) * output_gate);
}

// Backward: from the saved pre-activations z_*, the new cell c and the incoming gradients gh
// (w.r.t. new_h) and gc (w.r.t. new_cell), in the arithmetic type, the gate gradients and
// d_old_cell, each rounded once to the storage type.
template <typename T>
__device__ __forceinline__ void lltm_cell_backward(T z_i, T z_o, T z_c, T c_t,
                                                   typename lltm_traits<T>::acc gh,
                                                   typename lltm_traits<T>::acc gc, T* d_i,
                                                   T* d_o, T* d_c, T* d_old_cell) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const A zi = tr::load(z_i);
  const A zo = tr::load(z_o);
  const A zc = tr::load(z_c);
  const A c = tr::load(c_t);

  A input_gate, d_sig_i, output_gate, d_sig_o;
  lltm_sigmoid(zi, &input_gate, &d_sig_i);
  lltm_sigmoid(zo, &output_gate, &d_sig_o);
  const A candidate_cell = lltm_elu(zc);

  const A e2 = lltm_exp(A(-2) * lltm_abs(c));
  const A one_e2 = A(1) + e2;
  // tanh'(c) <= 1, but the rounded quotient is 1 + 1 ulp for some c near 0, and that ulp made
  // d_new_cell overflow at a grad_h near the largest finite value: at most 1 (NaN stays NaN)
  const A d_tanh_q = A(4) * e2 / (one_e2 * one_e2);
  const A d_tanh = d_tanh_q > A(1) ? A(1) : d_tanh_q;

  const A d_output_gate = lltm_tanh(c) * gh;
  const A d_new_cell = d_tanh * (output_gate * gh) + gc;

  // Bounded factors first (sigmoid' <= 1/4, input_gate and elu' <= 1), so that no product
  // overflows before the last multiplication unless the result itself does.
  *d_old_cell = tr::store(d_new_cell);
  *d_i = tr::store(candidate_cell * d_sig_i * d_new_cell);
  *d_o = tr::store(d_output_gate * d_sig_o);
  *d_c = tr::store(input_gate * lltm_d_elu(zc) * d_new_cell);
}

// ---------------------------------------------------------------------------------------------
// Index type I: `unsigned int` when every index of the 3 * B * S gate array fits in 32 bits (the
// launcher decides), else `unsigned long long`. 64-bit integer division is emulated on the GPU
// (tens of instructions per element), which a memory-bound kernel cannot afford when it need not.

// Forward: one thread per (b, s), grid-stride over n = B * S.
template <typename T, typename I>
__global__ void lltm_fwd_kernel(T* __restrict__ gates, const T* __restrict__ bias,
                                const T* __restrict__ old_cell, T* __restrict__ new_h,
                                T* __restrict__ new_cell, long long n_elements, int state_size) {
  typedef lltm_traits<T> tr;
  const I n = (I)n_elements;
  const I S = (I)state_size;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)blockDim.x * gridDim.x) {
    const I b = i / S;
    const I s = i - b * S;
    T* g = gates + b * 3 * S + s;
    lltm_cell_forward<T>(g[0], g[S], g[2 * S], bias[s], bias[S + s], bias[2 * S + s],
                         tr::load(old_cell[i]), g, g + S, g + 2 * S, new_cell + i, new_h + i);
  }
}

// Backward: d_gates (B, 3S) and d_old_cell (B, S) from the incoming gradients and the saved
// pre-activations and new_cell. has_grad_h / has_grad_cell = 0 means that gradient is zero
// (the pointer is then not read).
template <typename T, typename I>
__global__ void lltm_bwd_kernel(const T* __restrict__ grad_h, const T* __restrict__ grad_cell,
                                const T* __restrict__ gates, const T* __restrict__ new_cell,
                                T* __restrict__ d_gates, T* __restrict__ d_old_cell,
                                int has_grad_h, int has_grad_cell, long long n_elements,
                                int state_size) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const I n = (I)n_elements;
  const I S = (I)state_size;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)blockDim.x * gridDim.x) {
    const I b = i / S;
    const I s = i - b * S;
    const I row = b * 3 * S + s;
    lltm_cell_backward<T>(gates[row], gates[row + S], gates[row + 2 * S], new_cell[i],
                          has_grad_h ? tr::load(grad_h[i]) : A(0),
                          has_grad_cell ? tr::load(grad_cell[i]) : A(0), d_gates + row,
                          d_gates + row + S, d_gates + row + 2 * S, d_old_cell + i);
  }
}

// X = [old_h | input] (B, S + F) in one launch (the forward GEMM's left operand, saved for the
// weight gradient). One thread per element of X, grid-stride over n = B * (S + F).
template <typename T, typename I>
__global__ void lltm_concat_kernel(const T* __restrict__ old_h, const T* __restrict__ input,
                                   T* __restrict__ X, long long n_elements, int state_size,
                                   int features) {
  const I n = (I)n_elements;
  const I S = (I)state_size;
  const I K = S + (I)features;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)blockDim.x * gridDim.x) {
    const I b = i / K;
    const I k = i - b * K;
    X[i] = k < S ? old_h[b * S + k] : input[b * (K - S) + (k - S)];
  }
}

// x += y (B * S elements), in the arithmetic type: the one element-wise addition of the
// sequence backward (the final state's gradient into the last step's), bfloat16 included.
template <typename T, typename I>
__global__ void lltm_add_kernel(T* __restrict__ x, const T* __restrict__ y,
                                long long n_elements) {
  typedef lltm_traits<T> tr;
  const I n = (I)n_elements;
  for (I i = (I)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (I)blockDim.x * gridDim.x) {
    x[i] = tr::store(tr::load(x[i]) + tr::load(y[i]));
  }
}

// Fused whole-sequence kernels of the LLTM cell: one launch runs every step of one layer and
// direction, with the recurrent weights W_h (3S x S) in shared memory for all steps.
//
// This file is compiled after cuda_src/lltm.cu, in the same translation unit
// (lltm_cupy/_cuda/kernels.py joins the two texts for NVRTC; the host build includes both), and uses its scalar types
// (lltm_traits) and the cell's numerics (lltm_cell_forward / lltm_cell_backward): one definition
// of the arithmetic for the element-wise and the fused kernels.
//
// Work split: one thread block per tile of `tile` batch rows. Rows of a recurrence are independent,
// so blocks never wait for each other; inside a block every step is
//   forward:  h_t = cell(x_proj_t + h_{t-1} @ W_h.T), one thread per (row, state) element, the
//             three dot products over W_h and h_{t-1} from shared memory, accumulated in the
//             arithmetic type (float32 for the 16-bit types, as cuBLAS computes them);
//   backward: d_gates_t from the carried (d_h, d_c) by the cell's backward, then
//             d_h_{t-1} = d_gates_t @ W_h from shared memory;
// with __syncthreads() between the phases that read what other threads wrote. Only the outputs
// (h_t, c_t, the pre-activations, d_gates_t) go to global memory; nothing is read back.
//
// Rounding is the element-wise path's: the recurrent product is added to the input projection and
// rounded once to the storage type (as cuBLAS's GEMM with beta = 1 does), then the bias (in
// lltm_cell_forward); the hidden state and the cell carried to the next step are the values
// stored; in the backward the incoming d_h is rounded once with the output gradient added.
//
// Rows and steps: the packed layout of lltm_cupy/_packing.py when `packed` (step t holds rows
// offsets[t] .. offsets[t + 1], the sequences still running, a prefix of the batch), else step t
// holds all `batch` rows at t * batch. A row inactive at step t is inactive at every later step
// (forward), so each block keeps its rows' states in shared memory and stops when none is left.
//
// Shared memory (dynamic, bytes; A = arithmetic type, T = storage type; lltm_cupy/_cuda/fused.py
// computes the same sizes):
//   forward:  3 S^2 sizeof(T)  (W_h transposed, (S, 3S): consecutive threads read consecutive
//             words) + tile * 3 S sizeof(A)  (h of the step and of the next, c)
//   backward: 3 S^2 sizeof(T)  (W_h, (3S, S)) + tile * 5 S sizeof(A)  (d_gates of the step,
//             carried d_h and d_c)
// The weights' region is padded to 16 bytes so that the A arrays are aligned.

#ifndef LLTM_HOST_SHIM
extern __shared__ __align__(16) unsigned char lltm_dynamic_smem[];
#endif

__device__ __forceinline__ long long lltm_fused_w_bytes(int state, int item) {
  return ((3LL * state * state * item) + 15) / 16 * 16;
}

// Rows of step t: (first row, row count); with `packed`, offsets[t] - offsets[0] is the first (the
// launcher may pass a block of steps: a slice of the plan's offsets and of the row arrays).
__device__ __forceinline__ void lltm_fused_step_rows(const long long* __restrict__ offsets,
                                                     int packed, int t, int batch,
                                                     long long* first, int* count) {
  if (packed) {
    *first = offsets[t] - offsets[0];
    *count = (int)(offsets[t + 1] - offsets[t]);
  } else {
    *first = (long long)t * batch;
    *count = batch;
  }
}

// w: the weights (3S, S + F) row-major, of which columns 0..S-1 are W_h (row stride w_stride).
// gates (rows, 3S): the input projection on entry, the pre-activations (bias added) on exit.
// h0, c0 (batch, S): initial state; out, cells (rows, S): h_t and c_t of every step;
// h_last, c_last (batch, S): each row's state after its last step (h0, c0 for length 0).
template <typename T>
__global__ void lltm_seq_fwd_kernel(const T* __restrict__ w, long long w_stride,
                                    const T* __restrict__ bias, T* __restrict__ gates,
                                    const T* __restrict__ h0, const T* __restrict__ c0,
                                    T* __restrict__ out, T* __restrict__ cells,
                                    T* __restrict__ h_last, T* __restrict__ c_last,
                                    const long long* __restrict__ offsets, int packed, int steps,
                                    int batch, int state, int tile) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const int S = state;
  const int S3 = 3 * state;
  T* w_t = (T*)lltm_dynamic_smem;                                   // (S, 3S)
  A* h_buf = (A*)(lltm_dynamic_smem + lltm_fused_w_bytes(S, sizeof(T)));   // (2, tile, S)
  A* c_buf = h_buf + 2 * tile * S;                                  // (tile, S)
  const int row0 = blockIdx.x * tile;
  const int rows = min(tile, batch - row0);                          // this block's rows
  const int n = rows * S;

  for (int i = threadIdx.x; i < S3 * S; i += blockDim.x) {
    const int g = i / S;
    const int k = i - g * S;
    w_t[k * S3 + g] = w[g * w_stride + k];
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long src = (long long)row0 * S + i;
    h_buf[i] = tr::load(h0[src]);
    c_buf[i] = tr::load(c0[src]);
  }
  __syncthreads();

  int t = 0;
  for (; t < steps; ++t) {
    long long first;
    int count;
    lltm_fused_step_rows(offsets, packed, t, batch, &first, &count);
    const int active = min(rows, count - row0);      // the same for every thread of the block
    if (active <= 0) break;
    const A* h_cur = h_buf + (t & 1) * tile * S;
    A* h_next = h_buf + ((t + 1) & 1) * tile * S;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      const int r = i / S;
      const int s = i - r * S;
      if (r >= active) {             // finished: its state moves along unchanged
        h_next[i] = h_cur[i];
        continue;
      }
      const A* h = h_cur + r * S;
      A acc_i = A(0), acc_o = A(0), acc_c = A(0);
      for (int k = 0; k < S; ++k) {
        const T* wk = w_t + k * S3 + s;
        const A hk = h[k];
        acc_i += tr::load(wk[0]) * hk;
        acc_o += tr::load(wk[S]) * hk;
        acc_c += tr::load(wk[2 * S]) * hk;
      }
      const long long row = first + row0 + r;
      T* g = gates + row * S3 + s;
      const T gi = tr::store(acc_i + tr::load(g[0]));
      const T go = tr::store(acc_o + tr::load(g[S]));
      const T gc = tr::store(acc_c + tr::load(g[2 * S]));
      T c_t, h_t;
      lltm_cell_forward<T>(gi, go, gc, bias[s], bias[S + s], bias[2 * S + s], c_buf[i], g, g + S,
                           g + 2 * S, &c_t, &h_t);
      out[row * S + s] = h_t;
      cells[row * S + s] = c_t;
      h_next[i] = tr::load(h_t);
      c_buf[i] = tr::load(c_t);
    }
    __syncthreads();
  }
  const A* h_fin = h_buf + (t & 1) * tile * S;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long dst = (long long)row0 * S + i;
    h_last[dst] = tr::store(h_fin[i]);
    c_last[dst] = tr::store(c_buf[i]);
  }
}

// Backward through all steps. gates, cells (rows, 3S) / (rows, S): what the forward saved;
// grad_out (rows, S) the outputs' gradient (has_grad_out), grad_h_n, grad_c_n (batch, S) the
// final state's (has_grad_h_n / has_grad_c_n; an absent gradient is zero and is not read).
// Writes d_gates (rows, 3S) and d_h0, d_c0 (batch, S).
template <typename T>
__global__ void lltm_seq_bwd_kernel(const T* __restrict__ w, long long w_stride,
                                    const T* __restrict__ gates, const T* __restrict__ cells,
                                    const T* __restrict__ grad_out,
                                    const T* __restrict__ grad_h_n,
                                    const T* __restrict__ grad_c_n, T* __restrict__ d_gates,
                                    T* __restrict__ d_h0, T* __restrict__ d_c0,
                                    const long long* __restrict__ offsets, int packed,
                                    int has_grad_out, int has_grad_h_n, int has_grad_c_n,
                                    int steps, int batch, int state, int tile) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const int S = state;
  const int S3 = 3 * state;
  T* w_s = (T*)lltm_dynamic_smem;                                   // (3S, S)
  A* dg_buf = (A*)(lltm_dynamic_smem + lltm_fused_w_bytes(S, sizeof(T)));  // (tile, 3S)
  A* dh_buf = dg_buf + tile * S3;                                   // (tile, S)
  A* dc_buf = dh_buf + tile * S;                                    // (tile, S)
  const int row0 = blockIdx.x * tile;
  const int rows = min(tile, batch - row0);
  const int n = rows * S;

  for (int i = threadIdx.x; i < S3 * S; i += blockDim.x) {
    const int g = i / S;
    const int k = i - g * S;
    w_s[i] = w[g * w_stride + k];
  }
  // A row's carried gradients before its last step are the final state's. No barrier here: the
  // first phase below reads only the thread's own elements of dh_buf and dc_buf (same index
  // mapping), and the barrier after it comes before anything reads W_h or another thread's words.
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long src = (long long)row0 * S + i;
    dh_buf[i] = has_grad_h_n ? tr::load(grad_h_n[src]) : A(0);
    dc_buf[i] = has_grad_c_n ? tr::load(grad_c_n[src]) : A(0);
  }

  for (int t = steps - 1; t >= 0; --t) {
    long long first;
    int count;
    lltm_fused_step_rows(offsets, packed, t, batch, &first, &count);
    const int active = min(rows, count - row0);      // block-uniform
    if (active <= 0) continue;
    const int m = active * S;
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      const int r = i / S;
      const int s = i - r * S;
      const long long row = first + row0 + r;
      const A go = has_grad_out ? tr::load(grad_out[row * S + s]) : A(0);
      const A gh = tr::load(tr::store(dh_buf[i] + go));
      const T* z = gates + row * S3 + s;
      T d_i, d_o, d_c, d_c_t;
      lltm_cell_backward<T>(z[0], z[S], z[2 * S], cells[row * S + s], gh, dc_buf[i], &d_i,
                            &d_o, &d_c, &d_c_t);
      T* dg = d_gates + row * S3 + s;
      dg[0] = d_i;
      dg[S] = d_o;
      dg[2 * S] = d_c;
      A* dgs = dg_buf + r * S3 + s;      // the GEMM's operand: the stored values
      dgs[0] = tr::load(d_i);
      dgs[S] = tr::load(d_o);
      dgs[2 * S] = tr::load(d_c);
      dc_buf[i] = tr::load(d_c_t);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      const int r = i / S;
      const int k = i - r * S;
      const A* dgr = dg_buf + r * S3;
      A acc = A(0);
      for (int g = 0; g < S3; ++g) acc += dgr[g] * tr::load(w_s[g * S + k]);
      dh_buf[i] = acc;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long dst = (long long)row0 * S + i;
    d_h0[dst] = tr::store(dh_buf[i]);
    d_c0[dst] = tr::store(dc_buf[i]);
  }
}

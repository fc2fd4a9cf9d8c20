// Fused whole-sequence kernels of the LLTM cell: one launch runs every step of one layer and
// direction, with the recurrent weights W_h (3S x S) in shared memory for all steps.
//
// This file is compiled after cuda_src/lltm.cu, in the same translation unit
// (lltm_cupy/_cuda/fused_kernels.py joins the two texts for NVRTC; the host build includes
// both), and uses its scalar types (lltm_traits) and the cell's numerics (lltm_cell_forward /
// lltm_cell_backward): one definition of the arithmetic for the element-wise and the fused
// kernels. lltm_fused_mma.cu and lltm_fused_cluster.cu are compiled after this file, in the same
// translation unit, and use its helpers: every variant its kernels' parameters
// (LLTM_SEQ_FWD_PARAMS / LLTM_SEQ_BWD_PARAMS), step offsets, the backward's first step
// (lltm_fused_last_step) and one element's step each way after the recurrent product
// (lltm_fused_cell_forward / lltm_fused_cell_backward: the rounding points); the cluster kernels
// also its walk, row stride and dot products (lltm_fused_dot3 / lltm_fused_dot, both
// lltm_fused_sums: the order of the recurrent sums).
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
// Per step and element, the dot products (lltm_fused_dot3 forward, lltm_fused_dot backward) run
// in chunks of LLTM_FUSED_CHUNK terms, each in LLTM_FUSED_LANES independent partial sums (term k
// goes to sum k mod LLTM_FUSED_LANES) added as a tree into a running sum: shorter dependent
// chains than one running sum, and a float32 rounding error that grows with CHUNK / LANES +
// S / CHUNK additions (12 at S = 128) instead of S / LANES (32). The order is fixed by the source,
// so results do not depend on the launch geometry or the thread schedule.
//
// Prefetch: the global values an element of a step needs besides the dot product (the input
// projection and bias forward; the saved pre-activations, cell and output gradient backward) are
// loaded into registers one element of the thread's work ahead: while a thread computes an
// element, the loads of its next one are in flight, that is of the next step's (the previous
// step's backward) first element when it has one element per step, issued before the current
// step's dot product and barriers. The values are the same; only when they are read changes.
// The first element's bias, the same at every step, is loaded once per launch.
//
// Shared memory (dynamic, bytes; A = arithmetic type, T = storage type; lltm_cupy/_cuda/fused.py
// computes the same sizes):
//   forward:  S * P sizeof(T)  (W_h transposed, (S, 3S) in rows of P >= 3S elements: consecutive
//             threads read consecutive words; P is lltm_fused_wt_stride, chosen so that the load's
//             stores, consecutive threads on consecutive rows, fall in distinct banks: no conflict
//             where a warp stores into one gate's column, 2-way at most where it straddles two)
//             + tile * 3 S sizeof(A)  (h of the step and of the next, c)
//   backward: 3 S^2 sizeof(T)  (W_h, (3S, S)) + tile * 5 S sizeof(A)  (d_gates of the step,
//             carried d_h and d_c)
// The weights' region is padded to 16 bytes so that the A arrays are aligned.

#ifndef LLTM_HOST_SHIM
extern __shared__ __align__(16) unsigned char lltm_dynamic_smem[];
// The host build checks the launch's shared memory against what the kernel lays out.
#define LLTM_SHARED_FITS(bytes) true
#define LLTM_UNROLL _Pragma("unroll")
#else
#define LLTM_SHARED_FITS(bytes) shim_shared_fits(bytes)
#define LLTM_UNROLL _Pragma("GCC unroll 4")
#endif

// The partial sums of a dot product (the tree below adds four), and the terms of one chunk: each
// chunk's four partial sums are added as a tree into the running sum (lltm_fused_dot3).
#define LLTM_FUSED_LANES 4
#define LLTM_FUSED_CHUNK 32

// The fused sequence kernels' parameters, written once: every variant takes them, in this order
// (lltm_seq_fwd_kernel / lltm_seq_bwd_kernel below say what each is; the tensor-core kernels of
// lltm_fused_mma.cu and the cluster kernels of lltm_fused_cluster.cu take the same, its group
// kernels three more after them), so that the launchers pass one argument tuple to whichever
// variant runs. *_ARGS: the same names, to hand them on.
#define LLTM_SEQ_FWD_PARAMS(T)                                                                 \
  const T* __restrict__ w, long long w_stride, const T* __restrict__ bias,                     \
      T* __restrict__ gates, const T* __restrict__ h0, const T* __restrict__ c0,               \
      T* __restrict__ out, T* __restrict__ cells, T* __restrict__ h_last,                      \
      T* __restrict__ c_last, const long long* __restrict__ offsets, int packed, int steps,    \
      int batch, int state, int tile
#define LLTM_SEQ_FWD_ARGS                                                                      \
  w, w_stride, bias, gates, h0, c0, out, cells, h_last, c_last, offsets, packed, steps, batch, \
      state, tile
#define LLTM_SEQ_BWD_PARAMS(T)                                                                 \
  const T* __restrict__ w, long long w_stride, const T* __restrict__ gates,                    \
      const T* __restrict__ cells, const T* __restrict__ grad_out,                             \
      const T* __restrict__ grad_h_n, const T* __restrict__ grad_c_n,                          \
      T* __restrict__ d_gates, T* __restrict__ d_h0, T* __restrict__ d_c0,                     \
      const long long* __restrict__ offsets, int packed, int has_grad_out, int has_grad_h_n,   \
      int has_grad_c_n, int steps, int batch, int state, int tile
#define LLTM_SEQ_BWD_ARGS                                                                      \
  w, w_stride, gates, cells, grad_out, grad_h_n, grad_c_n, d_gates, d_h0, d_c0, offsets,       \
      packed, has_grad_out, has_grad_h_n, has_grad_c_n, steps, batch, state, tile

// Row stride (elements) of the forward's transposed W_h: at least 3S, and such that 32 consecutive
// rows start in 32 different banks: an odd number of 4-byte words for 2-byte types (stride = 2
// mod 4), an odd stride for 4- and 8-byte types (8-byte: 2 mod 4 words, what a half-warp's 64-bit
// accesses need). tests/kernels/test_fused_sequence.py counts the load's conflicts for every S.
__device__ __forceinline__ int lltm_fused_wt_stride(int state, int item) {
  const int s3 = 3 * state;
  return item == 2 ? s3 + (6 - s3 % 4) % 4 : (s3 | 1);
}

__device__ __forceinline__ long long lltm_fused_w_bytes(int state, int item) {
  return ((3LL * state * state * item) + 15) / 16 * 16;
}

__device__ __forceinline__ long long lltm_fused_wt_bytes(int state, int item) {
  return ((long long)state * lltm_fused_wt_stride(state, item) * item + 15) / 16 * 16;
}

// The (row, column) pair of a thread's elements i = threadIdx.x, threadIdx.x + blockDim.x, ...
// of a (rows, width) array, stepped without a division (computed once per launch): here a
// (rows, S) tile; in lltm_fused_cluster.cu also a block's (rows, L) part of one.
struct lltm_fused_walk {
  int r0, s0, dr, ds;
  __device__ __forceinline__ lltm_fused_walk(int width) {
    r0 = threadIdx.x / width;
    s0 = threadIdx.x - r0 * width;
    dr = blockDim.x / width;
    ds = blockDim.x - dr * width;
  }
  __device__ __forceinline__ void next(int width, int* r, int* s) const {
    *r += dr;
    *s += ds;
    if (*s >= width) {
      *s -= width;
      *r += 1;
    }
  }
};

// The first row of step t: with `packed`, offsets[t] - offsets[0] (the launcher may pass a block
// of steps: a slice of the plan's offsets and of the row arrays), else t * batch. Step t's rows
// end where step t + 1's begin; each kernel carries that edge to the next step in a register, so
// a step reads one offset, not two.
__device__ __forceinline__ long long lltm_fused_offset(const long long* __restrict__ offsets,
                                                       int packed, int t, int batch) {
  return packed ? offsets[t] - offsets[0] : (long long)t * batch;
}

// Where a backward starts: the last step that has a row of the block's `rows` rows from row0
// (the steps after its longest row run nothing; packed: the last ones, the rows sorted by
// length). Returns that step (-1 if none), its first row in *first and the block's rows active
// there in *active (the same for every thread of the block).
__device__ __forceinline__ int lltm_fused_last_step(const long long* __restrict__ offsets,
                                                    int packed, int steps, int batch, int rows,
                                                    int row0, long long* first, int* active) {
  long long edge = lltm_fused_offset(offsets, packed, steps, batch);
  *first = edge;
  *active = 0;
  int t = steps - 1;
  for (; t >= 0; --t, edge = *first) {
    *first = lltm_fused_offset(offsets, packed, t, batch);
    *active = min(rows, (int)(edge - *first) - row0);
    if (*active > 0) break;
  }
  return t;
}

// The recurrent dot products of one element, the one place their summation order is written
// (lltm_fused_sums): the terms in chunks of LLTM_FUSED_CHUNK (the last chunk shorter, then the
// terms - terms mod LLTM_FUSED_LANES ... terms - 1 alone); within a chunk term k goes to partial
// sum k mod LLTM_FUSED_LANES, in increasing k, the four partial sums added as (0 + 1) + (2 + 3),
// and each chunk's tree is added to the running sum in chunk order (the remainder's last). The
// kernels of this file and of lltm_fused_cluster.cu call these, so that the claims of both
// (results independent of the launch geometry and the thread schedule; a float32 error growing
// with CHUNK / LANES + terms / CHUNK additions, not terms / LANES) rest on this code alone.
//
// N sums at once over `terms` terms: add(k, part, l) adds term k of each sum q into
// part[q][l] (l = k mod LANES); sum[q] receives the total.
template <int N, typename A, typename Add>
__device__ __forceinline__ void lltm_fused_sums(int terms, const Add& add, A (&sum)[N]) {
  A part[N][LLTM_FUSED_LANES], run[N];
LLTM_UNROLL
  for (int q = 0; q < N; ++q) {
    run[q] = A(0);
LLTM_UNROLL
    for (int l = 0; l < LLTM_FUSED_LANES; ++l) part[q][l] = A(0);
  }
  const int whole = terms - terms % LLTM_FUSED_LANES;
  int k = 0;
  while (k < whole) {
    const int end = min(k + LLTM_FUSED_CHUNK, whole);
    for (; k < end; k += LLTM_FUSED_LANES) {
LLTM_UNROLL
      for (int l = 0; l < LLTM_FUSED_LANES; ++l) add(k + l, part, l);
    }
LLTM_UNROLL
    for (int q = 0; q < N; ++q) {
      run[q] += (part[q][0] + part[q][1]) + (part[q][2] + part[q][3]);
LLTM_UNROLL
      for (int l = 0; l < LLTM_FUSED_LANES; ++l) part[q][l] = A(0);
    }
  }
LLTM_UNROLL
  for (int l = 0; l < LLTM_FUSED_LANES - 1; ++l) {     // the last terms mod LANES terms
    if (k + l < terms) add(k + l, part, l);
  }
LLTM_UNROLL
  for (int q = 0; q < N; ++q) sum[q] = run[q] + ((part[q][0] + part[q][1]) + part[q][2]);
}

// Forward: the three gates' sums over `terms` terms of a transposed W_h, term k of gate q
// (0 i, 1 o, 2 c) w[k * stride + q * gate] * h[k], w pointing at the element's column of row 0
// (lltm_fused.cu: w_t + s, stride P, gate S; the cluster forward: w_t + j, stride Q, gate L).
template <typename T>
__device__ __forceinline__ void lltm_fused_dot3(const T* w, int stride, int gate,
                                                const typename lltm_traits<T>::acc* h, int terms,
                                                typename lltm_traits<T>::acc (&sum)[3]) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  lltm_fused_sums<3>(terms, [&](int k, A (&part)[3][LLTM_FUSED_LANES], int l) {
    const T* wk = w + k * stride;
    const A hk = h[k];
    part[0][l] += tr::load(wk[0]) * hk;
    part[1][l] += tr::load(wk[gate]) * hk;
    part[2][l] += tr::load(wk[2 * gate]) * hk;
  }, sum);
}

// Backward: one sum over `terms` terms of W_h (rows of `stride` elements), term g
// a[g] * w[g * stride], w pointing at the element's column of row 0 (lltm_fused.cu: d_gates
// against w_s + s over 3S rows; the cluster backward: against w_s + k over its 3L rows).
template <typename T>
__device__ __forceinline__ typename lltm_traits<T>::acc lltm_fused_dot(
    const typename lltm_traits<T>::acc* a, const T* w, int stride, int terms) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  A sum[1];
  lltm_fused_sums<1>(terms, [&](int g, A (&part)[1][LLTM_FUSED_LANES], int l) {
    part[0][l] += a[g] * tr::load(w[g * stride]);
  }, sum);
  return sum[0];
}

// One element of a forward step, after its recurrent products acc (the gates i, o, c), the one
// place the fused kernels' forward rounding is written: each product added to the element's
// input projection p and rounded once to the storage type (as cuBLAS's GEMM with beta = 1), then
// the cell (lltm_cell_forward: the bias b added, the pre-activations stored at g, g + S,
// g + 2 S) from the carried cell *c, which becomes the new one; h_t and c_t stored at out[o]
// and cells[o]. Returns h_t.
template <typename T>
__device__ __forceinline__ T lltm_fused_cell_forward(const typename lltm_traits<T>::acc (&acc)[3],
                                                     T p_i, T p_o, T p_c, T b_i, T b_o, T b_c,
                                                     typename lltm_traits<T>::acc* c, T* g,
                                                     int S, T* __restrict__ out,
                                                     T* __restrict__ cells, long long o) {
  typedef lltm_traits<T> tr;
  const T gi = tr::store(acc[0] + tr::load(p_i));
  const T go = tr::store(acc[1] + tr::load(p_o));
  const T gc = tr::store(acc[2] + tr::load(p_c));
  T c_t, h_t;
  lltm_cell_forward<T>(gi, go, gc, b_i, b_o, b_c, *c, g, g + S, g + 2 * S, &c_t, &h_t);
  out[o] = h_t;
  cells[o] = c_t;
  *c = tr::load(c_t);
  return h_t;
}

// What the backward of one element of a step reads besides the carried gradients: the saved
// pre-activations and cell, and the outputs' gradient (zero without one).
template <typename T>
struct lltm_fused_saved {
  T z_i, z_o, z_c, c_t;
  typename lltm_traits<T>::acc go;
  __device__ __forceinline__ void load(const T* __restrict__ gates, const T* __restrict__ cells,
                                       const T* __restrict__ grad_out, int has_grad_out,
                                       long long row, int s, int S) {
    const T* z = gates + row * 3 * S + s;
    z_i = z[0];
    z_o = z[S];
    z_c = z[2 * S];
    c_t = cells[row * S + s];
    go = has_grad_out ? lltm_traits<T>::load(grad_out[row * S + s])
                      : typename lltm_traits<T>::acc(0);
  }
};

// One element of a backward step, the one place the fused kernels' backward rounding is
// written: the incoming d_h (the carried dh plus the outputs' gradient, rounded once to the
// storage type, as the stepped path's add), the cell's backward from the saved values and the
// carried d_c *dc, which becomes the step's; the element's d_gates stored at dg, dg + S, dg + 2 S
// and returned in d (the recurrent product's operand: the stored values).
template <typename T>
__device__ __forceinline__ void lltm_fused_cell_backward(const lltm_fused_saved<T>& sv,
                                                         typename lltm_traits<T>::acc dh,
                                                         typename lltm_traits<T>::acc* dc, T* dg,
                                                         int S, T (&d)[3]) {
  typedef lltm_traits<T> tr;
  const typename tr::acc gh = tr::load(tr::store(dh + sv.go));
  T d_c_t;
  lltm_cell_backward<T>(sv.z_i, sv.z_o, sv.z_c, sv.c_t, gh, *dc, &d[0], &d[1], &d[2], &d_c_t);
  dg[0] = d[0];
  dg[S] = d[1];
  dg[2 * S] = d[2];
  *dc = tr::load(d_c_t);
}

// w: the weights (3S, S + F) row-major, of which columns 0..S-1 are W_h (row stride w_stride).
// gates (rows, 3S): the input projection on entry, the pre-activations (bias added) on exit.
// h0, c0 (batch, S): initial state; out, cells (rows, S): h_t and c_t of every step;
// h_last, c_last (batch, S): each row's state after its last step (h0, c0 for length 0).
template <typename T>
__global__ void lltm_seq_fwd_kernel(LLTM_SEQ_FWD_PARAMS(T)) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const int S = state;
  const int S3 = 3 * state;
  const int P = lltm_fused_wt_stride(S, sizeof(T));
  if (!LLTM_SHARED_FITS(lltm_fused_wt_bytes(S, sizeof(T)) + 3LL * tile * S * sizeof(A))) return;
  T* w_t = (T*)lltm_dynamic_smem;                                   // (S, P)
  A* h_buf = (A*)(lltm_dynamic_smem + lltm_fused_wt_bytes(S, sizeof(T)));  // (2, tile, S)
  A* c_buf = h_buf + 2 * tile * S;                                  // (tile, S)
  const int row0 = blockIdx.x * tile;
  const int rows = min(tile, batch - row0);                          // this block's rows
  const int n = rows * S;
  const lltm_fused_walk walk(S);

  for (int i = threadIdx.x; i < S3 * S; i += blockDim.x) {
    const int g = i / S;
    const int k = i - g * S;
    w_t[k * P + g] = w[g * w_stride + k];
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long src = (long long)row0 * S + i;
    h_buf[i] = tr::load(h0[src]);
    c_buf[i] = tr::load(c0[src]);
  }
  __syncthreads();

  // Step t's rows are first .. edge (edge: step t + 1's first row), `active` of them this
  // block's; the offset after edge is read one step ahead, for the prefetch of step t + 1.
  long long first = lltm_fused_offset(offsets, packed, 0, batch);
  long long edge = steps > 0 ? lltm_fused_offset(offsets, packed, 1, batch) : first;
  int active = min(rows, (int)(edge - first) - row0);             // the same for every thread
  // The bias of the thread's first element, the element it has at every step.
  const T b0_i = bias[walk.s0], b0_o = bias[S + walk.s0], b0_c = bias[2 * S + walk.s0];
  // Prefetched: the input projection and bias of the thread's next element (the loads of
  // step 0's first one here, then each loaded while the element before it computes).
  T q_i = T(), q_o = T(), q_c = T(), qb_i = b0_i, qb_o = b0_o, qb_c = b0_c;
  if ((int)threadIdx.x < active * S) {
    const T* gn = gates + (first + row0 + walk.r0) * S3 + walk.s0;
    q_i = gn[0];
    q_o = gn[S];
    q_c = gn[2 * S];
  }
  A* h_cur = h_buf;                                                 // h of step t - 1
  A* h_next = h_buf + tile * S;                                     // h of step t
  int t = 0;
  for (; t < steps; ++t) {
    if (active <= 0) break;
    const long long edge_next = t + 1 < steps ? lltm_fused_offset(offsets, packed, t + 2, batch)
                                              : edge;
    const int active_next = min(rows, (int)(edge_next - edge) - row0);  // <= 0 after the last
    const int m = active * S, m_next = max(active_next, 0) * S;
    int r = walk.r0, s = walk.s0;
    for (int i = threadIdx.x; i < n; i += blockDim.x, walk.next(S, &r, &s)) {
      if (r >= active) {             // finished: its state moves along unchanged
        h_next[i] = h_cur[i];
        continue;
      }
      const long long row = first + row0 + r;
      T* g = gates + row * S3 + s;
      const T p_i = q_i, p_o = q_o, p_c = q_c, b_i = qb_i, b_o = qb_o, b_c = qb_c;
      // the thread's next element: this step's next one, else step t + 1's first one
      long long row_n = -1;
      int s_n = walk.s0;
      if (i + (int)blockDim.x < m) {
        int r_n = r;
        s_n = s;
        walk.next(S, &r_n, &s_n);
        row_n = first + row0 + r_n;
        qb_i = bias[s_n];
        qb_o = bias[S + s_n];
        qb_c = bias[2 * S + s_n];
      } else if ((int)threadIdx.x < m_next) {
        row_n = edge + row0 + walk.r0;
        qb_i = b0_i;
        qb_o = b0_o;
        qb_c = b0_c;
      }
      if (row_n >= 0) {
        const T* gn = gates + row_n * S3 + s_n;
        q_i = gn[0];
        q_o = gn[S];
        q_c = gn[2 * S];
      }
      A acc[3];
      lltm_fused_dot3<T>(w_t + s, P, S, h_cur + r * S, S, acc);
      h_next[i] = tr::load(lltm_fused_cell_forward<T>(acc, p_i, p_o, p_c, b_i, b_o, b_c,
                                                      &c_buf[i], g, S, out, cells, row * S + s));
    }
    first = edge;
    edge = edge_next;
    active = active_next;
    A* const h_done = h_next;
    h_next = h_cur;
    h_cur = h_done;
    __syncthreads();
  }
  const A* h_fin = h_cur;
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
__global__ void lltm_seq_bwd_kernel(LLTM_SEQ_BWD_PARAMS(T)) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const int S = state;
  const int S3 = 3 * state;
  if (!LLTM_SHARED_FITS(lltm_fused_w_bytes(S, sizeof(T)) + 5LL * tile * S * sizeof(A))) return;
  T* w_s = (T*)lltm_dynamic_smem;                                   // (3S, S)
  A* dg_buf = (A*)(lltm_dynamic_smem + lltm_fused_w_bytes(S, sizeof(T)));  // (tile, 3S)
  A* dh_buf = dg_buf + tile * S3;                                   // (tile, S)
  A* dc_buf = dh_buf + tile * S;                                    // (tile, S)
  const int row0 = blockIdx.x * tile;
  const int rows = min(tile, batch - row0);
  const int n = rows * S;
  const lltm_fused_walk walk(S);

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

  // Step t's rows are first .. step t + 1's first row, `active` of them this block's. From the
  // last step with a row of this block on, every step runs, and the offset before `first` is
  // read one step ahead, for the prefetch of step t - 1.
  long long first;
  int active;                                                       // block-uniform
  int t = lltm_fused_last_step(offsets, packed, steps, batch, rows, row0, &first, &active);
  // Prefetched: the saved values of the thread's next element (the loads of the first step's
  // first one here, then each loaded while the element before it computes).
  lltm_fused_saved<T> next = {};
  if (t >= 0 && (int)threadIdx.x < active * S) {
    next.load(gates, cells, grad_out, has_grad_out, first + row0 + walk.r0, walk.s0, S);
  }
  for (; t >= 0; --t) {
    const long long prev = t > 0 ? lltm_fused_offset(offsets, packed, t - 1, batch) : first;
    const int active_prev = min(rows, (int)(first - prev) - row0);   // <= 0 before step 0
    const int m = active * S, m_prev = max(active_prev, 0) * S;
    int r = walk.r0, s = walk.s0;
    for (int i = threadIdx.x; i < m; i += blockDim.x, walk.next(S, &r, &s)) {
      const long long row = first + row0 + r;
      const lltm_fused_saved<T> cur = next;
      // the thread's next element: this step's next one, else step t - 1's first one
      if (i + (int)blockDim.x < m) {
        int r_n = r, s_n = s;
        walk.next(S, &r_n, &s_n);
        next.load(gates, cells, grad_out, has_grad_out, first + row0 + r_n, s_n, S);
      } else if ((int)threadIdx.x < m_prev) {
        next.load(gates, cells, grad_out, has_grad_out, prev + row0 + walk.r0, walk.s0, S);
      }
      T d[3];
      lltm_fused_cell_backward<T>(cur, dh_buf[i], &dc_buf[i], d_gates + row * S3 + s, S, d);
      A* dgs = dg_buf + r * S3 + s;      // the GEMM's operand: the stored values
      dgs[0] = tr::load(d[0]);
      dgs[S] = tr::load(d[1]);
      dgs[2 * S] = tr::load(d[2]);
    }
    // a thread with no element at step t and one at step t - 1 (a row that ends at t - 1)
    if ((int)threadIdx.x >= m && (int)threadIdx.x < m_prev) {
      next.load(gates, cells, grad_out, has_grad_out, prev + row0 + walk.r0, walk.s0, S);
    }
    __syncthreads();
    r = walk.r0;
    s = walk.s0;
    for (int i = threadIdx.x; i < m; i += blockDim.x, walk.next(S, &r, &s)) {
      dh_buf[i] = lltm_fused_dot<T>(dg_buf + r * S3, w_s + s, S, S3);
    }
    first = prev;
    active = active_prev;
    __syncthreads();
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const long long dst = (long long)row0 * S + i;
    d_h0[dst] = tr::store(dh_buf[i]);
    d_c0[dst] = tr::store(dc_buf[i]);
  }
}

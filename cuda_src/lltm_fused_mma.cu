// The fused sequence kernels of the LLTM cell on tensor cores, for float16 and bfloat16: the
// kernels of lltm_fused.cu (same arguments, same results up to the order of the recurrent
// products' sums) with each step's recurrent product (forward h_{t-1} @ W_h.T, backward
// d_gates_t @ W_h, the latter further below) computed by warp-level mma.sync.m16n8k16 (16-bit
// operands, float32 accumulation) instead of FMAs. The forward first:
//
// This file is compiled after cuda_src/lltm.cu and cuda_src/lltm_fused.cu, in the same
// translation unit (lltm_cupy/_cuda/fused_mma.py joins the texts for NVRTC; the host build of
// the tests includes the three), and uses their scalar types, kernel parameters, step offsets
// and one element's step each way after the recurrent product (lltm_fused_cell_forward /
// lltm_fused_cell_backward: the same rounding points), not lltm_fused.cu's dot products: the
// sums here are the mma's, in the order described below.
// mma.sync with these shapes and types exists from sm_80 on; the launcher uses these kernels only
// there (for an older architecture the product compiles to a trap).
//
// The product as an mma: M = the gates' rows of W_h (gate q, state s at m = q Sp + s, Sp = S
// rounded up to 16), N = the block's batch rows (tiles of 8), K = S (Sp, in k-tiles of 16):
//   D (3 Sp x 8) = W_h (3 Sp x Sp, the mma's row-major A) x h^T (Sp x 8, the col-major B: h's
//   rows, k contiguous) + 0,
// the padding (states S .. Sp - 1 of W_h's rows and columns, of h's columns, batch rows past the
// tile) zero. A warp's job is one s-tile j (states 16 j .. 16 j + 15) of one n-tile: the three
// m-tiles of j's i, o and c gates, so that each lane holds the three gates of the same four
// (row, state) elements in its accumulators (the C/D fragment layout: states 16 j + groupID and
// + 8, rows 8 nt + 2 threadID_in_group and + 1) and runs the cell on them directly. Jobs go to
// warps round-robin, the same every step, so a lane's cells stay its own.
//
// Accumulation: per element and gate, float32, k-tile by k-tile in increasing k (each mma adds
// its 16 products to the running sum), starting from zero; the sum is then added to the input
// projection and rounded once to the storage type, then the bias is added (lltm_cell_forward),
// as in lltm_fused.cu. How one mma sums its 16 products is the hardware's (the PTX ISA does not
// fix it; tests/host_shim/shim.h documents the order the host build uses).
//
// Shared memory (dynamic, bytes, lltm_cupy/_cuda/fused.py computes the same):
//   W_h in fragment order: 3 * (Sp/16)^2 fragments of 32 lanes x 16 bytes = 6 Sp^2, loaded once
//   per launch and read by every step, one 16-byte load per lane and mma, a warp's 512
//   consecutive bytes (no bank conflict);
//   + h of the step and of the next, in the storage type (exact: h is the rounded output):
//   2 R (Sp + 8) 2-byte elements, R = tile rounded up to 8; the row stride Sp + 8 puts the B
//   fragment's 32 words of a load in 32 distinct banks;
//   + c, tile S float32.
// Registers: where every warp has one job for the whole launch (jobs <= warps: the small batch
// tiles the kernels are for, e.g. S = 128 in one n-tile and eight warps), each lane also keeps
// its job's fragments of the first LLTM_MMA_KEPT k-tiles (forward: of each gate; backward:
// 3 LLTM_MMA_KEPT k-tiles) in registers, 48 registers, loaded once after the weights' load, and
// reads only the other k-tiles' from shared memory each step. The order of the sums is the
// same either way. All of W_h in registers would need 12 Sp / 16 registers per lane at indices
// known at compile time.

#ifndef LLTM_HOST_SHIM
// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32: D = A B + C, the fragments
// laid out as the PTX ISA's "Matrix Fragments for mma.m16n8k16 with floating point type" (see
// tests/host_shim/shim.h, which emulates it lane by lane).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LLTM_MMA_16816_BODY(TYPE)                                                               \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0, %1, %2, %3}, " \
               "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"                            \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),   \
                 "f"(c[1]), "f"(c[2]), "f"(c[3]))
#else
#define LLTM_MMA_16816_BODY(TYPE) asm volatile("trap;")
#endif
__device__ __forceinline__ void lltm_mma_16816_f16(float d[4], const unsigned a[4],
                                                   const unsigned b[2], const float c[4]) {
  LLTM_MMA_16816_BODY("f16");
}
__device__ __forceinline__ void lltm_mma_16816_bf16(float d[4], const unsigned a[4],
                                                    const unsigned b[2], const float c[4]) {
  LLTM_MMA_16816_BODY("bf16");
}

// Two consecutive 16-bit elements (the first at an even index) as one 32-bit word, the first in
// the low half.
__device__ __forceinline__ unsigned lltm_mma_word(const unsigned short* p) {
  return *(const unsigned*)p;
}
#else
__device__ __forceinline__ unsigned lltm_mma_word(const unsigned short* p) {
  unsigned w;
  memcpy(&w, p, sizeof w);
  return w;
}
#endif

template <typename T>
struct lltm_mma;
template <>
struct lltm_mma<lltm_half> {
  static __device__ __forceinline__ void run(float d[4], const unsigned a[4], const unsigned b[2],
                                             const float c[4]) {
    lltm_mma_16816_f16(d, a, b, c);
  }
};
template <>
struct lltm_mma<lltm_bf16> {
  static __device__ __forceinline__ void run(float d[4], const unsigned a[4], const unsigned b[2],
                                             const float c[4]) {
    lltm_mma_16816_bf16(d, a, b, c);
  }
};

// k-tiles per gate whose fragments a warp with one job keeps in registers (see the top).
#define LLTM_MMA_KEPT 4

// One lane's A fragment of an m16n8k16 product: four 32-bit registers.
struct alignas(16) lltm_mma_frag {
  unsigned r[4];
};

__device__ __forceinline__ int lltm_mma_pad(int state) { return (state + 15) / 16 * 16; }

// The dynamic shared memory of the kernel below (see the top of this file).
__device__ __forceinline__ long long lltm_mma_fwd_bytes(int state, int tile) {
  const long long sp = lltm_mma_pad(state), rows = (tile + 7) / 8 * 8;
  return 6 * sp * sp + 4 * rows * (sp + 8) + 4LL * tile * state;
}

// W_h[row][k] and W_h[row][k + 1] as one fragment register (zero past the weights).
template <typename T>
__device__ __forceinline__ unsigned lltm_mma_w_pair(const T* __restrict__ w, long long w_stride,
                                                    int row, bool in, int k, int S) {
  const unsigned lo = in && k < S ? w[row * w_stride + k].bits : 0u;
  const unsigned hi = in && k + 1 < S ? w[row * w_stride + k + 1].bits : 0u;
  return lo | hi << 16;
}

// The forward of lltm_seq_fwd_kernel (lltm_fused.cu), with its arguments and results, for the
// 16-bit types.
template <typename T>
__global__ void lltm_seq_fwd_mma_kernel(LLTM_SEQ_FWD_PARAMS(T)) {
  typedef lltm_traits<T> tr;
  const int S = state;
  const int S3 = 3 * state;
  const int Sp = lltm_mma_pad(S);
  const int KT = Sp / 16;                     // k-tiles, and s-tiles per gate
  const int HS = Sp + 8;                      // h's row stride (elements)
  const int R = (tile + 7) / 8 * 8;           // h's rows: the tile in whole n-tiles
  if (!LLTM_SHARED_FITS(lltm_mma_fwd_bytes(S, tile))) return;
  lltm_mma_frag* w_f = (lltm_mma_frag*)lltm_dynamic_smem;          // (3, KT, KT, 32 lanes)
  unsigned short* h_buf = (unsigned short*)(lltm_dynamic_smem + 6LL * Sp * Sp);   // (2, R, HS)
  float* c_buf = (float*)(lltm_dynamic_smem + 6LL * Sp * Sp + 4LL * R * HS);     // (tile, S)
  const int row0 = blockIdx.x * tile;
  const int rows = min(tile, batch - row0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int group = lane >> 2, quad = lane & 3;   // groupID, threadID_in_group

  // W_h's fragments: fragment f = ((q KT + j) KT + kt) 32 + lane holds, as the lane's four A
  // registers of the m-tile of gate q's states 16 j .. 16 j + 15 and the k-tile kt, the pairs
  // (row groupID, cols 2 tig, + 1), (row groupID + 8, same cols), (row groupID, cols 2 tig + 8,
  // + 9), (row groupID + 8, cols 2 tig + 8, + 9) of that 16 x 16 tile.
  for (int f = threadIdx.x; f < 3 * KT * KT * 32; f += blockDim.x) {
    const int fl = f & 31;
    const int kt = (f >> 5) % KT;
    const int j = (f >> 5) / KT % KT;
    const int q = (f >> 5) / KT / KT;
    lltm_mma_frag a;
LLTM_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int s = 16 * j + (fl >> 2) + (r & 1) * 8;
      const int k = 16 * kt + 2 * (fl & 3) + (r >> 1) * 8;
      a.r[r] = lltm_mma_w_pair(w, w_stride, q * S + s, s < S, k, S);
    }
    w_f[f] = a;
  }
  // h of step -1 in buffer 0; zero wherever no state is (both buffers' padding, read by the mma)
  for (int i = threadIdx.x; i < 2 * R * HS; i += blockDim.x) {
    const int r = i / HS % R, s = i % HS;
    h_buf[i] = i < R * HS && r < rows && s < S ? h0[(long long)(row0 + r) * S + s].bits : 0;
  }
  for (int i = threadIdx.x; i < rows * S; i += blockDim.x) {
    c_buf[i] = tr::load(c0[(long long)row0 * S + i]);
  }
  __syncthreads();

  long long first = lltm_fused_offset(offsets, packed, 0, batch);
  long long edge = steps > 0 ? lltm_fused_offset(offsets, packed, 1, batch) : first;
  int active = min(rows, (int)(edge - first) - row0);             // the same for every thread
  const int jobs = KT * (R / 8);
  // a warp's only job (jobs <= warps): its first k-tiles' fragments kept in registers
  const int kept = jobs <= warps ? min(KT, LLTM_MMA_KEPT) : 0;      // block-uniform
  lltm_mma_frag w_r[3][LLTM_MMA_KEPT];
LLTM_UNROLL
  for (int kt = 0; kt < LLTM_MMA_KEPT; ++kt) {
LLTM_UNROLL
    for (int q = 0; q < 3; ++q) {
      w_r[q][kt] = kt < kept && warp < jobs
                       ? w_f[((q * KT + warp % KT) * KT + kt) * 32 + lane] : lltm_mma_frag();
    }
  }
  int cur = 0;                                                    // h_{t-1}'s buffer
  for (int t = 0; t < steps; ++t) {
    if (active <= 0) break;
    const long long edge_next = t + 1 < steps ? lltm_fused_offset(offsets, packed, t + 2, batch)
                                              : edge;
    const unsigned short* hc = h_buf + cur * R * HS;
    unsigned short* hn = h_buf + (cur ^ 1) * R * HS;
    for (int job = warp; job < jobs; job += warps) {
      const int j = job % KT, nt = job / KT;
      float acc[3][4];
LLTM_UNROLL
      for (int q = 0; q < 3; ++q) {
LLTM_UNROLL
        for (int e = 0; e < 4; ++e) acc[q][e] = 0.0f;
      }
      // the lane's elements e: state 16 j + groupID (+ 8 for e >= 2), row 8 nt + 2 tig + (e & 1)
      T p[3][4];
LLTM_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int s = 16 * j + group + (e >> 1) * 8, n = 8 * nt + 2 * quad + (e & 1);
        const bool live = s < S && n < active;
        const T* g = gates + (first + row0 + n) * S3 + s;
LLTM_UNROLL
        for (int q = 0; q < 3; ++q) p[q][e] = live ? g[q * S] : T();
      }
      if (8 * nt < active) {                                      // the same for the warp
        const unsigned short* hb = hc + (8 * nt + group) * HS + 2 * quad;
        const lltm_mma_frag* wj = w_f + j * KT * 32 + lane;
LLTM_UNROLL
        for (int kt = 0; kt < LLTM_MMA_KEPT; ++kt) {                // from registers
          if (kt < kept) {
            const unsigned b[2] = {lltm_mma_word(hb + 16 * kt), lltm_mma_word(hb + 16 * kt + 8)};
LLTM_UNROLL
            for (int q = 0; q < 3; ++q) lltm_mma<T>::run(acc[q], w_r[q][kt].r, b, acc[q]);
          }
        }
        for (int kt = kept; kt < KT; ++kt) {                          // from shared memory
          const unsigned b[2] = {lltm_mma_word(hb + 16 * kt), lltm_mma_word(hb + 16 * kt + 8)};
LLTM_UNROLL
          for (int q = 0; q < 3; ++q) {
            const lltm_mma_frag a = wj[(q * KT * KT + kt) * 32];
            lltm_mma<T>::run(acc[q], a.r, b, acc[q]);
          }
        }
      }
LLTM_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int s = 16 * j + group + (e >> 1) * 8, n = 8 * nt + 2 * quad + (e & 1);
        if (s >= S || n >= rows) continue;
        if (n >= active) {           // finished: its state moves along unchanged
          hn[n * HS + s] = hc[n * HS + s];
          continue;
        }
        const long long row = first + row0 + n;
        const float sums[3] = {acc[0][e], acc[1][e], acc[2][e]};
        hn[n * HS + s] = lltm_fused_cell_forward<T>(sums, p[0][e], p[1][e], p[2][e], bias[s],
                                                    bias[S + s], bias[2 * S + s],
                                                    &c_buf[n * S + s], gates + row * S3 + s, S,
                                                    out, cells, row * S + s).bits;
      }
    }
    first = edge;
    edge = edge_next;
    active = min(rows, (int)(edge - first) - row0);
    cur ^= 1;
    __syncthreads();
  }
  const unsigned short* h_fin = h_buf + cur * R * HS;
  for (int i = threadIdx.x; i < rows * S; i += blockDim.x) {
    const int r = i / S, s = i - r * S;
    const long long dst = (long long)row0 * S + i;
    T h;
    h.bits = h_fin[r * HS + s];
    h_last[dst] = h;
    c_last[dst] = tr::store(c_buf[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// The backward on tensor cores: lltm_seq_bwd_kernel (lltm_fused.cu), with its arguments and
// results, for the 16-bit types, the step's d_h_{t-1} = d_gates_t @ W_h by mma.sync:
//   D (Sp x 8) = W_h^T (Sp x 3 Sp, the row-major A: A[s][q Sp + s'] = W_h[q S + s'][s]) x
//   d_gates^T (3 Sp x 8, the col-major B: d_gates' rows, gate-major, k contiguous),
// K = the three gates' padded states in 3 KT k-tiles, accumulated in float32 in increasing k.
// The operand d_gates is the stored (rounded) value, as in lltm_fused.cu, exact in 16 bits. A
// warp's job is again states 16 j .. 16 j + 15 of an n-tile of 8 rows: each lane runs the cell's
// backward for its four (row, state) elements (writing their three gates' d_gates) and receives
// the same four elements of d_h, so the carried d_h and d_c stay its own.
//
// Shared memory (bytes): W_h^T's fragments, 3 KT^2 x 32 lanes x 16 = 6 Sp^2; d_gates of the step,
// double-buffered in the storage type, 2 R (3 Sp + 8) 2-byte elements (a row stride of 4 mod 8
// words: a fragment's loads in 32 distinct banks); the carried d_h and d_c, 2 tile S float32.
// One __syncthreads() per step: the lanes write this step's d_gates into one buffer, read it
// after the barrier, and write the next step's into the other.

__device__ __forceinline__ long long lltm_mma_bwd_bytes(int state, int tile) {
  const long long sp = lltm_mma_pad(state), rows = (tile + 7) / 8 * 8;
  return 6 * sp * sp + 4 * rows * (3 * sp + 8) + 8LL * tile * state;
}

template <typename T>
__global__ void lltm_seq_bwd_mma_kernel(LLTM_SEQ_BWD_PARAMS(T)) {
  typedef lltm_traits<T> tr;
  const int S = state;
  const int S3 = 3 * state;
  const int Sp = lltm_mma_pad(S);
  const int KT = Sp / 16;                     // s-tiles; the k-tiles are 3 KT
  const int DS = 3 * Sp + 8;                  // d_gates' row stride (elements)
  const int R = (tile + 7) / 8 * 8;
  if (!LLTM_SHARED_FITS(lltm_mma_bwd_bytes(S, tile))) return;
  lltm_mma_frag* w_f = (lltm_mma_frag*)lltm_dynamic_smem;           // (KT, 3 KT, 32 lanes)
  unsigned short* dg_buf = (unsigned short*)(lltm_dynamic_smem + 6LL * Sp * Sp);  // (2, R, DS)
  float* dh_buf = (float*)(lltm_dynamic_smem + 6LL * Sp * Sp + 4LL * R * DS);   // (tile, S)
  float* dc_buf = dh_buf + tile * S;                                          // (tile, S)
  const int row0 = blockIdx.x * tile;
  const int rows = min(tile, batch - row0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int group = lane >> 2, quad = lane & 3;

  // fragment f = (j 3 KT + kt) 32 + lane: the A registers of W_h^T's tile of states 16 j ..
  // 16 j + 15 (rows) and padded gate columns 16 kt .. 16 kt + 15, laid out as in the forward
  for (int f = threadIdx.x; f < 3 * KT * KT * 32; f += blockDim.x) {
    const int fl = f & 31;
    const int kt = (f >> 5) % (3 * KT);
    const int j = (f >> 5) / (3 * KT);
    lltm_mma_frag a;
LLTM_UNROLL
    for (int r = 0; r < 4; ++r) {
      const int s = 16 * j + (fl >> 2) + (r & 1) * 8;
      const int gp = 16 * kt + 2 * (fl & 3) + (r >> 1) * 8;   // even: gp, gp + 1 in one gate
      const int q = gp / Sp, sq = gp - q * Sp;
      const unsigned lo = s < S && sq < S ? w[(q * S + sq) * w_stride + s].bits : 0u;
      const unsigned hi = s < S && sq + 1 < S ? w[(q * S + sq + 1) * w_stride + s].bits : 0u;
      a.r[r] = lo | hi << 16;
    }
    w_f[f] = a;
  }
  // d_gates' padding (states S .. Sp - 1 of each gate) is read by the mma: zero, never written
  for (int i = threadIdx.x; i < 2 * R * DS; i += blockDim.x) dg_buf[i] = 0;
  for (int i = threadIdx.x; i < rows * S; i += blockDim.x) {
    const long long src = (long long)row0 * S + i;
    dh_buf[i] = has_grad_h_n ? tr::load(grad_h_n[src]) : 0.0f;
    dc_buf[i] = has_grad_c_n ? tr::load(grad_c_n[src]) : 0.0f;
  }
  __syncthreads();

  // the last step with a row of this block (as lltm_seq_bwd_kernel)
  long long first;
  int active;
  int t = lltm_fused_last_step(offsets, packed, steps, batch, rows, row0, &first, &active);
  const int jobs = KT * (R / 8);
  // a warp's only job (jobs <= warps): its first k-tiles' fragments kept in registers
  const int kept = jobs <= warps ? min(3 * KT, 3 * LLTM_MMA_KEPT) : 0;   // block-uniform
  lltm_mma_frag w_r[3 * LLTM_MMA_KEPT];
LLTM_UNROLL
  for (int kt = 0; kt < 3 * LLTM_MMA_KEPT; ++kt) {
    w_r[kt] = kt < kept && warp < jobs ? w_f[((warp % KT) * 3 * KT + kt) * 32 + lane]
                                       : lltm_mma_frag();
  }
  int cur = 0;
  for (; t >= 0; --t) {
    const long long prev = t > 0 ? lltm_fused_offset(offsets, packed, t - 1, batch) : first;
    const int active_prev = min(rows, (int)(first - prev) - row0);   // <= 0 before step 0
    unsigned short* dg = dg_buf + cur * R * DS;
    for (int job = warp; job < jobs; job += warps) {
      const int j = job % KT, nt = job / KT;
LLTM_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int s = 16 * j + group + (e >> 1) * 8, n = 8 * nt + 2 * quad + (e & 1);
        if (s >= S || n >= active) continue;
        const long long row = first + row0 + n;
        lltm_fused_saved<T> sv;
        sv.load(gates, cells, grad_out, has_grad_out, row, s, S);
        T d[3];
        lltm_fused_cell_backward<T>(sv, dh_buf[n * S + s], &dc_buf[n * S + s],
                                    d_gates + row * S3 + s, S, d);
        unsigned short* dgs = dg + n * DS + s;     // the product's operand: the stored values
        dgs[0] = d[0].bits;
        dgs[Sp] = d[1].bits;
        dgs[2 * Sp] = d[2].bits;
      }
    }
    __syncthreads();
    for (int job = warp; job < jobs; job += warps) {
      const int j = job % KT, nt = job / KT;
      if (8 * nt >= active) continue;                             // the same for the warp
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const unsigned short* db = dg + (8 * nt + group) * DS + 2 * quad;
      const lltm_mma_frag* wj = w_f + j * 3 * KT * 32 + lane;
LLTM_UNROLL
      for (int kt = 0; kt < 3 * LLTM_MMA_KEPT; ++kt) {               // from registers
        if (kt < kept) {
          const unsigned b[2] = {lltm_mma_word(db + 16 * kt), lltm_mma_word(db + 16 * kt + 8)};
          lltm_mma<T>::run(acc, w_r[kt].r, b, acc);
        }
      }
      for (int kt = kept; kt < 3 * KT; ++kt) {                       // from shared memory
        const unsigned b[2] = {lltm_mma_word(db + 16 * kt), lltm_mma_word(db + 16 * kt + 8)};
        const lltm_mma_frag a = wj[kt * 32];
        lltm_mma<T>::run(acc, a.r, b, acc);
      }
LLTM_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int s = 16 * j + group + (e >> 1) * 8, n = 8 * nt + 2 * quad + (e & 1);
        if (s < S && n < active) dh_buf[n * S + s] = acc[e];
      }
    }
    first = prev;
    active = active_prev;
    cur ^= 1;
  }
  __syncthreads();                 // d_h and d_c were written by their lanes, read by index here
  for (int i = threadIdx.x; i < rows * S; i += blockDim.x) {
    const long long dst = (long long)row0 * S + i;
    d_h0[dst] = tr::store(dh_buf[i]);
    d_c0[dst] = tr::store(dc_buf[i]);
  }
}

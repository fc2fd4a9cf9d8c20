// Fused whole-sequence kernels of the LLTM cell across a thread-block cluster (sm_90 and newer):
// the kernels of lltm_fused.cu for state sizes whose W_h does not fit one block's shared memory.
// And the same split without clusters (sm_80 and newer; the launcher uses it on sm_80 to sm_89):
// the group kernels, whose P blocks per tile exchange through global memory and meet at a barrier
// on a counter per tile in global memory (lltm_group_sync), every block of the grid resident at
// once (a cooperative launch). Both are the same bodies (lltm_seq_fwd_split, lltm_seq_bwd_split),
// templates over the exchange (lltm_cluster_exchange, lltm_group_exchange): every line of the
// cell, the dot products and the arrays' loads and stores is shared, and the group kernels give
// the cluster kernels' bits.
//
// This file is compiled after cuda_src/lltm.cu and cuda_src/lltm_fused.cu, in the same
// translation unit (lltm_cupy/_cuda/cluster_kernels.py joins the three texts for NVRTC; the host
// build of the tests includes the three), and uses lltm.cu's scalar types (lltm_traits) and cell
// numerics (lltm_cell_forward / lltm_cell_backward) and lltm_fused.cu's shared memory
// declaration, kernel parameters (LLTM_SEQ_FWD_PARAMS / LLTM_SEQ_BWD_PARAMS), walk over a tile's
// elements (lltm_fused_walk), a step's first row (lltm_fused_offset), padded row stride
// (lltm_fused_wt_stride), dot products (lltm_fused_dot3 forward, lltm_fused_dot backward: the
// one definition of the order of the recurrent sums, for these kernels and the one-block ones)
// and one element's step each way (lltm_fused_cell_forward / lltm_fused_cell_backward: the same
// rounding points).
//
// Work split: one cluster of P blocks (P in 1, 2, 4, 8: the portable cluster sizes, and 16: a
// non-portable one, which the launcher opts in to and uses where the device holds it; the
// kernels' __cluster_dims__, one instantiation per P) per tile of `tile` batch rows; cluster c
// is blocks c * P .. c * P + P - 1, and block `rank` of it owns the states lo = rank * S / P up to
// (rank + 1) * S / P (L of them, at most LM = ceil(S / P)) and W_h's rows of those states' three
// gates, in its shared memory for all steps. Every step:
//   forward:  each block computes its states' gates from the whole previous h (its own copy,
//             in shared memory), the cell, and stores its slice of the new h into the next-h
//             buffer of every block of the cluster (distributed shared memory: mapa +
//             st.shared::cluster); h is double-buffered, so one cluster barrier per step orders
//             both the stores before the next step's reads and this step's reads before the
//             stores of the step after;
//   backward: each block computes its states' d_gates by the cell's backward, then (after a
//             block barrier: the product reads every thread's d_gates) its partial d_h_{t-1} =
//             d_gates[its gates] @ W_h[its gates] for every state, and stores the part of it
//             that block q owns into q's receive buffer, slot `rank` (a reduce-scatter); after
//             the step's cluster barrier each block adds the P partial sums of its states in the
//             fixed order of the slots, 0 .. P - 1. The receive buffer is double-buffered, so one
//             cluster barrier per step suffices here too.
// A barrier at the start (every block of the cluster running, before any store into a peer);
// none at the end: after a step's barrier no block stores into another, so a block may leave.
// The group kernels do the same through global memory: a step's h (or partial sums) is stored
// into the tile's region of an exchange buffer (double-buffered as above) instead of into the
// peers, the step's barrier is lltm_group_sync, and forward each block then copies the tile's
// next h into its own shared memory (a block barrier after the copy); their first barrier is a
// block barrier (no peer's shared memory is written).
//
// Numerics: as lltm_fused.cu. The forward's dot products are lltm_fused_dot3 over all S terms
// (chunks of LLTM_FUSED_CHUNK terms in LLTM_FUSED_LANES partial sums each, added in a fixed
// order), the same sums as the one-block forward's: the forward's results do not depend on P.
// The backward's sums are lltm_fused_dot over each block's 3L terms, then the blocks' partial
// sums in rank order: fixed for a given P (deterministic).
// Rounding points, packed layout, inactive rows: as lltm_fused.cu.
//
// Shared memory (dynamic, bytes, the same layout in every block of the cluster, so that an offset
// in one block is the same buffer in another; A = arithmetic type, T = storage type;
// lltm_cupy/_cuda/fused_cluster.py computes the same sizes):
//   forward:  S * Q sizeof(T)  (W_h's rows of the block's gates, transposed: (S, 3L) in rows of
//             Q = lltm_fused_wt_stride(LM) elements, row k holding gate g's state j at g L + j)
//             + tile * (2 S + LM) sizeof(A)  (whole h of the step and of the next; c of the
//             block's states)
//   backward: 3 LM S sizeof(T)  (W_h's rows of the block's gates, (3L, S))
//             + tile * (3 LM + 2 P LM + 2 LM) sizeof(A)  (the block's d_gates; the receive
//             buffers (2, P, tile, LM); carried d_h (before a row's first step) and d_c)
// The weights' region is padded to 16 bytes so that the A arrays are aligned. The group kernels
// lay out less (the exchange's h_buffers and recv_slots): one h buffer forward (S instead of 2 S
// per row: the next h is copied in after the step's barrier, when every read of the step's h is
// done) and no receive buffers backward (2 P LM fewer per row: they are in global memory).

#ifndef LLTM_HOST_SHIM
#define LLTM_CLUSTER_DIMS(P) __cluster_dims__(P, 1, 1)

// The cluster primitives, header-free inline PTX (sm_90). The host shim (tests/host_shim/shim.h)
// gives the same functions cluster semantics on the CPU.
typedef unsigned lltm_dsmem;   // an address in the cluster's shared window (shared::cluster)

// Every thread of every block of the cluster arrives, then waits for all (release / acquire at
// cluster scope, the defaults: the stores into peers before it are seen by their reads after
// it). The .aligned forms: the PTX ISA requires every thread of a warp to execute the same
// barrier.cluster instruction (undefined behaviour otherwise), which holds here: no call is inside
// a branch that a warp's threads may take differently (the step loops' bounds and breaks depend
// only on the offsets, the tile and the step: the same for every thread of the cluster). The
// host shim stops a launch whose warp's lanes wait at different calls.
__device__ __forceinline__ void lltm_cluster_sync() {
  asm volatile("barrier.cluster.arrive.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

__device__ __forceinline__ unsigned lltm_cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ unsigned lltm_cluster_size() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// The address of the word at p's offset (p in this block's shared memory) in block `rank`'s.
__device__ __forceinline__ lltm_dsmem lltm_cluster_map(const void* p, unsigned rank) {
  unsigned local, remote;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
               : "=r"(local) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

__device__ __forceinline__ void lltm_cluster_store(lltm_dsmem a, float v) {
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(a), "f"(v) : "memory");
}
__device__ __forceinline__ void lltm_cluster_store(lltm_dsmem a, double v) {
  asm volatile("st.shared::cluster.f64 [%0], %1;" :: "r"(a), "d"(v) : "memory");
}

// The group primitives (the split without clusters, sm_80 and newer: the blocks of a tile
// exchange through global memory and meet at a barrier in global memory; see lltm_group_sync),
// header-free inline PTX. The host shim gives the same functions a weak memory model on the CPU
// (exchange stores stay invisible to the other blocks until their block's fence, and a block
// reads what it had acquired at its last fence).
//
// fence.acq_rel.gpu: with a later relaxed store (the arrival) a release pattern, with an earlier
// relaxed load (the poll) an acquire pattern (PTX ISA, "Memory Consistency Model").
__device__ __forceinline__ void lltm_group_fence() {
  asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

// One arrival at the tile's counter (a relaxed atomic addition at GPU scope, in L2).
__device__ __forceinline__ void lltm_group_arrive(unsigned* counter) {
  asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" :: "l"(counter) : "memory");
}

// The tile's counter, read from L2 (relaxed, GPU scope).
__device__ __forceinline__ unsigned lltm_group_poll(const unsigned* counter) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// The body of the waiting loop (nothing on a GPU; the shim yields to the other blocks there).
__device__ __forceinline__ void lltm_group_spin() {}

// A step's exchanged value, stored to and loaded from L2 (.cg: not cached in L1, which is not
// coherent between SMs).
__device__ __forceinline__ void lltm_group_store(float* p, float v) {
  asm volatile("st.global.cg.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
}
__device__ __forceinline__ void lltm_group_store(double* p, double v) {
  asm volatile("st.global.cg.f64 [%0], %1;" :: "l"(p), "d"(v) : "memory");
}
__device__ __forceinline__ float lltm_group_load(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ double lltm_group_load(const double* p) {
  double v;
  asm volatile("ld.global.cg.f64 %0, [%1];" : "=d"(v) : "l"(p) : "memory");
  return v;
}
#else
#define LLTM_CLUSTER_DIMS(P)
#endif

// The barrier of the P blocks of one tile in the group variant (no cluster: every block of the
// grid resident at once, by a cooperative launch), on the tile's counter in global memory, zeroed
// before the launch: the n-th barrier of a launch waits until the counter reaches n P (a target
// that only grows within the launch, so no reset between steps; a block may arrive at barrier
// n + 1 while another still reads the counter of barrier n, which is then past n P, still
// reached). The block's stores before it (its threads', ordered before thread 0 by the first
// block barrier) are released at GPU scope by thread 0's fence before its arrival; thread 0
// acquires the peers' by its fence after it sees the P arrivals, and the second block barrier
// orders the block's later loads after that. Blocks of different tiles never wait for each
// other.
__device__ __forceinline__ void lltm_group_sync(unsigned* counter, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    lltm_group_fence();
    lltm_group_arrive(counter);
    while ((int)(lltm_group_poll(counter) - target) < 0) lltm_group_spin();
    lltm_group_fence();
  }
  __syncthreads();
}

// Bytes of the forward's transposed weights: S rows of lltm_fused_wt_stride(LM) elements (the
// one-block kernel's stride with LM for S: 32 consecutive rows in 32 different banks).
__device__ __forceinline__ long long lltm_cluster_wt_bytes(int state, int most, int item) {
  return ((long long)state * lltm_fused_wt_stride(most, item) * item + 15) / 16 * 16;
}

__device__ __forceinline__ long long lltm_cluster_w_bytes(int state, int most, int item) {
  return (3LL * most * state * item + 15) / 16 * 16;
}

// ------------------------------------------------------------------------------ the exchanges
// The kernels' bodies (lltm_seq_fwd_split, lltm_seq_bwd_split) are templates over how the P
// blocks of a tile exchange, X: lltm_cluster_exchange (distributed shared memory; the cluster
// kernels) or lltm_group_exchange (global memory; the group kernels). Every line of the cell, the
// dot products and the loads and stores of the arrays is the same for both. An exchange gives:
//   rank(), tile_index(): the block's rank in its tile (0 .. P - 1), the tile's index;
//   start(): the barrier after the block's loads, before any exchange;
//   forward, step t (h_next: the block's buffer of the next h in shared memory, (tile, S)):
//     fwd_step(h_next, t): where the step's h goes; put_h(i, v): element i = r S + s of it;
//     fwd_end(h_next, count): the step's barrier, after which h_next holds the whole next h of
//     the tile (its first `count` = rows S elements);
//   backward (recv: the block's receive buffers in shared memory, (2, P, tile, LM); slot = tile
//     LM; `done`: steps run so far):
//     bwd_in(recv, slot, done): the partial sums of d_h the blocks sent at the step before, P
//     slots of `slot` elements in rank order; partial(in, i): element i of them;
//     bwd_step(recv, slot, done, rank): where this step's go; put_partial(q, slot, i, v):
//     element i of block q's slot; bwd_end(): the step's barrier.

// Through distributed shared memory (sm_90 and newer): every block keeps the whole h of the tile
// in its own shared memory and the blocks store into each other's (see the top of this file).
template <typename A, int P>
struct lltm_cluster_exchange {
  // the layout's buffers in shared memory: the step's h and the next (peers store into the
  // next while this block still reads the step's); the receive buffers, (2, P, tile, LM)
  static constexpr int h_buffers = 2;
  static constexpr int recv_slots = 2 * P;
  lltm_dsmem peer[P];    // the step's next-h buffer in every block of the cluster (forward)
  A* dst;                // this block's slot of the step's receive buffers (backward)

  __device__ __forceinline__ int rank() const { return (int)lltm_cluster_rank(); }
  __device__ __forceinline__ unsigned tile_index() const { return blockIdx.x / P; }
  __device__ __forceinline__ void start() const {
    lltm_cluster_sync();    // the block's loads done, every block of the cluster running
  }
  __device__ __forceinline__ void fwd_step(A* h_next, int) {
LLTM_UNROLL
    for (int q = 0; q < P; ++q) peer[q] = lltm_cluster_map(h_next, q);
  }
  __device__ __forceinline__ void put_h(int i, A v) const {
    const unsigned at = (unsigned)(i * sizeof(A));
LLTM_UNROLL
    for (int q = 0; q < P; ++q) lltm_cluster_store(peer[q] + at, v);
  }
  __device__ __forceinline__ void fwd_end(A*, int) const {
    lltm_cluster_sync();    // the next h complete in every block; this step's reads of h done
  }
  __device__ __forceinline__ const A* bwd_in(A* recv, int slot, int done) const {
    return recv + ((done + 1) & 1) * P * slot;
  }
  __device__ __forceinline__ A partial(const A* in, int i) const { return in[i]; }
  __device__ __forceinline__ void bwd_step(A* recv, int slot, int done, int rank) {
    dst = recv + (done & 1) * P * slot + rank * slot;
  }
  __device__ __forceinline__ void put_partial(int q, int, int i, A v) const {
    lltm_cluster_store(lltm_cluster_map(dst, q) + (unsigned)(i * sizeof(A)), v);
  }
  __device__ __forceinline__ void bwd_end() const {
    lltm_cluster_sync();    // every block's partial sums in place; the step's reads of recv done
  }
};

// Through global memory (the group kernels; sm_80 and newer, a cooperative launch): the tile's
// region of the exchange buffer, two buffers of `half` elements (forward: the tile's h, (tile,
// S); backward: (P receiving blocks, P sending blocks, tile, LM)), and its counter, for
// lltm_group_sync. Forward, each block stores its states' new h there and, after the barrier,
// copies the tile's whole next h into its shared memory (then a block barrier); backward, each
// block stores its partial sums into the receiving blocks' slots there and reads its own after
// the barrier. Both double-buffered, as in shared memory: one barrier per step (a block writes a
// buffer again only after the barrier that follows every block's reads of it).
template <typename A, int P>
struct lltm_group_exchange {
  // one h buffer in shared memory: fwd_end copies the next h in after lltm_group_sync, whose
  // first block barrier follows every read of the step's h; no receive buffers (global memory)
  static constexpr int h_buffers = 1;
  static constexpr int recv_slots = 0;
  A* x;                  // the tile's region: (2, half)
  unsigned* counter;     // the tile's counter, zero before the launch
  unsigned arrivals;     // the barriers this block passed
  int first;             // the launch's first tile (it runs tiles first .. first + grid / P - 1)
  int half;
  A* at;                 // where this step's values go

  __device__ __forceinline__ lltm_group_exchange(A* exchange, unsigned* counters, int tile0,
                                                 int elements)
      : x(exchange + (long long)(blockIdx.x / P) * 2 * elements),
        counter(counters + blockIdx.x / P), arrivals(0), first(tile0), half(elements),
        at(nullptr) {}
  __device__ __forceinline__ int rank() const { return (int)(blockIdx.x % P); }
  __device__ __forceinline__ unsigned tile_index() const { return first + blockIdx.x / P; }
  __device__ __forceinline__ void start() const {
    __syncthreads();        // the block's loads done
  }
  __device__ __forceinline__ void fwd_step(A*, int t) { at = x + ((t + 1) & 1) * half; }
  __device__ __forceinline__ void put_h(int i, A v) const { lltm_group_store(at + i, v); }
  __device__ __forceinline__ void fwd_end(A* h_next, int count) {
    lltm_group_sync(counter, ++arrivals * P);   // every block's slice of the next h stored
    for (int i = threadIdx.x; i < count; i += blockDim.x) h_next[i] = lltm_group_load(at + i);
    __syncthreads();        // the next h in shared memory
  }
  __device__ __forceinline__ const A* bwd_in(A*, int slot, int done) const {
    return x + ((done + 1) & 1) * half + rank() * P * slot;
  }
  __device__ __forceinline__ A partial(const A* in, int i) const {
    return lltm_group_load(in + i);
  }
  __device__ __forceinline__ void bwd_step(A*, int slot, int done, int rank) {
    at = x + (done & 1) * half + rank * slot;
  }
  __device__ __forceinline__ void put_partial(int q, int slot, int i, A v) const {
    lltm_group_store(at + q * P * slot + i, v);
  }
  __device__ __forceinline__ void bwd_end() {
    lltm_group_sync(counter, ++arrivals * P);   // every block's partial sums stored
  }
};

// ------------------------------------------------------------------------------ the kernels

// The forward of one block of a tile (the kernels' arguments, see lltm_seq_fwd_cluster_kernel).
template <typename T, int P, typename X>
__device__ __forceinline__ void lltm_seq_fwd_split(X& x, LLTM_SEQ_FWD_PARAMS(T)) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const int S = state;
  const int S3 = 3 * state;
  const int rank = x.rank();
  const int lo = rank * S / P;                   // this block's states: lo .. lo + L - 1
  const int L = (rank + 1) * S / P - lo;
  const int LM = (S + P - 1) / P;
  const int Q = lltm_fused_wt_stride(LM, sizeof(T));
  const long long w_bytes = lltm_cluster_wt_bytes(S, LM, sizeof(T));
  const int hb = X::h_buffers - 1;   // the h buffers taken in turn: t & hb (one: always 0)
  if (!LLTM_SHARED_FITS(w_bytes + ((long long)X::h_buffers * S + LM) * tile * sizeof(A))) return;
  T* w_t = (T*)lltm_dynamic_smem;                                   // (S, Q)
  A* h_buf = (A*)(lltm_dynamic_smem + w_bytes);                     // (h_buffers, tile, S)
  A* c_buf = h_buf + X::h_buffers * tile * S;                       // (tile, L)
  const int row0 = x.tile_index() * tile;
  const int rows = min(tile, batch - row0);
  const int n = rows * L;
  const lltm_fused_walk walk(L);

  for (int i = threadIdx.x; i < 3 * L * S; i += blockDim.x) {
    const int gl = i / S;
    const int k = i - gl * S;
    const int g = gl / L;
    w_t[k * Q + gl] = w[(g * S + lo + gl - g * L) * w_stride + k];
  }
  for (int i = threadIdx.x; i < rows * S; i += blockDim.x) {
    h_buf[i] = tr::load(h0[(long long)row0 * S + i]);
  }
  {
    int r = walk.r0, j = walk.s0;
    for (int i = threadIdx.x; i < n; i += blockDim.x, walk.next(L, &r, &j)) {
      c_buf[i] = tr::load(c0[(long long)(row0 + r) * S + lo + j]);
    }
  }
  x.start();

  long long first = lltm_fused_offset(offsets, packed, 0, batch);
  int t = 0;
  for (; t < steps; ++t) {
    const long long edge = lltm_fused_offset(offsets, packed, t + 1, batch);
    const int active = min(rows, (int)(edge - first) - row0);   // the same for the tile
    if (active <= 0) break;
    const A* h_cur = h_buf + (t & hb) * tile * S;
    A* h_next = h_buf + ((t + 1) & hb) * tile * S;
    x.fwd_step(h_next, t);
    int r = walk.r0, j = walk.s0;
    for (int i = threadIdx.x; i < n; i += blockDim.x, walk.next(L, &r, &j)) {
      const int s = lo + j;
      A h_new;
      if (r >= active) {             // finished: its state moves along unchanged
        h_new = h_cur[r * S + s];
      } else {
        const long long row = first + row0 + r;
        T* g = gates + row * S3 + s;
        A acc[3];
        lltm_fused_dot3<T>(w_t + j, Q, L, h_cur + r * S, S, acc);
        h_new = tr::load(lltm_fused_cell_forward<T>(acc, g[0], g[S], g[2 * S], bias[s],
                                                    bias[S + s], bias[2 * S + s], &c_buf[i], g,
                                                    S, out, cells, row * S + s));
      }
      x.put_h(r * S + s, h_new);
    }
    first = edge;
    x.fwd_end(h_next, rows * S);
  }
  const A* h_fin = h_buf + (t & hb) * tile * S;
  int r = walk.r0, j = walk.s0;
  for (int i = threadIdx.x; i < n; i += blockDim.x, walk.next(L, &r, &j)) {
    const long long dst = (long long)(row0 + r) * S + lo + j;
    h_last[dst] = tr::store(h_fin[r * S + lo + j]);
    c_last[dst] = tr::store(c_buf[i]);
  }
}

// The backward of one block of a tile (the kernels' arguments, see lltm_seq_bwd_cluster_kernel).
template <typename T, int P, typename X>
__device__ __forceinline__ void lltm_seq_bwd_split(X& x, LLTM_SEQ_BWD_PARAMS(T)) {
  typedef lltm_traits<T> tr;
  typedef typename tr::acc A;
  const int S = state;
  const int S3 = 3 * state;
  const int rank = x.rank();
  const int lo = rank * S / P;
  const int L = (rank + 1) * S / P - lo;
  const int LM = (S + P - 1) / P;
  const long long w_bytes = lltm_cluster_w_bytes(S, LM, sizeof(T));
  if (!LLTM_SHARED_FITS(w_bytes + (5LL + X::recv_slots) * LM * tile * sizeof(A))) return;
  T* w_s = (T*)lltm_dynamic_smem;                                   // (3L, S)
  A* dg_buf = (A*)(lltm_dynamic_smem + w_bytes);                    // (tile, 3L)
  A* recv = dg_buf + 3 * tile * LM;                                 // (recv_slots, tile, LM)
  A* dh_buf = recv + X::recv_slots * tile * LM;                     // (tile, L)
  A* dc_buf = dh_buf + tile * LM;                                   // (tile, L)
  const int slot = tile * LM;                                       // one block's partial sums
  const int row0 = x.tile_index() * tile;
  const int rows = min(tile, batch - row0);
  const int n = rows * L;
  const lltm_fused_walk walk(L);      // the block's states of a tile
  const lltm_fused_walk all(S);       // every state of a tile

  for (int i = threadIdx.x; i < 3 * L * S; i += blockDim.x) {
    const int gl = i / S;
    const int k = i - gl * S;
    const int g = gl / L;
    w_s[i] = w[(g * S + lo + gl - g * L) * w_stride + k];
  }
  {
    int r = walk.r0, j = walk.s0;
    for (int i = threadIdx.x; i < n; i += blockDim.x, walk.next(L, &r, &j)) {
      const long long src = (long long)(row0 + r) * S + lo + j;
      dh_buf[i] = has_grad_h_n ? tr::load(grad_h_n[src]) : A(0);
      dc_buf[i] = has_grad_c_n ? tr::load(grad_c_n[src]) : A(0);
    }
  }
  x.start();

  int done = 0;           // steps run so far (their products stored in recv, alternately)
  int before = 0;         // rows active at the last step run: their d_h is in recv
  long long edge = lltm_fused_offset(offsets, packed, steps, batch);
  for (int t = steps - 1; t >= 0; --t) {
    const long long first = lltm_fused_offset(offsets, packed, t, batch);
    const int active = min(rows, (int)(edge - first) - row0);      // the same for the tile
    edge = first;
    if (active <= 0) continue;
    const A* in = x.bwd_in(recv, slot, done);
    int r = walk.r0, j = walk.s0;
    for (int i = threadIdx.x; i < active * L; i += blockDim.x, walk.next(L, &r, &j)) {
      const int s = lo + j;
      const long long row = first + row0 + r;
      lltm_fused_saved<T> sv;
      sv.load(gates, cells, grad_out, has_grad_out, row, s, S);
      A dh = dh_buf[i];
      if (r < before) {             // the blocks' partial sums, in rank order
        dh = x.partial(in, r * LM + j);
LLTM_UNROLL
        for (int q = 1; q < P; ++q) dh += x.partial(in, q * slot + r * LM + j);
      }
      T d[3];
      lltm_fused_cell_backward<T>(sv, dh, &dc_buf[i], d_gates + row * S3 + s, S, d);
      A* dgs = dg_buf + r * 3 * L + j;      // the product's operand: the stored values
      dgs[0] = tr::load(d[0]);
      dgs[L] = tr::load(d[1]);
      dgs[2 * L] = tr::load(d[2]);
    }
    __syncthreads();        // every d_gates of the block's states written
    x.bwd_step(recv, slot, done, rank);
    r = all.r0;
    int k = all.s0;
    for (int i = threadIdx.x; i < active * S; i += blockDim.x, all.next(S, &r, &k)) {
      const A sum = lltm_fused_dot<T>(dg_buf + r * 3 * L, w_s + k, S, 3 * L);
      const int q = ((k + 1) * P - 1) / S;                       // the block owning state k
      x.put_partial(q, slot, r * LM + k - q * S / P, sum);
    }
    x.bwd_end();
    before = active;
    ++done;
  }
  const A* in = x.bwd_in(recv, slot, done);
  int r = walk.r0, j = walk.s0;
  for (int i = threadIdx.x; i < n; i += blockDim.x, walk.next(L, &r, &j)) {
    A dh = dh_buf[i];
    if (r < before) {
      dh = x.partial(in, r * LM + j);
LLTM_UNROLL
      for (int q = 1; q < P; ++q) dh += x.partial(in, q * slot + r * LM + j);
    }
    const long long dst = (long long)(row0 + r) * S + lo + j;
    d_h0[dst] = tr::store(dh);
    d_c0[dst] = tr::store(dc_buf[i]);
  }
}

// The cluster kernels exist from sm_90 on (NVRTC refuses __cluster_dims__ before, even on a
// template that is not instantiated); the group kernels below compile for every architecture.
#if defined(LLTM_HOST_SHIM) || __CUDA_ARCH__ >= 900
// Arguments as lltm_seq_fwd_kernel's (lltm_fused.cu); the grid is P blocks per tile, a cluster.
template <typename T, int P>
__global__ void LLTM_CLUSTER_DIMS(P) lltm_seq_fwd_cluster_kernel(LLTM_SEQ_FWD_PARAMS(T)) {
  lltm_cluster_exchange<typename lltm_traits<T>::acc, P> x;
  lltm_seq_fwd_split<T, P>(x, LLTM_SEQ_FWD_ARGS);
}

// Arguments as lltm_seq_bwd_kernel's (lltm_fused.cu); the grid is P blocks per tile, a cluster.
template <typename T, int P>
__global__ void LLTM_CLUSTER_DIMS(P) lltm_seq_bwd_cluster_kernel(LLTM_SEQ_BWD_PARAMS(T)) {
  lltm_cluster_exchange<typename lltm_traits<T>::acc, P> x;
  lltm_seq_bwd_split<T, P>(x, LLTM_SEQ_BWD_ARGS);
}
#endif

// The group kernels (no cluster; sm_80 and newer, launched cooperatively so that every block of
// the grid is resident): the cluster kernels' arguments, then the exchange buffer (tiles of the
// launch x 2 x tile S elements of A forward, x 2 P^2 tile LM backward, A the arithmetic type), the
// launch's tiles' counters (zero before the launch) and the index of its first tile (a batch of
// more tiles than can be resident at once runs in several launches).
template <typename T, int P>
__global__ void lltm_seq_fwd_group_kernel(LLTM_SEQ_FWD_PARAMS(T),
                                          typename lltm_traits<T>::acc* __restrict__ exchange,
                                          unsigned* __restrict__ counters, int tile0) {
  lltm_group_exchange<typename lltm_traits<T>::acc, P> x(exchange, counters, tile0,
                                                         tile * state);
  lltm_seq_fwd_split<T, P>(x, LLTM_SEQ_FWD_ARGS);
}

template <typename T, int P>
__global__ void lltm_seq_bwd_group_kernel(LLTM_SEQ_BWD_PARAMS(T),
                                          typename lltm_traits<T>::acc* __restrict__ exchange,
                                          unsigned* __restrict__ counters, int tile0) {
  lltm_group_exchange<typename lltm_traits<T>::acc, P> x(exchange, counters, tile0,
                                                         P * P * tile * ((state + P - 1) / P));
  lltm_seq_bwd_split<T, P>(x, LLTM_SEQ_BWD_ARGS);
}

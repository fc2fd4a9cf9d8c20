// C entry points that run thread-block clusters on the CPU (shim_launch_cluster of shim.h): the
// cluster variant of the fused sequence kernels (cuda_src/lltm_fused_cluster.cu), and a small
// kernel that checks the shim's cluster semantics themselves; and the group variant (the same
// kernels' bodies exchanging through global memory, shim_launch_group) with a small kernel that
// checks the group barrier alone. Built by
// tests/helpers/host_cluster.py with:
//   g++ -O2 -std=c++17 -shared -fPIC -I<cuda_src> -I<this folder> harness_cluster.cpp
#include "shim.h"
#include "lltm.cu"
#include "lltm_fused.cu"
#include "lltm_fused_cluster.cu"

// The kernels' __cluster_dims__(P) is a template argument; the entry points take it at run time.
template <typename T, int P>
static void lltm_fwd_cluster(unsigned grid, unsigned block, unsigned long long shared,
                             const T* w, long long w_stride, const T* bias, T* gates,
                             const T* h0, const T* c0, T* out, T* cells, T* h_last, T* c_last,
                             const long long* offsets, int packed, int steps, int batch,
                             int state, int tile) {
  shim_launch_cluster(grid, block, P, shared, [&] {
    lltm_seq_fwd_cluster_kernel<T, P>(w, w_stride, bias, gates, h0, c0, out, cells, h_last,
                                      c_last, offsets, packed, steps, batch, state, tile);
  });
}

template <typename T, int P>
static void lltm_bwd_cluster(unsigned grid, unsigned block, unsigned long long shared,
                             const T* w, long long w_stride, const T* gates, const T* cells,
                             const T* grad_out, const T* grad_h_n, const T* grad_c_n,
                             T* d_gates, T* d_h0, T* d_c0, const long long* offsets, int packed,
                             int has_grad_out, int has_grad_h_n, int has_grad_c_n, int steps,
                             int batch, int state, int tile) {
  shim_launch_cluster(grid, block, P, shared, [&] {
    lltm_seq_bwd_cluster_kernel<T, P>(w, w_stride, gates, cells, grad_out, grad_h_n, grad_c_n,
                                      d_gates, d_h0, d_c0, offsets, packed, has_grad_out,
                                      has_grad_h_n, has_grad_c_n, steps, batch, state, tile);
  });
}

// The group kernels (the same split without a cluster: shim_launch_group).
template <typename T, int P>
static void lltm_fwd_group(unsigned grid, unsigned block, unsigned long long shared, const T* w,
                           long long w_stride, const T* bias, T* gates, const T* h0,
                           const T* c0, T* out, T* cells, T* h_last, T* c_last,
                           const long long* offsets, int packed, int steps, int batch,
                           int state, int tile, typename lltm_traits<T>::acc* exchange,
                           unsigned* counters, int tile0) {
  shim_launch_group(grid, block, P, shared, [&] {
    lltm_seq_fwd_group_kernel<T, P>(w, w_stride, bias, gates, h0, c0, out, cells, h_last,
                                    c_last, offsets, packed, steps, batch, state, tile,
                                    exchange, counters, tile0);
  });
}

template <typename T, int P>
static void lltm_bwd_group(unsigned grid, unsigned block, unsigned long long shared, const T* w,
                           long long w_stride, const T* gates, const T* cells,
                           const T* grad_out, const T* grad_h_n, const T* grad_c_n,
                           T* d_gates, T* d_h0, T* d_c0, const long long* offsets, int packed,
                           int has_grad_out, int has_grad_h_n, int has_grad_c_n, int steps,
                           int batch, int state, int tile, typename lltm_traits<T>::acc* exchange,
                           unsigned* counters, int tile0) {
  shim_launch_group(grid, block, P, shared, [&] {
    lltm_seq_bwd_group_kernel<T, P>(w, w_stride, gates, cells, grad_out, grad_h_n, grad_c_n,
                                    d_gates, d_h0, d_c0, offsets, packed, has_grad_out,
                                    has_grad_h_n, has_grad_c_n, steps, batch, state, tile,
                                    exchange, counters, tile0);
  });
}

#define LLTM_CLUSTER_SWITCH(FN, T, ...)                                                        \
  switch (cluster) {                                                                           \
    case 1: FN<T, 1>(__VA_ARGS__); break;                                                      \
    case 2: FN<T, 2>(__VA_ARGS__); break;                                                      \
    case 4: FN<T, 4>(__VA_ARGS__); break;                                                      \
    case 8: FN<T, 8>(__VA_ARGS__); break;                                                      \
    case 16: FN<T, 16>(__VA_ARGS__); break;                                                    \
    default: shim_error = "no kernel for this cluster size";                                   \
  }

#define LLTM_CLUSTER_ENTRY_POINTS(T, SUFFIX)                                                   \
  extern "C" void lltm_seq_fwd_cluster_##SUFFIX(                                               \
      unsigned grid, unsigned block, unsigned cluster, unsigned long long shared, const T* w,  \
      long long w_stride, const T* bias, T* gates, const T* h0, const T* c0, T* out,           \
      T* cells, T* h_last, T* c_last, const long long* offsets, int packed, int steps,         \
      int batch, int state, int tile) {                                                        \
    shim_error = nullptr;                                                                      \
    LLTM_CLUSTER_SWITCH(lltm_fwd_cluster, T, grid, block, shared, w, w_stride, bias, gates,    \
                        h0, c0, out, cells, h_last, c_last, offsets, packed, steps, batch,     \
                        state, tile)                                                           \
  }                                                                                            \
  extern "C" void lltm_seq_bwd_cluster_##SUFFIX(                                               \
      unsigned grid, unsigned block, unsigned cluster, unsigned long long shared, const T* w,  \
      long long w_stride, const T* gates, const T* cells, const T* grad_out,                   \
      const T* grad_h_n, const T* grad_c_n, T* d_gates, T* d_h0, T* d_c0,                      \
      const long long* offsets, int packed, int has_grad_out, int has_grad_h_n,                \
      int has_grad_c_n, int steps, int batch, int state, int tile) {                           \
    shim_error = nullptr;                                                                      \
    LLTM_CLUSTER_SWITCH(lltm_bwd_cluster, T, grid, block, shared, w, w_stride, gates, cells,   \
                        grad_out, grad_h_n, grad_c_n, d_gates, d_h0, d_c0, offsets, packed,    \
                        has_grad_out, has_grad_h_n, has_grad_c_n, steps, batch, state, tile)   \
  }

#define LLTM_GROUP_ENTRY_POINTS(T, SUFFIX)                                                     \
  extern "C" void lltm_seq_fwd_group_##SUFFIX(                                                 \
      unsigned grid, unsigned block, unsigned cluster, unsigned long long shared, const T* w,  \
      long long w_stride, const T* bias, T* gates, const T* h0, const T* c0, T* out,           \
      T* cells, T* h_last, T* c_last, const long long* offsets, int packed, int steps,         \
      int batch, int state, int tile, lltm_traits<T>::acc* exchange, unsigned* counters,       \
      int tile0) {                                                                             \
    shim_error = nullptr;                                                                      \
    LLTM_CLUSTER_SWITCH(lltm_fwd_group, T, grid, block, shared, w, w_stride, bias, gates, h0,  \
                        c0, out, cells, h_last, c_last, offsets, packed, steps, batch, state,  \
                        tile, exchange, counters, tile0)                                       \
  }                                                                                            \
  extern "C" void lltm_seq_bwd_group_##SUFFIX(                                                 \
      unsigned grid, unsigned block, unsigned cluster, unsigned long long shared, const T* w,  \
      long long w_stride, const T* gates, const T* cells, const T* grad_out,                   \
      const T* grad_h_n, const T* grad_c_n, T* d_gates, T* d_h0, T* d_c0,                      \
      const long long* offsets, int packed, int has_grad_out, int has_grad_h_n,                \
      int has_grad_c_n, int steps, int batch, int state, int tile,                             \
      lltm_traits<T>::acc* exchange, unsigned* counters, int tile0) {                          \
    shim_error = nullptr;                                                                      \
    LLTM_CLUSTER_SWITCH(lltm_bwd_group, T, grid, block, shared, w, w_stride, gates, cells,     \
                        grad_out, grad_h_n, grad_c_n, d_gates, d_h0, d_c0, offsets, packed,    \
                        has_grad_out, has_grad_h_n, has_grad_c_n, steps, batch, state, tile,   \
                        exchange, counters, tile0)                                             \
  }

LLTM_GROUP_ENTRY_POINTS(double, f64)
LLTM_GROUP_ENTRY_POINTS(float, f32)
LLTM_GROUP_ENTRY_POINTS(lltm_half, f16)
LLTM_GROUP_ENTRY_POINTS(lltm_bf16, bf16)

LLTM_CLUSTER_ENTRY_POINTS(double, f64)
LLTM_CLUSTER_ENTRY_POINTS(float, f32)
LLTM_CLUSTER_ENTRY_POINTS(lltm_half, f16)
LLTM_CLUSTER_ENTRY_POINTS(lltm_bf16, bf16)

// The kernels' own shared-memory layout functions, for the tests to hold the launcher's
// (lltm_cupy/_cuda/fused_cluster.py) against: the forward's row stride and the weights' regions.
extern "C" int lltm_host_cluster_wt_stride(int most, int item) {
  return lltm_fused_wt_stride(most, item);
}
extern "C" long long lltm_host_cluster_w_bytes(int state, int most, int item, int backward) {
  return backward ? lltm_cluster_w_bytes(state, most, item)
                  : lltm_cluster_wt_bytes(state, most, item);
}

// Every thread of block r stores its global index into block r + 1's (cyclically) shared memory
// through lltm_cluster_map, then reads its own block's word. mode: bit 0 a cluster barrier before
// the stores, bit 1 one after them, bit 2 __syncthreads() after them (a block barrier: it does not
// order the blocks), bit 3 the odd threads return before the barrier after the stores (a
// divergent cluster barrier), bit 4 the odd threads of block 0 wait at __syncthreads() where the
// others wait at the cluster barrier (a deadlock), bit 5 each thread stores one word past the
// cluster's shared memory instead, bit 6 the odd threads wait at another cluster barrier call
// than the even ones after the stores (all of the cluster at one, but a warp's lanes at two).
static void shim_selftest_exchange(int* out, int mode) {
  int* buf = (int*)lltm_dynamic_smem;
  const unsigned r = lltm_cluster_rank(), size = lltm_cluster_size(), t = threadIdx.x;
  if (mode & 1) lltm_cluster_sync();
  lltm_dsmem peer = lltm_cluster_map(buf + t, (r + 1) % size);
  if (mode & 32) peer = lltm_cluster_map(buf, size - 1) + shim_shared_bytes;
  lltm_cluster_store(peer, (int)(blockIdx.x * blockDim.x + t));
  if ((mode & 8) && (t & 1)) return;
  if ((mode & 16) && r == 0 && (t & 1)) {
    __syncthreads();
  } else if ((mode & 64) && (t & 1)) {
    lltm_cluster_sync();
  } else if (mode & 2) {
    lltm_cluster_sync();
  }
  if (mode & 4) __syncthreads();
  out[blockIdx.x * blockDim.x + t] = buf[t];
}

extern "C" void lltm_host_cluster_selftest(unsigned grid, unsigned block, unsigned cluster,
                                           int* out, int mode) {
  shim_launch_cluster(grid, block, cluster, block * sizeof(int),
                      [&] { shim_selftest_exchange(out, mode); });
}

static unsigned shim_group_selftest_size = 1;

// The group barrier alone (lltm_group_sync of cuda_src/lltm_fused_cluster.cu) on a small
// kernel: groups of `size` blocks, `rounds` rounds; in round k every thread stores
// k * 1000000 + its global index into its block's slot of the group's exchange buffer k mod 2
// (exchange: (grid / size groups, 2, size, block) words, lltm_group_store), meets the group's
// barrier (counters[group], target (k + 1) size), then reads the same thread's word of the
// previous block of the group (cyclically, lltm_group_load) into out[k, global index]. mode:
// bit 0 no barrier; bit 1 one counter for the whole grid, waiting for every block of the grid
// (a tile waiting for other tiles' blocks).
static void shim_selftest_group(int* exchange, unsigned* counters, int* out, int rounds,
                                int mode) {
  const unsigned size = shim_group_selftest_size, t = threadIdx.x, block = blockDim.x;
  const unsigned group = blockIdx.x / size, rank = blockIdx.x % size;
  const unsigned pred = (rank + size - 1) % size;
  const unsigned id = blockIdx.x * block + t;
  int* mine = exchange + (long long)group * 2 * size * block;
  for (int k = 0; k < rounds; ++k) {
    int* buf = mine + (k & 1) * size * block;
    lltm_group_store(buf + rank * block + t, k * 1000000 + (int)id);
    if (mode & 2) {
      lltm_group_sync(counters, (unsigned)(k + 1) * gridDim.x);
    } else if (!(mode & 1)) {
      lltm_group_sync(counters + group, (unsigned)(k + 1) * size);
    }
    out[(long long)k * gridDim.x * block + id] = lltm_group_load(buf + pred * block + t);
  }
}

extern "C" void lltm_host_group_selftest(unsigned grid, unsigned block, unsigned size,
                                         int* exchange, unsigned* counters, int* out, int rounds,
                                         int mode) {
  shim_group_selftest_size = size;
  shim_launch_group(grid, block, size, 0,
                    [&] { shim_selftest_group(exchange, counters, out, rounds, mode); });
}

// A group launch whose kernel calls a cluster primitive (refused: a group has no cluster).
extern "C" void lltm_host_group_mixed(unsigned grid, unsigned size) {
  shim_launch_group(grid, 2, size, 0, [&] { lltm_cluster_sync(); });
}

// What the last group launch did: fences run, turns of a waiting loop that found its counter
// short.
extern "C" long long lltm_host_group_fences(void) { return shim_group_fences; }
extern "C" long long lltm_host_group_spins(void) { return shim_group_spins; }

// The shim's scheduling order (0 ascending, 1 descending, 2 random with the seed), the error of
// the last launch (NULL if none) and the block and cluster barriers it passed.
extern "C" void lltm_host_set_schedule(int order, unsigned long long seed) {
  shim_schedule = order;
  shim_seed = seed;
}
extern "C" const char* lltm_host_last_error(void) { return shim_error; }
extern "C" long long lltm_host_barriers(void) { return shim_barriers; }
extern "C" long long lltm_host_cluster_barriers(void) { return shim_cluster_barriers; }


// C entry points that run thread-block clusters on the CPU (shim_launch_cluster of shim.h): a
// small kernel that checks the shim's cluster semantics themselves. Built by
// tests/helpers/host_cluster.py with:
//   g++ -O2 -std=c++17 -shared -fPIC -I<cuda_src> -I<this folder> harness_cluster.cpp
#include "shim.h"

// Every thread of block r stores its global index into block r + 1's (cyclically) shared memory
// through lltm_cluster_map, then reads its own block's word. mode: bit 0 a cluster barrier before
// the stores, bit 1 one after them, bit 2 __syncthreads() after them (a block barrier: it does not
// order the blocks), bit 3 the odd threads return before the barrier after the stores (a
// divergent cluster barrier), bit 4 the odd threads of block 0 wait at __syncthreads() where the
// others wait at the cluster barrier (a deadlock), bit 5 each thread stores one word past the
// cluster's shared memory instead.
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

// The shim's scheduling order (0 ascending, 1 descending, 2 random with the seed), the error of
// the last launch (NULL if none) and the block and cluster barriers it passed.
extern "C" void lltm_host_set_schedule(int order, unsigned long long seed) {
  shim_schedule = order;
  shim_seed = seed;
}
extern "C" const char* lltm_host_last_error(void) { return shim_error; }
extern "C" long long lltm_host_barriers(void) { return shim_barriers; }
extern "C" long long lltm_host_cluster_barriers(void) { return shim_cluster_barriers; }

// Just enough of CUDA for cuda_src/lltm.cu and cuda_src/lltm_fused.cu to compile as host C++
// and run on the CPU.
//
// shim_launch: runs every (block, thread) pair of the grid one after another; the element-wise
// kernels have no shared memory, barriers or atomics, so that is a faithful execution.
//
// shim_launch_block: real block semantics for kernels whose threads cooperate (the fused
// sequence kernels). Blocks run one after another; inside a block every thread is its own
// execution context (a ucontext with its own stack, so each thread has its own locals), and
//   - __syncthreads() is a barrier: a thread that reaches it stops, and the block's threads
//     resume only when every one of them has reached it. Between two barriers the threads run one
//     at a time, each until its next barrier, in an order set by shim_schedule: ascending thread
//     index, descending, or a pseudo-random permutation drawn afresh at every barrier. A kernel
//     without data races gives bit-identical results in every order; a missing barrier makes a
//     thread read shared memory that another has not written yet (or has already overwritten),
//     deterministically for a given order.
//   - a barrier that some threads reach while others have already returned (a __syncthreads()
//     under a condition that differs between threads: undefined behaviour on a GPU) stops the
//     launch with an error (shim_error).
//   - dynamic shared memory (extern __shared__ lltm_dynamic_smem[] in the kernel) is a fresh
//     buffer per block of the launch's byte size, filled with 0xFF bytes (a NaN in every
//     floating type) so that a read of a word no thread has written shows up in the results.
//
// shim_launch_cluster: thread-block clusters (a kernel's __cluster_dims__) with real cluster
// semantics. Clusters run one after another; inside a cluster every thread of every block is its
// own context, and the scheduler runs one thread at a time, each until it reaches a barrier or
// returns, picking the next by shim_schedule: the lowest-numbered runnable thread (ascending;
// threads numbered rank * blockDim + threadIdx), the highest (descending), or a random one. A
// block's barrier releases its threads as soon as all of them reach it, so with the ascending
// order block 0 runs as far as its barriers let it before block 1 starts: a missing cluster
// barrier shows. Besides __syncthreads() (the thread's block), the kernel's cluster primitives
// (cuda_src/lltm_fused_cluster.cu gives their GPU bodies, inline PTX):
//   - lltm_cluster_sync(): barrier.cluster.arrive.aligned + wait.aligned, all threads of all
//     blocks of the cluster; reached by some threads while others have returned: an error, as
//     for blocks; threads waiting at different barriers with none runnable: an error (a
//     deadlock); the lanes of one warp (threads 32w .. 32w + 31 of a block) at different
//     lltm_cluster_sync() calls of the source, though every thread of the cluster is at one:
//     an error (.aligned: every thread of a warp executes the same barrier instruction);
//   - lltm_cluster_rank() / lltm_cluster_size(): %cluster_ctarank / %cluster_nctarank;
//   - lltm_cluster_map(p, rank): mapa.shared::cluster, the address of the same offset as p (in
//     this block's dynamic shared memory) in block `rank`'s; lltm_cluster_store(address + bytes,
//     value): st.shared::cluster. A store outside the cluster's shared memory, or into a block
//     that has not started (a thread of it has not run yet: on a GPU a block must not be written
//     before a cluster barrier shows it running) or has finished (all its threads returned), stops
//     the launch with an error.
//
// shim_launch_group: the split of the cluster kernels without clusters (a cooperative launch;
// the P blocks of a tile exchange through global memory and meet at a barrier on a counter in
// global memory, lltm_group_sync of cuda_src/lltm_fused_cluster.cu). Groups of P consecutive
// blocks run one after another, each as a cluster does above (every thread a context, the same
// schedules, __syncthreads() per block); the cluster primitives are refused. The group primitives:
//   - lltm_group_store / lltm_group_load (st.cg / ld.cg): the exchange, through a weak memory
//     model (see "Group semantics" below): a block's stores are seen by the other blocks only
//     after a fence of the storing block, and by a block only if published before its own
//     latest fence; a word never published reads as the memory held it before the launch;
//   - lltm_group_fence (fence.acq_rel.gpu): publishes the block's pending stores and acquires
//     everything published so far;
//   - lltm_group_arrive / lltm_group_poll: the counter's atomic addition and load, on the memory
//     at once;
//   - lltm_group_spin: the waiting loop's body; the thread yields and runs again only after some
//     other thread of the group has stopped elsewhere (a barrier, a return); when only waiting
//     loops are left with nothing changed since they last looked, the launch stops with a
//     deadlock error (a barrier missing its arrival, or waiting for another tile's blocks).
//
// Warp-level matrix products (cuda_src/lltm_fused_mma.cu gives their GPU bodies, inline PTX):
// lltm_mma_16816_f16 / lltm_mma_16816_bf16 are mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.
// {f16,bf16}.f32, a collective of the 32 lanes of a warp (threads 32w .. 32w + 31 of a block),
// under shim_launch_block. A lane that calls one waits there; when the warp's last lane arrives,
// the product is computed from every lane's fragments (shim_mma_execute) and the warp's lanes go
// on at once, in the schedule's order, until each stops at something else: a warp runs ahead of
// the block's other warps between two block barriers, as it may on a GPU, so that a block barrier
// the kernel lacks shows up. A warp whose lanes do not all reach the collective (some wait at a
// block barrier or have returned), a block whose size is not a whole number of warps, or lanes
// of one warp at products of different types stop the launch with an error. No other warp
// intrinsic is emulated; a kernel that uses one fails to build.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

using std::max;
using std::min;

#define LLTM_HOST_SHIM 1
#define __global__
#define __device__
#define __forceinline__ inline

struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};
static dim3 threadIdx, blockIdx, blockDim, gridDim;

// IEEE binary16 <-> float with round-to-nearest-even, as cvt.rn.f16.f32 does.
static inline float lltm_host_half_bits_to_float(unsigned short bits) {
  _Float16 h;
  memcpy(&h, &bits, sizeof h);
  return (float)h;
}
static inline unsigned short lltm_host_float_to_half_bits(float f) {
  _Float16 h = (_Float16)f;
  unsigned short bits;
  memcpy(&bits, &h, sizeof bits);
  return bits;
}

template <typename Kernel>
static void shim_launch(unsigned int grid, unsigned int block, Kernel run) {
  gridDim.x = grid;
  blockDim.x = block;
  for (unsigned int b = 0; b < grid; ++b) {
    blockIdx.x = b;
    for (unsigned int t = 0; t < block; ++t) {
      threadIdx.x = t;
      run();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Block semantics (see the top of this file).

//: Order in which the threads of a block run between two barriers: 0 ascending thread index,
//: 1 descending, 2 a pseudo-random permutation (seeded by shim_seed) drawn at every barrier.
static int shim_schedule = 0;
static unsigned long long shim_seed = 1;
//: Set when a launch goes wrong (the message), cleared at the start of every launch.
static const char* shim_error = nullptr;
//: The mutation tests' switch (tests/helpers/mutants.py): in a build of sources whose statements
//: under test each read `{ if (lltm_host_mutant != K) statement; }`, statement K runs as if
//: deleted from the source; -1 (as loaded): none. The sources as they are never read it.
extern "C" {
int lltm_host_mutant = -1;
}
//: Barriers passed in the last launch, over all blocks (one per __syncthreads() round).
static long long shim_barriers = 0;
//: The block's dynamic shared memory (the kernel's extern __shared__ array) and its size.
static unsigned char* lltm_dynamic_smem = nullptr;
static size_t shim_shared_bytes = 0;

// A kernel's check that the launch gave it the shared memory it lays out (LLTM_SHARED_FITS in
// cuda_src/lltm_fused.cu; on a device a smaller launch would read and write past the block's
// allocation unnoticed): false, with the launch's error set, when it did not.
static inline bool shim_shared_fits(long long bytes) {
  if (bytes <= (long long)shim_shared_bytes) return true;
  shim_error = "the kernel lays out more dynamic shared memory than the launch gave it";
  return false;
}

// One lane's operands of a warp-level product (the addresses of its registers).
struct shim_mma_call {
  int bf16;                  // 1: bfloat16 operands, 0: float16
  float* d;
  const unsigned* a;
  const unsigned* b;
  const float* c;
};

struct shim_block {
  ucontext_t scheduler;
  std::vector<ucontext_t> threads;
  std::vector<int> state;    // 0 runnable, 1 waiting at a barrier, 2 returned, 4 at a warp product
  std::vector<shim_mma_call> mma;   // per thread, while it waits at a warp product
  unsigned int current = 0;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
};
static shim_block* shim_active = nullptr;

static inline void shim_cluster_syncthreads();
static inline bool shim_in_cluster();

static inline void __syncthreads() {
  if (shim_in_cluster()) {               // shim_launch_cluster: the barrier of the thread's block
    shim_cluster_syncthreads();
    return;
  }
  if (shim_active == nullptr) {          // an element-wise launch has no barrier semantics
    shim_error = "__syncthreads() outside shim_launch_block";
    return;
  }
  shim_active->state[shim_active->current] = 1;
  swapcontext(&shim_active->threads[shim_active->current], &shim_active->scheduler);
}

// A lane's call of a warp-level product (see the top of this file): it waits until the whole
// warp is there; its d is written when the product runs.
static inline void shim_mma_16816(int bf16, float d[4], const unsigned a[4], const unsigned b[2],
                                  const float c[4]) {
  if (shim_active == nullptr || shim_in_cluster()) {
    shim_error = "a warp-level product outside shim_launch_block";
    return;
  }
  shim_active->mma[shim_active->current] = shim_mma_call{bf16, d, a, b, c};
  shim_active->state[shim_active->current] = 4;
  swapcontext(&shim_active->threads[shim_active->current], &shim_active->scheduler);
}
static inline void lltm_mma_16816_f16(float d[4], const unsigned a[4], const unsigned b[2],
                                      const float c[4]) {
  shim_mma_16816(0, d, a, b, c);
}
static inline void lltm_mma_16816_bf16(float d[4], const unsigned a[4], const unsigned b[2],
                                       const float c[4]) {
  shim_mma_16816(1, d, a, b, c);
}

static void shim_thread_main() {
  shim_active->body(shim_active->arg);
  shim_active->state[shim_active->current] = 2;
  // returning resumes uc_link, the scheduler
}

static inline unsigned long long shim_next_random() {   // splitmix64
  unsigned long long z = (shim_seed += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline void shim_run_thread(shim_block& state, unsigned int t) {
  state.current = t;
  threadIdx.x = t;
  swapcontext(&state.scheduler, &state.threads[t]);
}

// IEEE binary16 or bfloat16 bits as a float (exact).
static inline float shim_mma_value(unsigned bits, int bf16) {
  if (bf16) {
    const unsigned u = bits << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
  }
  return lltm_host_half_bits_to_float((unsigned short)bits);
}

// The product of warp lo .. lo + 31, D = A B + C (A 16 x 16, B 16 x 8, C and D 16 x 8), from the
// lanes' fragments as the PTX ISA lays them out for mma.m16n8k16 with .f16 / .bf16 operands
// ("Matrix Fragments for mma.m16n8k16 with floating point type"):
//   groupID = %laneid >> 2, threadID_in_group = %laneid % 4;
//   A: four .b32 registers holding a0 .. a7 (low half first: register r holds a_2r, a_2r+1),
//      row = groupID for a_i with 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
//      col = threadID_in_group * 2 + (i & 1) for i < 4, + 8 for i >= 4;
//   B: two .b32 registers holding b0 .. b3,
//      row = threadID_in_group * 2 + (i & 1) for i < 2, + 8 for i >= 2; col = groupID;
//   C, D: four .f32 registers c0 .. c3,
//      row = groupID for i < 2, groupID + 8 for i >= 2; col = threadID_in_group * 2 + (i & 1).
// Arithmetic in float32: each product of two 16-bit values is exact in float32 (11 x 11 or 8 x 8
// significand bits; a bfloat16 product can underflow or overflow float32, float16 ones cannot),
// the 16 products of an element are added in a pairwise tree over k ((p0 + p1) + (p2 + p3)) + ...,
// then C's element is added: D = C + sum, each addition rounded to nearest. The PTX ISA leaves
// the order and the intermediate rounding of a product's sum to the hardware, so a GPU's bits may
// differ from these in the last places.
static void shim_mma_execute(shim_block& state, unsigned lo) {
  float A[16][16], B[16][8], C[16][8];
  const int bf16 = state.mma[lo].bf16;
  for (unsigned lane = 0; lane < 32; ++lane) {
    const shim_mma_call& m = state.mma[lo + lane];
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 8; ++i) {
      const unsigned row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
      const unsigned col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = shim_mma_value((m.a[i / 2] >> (16 * (i & 1))) & 0xFFFF, bf16);
    }
    for (unsigned i = 0; i < 4; ++i) {
      const unsigned row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][g] = shim_mma_value((m.b[i / 2] >> (16 * (i & 1))) & 0xFFFF, bf16);
    }
    for (unsigned i = 0; i < 4; ++i) C[i < 2 ? g : g + 8][t * 2 + (i & 1)] = m.c[i];
  }
  float D[16][8];
  for (unsigned row = 0; row < 16; ++row) {
    for (unsigned col = 0; col < 8; ++col) {
      float p[16];
      for (unsigned k = 0; k < 16; ++k) p[k] = A[row][k] * B[k][col];
      for (unsigned width = 1; width < 16; width *= 2) {
        for (unsigned k = 0; k < 16; k += 2 * width) p[k] = p[k] + p[k + width];
      }
      D[row][col] = C[row][col] + p[0];
    }
  }
  for (unsigned lane = 0; lane < 32; ++lane) {   // every lane's C was read before any D is written
    const unsigned g = lane >> 2, t = lane & 3;
    for (unsigned i = 0; i < 4; ++i) state.mma[lo + lane].d[i] = D[i < 2 ? g : g + 8][t * 2 + (i & 1)];
  }
}

// Thread t has just stopped: while every lane of its warp waits at a warp product, computes it
// and runs the warp's lanes on (in the schedule's order) until each stops again.
static void shim_warp_advance(shim_block& state, unsigned int block, unsigned int t) {
  const unsigned lo = t & ~31u, hi = std::min(lo + 32, block);
  for (;;) {
    for (unsigned u = lo; u < hi; ++u) {
      if (state.state[u] != 4) return;
    }
    if (hi - lo != 32) {
      shim_error = "a warp-level product in a block that is not a whole number of warps";
      return;
    }
    for (unsigned u = lo; u < hi; ++u) {
      if (state.mma[u].bf16 != state.mma[lo].bf16) {
        shim_error = "the lanes of a warp at warp-level products of different types";
        return;
      }
    }
    shim_mma_execute(state, lo);
    unsigned order[32];
    for (unsigned k = 0; k < 32; ++k) order[k] = shim_schedule == 1 ? 31 - k : k;
    if (shim_schedule == 2) {
      for (unsigned k = 32; k > 1; --k) std::swap(order[k - 1], order[shim_next_random() % k]);
    }
    for (unsigned u = lo; u < hi; ++u) state.state[u] = 0;
    for (unsigned k : order) {
      if (state.state[lo + k] == 0) shim_run_thread(state, lo + k);
      if (shim_error != nullptr) return;
    }
  }
}

// Runs the threads of one block (their contexts made) to their end; false on divergence (with
// shim_error set where a warp product is the cause).
static __attribute__((noinline)) bool shim_run_block(shim_block& state, unsigned int block) {
  std::vector<unsigned int> order(block);
  for (;;) {
    for (unsigned int t = 0; t < block; ++t) order[t] = shim_schedule == 1 ? block - 1 - t : t;
    if (shim_schedule == 2) {
      for (unsigned int t = block; t > 1; --t) std::swap(order[t - 1], order[shim_next_random() % t]);
    }
    for (unsigned int t : order) {
      if (state.state[t] != 0) continue;
      shim_run_thread(state, t);
      if (state.state[t] == 4) shim_warp_advance(state, block, t);
      if (shim_error != nullptr) return false;
    }
    for (int st : state.state) {
      if (st == 4) {
        shim_error = "a warp-level product that some lanes of the warp never reach (they wait "
                     "at a block barrier or have returned)";
        return false;
      }
    }
    unsigned int returned = 0;
    for (int st : state.state) returned += st == 2;
    if (returned == block) return true;
    if (returned) return false;
    ++shim_barriers;
    for (int& st : state.state) st = 0;
  }
}

// One context per thread of a block, each starting at the kernel with its own stack.
static __attribute__((noinline)) void shim_make_threads(shim_block& state, unsigned int block,
                                                        char* stacks, size_t stack_bytes) {
  state.threads.assign(block, ucontext_t());
  state.state.assign(block, 0);
  for (unsigned int t = 0; t < block; ++t) {
    ucontext_t& c = state.threads[t];
    getcontext(&c);
    c.uc_stack.ss_sp = stacks + t * stack_bytes;
    c.uc_stack.ss_size = stack_bytes;
    c.uc_link = &state.scheduler;
    makecontext(&c, shim_thread_main, 0);
  }
}

template <typename Kernel>
static void shim_launch_block(unsigned int grid, unsigned int block, size_t shared_bytes,
                              Kernel run) {
  const size_t stack_bytes = 64 * 1024;   // the kernels' locals are a few hundred bytes
  shim_error = nullptr;
  shim_barriers = 0;
  gridDim.x = grid;
  blockDim.x = block;
  std::vector<unsigned char> shared(shared_bytes + 16);
  shim_shared_bytes = shared_bytes;
  std::unique_ptr<char[]> stacks(new char[stack_bytes * block]);   // left uninitialised
  shim_block state;
  state.body = [](void* p) { (*(Kernel*)p)(); };
  state.arg = &run;
  for (unsigned int b = 0; b < grid && shim_error == nullptr; ++b) {
    blockIdx.x = b;
    memset(shared.data(), 0xFF, shared.size());
    lltm_dynamic_smem = shared.data();
    shim_make_threads(state, block, stacks.get(), stack_bytes);
    state.mma.assign(block, shim_mma_call());
    shim_active = &state;
    if (!shim_run_block(state, block) && shim_error == nullptr) {
      shim_error = "divergent __syncthreads(): some threads of a block wait at a barrier "
                   "that others, already returned, never reach";
    }
    shim_active = nullptr;
  }
  lltm_dynamic_smem = nullptr;
}

// ---------------------------------------------------------------------------------------------
// Cluster semantics (see the top of this file).

//: Cluster barriers passed in the last cluster launch (one per lltm_cluster_sync() round).
static long long shim_cluster_barriers = 0;

// A shared::cluster address: in the shim a plain pointer (byte arithmetic as on the GPU's u32).
typedef unsigned char* lltm_dsmem;

struct shim_cluster {
  ucontext_t scheduler;
  std::vector<ucontext_t> threads;       // rank * block + threadIdx
  std::vector<int> state;                // 0 runnable, 1 at __syncthreads, 2 returned, 3 at
                                         // cluster barrier, 5 in a waiting loop (groups)
  std::vector<char> started;             // the thread has run
  std::vector<const char*> site;         // the lltm_cluster_sync() call it waits at (file:line)
  std::vector<unsigned char*> smem;      // each block's dynamic shared memory
  std::vector<unsigned> runnable;        // random order: the runnable threads
  unsigned current = 0, block = 0, size = 0, first = 0;
  bool group = false;                    // shim_launch_group: no cluster primitive, global memory
  bool progress = false;                 // a thread stopped other than at a spin since the last
                                         // release of the spinning threads
  size_t shared_bytes = 0;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
};
static shim_cluster* shim_cluster_active = nullptr;

static inline bool shim_in_cluster() { return shim_cluster_active != nullptr; }

// Whether the calling thread runs a cluster launch (its cluster primitives are usable); an error
// if not (a group launch has none).
static inline bool shim_cluster_primitive(const char* name) {
  if (shim_cluster_active != nullptr && !shim_cluster_active->group) return true;
  if (shim_error == nullptr) shim_error = name;
  return false;
}

static inline void shim_cluster_wait(int why) {
  shim_cluster* c = shim_cluster_active;
  c->state[c->current] = why;
  swapcontext(&c->threads[c->current], &c->scheduler);
}

static inline void shim_cluster_syncthreads() { shim_cluster_wait(1); }

// lltm_cluster_sync() as a macro: each call names its place in the source, so that the release
// can check that a warp's lanes are at the same one.
#define SHIM_STRING2(x) #x
#define SHIM_STRING(x) SHIM_STRING2(x)
#define lltm_cluster_sync() shim_cluster_sync(__FILE__ ":" SHIM_STRING(__LINE__))
static inline void shim_cluster_sync(const char* site) {
  if (!shim_cluster_primitive("lltm_cluster_sync() outside shim_launch_cluster")) return;
  shim_cluster_active->site[shim_cluster_active->current] = site;
  shim_cluster_wait(3);
}

// nullptr if the lanes of every warp of the cluster wait at the same lltm_cluster_sync() call,
// else the error.
static inline const char* shim_cluster_aligned(const shim_cluster& c) {
  for (unsigned t = 0; t < c.size * c.block; ++t) {
    const unsigned lane0 = t - t % c.block + (t % c.block) / 32 * 32;
    if (strcmp(c.site[t], c.site[lane0]) != 0) {
      return "lanes of one warp at different cluster barriers (barrier.cluster .aligned: every "
             "thread of a warp must execute the same barrier instruction)";
    }
  }
  return nullptr;
}

static inline unsigned lltm_cluster_rank() {
  if (!shim_cluster_primitive("lltm_cluster_rank() outside shim_launch_cluster")) return 0;
  return shim_cluster_active->current / shim_cluster_active->block;
}
static inline unsigned lltm_cluster_size() {
  if (!shim_cluster_primitive("lltm_cluster_size() outside shim_launch_cluster")) return 1;
  return shim_cluster_active->size;
}

static unsigned char shim_cluster_scratch[64];   // where a refused store goes

static inline lltm_dsmem lltm_cluster_map(const void* p, unsigned rank) {
  shim_cluster* c = shim_cluster_active;
  const unsigned char* own = lltm_dynamic_smem;
  const unsigned char* q = (const unsigned char*)p;
  if (c == nullptr || c->group || rank >= c->size || q < own || q >= own + c->shared_bytes) {
    shim_error = "lltm_cluster_map(): not an address of the block's dynamic shared memory, or "
                 "a rank outside the cluster";
    return shim_cluster_scratch;
  }
  return c->smem[rank] + (q - own);
}

// The rank whose shared memory holds [a, a + n), after the checks of the top of this file; -1
// (with the launch's error set) if none may be written.
static inline int shim_cluster_target(lltm_dsmem a, size_t n) {
  shim_cluster* c = shim_cluster_active;
  if (c == nullptr || c->group) {
    shim_error = "a distributed shared memory store outside shim_launch_cluster";
    return -1;
  }
  for (unsigned r = 0; r < c->size; ++r) {
    if (a >= c->smem[r] && a + n <= c->smem[r] + c->shared_bytes) {
      if (r == c->current / c->block) return (int)r;      // the thread's own block
      bool started = true, finished = true;
      for (unsigned t = r * c->block; t < (r + 1) * c->block; ++t) {
        started = started && c->started[t];
        finished = finished && c->state[t] == 2;
      }
      if (!started) {
        shim_error = "a distributed shared memory store into a block of the cluster that has "
                     "not started (no cluster barrier before it)";
        return -1;
      }
      if (finished) {
        shim_error = "a distributed shared memory store into a block of the cluster that has "
                     "finished";
        return -1;
      }
      return (int)r;
    }
  }
  shim_error = "a distributed shared memory store outside the cluster's shared memory";
  return -1;
}

template <typename V>
static inline void lltm_cluster_store(lltm_dsmem a, V value) {
  if (shim_cluster_target(a, sizeof(V)) >= 0) memcpy(a, &value, sizeof(V));
}

// ---------------------------------------------------------------------------------------------
// Group semantics: the blocks of a tile exchanging through global memory (see the top of this
// file). The exchange's stores and loads (lltm_group_store / lltm_group_load, st.cg / ld.cg on a
// GPU) go through a model of a weak memory: a block's stores are pending, seen by its own threads
// only, until a thread of the block runs lltm_group_fence() (which publishes them, each a new
// epoch of the launch's global memory); a block's loads see a pending store of its own, else the
// latest published value no newer than the epoch the block held at its last fence (what it
// acquired), else what the memory held before the launch. So a barrier without its release (the
// fence before the arrival) leaves the peers reading the old words, and one without its acquire
// (the fence after the poll) reads the words of before the peers' stores. The counter's atomics
// (lltm_group_arrive / lltm_group_poll) act on the memory at once, as atomics in L2 do.

struct shim_group_store {
  unsigned char* at;
  size_t bytes;
  unsigned char value[8];
};

struct shim_group_version {
  long long epoch;
  unsigned char value[8];
};

struct shim_group_memory {
  std::vector<std::vector<shim_group_store>> pending;       // per block of the group
  std::vector<long long> view;                               // per block: the epoch it acquired
  std::map<unsigned char*, std::vector<shim_group_version>> history;   // epoch 0: the original
  long long epoch = 0;
  long long fences = 0, spins = 0;
};
static shim_group_memory shim_group;
//: Fences run and spins (one per turn of a waiting loop that found the counter short) in the last
//: group launch.
static long long shim_group_fences = 0, shim_group_spins = 0;

static inline int shim_group_block(const char* what) {
  shim_cluster* c = shim_cluster_active;
  if (c == nullptr || !c->group) {
    if (shim_error == nullptr) shim_error = what;
    return -1;
  }
  return (int)(c->current / c->block);
}

// Publishes block b's pending stores in their order.
static inline void shim_group_publish(int b) {
  for (const shim_group_store& st : shim_group.pending[b]) {
    auto& versions = shim_group.history[st.at];
    if (versions.empty()) {
      shim_group_version original{0, {}};
      memcpy(original.value, st.at, st.bytes);
      versions.push_back(original);
    }
    shim_group_version v{++shim_group.epoch, {}};
    memcpy(v.value, st.value, st.bytes);
    versions.push_back(v);
    memcpy(st.at, st.value, st.bytes);
  }
  shim_group.pending[b].clear();
}

static inline void lltm_group_fence() {
  const int b = shim_group_block("lltm_group_fence() outside shim_launch_group");
  if (b < 0) return;
  ++shim_group_fences;
  shim_group_publish(b);
  shim_group.view[b] = shim_group.epoch;
}

static inline void lltm_group_arrive(unsigned* counter) {
  if (shim_group_block("lltm_group_arrive() outside shim_launch_group") >= 0) *counter += 1;
}

static inline unsigned lltm_group_poll(const unsigned* counter) {
  if (shim_group_block("lltm_group_poll() outside shim_launch_group") < 0) return ~0u / 2;
  return *counter;
}

// The waiting loop's turn: the thread yields, and runs again only after a thread of the group
// has stopped elsewhere (shim_run_cluster; none: a deadlock).
static inline void lltm_group_spin() {
  if (shim_group_block("lltm_group_spin() outside shim_launch_group") < 0) return;
  ++shim_group_spins;
  shim_cluster_wait(5);
}

template <typename V>
static inline void lltm_group_store(V* p, V value) {
  static_assert(sizeof(V) <= 8, "a word of at most 8 bytes");
  const int b = shim_group_block("lltm_group_store() outside shim_launch_group");
  if (b < 0) return;
  shim_group_store st{(unsigned char*)p, sizeof(V), {}};
  memcpy(st.value, &value, sizeof(V));
  shim_group.pending[b].push_back(st);
}

template <typename V>
static inline V lltm_group_load(const V* p) {
  V value;
  memcpy(&value, p, sizeof(V));
  const int b = shim_group_block("lltm_group_load() outside shim_launch_group");
  if (b < 0) return value;
  unsigned char* at = (unsigned char*)p;
  const auto& own = shim_group.pending[b];
  for (auto it = own.rbegin(); it != own.rend(); ++it) {
    if (it->at == at) {
      memcpy(&value, it->value, sizeof(V));
      return value;
    }
  }
  const auto found = shim_group.history.find(at);
  if (found == shim_group.history.end()) return value;      // never published: the memory's
  const auto& versions = found->second;
  for (auto it = versions.rbegin(); it != versions.rend(); ++it) {
    if (it->epoch <= shim_group.view[b]) {
      memcpy(&value, it->value, sizeof(V));
      return value;
    }
  }
  return value;
}

static void shim_cluster_thread_main() {
  shim_cluster_active->body(shim_cluster_active->arg);
  shim_cluster_active->state[shim_cluster_active->current] = 2;
}

// Marks the threads [lo, hi) runnable.
static inline void shim_cluster_release(shim_cluster& c, unsigned lo, unsigned hi) {
  for (unsigned t = lo; t < hi; ++t) {
    c.state[t] = 0;
    if (shim_schedule == 2) c.runnable.push_back(t);
  }
}

// Runs the threads of one cluster (their contexts made) to their end; the error message, or
// nullptr.
static __attribute__((noinline)) const char* shim_run_cluster(shim_cluster& c) {
  const unsigned n = c.size * c.block;
  unsigned cursor = shim_schedule == 1 ? n - 1 : 0;   // no runnable thread beyond it (in order)
  c.runnable.clear();
  if (shim_schedule == 2) {
    for (unsigned t = 0; t < n; ++t) c.runnable.push_back(t);
  }
  for (;;) {
    // the next thread to run, by the schedule
    long long pick = -1;
    if (shim_schedule == 2) {
      if (!c.runnable.empty()) {
        const size_t at = shim_next_random() % c.runnable.size();
        pick = c.runnable[at];
        c.runnable[at] = c.runnable.back();
        c.runnable.pop_back();
      }
    } else if (shim_schedule == 1) {
      for (long long t = cursor; t >= 0; --t) {
        if (c.state[t] == 0) { pick = t; break; }
      }
    } else {
      for (unsigned t = cursor; t < n; ++t) {
        if (c.state[t] == 0) { pick = t; break; }
      }
    }
    if (pick < 0) {
      unsigned returned = 0, at_block = 0, at_cluster = 0, spinning = 0;
      for (int st : c.state) {
        returned += st == 2;
        at_block += st == 1;
        at_cluster += st == 3;
        spinning += st == 5;
      }
      if (returned == n) return nullptr;
      if (spinning && c.progress) {   // the waiting loops look again
        c.progress = false;
        for (unsigned t = 0; t < n; ++t) {
          if (c.state[t] == 5) shim_cluster_release(c, t, t + 1);
        }
        cursor = shim_schedule == 1 ? n - 1 : 0;
        continue;
      }
      if (spinning) {
        return "deadlock: a waiting loop on a counter in global memory that no thread of the "
               "group advances (every other thread waits or has returned)";
      }
      if (at_cluster && returned) {
        return "divergent cluster barrier: some threads of a cluster wait at a cluster barrier "
               "that others, already returned, never reach";
      }
      if (at_block && returned) {
        return "divergent __syncthreads(): some threads of a block wait at a barrier that "
               "others, already returned, never reach";
      }
      return "deadlock: the threads of a cluster wait at different barriers";
    }
    const unsigned t = (unsigned)pick;
    if (shim_schedule != 2) cursor = t;
    c.current = t;
    c.started[t] = 1;
    threadIdx.x = t % c.block;
    blockIdx.x = c.first + t / c.block;
    lltm_dynamic_smem = c.smem[t / c.block];
    swapcontext(&c.scheduler, &c.threads[t]);
    if (shim_error != nullptr) return shim_error;
    if (c.state[t] != 5) c.progress = true;
    if (c.state[t] == 1) {           // its block's barrier: released when all its threads are there
      const unsigned lo = t - t % c.block, hi = lo + c.block;
      bool all = true;
      for (unsigned u = lo; u < hi && all; ++u) all = c.state[u] == 1;
      if (all) {
        ++shim_barriers;
        shim_cluster_release(c, lo, hi);
        cursor = shim_schedule == 1 ? std::max(cursor, hi - 1) : std::min(cursor, lo);
      }
    } else if (c.state[t] == 3) {    // the cluster's barrier
      bool all = true;
      for (unsigned u = 0; u < n && all; ++u) all = c.state[u] == 3;
      if (all) {
        if (const char* error = shim_cluster_aligned(c)) return error;
        ++shim_cluster_barriers;
        shim_cluster_release(c, 0, n);
        cursor = shim_schedule == 1 ? n - 1 : 0;
      }
    }
  }
}

// One context per thread of every block of a cluster, each starting at the kernel.
static __attribute__((noinline)) void shim_make_cluster_threads(shim_cluster& c, char* stacks,
                                                                size_t stack_bytes) {
  const unsigned n = c.size * c.block;
  c.threads.assign(n, ucontext_t());
  c.state.assign(n, 0);
  c.started.assign(n, 0);
  c.site.assign(n, "");
  for (unsigned t = 0; t < n; ++t) {
    ucontext_t& u = c.threads[t];
    getcontext(&u);
    u.uc_stack.ss_sp = stacks + t * stack_bytes;
    u.uc_stack.ss_size = stack_bytes;
    u.uc_link = &c.scheduler;
    makecontext(&u, shim_cluster_thread_main, 0);
  }
}

// A launch of `grid` blocks of `block` threads in clusters of `cluster` blocks (consecutive
// blockIdx.x, rank = blockIdx.x mod cluster), `shared_bytes` of dynamic shared memory per block;
// `group`: the blocks form groups that exchange through global memory instead (shim_launch_group).
template <typename Kernel>
static void shim_launch_blocks(unsigned int grid, unsigned int block, unsigned int cluster,
                               size_t shared_bytes, bool group, Kernel run) {
  const size_t stack_bytes = 64 * 1024;
  shim_error = nullptr;
  shim_barriers = 0;
  shim_cluster_barriers = 0;
  shim_group_fences = 0;
  shim_group_spins = 0;
  if (cluster == 0 || grid % cluster != 0) {
    shim_error = group ? "the grid is not a whole number of groups"
                       : "the grid is not a whole number of clusters";
    return;
  }
  gridDim.x = grid;
  blockDim.x = block;
  shim_shared_bytes = shared_bytes;
  std::vector<std::vector<unsigned char>> shared(cluster,
                                                 std::vector<unsigned char>(shared_bytes + 16));
  std::unique_ptr<char[]> stacks(new char[stack_bytes * block * cluster]);   // uninitialised
  shim_cluster c;
  c.body = [](void* p) { (*(Kernel*)p)(); };
  c.arg = &run;
  c.block = block;
  c.size = cluster;
  c.shared_bytes = shared_bytes;
  c.group = group;
  shim_group = shim_group_memory();
  for (unsigned int first = 0; first < grid && shim_error == nullptr; first += cluster) {
    c.first = first;
    c.progress = false;
    c.smem.clear();
    for (auto& s : shared) {
      memset(s.data(), 0xFF, s.size());
      c.smem.push_back(s.data());
    }
    shim_group.pending.assign(cluster, {});
    shim_group.view.assign(cluster, shim_group.epoch);   // what the launch's start shows
    shim_make_cluster_threads(c, stacks.get(), stack_bytes);
    shim_cluster_active = &c;
    const char* error = shim_run_cluster(c);
    shim_cluster_active = nullptr;
    if (error != nullptr) shim_error = error;
    for (unsigned b = 0; b < cluster; ++b) shim_group_publish((int)b);   // at the blocks' end
  }
  shim_group = shim_group_memory();
  lltm_dynamic_smem = nullptr;
}

template <typename Kernel>
static void shim_launch_cluster(unsigned int grid, unsigned int block, unsigned int cluster,
                                size_t shared_bytes, Kernel run) {
  shim_launch_blocks(grid, block, cluster, shared_bytes, false, run);
}

// A cooperative launch of `grid` blocks in groups of `size` consecutive blocks (a tile's), each
// group's threads cooperating contexts as a cluster's are, with no cluster primitive: the blocks
// exchange through global memory (lltm_group_store / lltm_group_load) and meet at
// lltm_group_sync's barrier on a counter. Groups run one after another: a group that waits for
// another's blocks is a deadlock, reported.
template <typename Kernel>
static void shim_launch_group(unsigned int grid, unsigned int block, unsigned int size,
                              size_t shared_bytes, Kernel run) {
  shim_launch_blocks(grid, block, size, shared_bytes, true, run);
}

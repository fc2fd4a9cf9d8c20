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
// No warp intrinsics are emulated (the kernels use none); a kernel that uses one fails to build.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <algorithm>
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

struct shim_block {
  ucontext_t scheduler;
  std::vector<ucontext_t> threads;
  std::vector<int> state;    // 0 runnable, 1 waiting at a barrier, 2 returned
  unsigned int current = 0;
  void (*body)(void*) = nullptr;
  void* arg = nullptr;
};
static shim_block* shim_active = nullptr;

static inline void __syncthreads() {
  if (shim_active == nullptr) {          // an element-wise launch has no barrier semantics
    shim_error = "__syncthreads() outside shim_launch_block";
    return;
  }
  shim_active->state[shim_active->current] = 1;
  swapcontext(&shim_active->threads[shim_active->current], &shim_active->scheduler);
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

// Runs the threads of one block (their contexts made) to their end; false on divergence.
static __attribute__((noinline)) bool shim_run_block(shim_block& state, unsigned int block) {
  std::vector<unsigned int> order(block);
  for (;;) {
    for (unsigned int t = 0; t < block; ++t) order[t] = shim_schedule == 1 ? block - 1 - t : t;
    if (shim_schedule == 2) {
      for (unsigned int t = block; t > 1; --t) std::swap(order[t - 1], order[shim_next_random() % t]);
    }
    for (unsigned int t : order) {
      if (state.state[t] != 0) continue;
      state.current = t;
      threadIdx.x = t;
      swapcontext(&state.scheduler, &state.threads[t]);
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
    shim_active = &state;
    if (!shim_run_block(state, block)) {
      shim_error = "divergent __syncthreads(): some threads of a block wait at a barrier "
                   "that others, already returned, never reach";
    }
    shim_active = nullptr;
  }
  lltm_dynamic_smem = nullptr;
}

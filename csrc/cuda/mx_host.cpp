// The CUDA op's block math (mx_block.cuh) compiled for the host, as a tiny C library that the tests
// load with ctypes (tests/test_cuda_op.py) to check it bit for bit against mfqat/quant/reference.py
// without a GPU. Not part of the extension. Build: g++ -std=c++20 -O1 -ffp-contract=off -shared -fPIC
// -pthread csrc/cuda/mx_host.cpp -o libmx_host.so
//
// Two ways to run a block: serially (one thread owns every element), or as 32 emulated lanes (lane l
// owns elements l, l + 32, ... with the kernel's PER; the maximum by the kernel's xor butterfly through a
// shared slot array and a barrier), which checks the kernel's lane striding and reduction, not only the
// per-element math. The lanes are 32 fibers (ucontext) on one thread, run round-robin from barrier to
// barrier: the barrier semantics of a warp in lockstep, without 32 OS threads taking turns on a busy
// machine's cores at every step (which made this test take minutes there). What no host build can
// check is the shuffle instruction itself and the device's float arithmetic; scripts/gpu_check.sh runs
// the real kernels on a GPU.
#include <ucontext.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "mx_block.cuh"

namespace mfqat_cuda {
namespace {

struct SerialLanes {
  int32_t first = 0;
  static constexpr int32_t stride = 1;
  uint32_t reduce_max(uint32_t v) const { return v; }
};

struct WarpShared {
  uint32_t slot[32];
  ucontext_t scheduler;      // where a lane goes at a barrier (and when it finishes)
  ucontext_t lane_ctx[32];
  std::function<void(int32_t)> body;  // what every lane runs
  bool done[32];
};

thread_local WarpShared* current_warp = nullptr;  // makecontext passes ints only

void lane_entry(int lane) {
  current_warp->body(lane);
  current_warp->done[lane] = true;  // returning resumes the scheduler (uc_link)
}

struct EmulatedLanes {
  int32_t first;
  static constexpr int32_t stride = 32;
  WarpShared* warp;
  void barrier() const { swapcontext(&warp->lane_ctx[first], &warp->scheduler); }
  uint32_t reduce_max(uint32_t v) const {  // __shfl_xor_sync(full, v, off) for off = 16, 8, 4, 2, 1
    for (int off = 16; off > 0; off >>= 1) {
      warp->slot[first] = v;
      barrier();
      const uint32_t o = warp->slot[first ^ off];
      barrier();
      v = o > v ? o : v;
    }
    return v;
  }
};

// Run body(lane) for the 32 lanes as fibers, round-robin: each round takes every lane to its next barrier,
// so no lane reads a slot before every lane has written it, nor writes it again before every lane has read.
void run_warp(WarpShared& warp, std::function<void(int32_t)> body) {
  constexpr size_t kStack = 256 * 1024;
  std::vector<std::vector<char>> stacks(32, std::vector<char>(kStack));
  warp.body = std::move(body);
  current_warp = &warp;
  for (int lane = 0; lane < 32; ++lane) {
    warp.done[lane] = false;
    getcontext(&warp.lane_ctx[lane]);
    warp.lane_ctx[lane].uc_stack.ss_sp = stacks[lane].data();
    warp.lane_ctx[lane].uc_stack.ss_size = kStack;
    warp.lane_ctx[lane].uc_link = &warp.scheduler;
    makecontext(&warp.lane_ctx[lane], reinterpret_cast<void (*)()>(lane_entry), 1, lane);
  }
  for (bool running = true; running;) {
    running = false;
    for (int lane = 0; lane < 32; ++lane) {
      if (warp.done[lane]) continue;
      swapcontext(&warp.scheduler, &warp.lane_ctx[lane]);
      running = true;
    }
  }
  current_warp = nullptr;
}

MXFormat make_format(const int32_t* ints, const float* floats) {
  // ints: is_int, emax, emin, mbits, ceil_rule; floats: step, inv_step, code_min, code_max, max_normal
  return MXFormat{ints[0], ints[1], ints[2], ints[3], floats[0], floats[1], floats[2], floats[3], floats[4], ints[4]};
}

template <class D, int PER, class Lanes>
void run_block(bool through, const void* x, void* out, bool* mask, int64_t blk, int32_t bs, const MXFormat& a,
               const MXFormat& f, const Lanes& lanes) {
  using R = typename D::raw;
  const R* in = static_cast<const R*>(x) + blk * bs;
  R* o = static_cast<R*>(out) + blk * bs;
  bool* m = mask ? mask + blk * bs : nullptr;
  if (through) {
    through_block<D, PER>(in, o, m, bs, a, f, lanes);
  } else {
    fake_quant_block<D, PER>(in, o, m, bs, f, lanes);
  }
}

template <class D>
void run_typed(bool through, int32_t mode, const void* x, void* out, bool* mask, int64_t n_blocks, int32_t bs,
               const MXFormat& a, const MXFormat& f) {
  if (mode == 0) {  // serial
    for (int64_t b = 0; b < n_blocks; ++b) run_block<D, 256>(through, x, out, mask, b, bs, a, f, SerialLanes{});
    return;
  }
  WarpShared warp;  // one warp walks every block, as the kernel's grid-stride loop does with one warp
  run_warp(warp, [&](int32_t lane) {
    const EmulatedLanes lanes{lane, &warp};
    for (int64_t b = 0; b < n_blocks; ++b) {
      if (bs == 32) {
        run_block<D, 1>(through, x, out, mask, b, bs, a, f, lanes);
      } else {
        run_block<D, 8>(through, x, out, mask, b, bs, a, f, lanes);
      }
    }
  });
}

void run(bool through, int32_t dtype, int32_t mode, const void* x, void* out, bool* mask, int64_t n_blocks,
         int32_t bs, const MXFormat& a, const MXFormat& f) {
  if (dtype == kFloat32) run_typed<F32>(through, mode, x, out, mask, n_blocks, bs, a, f);
  if (dtype == kBFloat16) run_typed<BF16>(through, mode, x, out, mask, n_blocks, bs, a, f);
  if (dtype == kFloat16) run_typed<F16>(through, mode, x, out, mask, n_blocks, bs, a, f);
}

}  // namespace
}  // namespace mfqat_cuda

extern "C" {

// mode 0: serial; 1: 32 emulated lanes (the kernel's layout). mask may be null. 1 <= bs <= 256.
void mfqat_host_fake_quant(int32_t dtype, int32_t mode, const void* x, void* out, bool* mask, int64_t n_blocks,
                           int32_t bs, const int32_t* ints, const float* floats) {
  const mfqat_cuda::MXFormat f = mfqat_cuda::make_format(ints, floats);
  mfqat_cuda::run(false, dtype, mode, x, out, mask, n_blocks, bs, f, f);
}

void mfqat_host_through(int32_t dtype, int32_t mode, const void* x, void* out, bool* mask, int64_t n_blocks,
                        int32_t bs, const int32_t* a_ints, const float* a_floats, const int32_t* ints,
                        const float* floats) {
  mfqat_cuda::run(true, dtype, mode, x, out, mask, n_blocks, bs, mfqat_cuda::make_format(a_ints, a_floats),
                  mfqat_cuda::make_format(ints, floats));
}
}

extern "C" {
// Element-wise conversions over arrays (the tests sweep every float16 and the float32 values around them).
void mfqat_host_float_to_half_n(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = mfqat_cuda::float_to_half(x[i]);
}
void mfqat_host_half_to_float_n(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = mfqat_cuda::half_to_float(x[i]);
}
void mfqat_host_float_to_bf16_n(const float* x, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = mfqat_cuda::float_to_bf16(x[i]);
}
}

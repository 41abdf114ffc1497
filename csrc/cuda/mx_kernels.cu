// mfqat CUDA kernels: MX fake-quantize and train-through-anchor, one warp per block of 32 elements
// (the per-block maximum exponent by a shuffle butterfly), for float32, bfloat16 and float16. The math
// is mx_block.cuh's, shared with the host build that the tests check bit for bit against the
// reference (tests/test_cuda_op.py); this file needs only the CUDA runtime (no torch header), so the
// tests compile it with nvcc to sm_80 / sm_90 / sm_100 cubins on a machine without a GPU.
//
// Build flags (setup.py, the tests): --fmad=false (no fused multiply-add; mx_block.cuh uses
// __fmul_rn / __fadd_rn anyway), no --use_fast_math (subnormals kept, IEEE division not used).
#include "mx_kernels.h"

namespace mfqat_cuda {
namespace {

constexpr int kWarpsPerCta = 8;  // 256 threads: 8 blocks of 32 in flight per CTA
constexpr int kMaxCtas = 1 << 20;  // grid-stride beyond this

// One warp's lanes: lane l owns elements l, l + 32, ...; the block maximum by an xor butterfly, so every
// lane ends with the same value (a max is order-free: the butterfly gives the serial loop's result).
struct WarpLanes {
  int32_t first;
  static constexpr int32_t stride = 32;
  __device__ __forceinline__ uint32_t reduce_max(uint32_t v) const {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const uint32_t o = __shfl_xor_sync(0xffffffffu, v, off);
      v = o > v ? o : v;
    }
    return v;
  }
};

// PER: elements per lane (1 for bs = 32, 8 for any bs up to 256). Every lane of a warp walks the same
// blocks (blk depends on the warp only), so the full-mask shuffles are legal.
template <class D, int PER>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    fake_quant_kernel(const typename D::raw* __restrict__ x, typename D::raw* __restrict__ out,
                      bool* __restrict__ mask, int64_t n_blocks, int32_t bs, MXFormat p) {
  const WarpLanes lanes{static_cast<int32_t>(threadIdx.x & 31)};
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t blk = warp; blk < n_blocks; blk += n_warps) {
    const int64_t base = blk * bs;
    fake_quant_block<D, PER>(x + base, out + base, mask ? mask + base : nullptr, bs, p, lanes);
  }
}

template <class D, int PER>
__global__ void __launch_bounds__(kWarpsPerCta * 32)
    through_kernel(const typename D::raw* __restrict__ x, typename D::raw* __restrict__ out,
                   bool* __restrict__ mask, int64_t n_blocks, int32_t bs, MXFormat a, MXFormat f) {
  const WarpLanes lanes{static_cast<int32_t>(threadIdx.x & 31)};
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t n_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t blk = warp; blk < n_blocks; blk += n_warps) {
    const int64_t base = blk * bs;
    through_block<D, PER>(x + base, out + base, mask ? mask + base : nullptr, bs, a, f, lanes);
  }
}

dim3 grid_for(int64_t n_blocks) {
  const int64_t ctas = (n_blocks + kWarpsPerCta - 1) / kWarpsPerCta;
  return dim3(static_cast<unsigned>(ctas < 1 ? 1 : (ctas > kMaxCtas ? kMaxCtas : ctas)));
}

template <class D>
cudaError_t fake_quant_typed(const void* x, void* out, bool* mask, int64_t n_blocks, int32_t bs, MXFormat p,
                             cudaStream_t stream) {
  using R = typename D::raw;
  const R* xi = static_cast<const R*>(x);
  R* o = static_cast<R*>(out);
  if (bs == 32) {
    fake_quant_kernel<D, 1><<<grid_for(n_blocks), kWarpsPerCta * 32, 0, stream>>>(xi, o, mask, n_blocks, bs, p);
  } else {
    fake_quant_kernel<D, 8><<<grid_for(n_blocks), kWarpsPerCta * 32, 0, stream>>>(xi, o, mask, n_blocks, bs, p);
  }
  return cudaGetLastError();
}

template <class D>
cudaError_t through_typed(const void* x, void* out, bool* mask, int64_t n_blocks, int32_t bs, MXFormat a,
                          MXFormat f, cudaStream_t stream) {
  using R = typename D::raw;
  const R* xi = static_cast<const R*>(x);
  R* o = static_cast<R*>(out);
  if (bs == 32) {
    through_kernel<D, 1><<<grid_for(n_blocks), kWarpsPerCta * 32, 0, stream>>>(xi, o, mask, n_blocks, bs, a, f);
  } else {
    through_kernel<D, 8><<<grid_for(n_blocks), kWarpsPerCta * 32, 0, stream>>>(xi, o, mask, n_blocks, bs, a, f);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_fake_quant(int32_t dtype, const void* x, void* out, bool* mask, int64_t n_blocks, int32_t bs,
                              MXFormat p, cudaStream_t stream) {
  if (bs < 1 || bs > 256) return cudaErrorInvalidValue;
  if (n_blocks == 0) return cudaSuccess;
  switch (dtype) {
    case kFloat32: return fake_quant_typed<F32>(x, out, mask, n_blocks, bs, p, stream);
    case kBFloat16: return fake_quant_typed<BF16>(x, out, mask, n_blocks, bs, p, stream);
    case kFloat16: return fake_quant_typed<F16>(x, out, mask, n_blocks, bs, p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_through(int32_t dtype, const void* x, void* out, bool* mask, int64_t n_blocks, int32_t bs,
                           MXFormat a, MXFormat f, cudaStream_t stream) {
  if (bs < 1 || bs > 256) return cudaErrorInvalidValue;
  if (n_blocks == 0) return cudaSuccess;
  switch (dtype) {
    case kFloat32: return through_typed<F32>(x, out, mask, n_blocks, bs, a, f, stream);
    case kBFloat16: return through_typed<BF16>(x, out, mask, n_blocks, bs, a, f, stream);
    case kFloat16: return through_typed<F16>(x, out, mask, n_blocks, bs, a, f, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace mfqat_cuda

// mfqat CPU kernel of MLX's affine quantization (reference: affine_quantize_blocks in
// mfqat/quant/reference.py), as the torch custom op quantize_affine: one pass over each block instead of
// the reference's dozen whole-tensor temporaries. Returns the codes and the float32 scales and biases
// before their rounding to the input dtype (the caller rounds them, as the reference does), and whether
// every value was finite. The same IEEE float32 operations in the same order as the reference (no fused
// multiply-add: setup.py builds with -ffp-contract=off), so bit-exact with it for finite inputs
// (tests/test_affine_kernel.py); the caller (mfqat.quant.kernels.affine_quantize_dispatch) gives a tensor
// holding NaN or Inf (flag false: the outputs are incomplete) to the reference.
#include "mx_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <limits>

namespace mfqat {
namespace {

constexpr float kAffineEps = 1e-7f;  // MLX's floor on the scale (reference.AFFINE_EPS)

// Blocks [begin, end); false (and the outputs left partial) when a block holds NaN or Inf.
template <typename T>
bool affine_blocks(const T* x, uint8_t* codes, float* scales, float* biases, int64_t begin, int64_t end,
                   int64_t bs, float n_bins) {
  for (int64_t blk = begin; blk < end; ++blk) {
    const T* v = x + blk * bs;
    float wmin = load(v, 0), wmax = wmin;
    bool finite = true;
    for (int64_t i = 0; i < bs; ++i) {
      const float w = load(v, i);
      finite &= std::fabs(w) <= std::numeric_limits<float>::max();  // false for NaN and Inf
      wmin = w < wmin ? w : wmin;
      wmax = w > wmax ? w : wmax;
    }
    if (!finite) return false;
    const bool use_min = std::fabs(wmin) > std::fabs(wmax);
    float scale = (wmax - wmin) / n_bins;
    scale = scale < kAffineEps ? kAffineEps : scale;
    scale = use_min ? scale : -scale;
    const float edge = use_min ? wmin : wmax;
    const float q0 = std::nearbyint(edge / scale);  // any magnitude: a flat block of large values
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = edge / q0;
      bias = edge;
    }
    uint8_t* c = codes + blk * bs;
    for (int64_t i = 0; i < bs; ++i) {
      float t = (load(v, i) - bias) / scale;
      t = t < 0.0f ? 0.0f : (t > n_bins ? n_bins : t);  // clamp then round = round then clamp (integer bounds)
      c[i] = static_cast<uint8_t>(round_half_even(t));
    }
    scales[blk] = scale;
    biases[blk] = bias;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, bool> quantize_affine(const at::Tensor& x_in, int64_t block_size,
                                                               int64_t bits) {
  TORCH_CHECK(x_in.device().is_cpu(), "mfqat quantize_affine: CPU tensors expected");
  TORCH_CHECK(x_in.dim() >= 1 && block_size > 0 && x_in.size(-1) % block_size == 0,
              "mfqat quantize_affine: the last dimension must be a multiple of block_size");
  TORCH_CHECK(bits >= 1 && bits <= 8, "mfqat quantize_affine: bits must be in 1..8");
  at::Tensor x = x_in.contiguous();
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  auto scale_shape = x.sizes().vec();
  scale_shape.back() /= block_size;
  at::Tensor scales = at::empty(scale_shape, x.options().dtype(at::kFloat));
  at::Tensor biases = at::empty(scale_shape, x.options().dtype(at::kFloat));
  const int64_t n_blocks = x.numel() / block_size;
  const float n_bins = static_cast<float>((1 << bits) - 1);
  std::atomic<bool> all_finite{true};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mfqat_quantize_affine", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    uint8_t* cp = codes.data_ptr<uint8_t>();
    float* sp = scales.data_ptr<float>();
    float* bp = biases.data_ptr<float>();
    at::parallel_for(0, n_blocks, 1024, [&](int64_t begin, int64_t end) {
      if (all_finite.load(std::memory_order_relaxed) &&
          !affine_blocks<scalar_t>(xp, cp, sp, bp, begin, end, block_size, n_bins)) {
        all_finite.store(false, std::memory_order_relaxed);
      }
    });
  });
  return {codes, scales, biases, all_finite.load()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfqat, m) {
  m.def("quantize_affine(Tensor x, int block_size, int bits) -> (Tensor, Tensor, Tensor, bool)");
}

TORCH_LIBRARY_IMPL(mfqat, CPU, m) { m.impl("quantize_affine", &quantize_affine); }

}  // namespace mfqat

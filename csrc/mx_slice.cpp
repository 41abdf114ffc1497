// mfqat CPU kernel for Slice-and-Scale of MX codes (reference: mfqat/quant/slice.py), as the torch custom op
// slice_mx: MXINT codes by a rounded right shift (scale unchanged); MXFP codes decoded, re-blocked to
// the lower format's exponent and re-encoded. Bit-exact with the reference (tests/test_kernels.py).
#include "mx_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace mfqat {
namespace {

// Slice-and-Scale of one tensor (reference: mfqat/quant/slice.py), codes (n_blocks * bs) + E8M0 scales.
void slice_kernel(const uint8_t* codes, const uint8_t* scales, uint8_t* out_codes, uint8_t* out_scales,
                  int64_t n_blocks, int64_t bs, bool is_int, int32_t shift, const MXParams& src,
                  int32_t src_ebits, int32_t src_bias, const MXParams& dst, int32_t dst_ebits, int32_t dst_bias) {
  at::parallel_for(0, n_blocks, 256, [&](int64_t begin, int64_t end) {
    float vals[256];
    for (int64_t blk = begin; blk < end; ++blk) {
      const uint8_t* c = codes + blk * bs;
      uint8_t* o = out_codes + blk * bs;
      const uint8_t scale = scales[blk];
      if (is_int) {  // rounded right shift of the two's-complement codes, scale unchanged
        const float inv = exp2i(-shift);
        for (int64_t i = 0; i < bs; ++i) {
          float q = round_half_even(static_cast<float>(static_cast<int8_t>(c[i])) * inv);
          q = q < dst.code_min ? dst.code_min : (q > dst.code_max ? dst.code_max : q);
          o[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
        }
        out_scales[blk] = scale;
        continue;
      }
      if (scale == 255) {  // NaN block stays NaN
        std::memset(o, 0, bs);
        out_scales[blk] = scale;
        continue;
      }
      const int32_t s_high = static_cast<int32_t>(scale) - 127;
      float amax = 0.0f;
      for (int64_t i = 0; i < bs; ++i) {
        vals[i] = fp_value(c[i], src_ebits, src.mbits, src_bias, src.emin);
        float a = std::fabs(vals[i]);
        amax = a > amax ? a : amax;
      }
      int32_t s_low = static_cast<int32_t>(float_bits(amax) >> 23) - 127 + s_high - dst.emax;
      s_low = s_low < -127 ? -127 : (s_low > 127 ? 127 : s_low);
      if (amax == 0.0f) s_low = -127;
      int32_t k = s_high - s_low;
      k = k < -149 ? -149 : (k > 127 ? 127 : k);
      const float to_grid = exp2i(k);
      for (int64_t i = 0; i < bs; ++i) o[i] = fp_code(round_fp_element(vals[i] * to_grid, dst), dst, dst_bias, dst_ebits);
      out_scales[blk] = static_cast<uint8_t>(s_low + 127);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> slice_mx(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t block_size,
                                            bool is_int, int64_t shift,
                                            int64_t src_emax, int64_t src_emin, int64_t src_mbits, int64_t src_ebits,
                                            int64_t src_bias,
                                            int64_t dst_emax, int64_t dst_emin, int64_t dst_mbits, int64_t dst_ebits,
                                            int64_t dst_bias, int64_t dst_code_min, int64_t dst_code_max,
                                            double dst_max_normal) {
  TORCH_CHECK(codes_in.device().is_cpu() && scales_in.device().is_cpu(), "mfqat slice_mx: CPU tensors expected");
  TORCH_CHECK(codes_in.element_size() == 1 && scales_in.scalar_type() == at::kByte,
              "mfqat slice_mx: int8/uint8 codes and uint8 E8M0 scales expected");
  TORCH_CHECK(block_size > 0 && block_size <= 256 && codes_in.numel() % block_size == 0 &&
                  codes_in.numel() / block_size == scales_in.numel(),
              "mfqat slice_mx: codes (", codes_in.numel(), ") and scales (", scales_in.numel(),
              ") do not match block_size ", block_size);
  at::Tensor codes = codes_in.contiguous().view(at::kByte);
  at::Tensor scales = scales_in.contiguous();
  at::Tensor out_codes = at::empty_like(codes);
  at::Tensor out_scales = at::empty_like(scales);
  const MXParams src = make_params(false, src_emax, src_emin, src_mbits, 0, 0, 0, 0.0, false);
  const MXParams dst = make_params(is_int, dst_emax, dst_emin, dst_mbits, 0, dst_code_min, dst_code_max,
                                   dst_max_normal, false);
  slice_kernel(codes.const_data_ptr<uint8_t>(), scales.const_data_ptr<uint8_t>(), out_codes.data_ptr<uint8_t>(),
               out_scales.data_ptr<uint8_t>(), codes.numel() / block_size, block_size, is_int,
               static_cast<int32_t>(shift), src, static_cast<int32_t>(src_ebits), static_cast<int32_t>(src_bias), dst,
               static_cast<int32_t>(dst_ebits), static_cast<int32_t>(dst_bias));
  return {is_int ? out_codes.view(at::kChar) : out_codes, out_scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfqat, m) {
  m.def("slice_mx(Tensor codes, Tensor scales, int block_size, bool is_int, int shift, int src_emax, int src_emin, "
        "int src_mbits, int src_ebits, int src_bias, int dst_emax, int dst_emin, int dst_mbits, int dst_ebits, "
        "int dst_bias, int dst_code_min, int dst_code_max, float dst_max_normal) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mfqat, CPU, m) { m.impl("slice_mx", &slice_mx); }

}  // namespace mfqat

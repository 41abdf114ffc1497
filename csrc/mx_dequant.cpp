// mfqat CPU kernel of MX dequantization (reference: mx_dequantize_blocks in mfqat/quant/reference.py), as
// the torch custom op dequantize_mx: stored codes and E8M0 scales -> float32, in one pass (the reference
// builds five whole-tensor temporaries). MXINT codes are code / 2^int_shift, MXFP codes decode exactly
// (fp_value), then one float32 multiplication by the block's 2^s (E8M0 byte 255: NaN), the reference's
// operations in its order: bit-exact (tests/test_dequant_kernel.py).
#include "mx_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

namespace mfqat {
namespace {

at::Tensor dequantize_mx(const at::Tensor& codes_in, const at::Tensor& scales_in, int64_t block_size, bool is_int,
                         int64_t int_shift, int64_t ebits, int64_t mbits, int64_t bias, int64_t emin) {
  TORCH_CHECK(codes_in.device().is_cpu() && scales_in.device().is_cpu(), "mfqat dequantize_mx: CPU tensors expected");
  TORCH_CHECK(codes_in.element_size() == 1 && scales_in.scalar_type() == at::kByte,
              "mfqat dequantize_mx: int8/uint8 codes and uint8 E8M0 scales expected");
  TORCH_CHECK(block_size > 0 && codes_in.numel() % block_size == 0 && codes_in.numel() / block_size == scales_in.numel(),
              "mfqat dequantize_mx: codes must hold one block of block_size per scale");
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor scales = scales_in.contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const uint8_t* c = static_cast<const uint8_t*>(codes.const_data_ptr());
  const uint8_t* s = scales.const_data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t n_blocks = scales.numel();
  const float step = exp2i(static_cast<int32_t>(int_shift));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  at::parallel_for(0, n_blocks, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int32_t e = static_cast<int32_t>(s[blk]) - 127;
      const float x = s[blk] == 255 ? nan : exp2i(e > 127 ? 127 : e);
      const uint8_t* cb = c + blk * block_size;
      float* ob = o + blk * block_size;
      if (is_int) {
        for (int64_t i = 0; i < block_size; ++i) ob[i] = (static_cast<float>(static_cast<int8_t>(cb[i])) / step) * x;
      } else {
        for (int64_t i = 0; i < block_size; ++i)
          ob[i] = fp_value(cb[i], static_cast<int32_t>(ebits), static_cast<int32_t>(mbits), static_cast<int32_t>(bias),
                           static_cast<int32_t>(emin)) * x;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfqat, m) {
  m.def("dequantize_mx(Tensor codes, Tensor scales, int block_size, bool is_int, int int_shift, int ebits, int mbits, "
        "int bias, int emin) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfqat, CPU, m) { m.impl("dequantize_mx", &dequantize_mx); }

}  // namespace mfqat

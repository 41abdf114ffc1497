// mfqat CPU kernels: an MX format's quantize-dequantize for given per-block exponents (reference:
// mfqat/quant/scale_search.py, dequantize_with_exponents), the forward of a searched format once its
// exponents are kept for the step.
// decode_mx_exponents: MXINT (reference: _mxint_values): the code clamp(round_half_even(x * 2^-s * 2^k))
// with -0 made +0, times 2^(s - k); MXFP: the element rounding of x * 2^-s times 2^s (what encoding then
// decoding gives); NaN for flagged blocks.
// decode_mx_exponents_through: the same on the anchor's quantize-dequantize of x, in one pass.
#include "mx_decode.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace mfqat {
namespace {

// Through = true: x is first quantize-dequantized in the anchor format `a` (the searched formats are
// searched on the anchor's values), as fake_quant_mx then decode_mx_exponents would, in one pass. The
// anchor's value is rounded to T as the two-pass composition stores it (it is exact in T, see
// mx_cpu.cpp's through_blocks; the rounding only makes that independent of the argument).
template <typename T, bool Through, int64_t BS>
void decode_blocks(int64_t begin, int64_t end, const T* __restrict__ x, const int32_t* s_in, const bool* nonfinite,
                   T* __restrict__ out, int64_t bs_arg, MXParams p, int32_t int_shift, MXParams a) {
  const int64_t bs = BS ? BS : bs_arg;  // a constant where BS is given: a block's loops unroll
  const float nan = std::nanf("");
  float mid[256];
  for (int64_t blk = begin; blk < end; ++blk) {
    const T* in = x + blk * bs;
    T* o = out + blk * bs;
    if (nonfinite[blk]) {
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(nan);
      continue;
    }
    if constexpr (Through) {
      anchor_block(in, bs, a, mid);
    } else {
      for (int64_t i = 0; i < bs; ++i) mid[i] = load(in, i);
    }
    decode_block(mid, bs, s_in[blk], int_shift, p, o);
  }
}

void check_exponents(const at::Tensor& s, const at::Tensor& nonfinite, int64_t n_blocks) {
  TORCH_CHECK(s.device().is_cpu() && nonfinite.device().is_cpu(),
              "mfqat decode_mx_exponents: exponents and mask must be CPU tensors");
  TORCH_CHECK(s.scalar_type() == at::kInt && s.numel() == n_blocks && nonfinite.scalar_type() == at::kBool &&
                  nonfinite.numel() == n_blocks,
              "mfqat decode_mx_exponents: expected int32 exponents and a bool mask with ", n_blocks, " entries");
}

template <bool Through>
at::Tensor decode_exponents(const at::Tensor& x_in, const at::Tensor& s_in, const at::Tensor& nonfinite_in,
                            int64_t block_size, const MXParams& p, int64_t int_shift, const MXParams& a) {
  check_input(x_in, block_size);
  const int64_t n_blocks = x_in.numel() / block_size;
  check_exponents(s_in, nonfinite_in, n_blocks);
  at::Tensor x = x_in.contiguous();
  at::Tensor s = s_in.contiguous();
  at::Tensor nonfinite = nonfinite_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mfqat_decode_mx_exponents", [&] {
    parallel_sized_blocks<decode_blocks<scalar_t, Through, 32>, decode_blocks<scalar_t, Through, 0>>(
        block_size, n_blocks, x.const_data_ptr<scalar_t>(), s.const_data_ptr<int32_t>(), nonfinite.const_data_ptr<bool>(),
        out.data_ptr<scalar_t>(), block_size, p, static_cast<int32_t>(int_shift), a);
  });
  return out;
}

at::Tensor decode_mx_exponents(const at::Tensor& x, const at::Tensor& s, const at::Tensor& nonfinite,
                               int64_t block_size, bool is_int, int64_t emax, int64_t emin, int64_t mbits,
                               int64_t int_shift, int64_t code_min, int64_t code_max, double max_normal) {
  const MXParams p = make_params(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, false);
  const MXParams unused = make_params(true, 0, 0, 0, 0, 0, 0, 0.0, false);
  return decode_exponents<false>(x, s, nonfinite, block_size, p, int_shift, unused);
}

// decode_mx_exponents(fake_quant_mx(x, <anchor>), s, nonfinite, ...) bit for bit, in one pass.
at::Tensor decode_mx_exponents_through(const at::Tensor& x, const at::Tensor& s, const at::Tensor& nonfinite,
                                       int64_t block_size, bool a_is_int, int64_t a_emax, int64_t a_emin,
                                       int64_t a_mbits, int64_t a_int_shift, int64_t a_code_min, int64_t a_code_max,
                                       double a_max_normal, bool a_ceil_rule, bool is_int, int64_t emax, int64_t emin,
                                       int64_t mbits, int64_t int_shift, int64_t code_min, int64_t code_max,
                                       double max_normal) {
  const MXParams a = make_params(a_is_int, a_emax, a_emin, a_mbits, a_int_shift, a_code_min, a_code_max, a_max_normal,
                                 a_ceil_rule);
  const MXParams p = make_params(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, false);
  return decode_exponents<true>(x, s, nonfinite, block_size, p, int_shift, a);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfqat, m) {
  m.def("decode_mx_exponents(Tensor x, Tensor s, Tensor nonfinite, int block_size, bool is_int, int emax, int emin, "
        "int mbits, int int_shift, int code_min, int code_max, float max_normal) -> Tensor");
  m.def("decode_mx_exponents_through(Tensor x, Tensor s, Tensor nonfinite, int block_size, bool a_is_int, int a_emax, "
        "int a_emin, int a_mbits, int a_int_shift, int a_code_min, int a_code_max, float a_max_normal, "
        "bool a_ceil_rule, bool is_int, int emax, int emin, int mbits, int int_shift, int code_min, int code_max, "
        "float max_normal) -> Tensor");
}

TORCH_LIBRARY_IMPL(mfqat, CPU, m) {
  m.impl("decode_mx_exponents", &decode_mx_exponents);
  m.impl("decode_mx_exponents_through", &decode_mx_exponents_through);
}

}  // namespace mfqat

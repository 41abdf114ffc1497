// mfqat CPU kernels: fused MX fake-quantization and quantize-to-codes as torch custom ops.
//
// Bit-exact with mfqat/quant/reference.py (docs/numerics.md):
//   * the block maximum is taken over the absolute float32 *bit patterns* (an integer max: for
//     non-negative IEEE floats, bit order == value order, and NaN/Inf patterns sort above every
//     finite value), so floor(log2(amax)) and the non-finite test come straight from its bits;
//   * powers of two are built from exponent bits (exp2i), every scaling is a multiplication by an
//     exact power of two, and rounding is round-half-to-even via the 1.5*2^23 trick (valid for
//     |t| < 2^22, which the element grids guarantee), with the sign of zero restored by copysign;
//   * no -ffast-math: the compiler keeps IEEE semantics (subnormals, NaN propagation).
// One pass over the tensor: read once, write once; blocks are split over threads by
#include "mx_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

namespace mfqat {
namespace {

template <typename T, int64_t BS>
void fake_quant_blocks(int64_t begin, int64_t end, const T* x, T* out, bool* mask, int64_t bs_arg, MXParams p) {
  const int64_t bs = BS ? BS : bs_arg;  // a constant where BS is given: a block's loops unroll
  const float nan = std::nanf("");
  float buf[256];
  for (int64_t blk = begin; blk < end; ++blk) {
    const T* in = x + blk * bs;
    T* o = out + blk * bs;
    bool* m = mask ? mask + blk * bs : nullptr;
    BlockScale sc = block_exponent(in, bs, p, buf);
    if (sc.nonfinite) {
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(nan);
      if (m) std::memset(m, 0, bs);
      continue;
    }
    const float to_grid = exp2i(-sc.s);
    const float from_grid = exp2i(sc.s);
    if (p.is_int) {
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(round_int_element(buf[i] * to_grid, p) * from_grid);
    } else {
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(round_fp_element(buf[i] * to_grid, p) * from_grid);
    }
    if (m) {
      for (int64_t i = 0; i < bs; ++i) m[i] = std::fabs(buf[i] * to_grid) > p.max_normal;
    }
  }
}

// Train-through-anchor in one pass: per block, qdq in the anchor format `a`, then qdq of that in the
// target format `f` (reference: fake_quantize_reference applied twice). The two-pass composition
// stores the intermediate in T; the fused pass keeps it in float32, which is the same value: one MX
// qdq of a T-valued block is exactly representable in T (its values have at most 8 significant bits,
// a quantum no finer than the input's where it rounds, and a saturated maximum that the input's own
// grid cannot exceed; tests/test_through_kernel.py checks it for every value of float16/bfloat16).
// The mask is the union of both stages' saturation masks (the straight-through gradient passes both).
template <typename T, int64_t BS>
void through_blocks(int64_t begin, int64_t end, const T* x, T* out, bool* mask, int64_t bs_arg, MXParams a,
                    MXParams f) {
  const int64_t bs = BS ? BS : bs_arg;
  const float nan = std::nanf("");
  float buf[256];
  float mid[256];
  bool sat[256];
  for (int64_t blk = begin; blk < end; ++blk) {
    const T* in = x + blk * bs;
    T* o = out + blk * bs;
    bool* m = mask ? mask + blk * bs : nullptr;
    BlockScale sa = block_exponent(in, bs, a, buf);
    if (sa.nonfinite) {  // NaN in the anchor -> NaN block in every format
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(nan);
      if (m) std::memset(m, 0, bs);
      continue;
    }
    const float a_to = exp2i(-sa.s), a_from = exp2i(sa.s);
    // The family branch stays outside the element loops (as in fake_quant_blocks) so they vectorise.
    if (a.is_int) {
      for (int64_t i = 0; i < bs; ++i) mid[i] = round_int_element(buf[i] * a_to, a) * a_from;
    } else {
      for (int64_t i = 0; i < bs; ++i) mid[i] = round_fp_element(buf[i] * a_to, a) * a_from;
    }
    uint32_t max_bits = 0;  // mid is exact in T: see the comment above
    for (int64_t i = 0; i < bs; ++i) {
      const uint32_t b = float_bits(mid[i]) & 0x7fffffffu;
      max_bits = b > max_bits ? b : max_bits;
    }
    if (m) {
      for (int64_t i = 0; i < bs; ++i) sat[i] = std::fabs(buf[i] * a_to) > a.max_normal;
    }
    BlockScale sf = exponent_from_max_bits(max_bits, f, max_exponent<T>());
    if (sf.nonfinite) {  // the anchor's qdq overflowed the dtype: NaN, as the second pass gives
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(nan);
      if (m) std::memcpy(m, sat, bs);
      continue;
    }
    const float f_to = exp2i(-sf.s), f_from = exp2i(sf.s);
    if (f.is_int) {
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(round_int_element(mid[i] * f_to, f) * f_from);
    } else {
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(round_fp_element(mid[i] * f_to, f) * f_from);
    }
    if (m) {
      for (int64_t i = 0; i < bs; ++i) m[i] = sat[i] || std::fabs(mid[i] * f_to) > f.max_normal;
    }
  }
}

template <typename T>
void quantize_blocks(int64_t begin, int64_t end, const T* x, uint8_t* codes, uint8_t* scales, int64_t bs, MXParams p,
                     int32_t bias, int32_t ebits) {
  float buf[256];
  for (int64_t blk = begin; blk < end; ++blk) {
    BlockScale sc = block_exponent(x + blk * bs, bs, p, buf);
    uint8_t* c = codes + blk * bs;
    scales[blk] = sc.nonfinite ? 255 : static_cast<uint8_t>(sc.s + 127);
    if (sc.nonfinite) {
      std::memset(c, 0, bs);
      continue;
    }
    const float to_grid = exp2i(-sc.s);
    if (p.is_int) {
      for (int64_t i = 0; i < bs; ++i) {
        float q = round_int_element(buf[i] * to_grid, p);
        c[i] = static_cast<uint8_t>(static_cast<int8_t>(q * p.step));
      }
    } else {
      for (int64_t i = 0; i < bs; ++i) c[i] = fp_code(round_fp_element(buf[i] * to_grid, p), p, bias, ebits);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> fake_quant_mx(const at::Tensor& x_in, int64_t block_size, bool is_int,
                                                 int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift,
                                                 int64_t code_min, int64_t code_max, double max_normal,
                                                 bool ceil_rule, bool need_mask) {
  check_input(x_in, block_size);
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = need_mask ? at::empty(x.sizes(), x.options().dtype(at::kBool)) : at::empty({0}, x.options().dtype(at::kBool));
  const MXParams p = make_params(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, ceil_rule);
  const int64_t n_blocks = x.numel() / block_size;
  bool* m = need_mask ? mask.data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mfqat_fake_quant_mx", [&] {
    parallel_sized_blocks<fake_quant_blocks<scalar_t, 32>, fake_quant_blocks<scalar_t, 0>>(
        block_size, n_blocks, x.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), m, block_size, p);
  });
  return {out, mask};
}

std::tuple<at::Tensor, at::Tensor> fake_quant_mx_through(
    const at::Tensor& x_in, int64_t block_size, bool a_is_int, int64_t a_emax, int64_t a_emin, int64_t a_mbits,
    int64_t a_int_shift, int64_t a_code_min, int64_t a_code_max, double a_max_normal, bool a_ceil_rule, bool is_int,
    int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift, int64_t code_min, int64_t code_max,
    double max_normal, bool ceil_rule, bool need_mask) {
  check_input(x_in, block_size);
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = need_mask ? at::empty(x.sizes(), x.options().dtype(at::kBool)) : at::empty({0}, x.options().dtype(at::kBool));
  const MXParams a = make_params(a_is_int, a_emax, a_emin, a_mbits, a_int_shift, a_code_min, a_code_max, a_max_normal,
                                 a_ceil_rule);
  const MXParams f = make_params(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, ceil_rule);
  const int64_t n_blocks = x.numel() / block_size;
  bool* m = need_mask ? mask.data_ptr<bool>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mfqat_fake_quant_mx_through", [&] {
    parallel_sized_blocks<through_blocks<scalar_t, 32>, through_blocks<scalar_t, 0>>(
        block_size, n_blocks, x.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), m, block_size, a, f);
  });
  return {out, mask};
}

std::tuple<at::Tensor, at::Tensor> quantize_mx(const at::Tensor& x_in, int64_t block_size, bool is_int,
                                               int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift,
                                               int64_t code_min, int64_t code_max, double max_normal,
                                               bool ceil_rule, int64_t bias, int64_t ebits) {
  check_input(x_in, block_size);
  at::Tensor x = x_in.contiguous();
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kByte));
  auto scale_shape = x.sizes().vec();
  scale_shape.back() /= block_size;
  at::Tensor scales = at::empty(scale_shape, x.options().dtype(at::kByte));
  const MXParams p = make_params(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, ceil_rule);
  const int64_t n_blocks = x.numel() / block_size;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mfqat_quantize_mx", [&] {
    parallel_blocks<quantize_blocks<scalar_t>>(n_blocks, x.const_data_ptr<scalar_t>(), codes.data_ptr<uint8_t>(),
                                               scales.data_ptr<uint8_t>(), block_size, p, static_cast<int32_t>(bias),
                                               static_cast<int32_t>(ebits));
  });
  if (is_int) codes = codes.view(at::kChar);
  return {codes, scales};
}

// Which build of the block loops the ops run now: "avx2" or "baseline" (see mx_common.h).
std::string cpu_isa() { return use_avx2() ? "avx2" : "baseline"; }

}  // namespace

TORCH_LIBRARY(mfqat, m) {
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("fake_quant_mx(Tensor x, int block_size, bool is_int, int emax, int emin, int mbits, int int_shift, "
        "int code_min, int code_max, float max_normal, bool ceil_rule, bool need_mask) -> (Tensor, Tensor)");
  m.def("fake_quant_mx_through(Tensor x, int block_size, bool a_is_int, int a_emax, int a_emin, int a_mbits, "
        "int a_int_shift, int a_code_min, int a_code_max, float a_max_normal, bool a_ceil_rule, bool is_int, int emax, "
        "int emin, int mbits, int int_shift, int code_min, int code_max, float max_normal, bool ceil_rule, "
        "bool need_mask) -> (Tensor, Tensor)");
  m.def("quantize_mx(Tensor x, int block_size, bool is_int, int emax, int emin, int mbits, int int_shift, "
        "int code_min, int code_max, float max_normal, bool ceil_rule, int bias, int ebits) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mfqat, CPU, m) {
  m.impl("fake_quant_mx", &fake_quant_mx);
  m.impl("fake_quant_mx_through", &fake_quant_mx_through);
  m.impl("quantize_mx", &quantize_mx);
}

}  // namespace mfqat

// A Python module so that `import mfqat._C` loads the library (and registers the ops).
#include <Python.h>
static struct PyModuleDef mfqat_c_module = {PyModuleDef_HEAD_INIT, "_C", "mfqat C++ ops (torch.library)", -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&mfqat_c_module); }

// mfqat CPU kernels for the MX scale search, MXINT and MXFP (reference: mfqat/quant/scale_search.py).
//
// search_mx: per block, the shared exponent among floor (OCP) and floor + d for d in `offsets`
// (clamped to [-127, min(127, max_exp - emax)]) whose quantize-dequantize has the lowest error
//     err(s) = sum_j w_j * (x_j - qdq_s(x)_j)^2
// with the difference in float32 (exact, see the reference), its square and the weighting in
// float64, and the sum in the reference's fixed pairwise order (fixed_order_sum: pairs (i, i + h)
// for h = n / 2, an odd last element carried), so every block picks the same exponent as the
// reference, near-ties included. Ties keep the earlier candidate (floor first); non-finite blocks
// keep floor and are flagged.
// decode_mx_exponents: the values for given exponents; MXINT (reference: _mxint_values): the code
// clamp(round_half_even(x * 2^-s * 2^k)) with -0 made +0, times 2^(s - k); MXFP: the element rounding of
// x * 2^-s times 2^s (what encoding then decoding gives); NaN for flagged blocks.
// search_mx_through / decode_mx_exponents_through: the same on the anchor's quantize-dequantize of x
// (train-through-anchor), computed per block in registers: one pass over x instead of two or three.
#include "mx_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

namespace mfqat {
namespace {

// err(s) of one finite float32 block (w: its float64 column weights, or nullptr).
inline double block_error(const float* v, const double* w, int64_t bs, int32_t s, const MXParams& p, double* acc) {
  const float to_grid = exp2i(-s), from_grid = exp2i(s);
  if (p.is_int) {  // one loop per family, so each vectorises
    for (int64_t i = 0; i < bs; ++i) {
      const float d = v[i] - round_int_element(v[i] * to_grid, p) * from_grid;
      acc[i] = static_cast<double>(d) * static_cast<double>(d);
    }
  } else {
    for (int64_t i = 0; i < bs; ++i) {
      const float d = v[i] - round_fp_element(v[i] * to_grid, p) * from_grid;
      acc[i] = static_cast<double>(d) * static_cast<double>(d);
    }
  }
  if (w) {
    for (int64_t i = 0; i < bs; ++i) acc[i] *= w[i];
  }
  int64_t n = bs;
  while (n > 1) {
    const int64_t h = n / 2;
    for (int64_t i = 0; i < h; ++i) acc[i] += acc[i + h];
    if (n % 2) acc[h] = acc[2 * h];
    n = h + n % 2;
  }
  return acc[0];
}

// The exponent one finite float32 block v takes: floor (sc.s) unless a candidate has a lower error.
inline int32_t best_exponent(const float* v, const double* w, int64_t bs, int32_t floor_s, int32_t hi,
                             const MXParams& p, const int64_t* offsets, int64_t n_offsets, double* acc) {
  int32_t best = floor_s;
  double best_err = block_error(v, w, bs, best, p, acc);
  for (int64_t j = 0; j < n_offsets; ++j) {
    int32_t s = floor_s + static_cast<int32_t>(offsets[j]);
    s = s < -127 ? -127 : (s > hi ? hi : s);
    const double err = block_error(v, w, bs, s, p, acc);
    if (err < best_err) {
      best = s;
      best_err = err;
    }
  }
  return best;
}

template <typename T>
void search_blocks(int64_t begin, int64_t end, const T* x, const double* weights, int32_t* s_out, bool* nonfinite_out,
                   int64_t bs, int64_t blocks_per_row, MXParams p, const int64_t* offsets, int64_t n_offsets) {
  const int32_t hi = std::min<int32_t>(127, max_exponent<T>() - p.emax);
  float buf[256];
  double acc[256];
  for (int64_t blk = begin; blk < end; ++blk) {
    const BlockScale sc = block_exponent(x + blk * bs, bs, p, buf);
    nonfinite_out[blk] = sc.nonfinite;
    const double* w = weights ? weights + (blk % blocks_per_row) * bs : nullptr;
    s_out[blk] = sc.nonfinite ? sc.s : best_exponent(buf, w, bs, sc.s, hi, p, offsets, n_offsets, acc);
  }
}

// One block's MXINT code for exponent s, decoded (reference: _mxint_values): v is x (or its anchor value).
inline float decode_value(float v, float to_grid, float scale, const MXParams& p) {
  float c = round_half_even(v * to_grid * p.step);  // two multiplications, as the reference (2^127 * 2^k overflows)
  c = c < p.code_min ? p.code_min : c;
  c = c > p.code_max ? p.code_max : c;
  return (c + 0.0f) * scale;
}

// A finite block v (x or its anchor values) encoded with exponent s and decoded into o: MXINT by
// decode_value (scale 2^(s - k)), MXFP as the element rounding of v * 2^-s times 2^s (int_shift is 0).
template <typename T>
inline void decode_block(const float* v, int64_t bs, int32_t s, int32_t int_shift, const MXParams& p, T* o) {
  const float to_grid = exp2i(-s), scale = exp2i(s - int_shift);
  if (p.is_int) {
    for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(decode_value(v[i], to_grid, scale, p));
  } else {
    for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(round_fp_element(v[i] * to_grid, p) * scale);
  }
}

// One block of x quantize-dequantized in the anchor format `a`, as fake_quant_mx stores it in T (exact
// in T, see mx_cpu.cpp's through_blocks; rounding to T only makes that independent of the argument);
// NaN for a non-finite block.
template <typename T>
inline void anchor_block(const T* in, int64_t bs, const MXParams& a, float* mid) {
  const BlockScale sa = block_exponent(in, bs, a, mid);
  const float a_to = exp2i(-sa.s), a_from = exp2i(sa.s);
  if (sa.nonfinite) {
    for (int64_t i = 0; i < bs; ++i) mid[i] = std::nanf("");
  } else if (a.is_int) {
    for (int64_t i = 0; i < bs; ++i) mid[i] = load_stored<T>(round_int_element(mid[i] * a_to, a) * a_from);
  } else {
    for (int64_t i = 0; i < bs; ++i) mid[i] = load_stored<T>(round_fp_element(mid[i] * a_to, a) * a_from);
  }
}

// Through = true: x is first quantize-dequantized in the anchor format `a` (the searched formats are
// searched on the anchor's values), as fake_quant_mx then decode_mx_exponents would, in one pass. The
// anchor's value is rounded to T as the two-pass composition stores it (it is exact in T, see
// mx_cpu.cpp's through_blocks; the rounding only makes that independent of the argument).
template <typename T, bool Through>
void decode_blocks(int64_t begin, int64_t end, const T* __restrict__ x, const int32_t* s_in, const bool* nonfinite,
                   T* __restrict__ out,
                   int64_t bs, MXParams p, int32_t int_shift, MXParams a) {
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

// search_mx of the anchor's values (fake_quant_mx(x, <anchor>)) and their decode with the exponents
// found (decode_mx_exponents), in one pass over x: a searched format's weight at the step's search.
template <typename T>
void search_through_blocks(int64_t begin, int64_t end, const T* x, const double* weights, int32_t* s_out,
                           bool* nonfinite_out, T* values, int64_t bs, int64_t blocks_per_row, MXParams p,
                           MXParams a, int32_t int_shift, const int64_t* offsets, int64_t n_offsets) {
  const int32_t hi = std::min<int32_t>(127, max_exponent<T>() - p.emax);
  const float nan = std::nanf("");
  float mid[256];
  double acc[256];
  for (int64_t blk = begin; blk < end; ++blk) {
    anchor_block(x + blk * bs, bs, a, mid);
    uint32_t max_bits = 0;
    for (int64_t i = 0; i < bs; ++i) {
      const uint32_t b = float_bits(mid[i]) & 0x7fffffffu;
      max_bits = b > max_bits ? b : max_bits;
    }
    const BlockScale sc = exponent_from_max_bits(max_bits, p, max_exponent<T>());
    nonfinite_out[blk] = sc.nonfinite;
    T* o = values + blk * bs;
    if (sc.nonfinite) {
      s_out[blk] = sc.s;
      for (int64_t i = 0; i < bs; ++i) o[i] = store<T>(nan);
      continue;
    }
    const double* w = weights ? weights + (blk % blocks_per_row) * bs : nullptr;
    const int32_t best = best_exponent(mid, w, bs, sc.s, hi, p, offsets, n_offsets, acc);
    s_out[blk] = best;
    decode_block(mid, bs, best, int_shift, p, o);
  }
}

void check_weights(const at::Tensor& weights, int64_t k) {
  TORCH_CHECK(weights.device().is_cpu(), "mfqat search_mx: weights must be a CPU tensor, got ", weights.device());
  TORCH_CHECK(weights.numel() == 0 || (weights.scalar_type() == at::kDouble && weights.numel() == k),
              "mfqat search_mx: weights must be empty or float64 with ", k, " entries (one per input column), got ",
              weights.numel(), " of ", weights.scalar_type());
}

// A search's per-block outputs for x: int32 exponents and the non-finite mask.
std::tuple<at::Tensor, at::Tensor> block_outputs(const at::Tensor& x, int64_t block_size) {
  auto shape = x.sizes().vec();
  shape.back() /= block_size;
  return {at::empty(shape, x.options().dtype(at::kInt)), at::empty(shape, x.options().dtype(at::kBool))};
}

std::tuple<at::Tensor, at::Tensor> search_mx(const at::Tensor& x_in, const at::Tensor& weights_in, int64_t block_size,
                                             bool is_int, int64_t emax, int64_t emin, int64_t mbits,
                                             int64_t int_shift, int64_t code_min, int64_t code_max,
                                             double max_normal, at::IntArrayRef offsets) {
  check_input(x_in, block_size);
  const int64_t k = x_in.size(-1);
  check_weights(weights_in, k);
  at::Tensor x = x_in.contiguous();
  at::Tensor weights = weights_in.contiguous();
  auto [s, nonfinite] = block_outputs(x, block_size);
  const MXParams p = make_params(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, false);
  const std::vector<int64_t> offs(offsets.begin(), offsets.end());
  const double* w = weights.numel() ? weights.const_data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mfqat_search_mx", [&] {
    parallel_blocks<search_blocks<scalar_t>>(x.numel() / block_size, x.const_data_ptr<scalar_t>(), w,
                                             s.data_ptr<int32_t>(), nonfinite.data_ptr<bool>(), block_size,
                                             k / block_size, p, offs.data(), static_cast<int64_t>(offs.size()));
  });
  return {s, nonfinite};
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
    parallel_blocks<decode_blocks<scalar_t, Through>>(n_blocks, x.const_data_ptr<scalar_t>(), s.const_data_ptr<int32_t>(),
                                                      nonfinite.const_data_ptr<bool>(), out.data_ptr<scalar_t>(),
                                                      block_size, p, static_cast<int32_t>(int_shift), a);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> search_mx_through(
    const at::Tensor& x_in, const at::Tensor& weights_in, int64_t block_size, bool a_is_int, int64_t a_emax,
    int64_t a_emin, int64_t a_mbits, int64_t a_int_shift, int64_t a_code_min, int64_t a_code_max, double a_max_normal,
    bool a_ceil_rule, bool is_int, int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift, int64_t code_min,
    int64_t code_max, double max_normal, at::IntArrayRef offsets) {
  check_input(x_in, block_size);
  const int64_t k = x_in.size(-1);
  check_weights(weights_in, k);
  at::Tensor x = x_in.contiguous();
  at::Tensor weights = weights_in.contiguous();
  auto [s, nonfinite] = block_outputs(x, block_size);
  at::Tensor values = at::empty_like(x, at::MemoryFormat::Contiguous);
  const MXParams a = make_params(a_is_int, a_emax, a_emin, a_mbits, a_int_shift, a_code_min, a_code_max, a_max_normal,
                                 a_ceil_rule);
  const MXParams p = make_params(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, false);
  const std::vector<int64_t> offs(offsets.begin(), offsets.end());
  const double* w = weights.numel() ? weights.const_data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mfqat_search_mx_through", [&] {
    parallel_blocks<search_through_blocks<scalar_t>>(
        x.numel() / block_size, x.const_data_ptr<scalar_t>(), w, s.data_ptr<int32_t>(), nonfinite.data_ptr<bool>(),
        values.data_ptr<scalar_t>(), block_size, k / block_size, p, a, static_cast<int32_t>(int_shift), offs.data(),
        static_cast<int64_t>(offs.size()));
  });
  return {s, nonfinite, values};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfqat, m) {
  m.def("search_mx(Tensor x, Tensor weights, int block_size, bool is_int, int emax, int emin, int mbits, "
        "int int_shift, int code_min, int code_max, float max_normal, int[] offsets) -> (Tensor, Tensor)");
  m.def("decode_mx_exponents(Tensor x, Tensor s, Tensor nonfinite, int block_size, bool is_int, int emax, int emin, "
        "int mbits, int int_shift, int code_min, int code_max, float max_normal) -> Tensor");
  m.def("decode_mx_exponents_through(Tensor x, Tensor s, Tensor nonfinite, int block_size, bool a_is_int, int a_emax, "
        "int a_emin, int a_mbits, int a_int_shift, int a_code_min, int a_code_max, float a_max_normal, "
        "bool a_ceil_rule, bool is_int, int emax, int emin, int mbits, int int_shift, int code_min, int code_max, "
        "float max_normal) -> Tensor");
  m.def("search_mx_through(Tensor x, Tensor weights, int block_size, bool a_is_int, int a_emax, int a_emin, "
        "int a_mbits, int a_int_shift, int a_code_min, int a_code_max, float a_max_normal, bool a_ceil_rule, "
        "bool is_int, int emax, int emin, int mbits, int int_shift, int code_min, int code_max, float max_normal, "
        "int[] offsets) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mfqat, CPU, m) {
  m.impl("search_mx", &search_mx);
  m.impl("decode_mx_exponents", &decode_mx_exponents);
  m.impl("decode_mx_exponents_through", &decode_mx_exponents_through);
  m.impl("search_mx_through", &search_mx_through);
}

}  // namespace mfqat

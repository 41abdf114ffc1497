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
// search_mx_through: the same on the anchor's quantize-dequantize of x (train-through-anchor), with the
// values the exponents found decode to (mx_decode.h), computed per block in registers: one pass over x
// instead of three. The decode ops for kept exponents are in mx_decode.cpp.
#include "mx_decode.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace mfqat {
namespace {

#if defined(__GNUC__)
typedef double f64x4 __attribute__((vector_size(32)));

// The pairwise sum below for 32 terms, in registers: the same additions in the same order (pairs
// (i, i + 16), then (i, i + 8), ...). The loop's in-memory version stalls on store forwarding.
inline double pairwise_sum32(const double* t) {
  f64x4 v[8];
  std::memcpy(v, t, sizeof(v));
  for (int k = 0; k < 4; ++k) v[k] += v[k + 4];
  v[0] += v[2];
  v[1] += v[3];
  v[0] += v[1];
  return (v[0][0] + v[0][2]) + (v[0][1] + v[0][3]);
}
#else
inline double pairwise_sum32(const double* t) {
  double a[32];
  std::memcpy(a, t, sizeof(a));
  for (int h = 16; h >= 1; h /= 2) {
    for (int i = 0; i < h; ++i) a[i] += a[i + h];
  }
  return a[0];
}
#endif

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
  if (bs == 32) return pairwise_sum32(acc);
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

template <typename T, int64_t BS>
void search_blocks(int64_t begin, int64_t end, const T* x, const double* weights, int32_t* s_out, bool* nonfinite_out,
                   int64_t bs_arg, int64_t blocks_per_row, MXParams p, const int64_t* offsets, int64_t n_offsets) {
  const int64_t bs = BS ? BS : bs_arg;  // a constant where BS is given: the block loops unroll
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

// search_mx of the anchor's values (fake_quant_mx(x, <anchor>)) and their decode with the exponents
// found (decode_mx_exponents), in one pass over x: a searched format's weight at the step's search.
template <typename T, int64_t BS>
void search_through_blocks(int64_t begin, int64_t end, const T* x, const double* weights, int32_t* s_out,
                           bool* nonfinite_out, T* values, int64_t bs_arg, int64_t blocks_per_row, MXParams p,
                           MXParams a, int32_t int_shift, const int64_t* offsets, int64_t n_offsets) {
  const int64_t bs = BS ? BS : bs_arg;
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
    parallel_sized_blocks<search_blocks<scalar_t, 32>, search_blocks<scalar_t, 0>>(
        block_size, x.numel() / block_size, x.const_data_ptr<scalar_t>(), w, s.data_ptr<int32_t>(),
        nonfinite.data_ptr<bool>(), block_size, k / block_size, p, offs.data(), static_cast<int64_t>(offs.size()));
  });
  return {s, nonfinite};
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
    parallel_sized_blocks<search_through_blocks<scalar_t, 32>, search_through_blocks<scalar_t, 0>>(
        block_size, x.numel() / block_size, x.const_data_ptr<scalar_t>(), w, s.data_ptr<int32_t>(), nonfinite.data_ptr<bool>(),
        values.data_ptr<scalar_t>(), block_size, k / block_size, p, a, static_cast<int32_t>(int_shift), offs.data(),
        static_cast<int64_t>(offs.size()));
  });
  return {s, nonfinite, values};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mfqat, m) {
  m.def("search_mx(Tensor x, Tensor weights, int block_size, bool is_int, int emax, int emin, int mbits, "
        "int int_shift, int code_min, int code_max, float max_normal, int[] offsets) -> (Tensor, Tensor)");
  m.def("search_mx_through(Tensor x, Tensor weights, int block_size, bool a_is_int, int a_emax, int a_emin, "
        "int a_mbits, int a_int_shift, int a_code_min, int a_code_max, float a_max_normal, bool a_ceil_rule, "
        "bool is_int, int emax, int emin, int mbits, int int_shift, int code_min, int code_max, float max_normal, "
        "int[] offsets) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mfqat, CPU, m) {
  m.impl("search_mx", &search_mx);
  m.impl("search_mx_through", &search_mx_through);
}

}  // namespace mfqat

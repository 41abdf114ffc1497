// Per-block decode helpers shared by the scale-search ops (mx_search.cpp) and the decode ops
// (mx_decode.cpp): one block encoded with a given shared exponent and decoded, and one block
// quantize-dequantized in the anchor format (train-through-anchor).
#pragma once

#include "mx_common.h"

#include <cmath>

namespace mfqat {

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

}  // namespace mfqat

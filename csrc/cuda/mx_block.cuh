// The per-element and per-block math of the mfqat CUDA op, as __host__ __device__ functions that need
// no CUDA or torch header: nvcc compiles them into the kernels (mx_kernels.cu), and a plain C++
// compiler compiles the very same functions for the host (mx_host.cpp), which is how the tests check
// them bit for bit against mfqat/quant/reference.py on a machine without a GPU.
//
// Same numerics as the C++ CPU op (csrc/mx_common.h, mx_cpu.cpp): the block maximum is an integer max
// over absolute float32 bit patterns (NaN/Inf blocks fall out of the same value); powers of two are
// built from exponent bits; every scaling is a multiplication by an exact power of two; rounding is
// half-to-even via the 1.5*2^23 trick with the sign of zero restored. On the device, every float
// addition and multiplication goes through __fadd_rn / __fmul_rn, which nvcc never contracts into a
// fused multiply-add (whose single rounding would differ from PyTorch's two); subnormals are kept
// (no --use_fast_math / -ftz). bfloat16 and float16 are converted in software with IEEE
// round-half-to-even (c10's rule), the same code on host and device.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define MFQAT_HD __host__ __device__ __forceinline__
#else
#define MFQAT_HD inline
#endif

namespace mfqat_cuda {

// An MX element format, as the torch ops' scalar arguments give it (csrc/mx_common.h: MXParams).
struct MXFormat {
  int32_t is_int;
  int32_t emax;
  int32_t emin;
  int32_t mbits;
  float step;      // MXINT: 2^int_shift
  float inv_step;  // MXINT: 2^-int_shift
  float code_min;  // MXINT code range
  float code_max;
  float max_normal;
  int32_t ceil_rule;
};

MFQAT_HD uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t b;
  __builtin_memcpy(&b, &v, sizeof(b));
  return b;
#endif
}

MFQAT_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float v;
  __builtin_memcpy(&v, &b, sizeof(v));
  return v;
#endif
}

// a * b and a + b rounded once each, never fused.
MFQAT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MFQAT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

MFQAT_HD float abs_f(float v) { return bits_float(float_bits(v) & 0x7fffffffu); }

MFQAT_HD float copysign_f(float mag, float sign) {
  return bits_float((float_bits(mag) & 0x7fffffffu) | (float_bits(sign) & 0x80000000u));
}

// Exact float32 2^e for e in [-149, 127].
MFQAT_HD float exp2i(int32_t e) {
  return e >= -126 ? bits_float(static_cast<uint32_t>(e + 127) << 23) : bits_float(1u << (e + 149));
}

// Round half to even for |t| < 2^22, keeping the sign of zero like nearbyint.
MFQAT_HD float round_half_even(float t) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return copysign_f(add_rn(add_rn(t, magic), -magic), t);
}

// floor(log2) of the input dtype's largest finite value (reference: dtype_max_exponent).
enum Dtype : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

MFQAT_HD int32_t max_exponent(int32_t dtype) { return dtype == kFloat16 ? 15 : 127; }

// |v|'s float32 bit pattern: the block maximum is an integer max of these (order == value order for
// non-negative floats; NaN and Inf patterns sort above every finite value).
MFQAT_HD uint32_t abs_bits(float v) { return float_bits(v) & 0x7fffffffu; }

// The shared exponent of a block from its largest absolute bit pattern (reference: mx_shared_exponent);
// *nonfinite is set for a block holding NaN or Inf.
MFQAT_HD int32_t shared_exponent(uint32_t max_bits, const MXFormat& p, int32_t max_exp, bool* nonfinite) {
  *nonfinite = max_bits >= 0x7f800000u;
  const uint32_t amax_bits = *nonfinite ? 0u : max_bits;
  int32_t s = static_cast<int32_t>(amax_bits >> 23) - 127 - p.emax;
  if (p.ceil_rule) {
    int32_t k = -s;
    k = k < -149 ? -149 : (k > 127 ? 127 : k);
    if (mul_rn(bits_float(amax_bits), exp2i(k)) > p.max_normal) s += 1;
    const int32_t cap = max_exp - p.emax;  // 2^s * max_normal must stay finite in the input dtype
    s = s > cap ? cap : s;
  }
  return s < -127 ? -127 : (s > 127 ? 127 : s);
}

// Element rounding to the format's grid (reference: mx_round_elements), y already scaled by 2^-s.
MFQAT_HD float round_int_element(float y, const MXFormat& p) {
  float r = round_half_even(mul_rn(y, p.step));
  r = r < p.code_min ? p.code_min : r;
  r = r > p.code_max ? p.code_max : r;
  return mul_rn(r, p.inv_step);
}

MFQAT_HD float round_fp_element(float y, const MXFormat& p) {
  const float a = abs_f(y);
  int32_t e = static_cast<int32_t>(float_bits(a) >> 23) - 127;
  e = e < p.emin ? p.emin : e;  // e in [emin, emax + 1]: both powers below are normal
  float q = mul_rn(round_half_even(mul_rn(a, exp2i(p.mbits - e))), exp2i(e - p.mbits));
  q = q < p.max_normal ? q : p.max_normal;
  return copysign_f(q, y);
}

// One element's quantize-dequantize with the block's exponent s; *saturated: |v / 2^s| > max_normal.
MFQAT_HD float qdq_element(float v, int32_t s, const MXFormat& p, bool* saturated) {
  const float y = mul_rn(v, exp2i(-s));
  *saturated = abs_f(y) > p.max_normal;
  const float q = p.is_int ? round_int_element(y, p) : round_fp_element(y, p);
  return mul_rn(q, exp2i(s));
}

// ------------------------------------------------------------------------ storage dtypes

// bfloat16 bits -> float32 (exact).
MFQAT_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

// float32 -> bfloat16 bits, round half to even, NaN -> 0x7fc0 (c10's rule, as tensor.to(bfloat16)).
MFQAT_HD uint16_t float_to_bf16(float v) {
  const uint32_t b = float_bits(v);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(v != v ? 0x7fc0u : rounded);
}

// float16 bits -> float32 (exact, subnormals included).
MFQAT_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));  // Inf, NaN (payload kept)
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24, exact (mant < 2^10)
  return copysign_f(mul_rn(static_cast<float>(mant), 5.9604644775390625e-08f), bits_float(sign));
}

// float32 -> float16 bits, IEEE round half to even (as tensor.to(float16)); NaN -> 0x7e00 with the sign.
MFQAT_HD uint16_t float_to_half(float v) {
  const uint32_t b = float_bits(v);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (a >= 0x38800000u) {  // >= 2^-14: a normal half
    const uint32_t mant = a & 0x7fffffu;
    uint32_t h = ((((a >> 23) - 112u) << 10) | (mant >> 13));
    const uint32_t rem = mant & 0x1fffu;
    h += (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ? 1u : 0u;  // a carry moves into the exponent
    return static_cast<uint16_t>(sign | h);
  }
  // a subnormal half: round(|v| * 2^24) half to even; the product is exact and below 2^10
  const float n = round_half_even(mul_rn(bits_float(a), 16777216.0f));
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(n));
}

// The three storage types: raw element type, load to float32, store from float32.
struct F32 {
  using raw = float;
  static constexpr int32_t dtype = kFloat32;
  static MFQAT_HD float load(raw v) { return v; }
  static MFQAT_HD raw store(float v) { return v; }
};

struct BF16 {
  using raw = uint16_t;
  static constexpr int32_t dtype = kBFloat16;
  static MFQAT_HD float load(raw v) { return bf16_to_float(v); }
  static MFQAT_HD raw store(float v) { return float_to_bf16(v); }
};

struct F16 {
  using raw = uint16_t;
  static constexpr int32_t dtype = kFloat16;
  static MFQAT_HD float load(raw v) { return half_to_float(v); }
  static MFQAT_HD raw store(float v) { return float_to_half(v); }
};

// The anchor stage of train-through-anchor for one element: its qdq, rounded to the storage dtype.
template <class D>
MFQAT_HD float anchor_element(float v, int32_t s_anchor, const MXFormat& a, bool* saturated) {
  return D::load(D::store(qdq_element(v, s_anchor, a, saturated)));
}

// ------------------------------------------------------------------------ one block

#if defined(__CUDACC__)
#define MFQAT_UNROLL _Pragma("unroll")
#else
#define MFQAT_UNROLL
#endif

// Who runs a block: `Lanes` says which elements this thread owns (first, first + stride, ...; at most
// PER of them) and reduces a value over the threads of the block (reduce_max). The CUDA kernel runs
// one warp per block (first = lane, stride = 32, a shuffle butterfly); the host build runs it serially
// (first = 0, stride = 1) or as 32 emulated lanes with the same butterfly (mx_host.cpp).
MFQAT_HD float nan_f() { return bits_float(0x7fc00000u); }

// Fake-quantize one block of bs elements (reference: mx_fake_quantize_blocks): the output in the
// storage dtype, and where mask is given, the saturated elements (all false in a NaN/Inf block).
template <class D, int PER, class Lanes>
MFQAT_HD void fake_quant_block(const typename D::raw* __restrict__ in, typename D::raw* __restrict__ out,
                               bool* __restrict__ mask, int32_t bs, const MXFormat& p, const Lanes& lanes) {
  float v[PER];
  uint32_t m = 0;
  MFQAT_UNROLL
  for (int32_t k = 0; k < PER; ++k) {
    const int32_t i = lanes.first + k * Lanes::stride;
    v[k] = i < bs ? D::load(in[i]) : 0.0f;
    const uint32_t b = abs_bits(v[k]);
    m = b > m ? b : m;
  }
  m = lanes.reduce_max(m);
  bool nonfinite;
  const int32_t s = shared_exponent(m, p, max_exponent(D::dtype), &nonfinite);
  MFQAT_UNROLL
  for (int32_t k = 0; k < PER; ++k) {
    const int32_t i = lanes.first + k * Lanes::stride;
    if (i < bs) {
      bool sat;
      const float q = qdq_element(v[k], s, p, &sat);
      out[i] = D::store(nonfinite ? nan_f() : q);
      if (mask) mask[i] = sat && !nonfinite;
    }
  }
}

// Train-through-anchor for one block (mx_cpu.cpp: through_blocks): qdq in the anchor format `a`,
// rounded to the storage dtype as the two-pass composition stores it, then qdq of that in the target
// format `f`; the mask is the union of both stages' saturation masks. A NaN/Inf block of the input
// gives NaN and no mask; an anchor result that overflows the dtype gives NaN and the anchor's mask.
template <class D, int PER, class Lanes>
MFQAT_HD void through_block(const typename D::raw* __restrict__ in, typename D::raw* __restrict__ out,
                            bool* __restrict__ mask, int32_t bs, const MXFormat& a, const MXFormat& f,
                            const Lanes& lanes) {
  float mid[PER];
  bool sat_a[PER];
  uint32_t m = 0;
  MFQAT_UNROLL
  for (int32_t k = 0; k < PER; ++k) {
    const int32_t i = lanes.first + k * Lanes::stride;
    mid[k] = i < bs ? D::load(in[i]) : 0.0f;
    const uint32_t b = abs_bits(mid[k]);
    m = b > m ? b : m;
  }
  m = lanes.reduce_max(m);
  bool nonfinite_a;
  const int32_t sa = shared_exponent(m, a, max_exponent(D::dtype), &nonfinite_a);
  m = 0;
  MFQAT_UNROLL
  for (int32_t k = 0; k < PER; ++k) {
    mid[k] = anchor_element<D>(mid[k], sa, a, &sat_a[k]);
    const uint32_t b = abs_bits(mid[k]);
    m = b > m ? b : m;
  }
  m = lanes.reduce_max(m);
  bool nonfinite_f;
  const int32_t sf = shared_exponent(m, f, max_exponent(D::dtype), &nonfinite_f);
  MFQAT_UNROLL
  for (int32_t k = 0; k < PER; ++k) {
    const int32_t i = lanes.first + k * Lanes::stride;
    if (i < bs) {
      bool sat_f;
      const float q = qdq_element(mid[k], sf, f, &sat_f);
      out[i] = D::store(nonfinite_a || nonfinite_f ? nan_f() : q);
      if (mask) mask[i] = !nonfinite_a && (sat_a[k] || (sat_f && !nonfinite_f));
    }
  }
}

}  // namespace mfqat_cuda

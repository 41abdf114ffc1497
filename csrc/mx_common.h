// Shared helpers of the mfqat CPU ops (mx_cpu.cpp, mx_slice.cpp, mx_search.cpp, mx_decode.cpp): bit-level float helpers, the MX
// format parameters, the shared exponent of a block and the element roundings. Bit-exact with
// mfqat/quant/reference.py; see mx_cpu.cpp's top comment for how.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <cstdlib>

#include <ATen/Parallel.h>

namespace mfqat {

// The element loops are built twice: for the baseline target (-march=x86-64-v2, SSE4.2) and for
// AVX2, taken at run time where the CPU has it. Both builds do the same IEEE operations in the same
// order (no -ffast-math, and -ffp-contract=off forms no fused multiply-add), so they give the same
// bits; MFQAT_CPU_ISA=baseline forces the baseline build (the tests compare the two).
#if defined(__x86_64__) && defined(__GNUC__)
#define MFQAT_AVX2_TARGET __attribute__((target("avx2"), flatten))
#else
#define MFQAT_AVX2_TARGET
#endif

inline bool use_avx2() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has_avx2 = __builtin_cpu_supports("avx2");
  const char* isa = std::getenv("MFQAT_CPU_ISA");
  return has_avx2 && !(isa && std::strcmp(isa, "baseline") == 0);
#else
  return false;
#endif
}

template <auto Blocks, typename... Args>
MFQAT_AVX2_TARGET void call_avx2(int64_t begin, int64_t end, Args... args) {
  Blocks(begin, end, args...);
}

// Blocks(begin, end, args...) over the blocks [0, n_blocks), split over threads (at::parallel_for,
// 256 blocks a task), in the AVX2 build where the CPU has it. Blocks takes everything by value, so
// its stores cannot alias its parameters and the element loops vectorise.
template <auto Blocks, typename... Args>
void parallel_blocks(int64_t n_blocks, Args... args) {
  const bool avx2 = use_avx2();
  at::parallel_for(0, n_blocks, 256, [&](int64_t begin, int64_t end) {
    if (avx2) {
      call_avx2<Blocks>(begin, end, args...);
    } else {
      Blocks(begin, end, args...);
    }
  });
}

// parallel_blocks of Blocks32 when the block size is 32 (the default: a block's loops then have a
// constant trip count and unroll), else of BlocksAny (any size). Both do the same operations.
template <auto Blocks32, auto BlocksAny, typename... Args>
void parallel_sized_blocks(int64_t block_size, int64_t n_blocks, Args... args) {
  if (block_size == 32) {
    parallel_blocks<Blocks32>(n_blocks, args...);
  } else {
    parallel_blocks<BlocksAny>(n_blocks, args...);
  }
}

constexpr float kRoundMagic = 12582912.0f;  // 1.5 * 2^23

inline uint32_t float_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

inline float bits_float(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
}

// Exact float32 2^e for e in [-149, 127].
inline float exp2i(int32_t e) {
  if (e >= -126) return bits_float(static_cast<uint32_t>(e + 127) << 23);
  return bits_float(1u << (e + 149));
}

// Exact 2^e for e in the normal range [-126, 127] (no branch, so loops vectorise).
inline float exp2i_normal(int32_t e) { return bits_float(static_cast<uint32_t>(e + 127) << 23); }

// Round half to even for |t| < 2^22, keeping the sign of zero like nearbyint.
inline float round_half_even(float t) {
  float r = (t + kRoundMagic) - kRoundMagic;
  return std::copysign(r, t);
}

// Element code -> value (reference: mx_codes_to_values), MXFP only; exact.
inline float fp_value(uint8_t code, int32_t ebits, int32_t mbits, int32_t bias, int32_t emin) {
  uint32_t c = code;
  uint32_t sign = (c >> (ebits + mbits)) & 1u;
  int32_t exp_field = static_cast<int32_t>((c >> mbits) & ((1u << ebits) - 1u));
  int32_t mant = static_cast<int32_t>(c & ((1u << mbits) - 1u));
  bool subnormal = exp_field == 0;
  int32_t e = subnormal ? emin : exp_field - bias;
  float sig = static_cast<float>(subnormal ? mant : mant + (1 << mbits));
  float v = sig * exp2i(e - mbits);
  return sign ? -v : v;
}

struct MXParams {
  bool is_int;
  int32_t emax;
  int32_t emin;
  int32_t mbits;
  float step;       // MXINT: 2^int_shift
  float inv_step;   // MXINT: 2^-int_shift
  float code_min;   // MXINT code range
  float code_max;
  float max_normal;
  bool ceil_rule;
};

struct BlockScale {
  int32_t s;
  bool nonfinite;
};

template <typename T>
inline float load(const T* p, int64_t i) {
  return static_cast<float>(p[i]);
}

template <>
inline float load<c10::BFloat16>(const c10::BFloat16* p, int64_t i) {
  return bits_float(static_cast<uint32_t>(p[i].x) << 16);
}

template <typename T>
inline T store(float v) {
  return static_cast<T>(v);
}

// float32 -> bfloat16 with round-half-even and NaN -> 0x7fc0, the same rule as c10 (and so as
// tensor.to(torch.bfloat16)), written branch-free so that the loops vectorise.
template <>
inline c10::BFloat16 store<c10::BFloat16>(float v) {
  uint32_t b = float_bits(v);
  uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  uint16_t out = static_cast<uint16_t>(v != v ? 0x7fc0u : rounded);
  return c10::BFloat16(out, c10::BFloat16::from_bits());
}

// v as stored in T and loaded back (the identity for float32).
template <typename T>
inline float load_stored(float v) {
  const T t = store<T>(v);
  return load(&t, 0);
}

// floor(log2) of the input dtype's largest finite value (reference: dtype_max_exponent).
template <typename T>
constexpr int32_t max_exponent() {
  return std::is_same<T, c10::Half>::value ? 15 : 127;
}

// Shared exponent from the largest absolute float32 bit pattern of a block (reference:
// mx_shared_exponent); max_exp = floor(log2) of the input dtype's largest finite value.
inline BlockScale exponent_from_max_bits(uint32_t max_bits, const MXParams& p, int32_t max_exp) {
  BlockScale out{0, max_bits >= 0x7f800000u};
  uint32_t amax_bits = out.nonfinite ? 0u : max_bits;
  int32_t s = static_cast<int32_t>(amax_bits >> 23) - 127 - p.emax;
  if (p.ceil_rule) {
    int32_t k = -s;
    k = k < -149 ? -149 : (k > 127 ? 127 : k);
    float scaled = bits_float(amax_bits) * exp2i(k);
    if (scaled > p.max_normal) s += 1;
    // Cap (reference: mx_shared_exponent): 2^s * max_normal must stay finite in the input dtype.
    const int32_t cap = max_exp - p.emax;
    s = s > cap ? cap : s;
  }
  out.s = s < -127 ? -127 : (s > 127 ? 127 : s);
  return out;
}

// Shared exponent of one block of the input (also copies the block to buf as float32).
template <typename T>
inline BlockScale block_exponent(const T* in, int64_t bs, const MXParams& p, float* buf) {
  uint32_t max_bits = 0;
  for (int64_t i = 0; i < bs; ++i) {
    float v = load(in, i);
    buf[i] = v;
    uint32_t b = float_bits(v) & 0x7fffffffu;
    max_bits = b > max_bits ? b : max_bits;
  }
  return exponent_from_max_bits(max_bits, p, max_exponent<T>());
}

// Element rounding (reference: mx_round_elements); returns the element-grid value.
inline float round_int_element(float y, const MXParams& p) {
  float r = round_half_even(y * p.step);
  r = r < p.code_min ? p.code_min : r;  // two plain selects (a nested one blocks vectorisation)
  r = r > p.code_max ? p.code_max : r;
  return r * p.inv_step;
}

inline float round_fp_element(float y, const MXParams& p) {
  float a = std::fabs(y);
  int32_t e = static_cast<int32_t>(float_bits(a) >> 23) - 127;
  e = e < p.emin ? p.emin : e;  // e in [emin, emax + 1]: both powers below are normal
  float q = round_half_even(a * exp2i_normal(p.mbits - e)) * exp2i_normal(e - p.mbits);
  q = q < p.max_normal ? q : p.max_normal;
  return std::copysign(q, y);
}

inline MXParams make_params(bool is_int, int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift,
                     int64_t code_min, int64_t code_max, double max_normal, bool ceil_rule) {
  MXParams p;
  p.is_int = is_int;
  p.emax = static_cast<int32_t>(emax);
  p.emin = static_cast<int32_t>(emin);
  p.mbits = static_cast<int32_t>(mbits);
  p.step = exp2i(static_cast<int32_t>(int_shift));
  p.inv_step = exp2i(-static_cast<int32_t>(int_shift));
  p.code_min = static_cast<float>(code_min);
  p.code_max = static_cast<float>(code_max);
  p.max_normal = static_cast<float>(max_normal);
  p.ceil_rule = ceil_rule;
  return p;
}

inline void check_input(const at::Tensor& x, int64_t block_size) {
  TORCH_CHECK(x.device().is_cpu(), "mfqat CPU op: expected a CPU tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "mfqat CPU op: dtype ", x.scalar_type(), " is not supported (float32, bfloat16, float16)");
  TORCH_CHECK(block_size > 0 && block_size <= 256, "mfqat CPU op: block_size ", block_size, " not in [1, 256]");
  TORCH_CHECK(x.dim() > 0 && x.size(-1) % block_size == 0, "mfqat CPU op: last dimension ",
              x.dim() > 0 ? x.size(-1) : 0, " is not a multiple of block_size ", block_size);
}


// Element-grid value -> stored code (reference: mx_values_to_codes).
inline uint8_t fp_code(float q, const MXParams& p, int32_t bias, int32_t ebits) {
  float a = std::fabs(q);
  uint32_t sign = std::signbit(q) ? 1u : 0u;
  int32_t e = static_cast<int32_t>(float_bits(a) >> 23) - 127;
  e = e < p.emin ? p.emin : e;
  bool subnormal = a < exp2i(p.emin);
  uint32_t exp_field = subnormal ? 0u : static_cast<uint32_t>(e + bias);
  uint32_t mant = static_cast<uint32_t>(a * exp2i(p.mbits - e));
  if (!subnormal) mant -= (1u << p.mbits);
  return static_cast<uint8_t>((sign << (ebits + p.mbits)) | (exp_field << p.mbits) | mant);
}

}  // namespace mfqat

// The CUDA implementations of torch.ops.mfqat.fake_quant_mx and fake_quant_mx_through (the schemas are
// defined once, in csrc/mx_cpu.cpp's TORCH_LIBRARY): checks, allocation and the launch on the current
// stream; the kernels are in mx_kernels.cu. Built into mfqat._C by setup.py only when torch has CUDA
// and nvcc is found (a CUDAExtension); a CPU-only torch builds csrc/*.cpp alone.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "mx_kernels.h"

namespace mfqat_cuda {
namespace {

MXFormat make_format(bool is_int, int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift, int64_t code_min,
                     int64_t code_max, double max_normal, bool ceil_rule) {
  const int32_t shift = static_cast<int32_t>(int_shift);
  return MXFormat{is_int ? 1 : 0, static_cast<int32_t>(emax), static_cast<int32_t>(emin), static_cast<int32_t>(mbits),
                  exp2i(shift), exp2i(-shift), static_cast<float>(code_min), static_cast<float>(code_max),
                  static_cast<float>(max_normal), ceil_rule ? 1 : 0};
}

int32_t dtype_code(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return kFloat32;
    case at::kBFloat16: return kBFloat16;
    case at::kHalf: return kFloat16;
    default:
      TORCH_CHECK(false, "mfqat CUDA op: dtype ", x.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
}

void check_input(const at::Tensor& x, int64_t block_size) {
  TORCH_CHECK(x.is_cuda(), "mfqat CUDA op: expected a CUDA tensor, got ", x.device());
  dtype_code(x);
  TORCH_CHECK(block_size > 0 && block_size <= 256, "mfqat CUDA op: block_size ", block_size, " not in [1, 256]");
  TORCH_CHECK(x.dim() > 0 && x.size(-1) % block_size == 0, "mfqat CUDA op: last dimension ",
              x.dim() > 0 ? x.size(-1) : 0, " is not a multiple of block_size ", block_size);
}

std::tuple<at::Tensor, at::Tensor> outputs(const at::Tensor& x, bool need_mask) {
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor mask = need_mask ? at::empty(x.sizes(), x.options().dtype(at::kBool))
                              : at::empty({0}, x.options().dtype(at::kBool));
  return {out, mask};
}

std::tuple<at::Tensor, at::Tensor> fake_quant_mx_cuda(const at::Tensor& x_in, int64_t block_size, bool is_int,
                                                      int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift,
                                                      int64_t code_min, int64_t code_max, double max_normal,
                                                      bool ceil_rule, bool need_mask) {
  check_input(x_in, block_size);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  auto [out, mask] = outputs(x, need_mask);
  const MXFormat p = make_format(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, ceil_rule);
  C10_CUDA_CHECK(launch_fake_quant(dtype_code(x), x.const_data_ptr(), out.data_ptr(),
                                   need_mask ? mask.data_ptr<bool>() : nullptr, x.numel() / block_size,
                                   static_cast<int32_t>(block_size), p, c10::cuda::getCurrentCUDAStream()));
  return {out, mask};
}

std::tuple<at::Tensor, at::Tensor> fake_quant_mx_through_cuda(
    const at::Tensor& x_in, int64_t block_size, bool a_is_int, int64_t a_emax, int64_t a_emin, int64_t a_mbits,
    int64_t a_int_shift, int64_t a_code_min, int64_t a_code_max, double a_max_normal, bool a_ceil_rule, bool is_int,
    int64_t emax, int64_t emin, int64_t mbits, int64_t int_shift, int64_t code_min, int64_t code_max,
    double max_normal, bool ceil_rule, bool need_mask) {
  check_input(x_in, block_size);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  auto [out, mask] = outputs(x, need_mask);
  const MXFormat a = make_format(a_is_int, a_emax, a_emin, a_mbits, a_int_shift, a_code_min, a_code_max,
                                 a_max_normal, a_ceil_rule);
  const MXFormat f = make_format(is_int, emax, emin, mbits, int_shift, code_min, code_max, max_normal, ceil_rule);
  C10_CUDA_CHECK(launch_through(dtype_code(x), x.const_data_ptr(), out.data_ptr(),
                                need_mask ? mask.data_ptr<bool>() : nullptr, x.numel() / block_size,
                                static_cast<int32_t>(block_size), a, f, c10::cuda::getCurrentCUDAStream()));
  return {out, mask};
}

}  // namespace

TORCH_LIBRARY_IMPL(mfqat, CUDA, m) {
  m.impl("fake_quant_mx", &fake_quant_mx_cuda);
  m.impl("fake_quant_mx_through", &fake_quant_mx_through_cuda);
}

}  // namespace mfqat_cuda

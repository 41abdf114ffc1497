// Launchers of the mfqat CUDA kernels (mx_kernels.cu), for the torch binding (mx_cuda_ops.cpp). Only
// CUDA runtime types here: the kernels compile with nvcc alone, without torch's headers.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "mx_block.cuh"

namespace mfqat_cuda {

// Fake-quantize n_blocks contiguous blocks of bs elements (1 <= bs <= 256) of dtype (Dtype) from x to
// out; mask (bool, one per element) is written where non-null. One warp per block.
cudaError_t launch_fake_quant(int32_t dtype, const void* x, void* out, bool* mask, int64_t n_blocks, int32_t bs,
                              MXFormat p, cudaStream_t stream);

// Train-through-anchor (anchor a, then format f) of the same layout, in one pass.
cudaError_t launch_through(int32_t dtype, const void* x, void* out, bool* mask, int64_t n_blocks, int32_t bs,
                           MXFormat a, MXFormat f, cudaStream_t stream);

}  // namespace mfqat_cuda

// 3x3 float16 / bfloat16 channels_last convolution (+ bias, + ReLU) on tensor cores
// (conv3x3_hmma.cu): an implicit GEMM with float32 accumulation, Conv+BN+ReLU's inference
// variant "hmma" (conv_bias_relu impl 3) and, opt-in, the convolution of its 16-bit
// channels_last training forward.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>

namespace cudadoctor_ops {
namespace hmmaconv {

// Whether conv3x3 takes this convolution: float16 or bfloat16 input and weight of one dtype on a
// device of compute capability 8.0 or newer, the input channels_last (and not also plain
// contiguous) with its data on a 16-byte boundary, a 3x3 filter, stride 1, padding 1, dilation 1,
// groups 1, input channels a multiple of 32 and output channels a multiple of 64.
bool applies(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// conv2d(input, weight, bias, stride 1, padding 1), float32 sums of the 16-bit products, then
// + bias (float32 or the input's dtype) and a ReLU when relu; rounded once to the input's dtype.
// Channels_last output. Where applies().
at::Tensor conv3x3(const at::Tensor& input, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, bool relu);

// Whether Conv+BN+ReLU's 16-bit channels_last training forward runs its convolution on this
// kernel (where applies()): CUDADOCTOR_OPS_CBR_HMMA_TRAIN=1 (read once; default off).
bool train_enabled();

}  // namespace hmmaconv
}  // namespace cudadoctor_ops

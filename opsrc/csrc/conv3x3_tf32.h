// Direct 3x3 float32 NCHW convolution (+ bias, + ReLU) on TF32 tensor cores (conv3x3_tf32.cu).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>

namespace cudadoctor_ops {
namespace tf32conv {

// Whether torch's float32 convolutions would run cuDNN's TF32 kernels: cuDNN enabled
// (torch.backends.cudnn.enabled) and TF32 allowed for them (torch.backends.cudnn.allow_tf32 /
// torch.backends.cudnn.conv.fp32_precision), the condition under which the TF32 kernel stands in
// for them.
bool tf32_allowed();

// The compute capability of `device` as major * 10 + minor (cached per device).
int compute_capability(int device);

// Whether conv3x3 takes this convolution: float32 contiguous (NCHW) input on a device
// of compute capability 8.0 or newer, a 3x3 filter, stride 1, padding 1, dilation 1, groups 1,
// input channels a multiple of 8, output channels a multiple of 64, and the staged rows of one
// tile within 110 KB of shared memory, or the device's limit where lower (rows up to about 200
// floats wide). TF32 permission is
// the caller's to check.
bool applies(const at::Tensor& input, const at::Tensor& weight, at::IntArrayRef stride,
             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// conv2d(input, weight, bias, stride 1, padding 1) with TF32 products, with a ReLU after it when
// relu; where applies(). Contiguous (NCHW) float32 output.
at::Tensor conv3x3(const at::Tensor& input, const at::Tensor& weight,
                   const std::optional<at::Tensor>& bias, bool relu);

// Output pixels per image from which Conv+BN+ReLU's training forward runs its convolution on this
// kernel (where applies() and tf32_allowed()) instead of cuDNN's: on the H200 it beat cuDNN's
// float32 NCHW convolution (a TF32 kernel in NHWC between two transposes) on 56x56 images and
// lost on 28x28 and smaller (the 256-pixel tiles run partly empty; see conv3x3_tf32.cu).
constexpr int64_t kTrainMinPixels = 56 * 56;

// Whether the training forward of this input would take the kernel, the conditions above aside:
// H * W >= kTrainMinPixels, and CUDADOCTOR_OPS_CBR_TF32_TRAIN not 0 (read once).
bool train_prefers(const at::Tensor& input);

}  // namespace tf32conv
}  // namespace cudadoctor_ops

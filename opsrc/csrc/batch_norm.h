// Entry points of the BatchNorm kernels (csrc/batch_norm_fwd.cu) and of the Conv+BN+ReLU forward
// (csrc/conv_bn_relu.cu) that other files call directly, outside the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <tuple>

namespace cudadoctor_ops {
namespace bn {

// batch_norm's training forward (out, save_mean, save_invstd, reserve) that also updates
// running_mean / running_var in place (contiguous [C], any floating dtype): running =
// (1 - momentum) * running + momentum * batch, with the unbiased batch variance. One launch
// fewer than batch_norm followed by batch_norm_update_stats.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batch_norm_train_update_cuda(
    const at::Tensor& input, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, const at::Tensor& running_mean,
    const at::Tensor& running_var, double momentum, double eps, c10::string_view activation);

// Training forward of BatchNorm + ReLU in one launch where it applies:
//   out (x's sizes and strides, 16-byte aligned) = relu((x - mean) * invstd * weight + bias);
//   mask (uint8, >= ceil(numel / 8) bytes): bit i of byte k = 1 when element 8k + i of out, in
//     memory order, is > 0 (Conv+BN+ReLU's mask);
//   save_mean / save_invstd (float32 [C]): the batch mean and 1 / sqrt(biased var + eps);
//   running_mean / running_var (both or neither; contiguous [C], any floating dtype): updated in
//     place, running = (1 - m) * running + m * batch with the unbiased batch variance;
//   num_batches_tracked (optional int64 [1]): incremented; m = momentum, or with momentum < 0
//     and num_batches_tracked given, 1 / (num_batches_tracked + 1) (the cumulative average).
// weight / bias: contiguous [C] of x's dtype or float32, or undefined. x is a CUDA tensor, 16-byte
// aligned, and either
//   channels-last float16 / bfloat16 ([N*HW, C] rows, C % 8 == 0): ONE launch of bn_tile_nhwc,
//     where a resident grid gives every thread <= 8 rows; or
//   contiguous (NCHW) float32 / float16 / bfloat16 with H*W % 8 == 0 (out contiguous):
//     bn_fused_nchw in one launch up to 32 MB (every block resident), else the statistics and
//     apply kernels; not for the cumulative average (left to the caller's kernels).
// Returns false, having launched and written nothing, when neither applies.
bool batch_norm_relu_mask_train(const at::Tensor& x, const at::Tensor& out, const at::Tensor& mask,
                                const at::Tensor& weight, const at::Tensor& bias, double eps,
                                const at::Tensor& save_mean, const at::Tensor& save_invstd,
                                const at::Tensor& running_mean, const at::Tensor& running_var,
                                const at::Tensor& num_batches_tracked, double momentum);

// The BatchNorm part of Conv+BN+ReLU's training backward (csrc/batch_norm_bwd.cu) on BatchNorm's
// backward kernels, the ReLU gradient taken from the bit mask (bit i of byte k = element 8k + i,
// in memory order, of the forward output was > 0): x is conv_out (contiguous or channels_last as
// returned by the forward), save_mean / save_invstd the forward's statistics, weight the BN weight
// (or undefined); writes dx (x's layout; may be undefined) and grad_weight / grad_bias (may be
// undefined). Returns false, having written nothing, when it does not apply (dtype, layout, mask).
// dres (optional; x's sizes, dtype and layout): where the kernels that run can, they also write
// the gradient of Conv+BN+Add+ReLU's residual into it (grad_out where the mask is set, else 0),
// and *dres_written (when given) says whether they did; otherwise the caller computes it.
bool relu_mask_backward_cuda(const at::Tensor& x, const at::Tensor& grad_out,
                             const at::Tensor& mask, const at::Tensor& save_mean,
                             const at::Tensor& save_invstd, const at::Tensor& weight,
                             const at::Tensor& dx, const at::Tensor& grad_weight,
                             const at::Tensor& grad_bias, const at::Tensor& dres = at::Tensor(),
                             bool* dres_written = nullptr);

}  // namespace bn

namespace cbr {

// CUDADOCTOR_OPS_CBR_TILE=0 (read once) keeps Conv+BN+ReLU's training forward off
// bn::batch_norm_relu_mask_train: the channels-last forward then runs the v2 kernels and the
// module forward updates the running statistics with the conv_bn_relu_update_stats op, as before.
inline bool tile_enabled() {
  static const bool on = [] {
    const char* e = std::getenv("CUDADOCTOR_OPS_CBR_TILE");
    return e == nullptr || e[0] != '0';
  }();
  return on;
}

// conv_bn_relu_train (out, conv_out, save_mean, save_invstd, mask) that also does what
// conv_bn_relu_update_stats does with (running_mean, running_var, num_batches_tracked, momentum,
// eps, count = values per channel): in the same launch as the batch statistics where
// bn::batch_norm_relu_mask_train applies, else with one more kernel. The running statistics
// (both or neither) and num_batches_tracked are checked as conv_bn_relu_update_stats checks them,
// before anything runs.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
conv_bn_relu_train_update_cuda(const at::Tensor& input, const at::Tensor& conv_weight,
                               const std::optional<at::Tensor>& conv_bias,
                               const std::optional<at::Tensor>& bn_weight,
                               const std::optional<at::Tensor>& bn_bias, double eps,
                               at::IntArrayRef stride, at::IntArrayRef padding,
                               at::IntArrayRef dilation, int64_t groups,
                               const std::optional<at::Tensor>& running_mean,
                               const std::optional<at::Tensor>& running_var,
                               const std::optional<at::Tensor>& num_batches_tracked,
                               double momentum);

// relu_mask_grad: grad_out where the mask of conv_out's elements is set, else 0.
at::Tensor relu_mask_grad_cuda(const at::Tensor& grad_out, const at::Tensor& conv_out,
                               const at::Tensor& mask);

// conv_bn_relu_backward's five results and, sixth, the gradient of conv_bn_add_relu_train's
// residual (relu_mask_grad's), which the BatchNorm backward's channels-last apply kernel writes
// from the grad_out and mask it reads anyway where it runs (saving relu_mask_grad's pass).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
conv_bn_add_relu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& input,
                               const at::Tensor& conv_weight, const at::Tensor& conv_out,
                               const std::optional<at::Tensor>& bn_weight,
                               const at::Tensor& save_mean, const at::Tensor& save_invstd,
                               const at::Tensor& mask, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                               std::array<bool, 5> output_mask);

}  // namespace cbr
}  // namespace cudadoctor_ops

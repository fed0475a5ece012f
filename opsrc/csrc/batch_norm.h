// Entry points of the BatchNorm kernels (csrc/batch_norm_fwd.cu) that the host code
// (csrc/batch_norm_host.cpp) calls directly, outside the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

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

}  // namespace bn
}  // namespace cudadoctor_ops

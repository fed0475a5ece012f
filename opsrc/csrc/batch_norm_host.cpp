// Host side of BatchNorm (kernels: batch_norm_fwd.cu, batch_norm_bwd.cu).
//
// * The autograd formula of cudadoctor_ops::batch_norm as a C++ autograd Function (Autograd
//   dispatch key): no Python runs in the forward or the backward, and the gradients of the
//   non-differentiable outputs (save_mean, save_invstd, reserve) are never materialised.
// * batch_norm_forward: CompositeImplicitAutograd op the Python layer calls once per forward:
//   batch_norm, then batch_norm_update_stats when training with running statistics.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <cmath>

#include <array>
#include <string>
#include <tuple>

#include "batch_norm.h"
#include "host_util.h"

namespace cudadoctor_ops {
namespace bn_host {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using FwdOut = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using BwdOut = std::tuple<Tensor, Tensor, Tensor>;

const c10::TypedOperatorHandle<FwdOut(const Tensor&, const OptTensor&, const OptTensor&,
                                      const OptTensor&, const OptTensor&, bool, double,
                                      c10::string_view)>&
forward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::batch_norm", "")
                       .typed<FwdOut(const Tensor&, const OptTensor&, const OptTensor&,
                                     const OptTensor&, const OptTensor&, bool, double,
                                     c10::string_view)>();
  return op;
}

const c10::TypedOperatorHandle<BwdOut(const Tensor&, const Tensor&, const OptTensor&,
                                      const OptTensor&, const Tensor&, const Tensor&,
                                      const Tensor&, bool, c10::string_view,
                                      std::array<bool, 3>)>&
backward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::batch_norm_backward", "")
                       .typed<BwdOut(const Tensor&, const Tensor&, const OptTensor&,
                                     const OptTensor&, const Tensor&, const Tensor&,
                                     const Tensor&, bool, c10::string_view,
                                     std::array<bool, 3>)>();
  return op;
}

const c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                    double, double, int64_t)>&
update_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::batch_norm_update_stats", "")
                       .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   double, double, int64_t)>();
  return op;
}

// update_momentum >= 0 (training with running statistics, eager CUDA tensors only): the forward
// calls the CUDA implementation directly and it updates the running statistics in the same
// launch; < 0: the batch_norm op through the dispatcher, running statistics untouched.
struct BatchNormFn : public torch::autograd::Function<BatchNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input,
                               const OptTensor& weight, const OptTensor& bias,
                               const OptTensor& running_mean, const OptTensor& running_var,
                               bool training, double eps, c10::string_view activation,
                               double update_momentum) {
    Tensor out, save_mean, save_invstd, reserve;
    if (update_momentum >= 0) {
      // the version bumps first: they refuse an inference tensor outside inference mode before
      // anything is written
      torch::autograd::impl::bump_version(*running_mean);
      torch::autograd::impl::bump_version(*running_var);
      std::tie(out, save_mean, save_invstd, reserve) = bn::batch_norm_train_update_cuda(
          input, weight, bias, *running_mean, *running_var, update_momentum, eps, activation);
    } else {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(out, save_mean, save_invstd, reserve) = forward_op().call(
          input, weight, bias, running_mean, running_var, training, eps, activation);
    }
    ctx->save_for_backward({input, has(weight) ? *weight : Tensor(), has(bias) ? *bias : Tensor(),
                            save_mean, save_invstd, reserve});
    ctx->saved_data["training"] = training;
    ctx->saved_data["activation"] = std::string(activation);
    ctx->saved_data["has_w"] = has(weight);
    ctx->saved_data["has_b"] = has(bias);
    ctx->mark_non_differentiable({save_mean, save_invstd, reserve});
    ctx->set_materialize_grads(false);
    return {out, save_mean, save_invstd, reserve};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // one entry per forward argument (tensors or not); only tensor inputs get gradients
    variable_list result(9);
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return result;
    const bool has_w = ctx->saved_data["has_w"].toBool();
    const bool has_b = ctx->saved_data["has_b"].toBool();
    // needs_input_grad counts only the tensor inputs that were given
    size_t edge = 0;
    const bool n_in = ctx->needs_input_grad(edge++);
    const bool n_w = has_w && ctx->needs_input_grad(edge++);
    const bool n_b = has_b && ctx->needs_input_grad(edge++);
    if (!(n_in || n_w || n_b)) return result;
    auto saved = ctx->get_saved_variables();
    OptTensor weight, bias;
    if (saved[1].defined()) weight = saved[1];
    if (saved[2].defined()) bias = saved[2];
    const std::string activation = ctx->saved_data["activation"].toStringRef();
    auto r = backward_op().call(grad_out, saved[0], weight, bias, saved[3], saved[4], saved[5],
                                ctx->saved_data["training"].toBool(), activation,
                                {n_in, n_w, n_b});
    if (n_in) result[0] = std::get<0>(r);
    if (n_w) result[1] = std::get<1>(r);
    if (n_b) result[2] = std::get<2>(r);
    return result;
  }
};

FwdOut batch_norm_autograd(const Tensor& input, const OptTensor& weight, const OptTensor& bias,
                           const OptTensor& running_mean, const OptTensor& running_var,
                           bool training, double eps, c10::string_view activation) {
  auto r = BatchNormFn::apply(input, weight, bias, running_mean, running_var, training, eps,
                              activation, -1.0);
  return {r[0], r[1], r[2], r[3]};
}

bool eager_fast_path(const Tensor& input, const OptTensor& weight, const OptTensor& bias,
                     const OptTensor& running_mean, const OptTensor& running_var) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  if (c10::impl::tls_local_dispatch_key_set().included_.has(c10::DispatchKey::Python))
    return false;
  if (!plain_cuda(input) || !plain_cuda(*running_mean) || !plain_cuda(*running_var)) return false;
  if (!running_mean->is_contiguous() || !running_var->is_contiguous()) return false;
  if (has(weight) && !plain_cuda(*weight)) return false;
  if (has(bias) && !plain_cuda(*bias)) return false;
  return input.numel() > 0;
}

// One forward of F.batch_norm semantics: batch statistics and the in-place running-statistics
// update when training, the running statistics otherwise.
Tensor batch_norm_forward(const Tensor& input, const OptTensor& weight, const OptTensor& bias,
                          const OptTensor& running_mean, const OptTensor& running_var,
                          bool training, double momentum, double eps,
                          c10::string_view activation) {
  TORCH_CHECK_VALUE(std::isfinite(momentum),
                    "batch_norm: momentum must be a finite float, got ", momentum);
  if (!training) {
    return std::get<0>(
        forward_op().call(input, weight, bias, running_mean, running_var, false, eps, activation));
  }
  TORCH_CHECK_VALUE(input.dim() < 2 || input.sym_numel() != input.sym_size(1),
                    "Expected more than 1 value per channel when training, got input size ",
                    input.sym_sizes());
  if (has(running_mean) && has(running_var) &&
      eager_fast_path(input, weight, bias, running_mean, running_var)) {
    // eager: one C++ autograd node whose forward updates the running statistics in its launch
    return BatchNormFn::apply(input, weight, bias, running_mean, running_var, true, eps,
                              activation, momentum)[0];
  }
  auto r = forward_op().call(input, weight, bias, OptTensor(), OptTensor(), true, eps, activation);
  if (has(running_mean) && has(running_var) && input.numel() > 0) {
    const int64_t count = input.numel() / input.size(1);
    update_op().call(*running_mean, *running_var, std::get<1>(r), std::get<2>(r), momentum, eps,
                     count);
  }
  return std::get<0>(r);
}

}  // namespace
}  // namespace bn_host
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, Autograd, m) {
  m.impl("batch_norm", &cudadoctor_ops::bn_host::batch_norm_autograd);
}

TORCH_LIBRARY_IMPL(cudadoctor_ops, CompositeImplicitAutograd, m) {
  m.impl("batch_norm_forward", &cudadoctor_ops::bn_host::batch_norm_forward);
}

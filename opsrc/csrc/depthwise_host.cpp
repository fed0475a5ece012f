// Host side of the depthwise convolution (kernels: depthwise*.cu): the autograd formula of
// cudadoctor_ops::depthwise_conv2d as a C++ autograd Function (Autograd dispatch key), so no
// Python runs in the forward or the backward.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "host_util.h"

namespace cudadoctor_ops {
namespace dw_host {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const OptTensor&,
                                      at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t)>&
forward_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::depthwise_conv2d", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&,
                                     at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                     int64_t)>();
  return op;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&,
                                      at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t)>&
backward_input_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::depthwise_conv2d_backward_input", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&,
                                     at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                     int64_t)>();
  return op;
}

const c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, at::IntArrayRef, at::IntArrayRef,
    at::IntArrayRef, bool, int64_t)>&
backward_weight_op() {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("cudadoctor_ops::depthwise_conv2d_backward_weight", "")
          .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                            bool, int64_t)>();
  return op;
}

struct DepthwiseFn : public torch::autograd::Function<DepthwiseFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                               const OptTensor& bias, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, int64_t impl) {
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = forward_op().call(input, weight, bias, stride, padding, dilation, impl);
    }
    ctx->save_for_backward({input, weight});
    ctx->saved_data["stride"] = vec(stride);
    ctx->saved_data["padding"] = vec(padding);
    ctx->saved_data["dilation"] = vec(dilation);
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["has_bias"] = has(bias);
    ctx->set_materialize_grads(false);
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // one entry per forward argument (tensors or not); only tensor inputs get gradients
    variable_list result(7);
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return result;
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    // needs_input_grad counts only the tensor inputs that were given
    const bool n_in = ctx->needs_input_grad(0);
    const bool n_w = ctx->needs_input_grad(1);
    const bool n_b = has_bias && ctx->needs_input_grad(2);
    if (!(n_in || n_w || n_b)) return result;
    auto saved = ctx->get_saved_variables();
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const int64_t impl = ctx->saved_data["impl"].toInt();
    if (n_in) {
      result[0] =
          backward_input_op().call(grad_out, saved[0], saved[1], stride, padding, dilation, impl);
    }
    if (n_w || n_b) {
      auto r = backward_weight_op().call(grad_out, saved[0], saved[1], stride, padding, dilation,
                                         n_b, impl);
      if (n_w) result[1] = std::get<0>(r);
      if (n_b) result[2] = std::get<1>(r);
    }
    return result;
  }
};

Tensor depthwise_autograd(const Tensor& input, const Tensor& weight, const OptTensor& bias,
                          at::IntArrayRef stride, at::IntArrayRef padding,
                          at::IntArrayRef dilation, int64_t impl) {
  return DepthwiseFn::apply(input, weight, bias, stride, padding, dilation, impl)[0];
}

}  // namespace
}  // namespace dw_host
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, Autograd, m) {
  m.impl("depthwise_conv2d", &cudadoctor_ops::dw_host::depthwise_autograd);
}

// Host side of the fused Conv2d -> BatchNorm2d -> ReLU ops (kernels: conv_bn_relu.cu).
//
// * Autograd formulas of conv_bn_relu_train and conv_bias_relu as C++ autograd Functions (the
//   Autograd dispatch key): no Python runs in the forward or the backward of a training step.
// * conv_bn_relu_forward: CompositeImplicitAutograd op that a module calls once per training
//   forward: conv_bn_relu_train, then conv_bn_relu_update_stats (running statistics and
//   num_batches_tracked in one kernel).
// * CPU kernels of every op, written with ATen ops. They follow the CUDA kernels' contract (same
//   outputs, same bit-packed mask) so the ops also work on CPU tensors.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <array>
#include <tuple>
#include <vector>

#include "batch_norm.h"
#include "env_setting.h"
#include "host_util.h"

namespace cudadoctor_ops {
namespace cbr_host {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using TrainOut = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

const c10::TypedOperatorHandle<TrainOut(const Tensor&, const Tensor&, const OptTensor&,
                                        const OptTensor&, const OptTensor&, double,
                                        at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                        int64_t)>&
train_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::conv_bn_relu_train", "")
                       .typed<TrainOut(const Tensor&, const Tensor&, const OptTensor&,
                                       const OptTensor&, const OptTensor&, double, at::IntArrayRef,
                                       at::IntArrayRef, at::IntArrayRef, int64_t)>();
  return op;
}

const c10::TypedOperatorHandle<TrainOut(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&, const Tensor&,
    const Tensor&, const Tensor&, at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
    std::array<bool, 5>)>&
backward_op() {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("cudadoctor_ops::conv_bn_relu_backward", "")
          .typed<TrainOut(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const OptTensor&, const Tensor&, const Tensor&, const Tensor&,
                          at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
                          std::array<bool, 5>)>();
  return op;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const OptTensor&,
                                      at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
                                      int64_t)>&
eval_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::conv_bias_relu", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&,
                                     at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
                                     int64_t)>();
  return op;
}

const c10::TypedOperatorHandle<TrainOut(const Tensor&, const Tensor&, const OptTensor&,
                                        const OptTensor&, const OptTensor&, const Tensor&, double,
                                        at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                        int64_t)>&
train_add_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::conv_bn_add_relu_train", "")
                       .typed<TrainOut(const Tensor&, const Tensor&, const OptTensor&,
                                       const OptTensor&, const OptTensor&, const Tensor&, double,
                                       at::IntArrayRef, at::IntArrayRef, at::IntArrayRef,
                                       int64_t)>();
  return op;
}

const c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&)>&
mask_grad_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::relu_mask_grad", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&)>();
  return op;
}

const c10::TypedOperatorHandle<void(const OptTensor&, const OptTensor&, const OptTensor&,
                                    const Tensor&, const Tensor&, double, double, int64_t)>&
update_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("cudadoctor_ops::conv_bn_relu_update_stats", "")
                       .typed<void(const OptTensor&, const OptTensor&, const OptTensor&,
                                   const Tensor&, const Tensor&, double, double, int64_t)>();
  return op;
}

// ---------------------------------------------------------------- autograd

// What the training ops' autograd Functions keep for conv_bn_relu_backward, from the op's
// outputs r = (out, conv_out, save_mean, save_invstd, mask); returns them as the Function's
// outputs.
variable_list save_train(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                         const OptTensor& conv_bias, const OptTensor& bn_weight,
                         const OptTensor& bn_bias, at::IntArrayRef stride,
                         at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                         const TrainOut& r) {
  const auto& [out, conv_out, save_mean, save_invstd, mask] = r;
  ctx->save_for_backward({input, weight, conv_out, has(bn_weight) ? *bn_weight : Tensor(),
                          save_mean, save_invstd, mask});
  ctx->saved_data["stride"] = vec(stride);
  ctx->saved_data["padding"] = vec(padding);
  ctx->saved_data["dilation"] = vec(dilation);
  ctx->saved_data["groups"] = groups;
  ctx->saved_data["has_cb"] = has(conv_bias);
  ctx->saved_data["has_bw"] = has(bn_weight);
  ctx->saved_data["has_bb"] = has(bn_bias);
  ctx->saved_data["bb_dtype"] =
      static_cast<int64_t>(has(bn_bias) ? bn_bias->scalar_type() : at::kFloat);
  ctx->mark_non_differentiable({conv_out, save_mean, save_invstd, mask});
  ctx->set_materialize_grads(false);
  return {out, conv_out, save_mean, save_invstd, mask};
}

// conv_bn_relu_backward's results r, where `need` asks for them, into result[0 .. 4] (the BN
// bias gradient in the bias' dtype).
void set_train_grads(AutogradContext* ctx, const std::array<bool, 5>& need,
                     const std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>& r,
                     variable_list& result) {
  if (need[0]) result[0] = std::get<0>(r);
  if (need[1]) result[1] = std::get<1>(r);
  if (need[2]) result[2] = std::get<2>(r);
  if (need[3]) result[3] = std::get<3>(r);
  if (need[4]) {
    const auto dt = static_cast<at::ScalarType>(ctx->saved_data["bb_dtype"].toInt());
    const Tensor& g = std::get<4>(r);
    result[4] = g.scalar_type() == dt ? g : g.to(dt);
  }
}

// An eager call on plain CUDA tensors (no dispatch mode, no Python key): the backward may call the
// CUDA implementation directly, as the forward's eager path does.
bool eager_cuda(std::initializer_list<const Tensor*> ts) {
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0) return false;
  if (c10::impl::tls_local_dispatch_key_set().included_.has(c10::DispatchKey::Python))
    return false;
  for (const Tensor* t : ts)
    if (t->defined() && !plain_cuda(*t)) return false;
  return true;
}

// The training Functions' backward: one entry per forward argument (n_args; tensors or not, only
// tensor inputs get gradients); conv_bn_relu_backward with the saved mask for input, conv weight
// / bias and BN weight / bias (forward arguments 0 .. 4), and with `residual` (forward argument
// 5, conv_bn_add_relu_train) relu_mask_grad for the residual (in an eager CUDA call both in
// conv_bn_add_relu_backward_cuda, the residual's from the same kernels where they can).
// needs_input_grad counts only the tensor inputs that were given.
variable_list train_backward(AutogradContext* ctx, const variable_list& grads, size_t n_args,
                             bool residual) {
  variable_list result(n_args);
  const Tensor& grad_out = grads[0];
  if (!grad_out.defined()) return result;
  size_t edge = 0;
  const bool n_in = ctx->needs_input_grad(edge++);
  const bool n_w = ctx->needs_input_grad(edge++);
  const bool n_cb = ctx->saved_data["has_cb"].toBool() && ctx->needs_input_grad(edge++);
  const bool n_bw = ctx->saved_data["has_bw"].toBool() && ctx->needs_input_grad(edge++);
  const bool n_bb = ctx->saved_data["has_bb"].toBool() && ctx->needs_input_grad(edge++);
  const std::array<bool, 5> need = {n_in, n_w, n_cb, n_bw, n_bb};
  const bool n_res = residual && ctx->needs_input_grad(edge);
  const bool any = n_in || n_w || n_cb || n_bw || n_bb;
  if (!(any || n_res)) return result;
  auto saved = ctx->get_saved_variables();
  OptTensor bn_weight;
  if (saved[3].defined()) bn_weight = saved[3];
  if (n_res && any &&
      eager_cuda({&grad_out, &saved[0], &saved[1], &saved[2], &saved[3], &saved[4], &saved[5],
                  &saved[6]}) &&
      env_switch("CUDADOCTOR_OPS_CBR_RES_GRAD_FUSED") != 0) {
    // eager CUDA: the residual's gradient from the BatchNorm backward's kernels where they can
    // write it (no separate relu_mask_grad pass); CUDADOCTOR_OPS_CBR_RES_GRAD_FUSED=0 (read at
    // every call) takes the ops' way below
    auto r = cbr::conv_bn_add_relu_backward_cuda(
        grad_out, saved[0], saved[1], saved[2], bn_weight, saved[4], saved[5], saved[6],
        ctx->saved_data["stride"].toIntVector(), ctx->saved_data["padding"].toIntVector(),
        ctx->saved_data["dilation"].toIntVector(), ctx->saved_data["groups"].toInt(), need);
    result[5] = std::get<5>(r);
    set_train_grads(ctx, need, {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r),
                                std::get<4>(r)}, result);
    return result;
  }
  if (n_res) result[5] = mask_grad_op().call(grad_out, saved[2], saved[6]);
  if (!any) return result;
  auto r = backward_op().call(grad_out, saved[0], saved[1], saved[2], bn_weight, saved[4],
                              saved[5], saved[6], ctx->saved_data["stride"].toIntVector(),
                              ctx->saved_data["padding"].toIntVector(),
                              ctx->saved_data["dilation"].toIntVector(),
                              ctx->saved_data["groups"].toInt(), need);
  set_train_grads(ctx, need, r, result);
  return result;
}

// update (eager CUDA tensors only, see forward_composite): the forward calls the CUDA
// implementation directly and it also updates running_mean / running_var / num_batches_tracked
// (conv_bn_relu_update_stats' semantics), in the launch of the batch statistics where it can;
// otherwise the conv_bn_relu_train op through the dispatcher, those three untouched.
struct TrainFn : public torch::autograd::Function<TrainFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                               const OptTensor& conv_bias, const OptTensor& bn_weight,
                               const OptTensor& bn_bias, double eps, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation,
                               int64_t groups, const OptTensor& running_mean,
                               const OptTensor& running_var,
                               const OptTensor& num_batches_tracked, double momentum,
                               bool update) {
    TrainOut r;
    if (update) {
      // the version bumps first: they refuse an inference tensor outside inference mode before
      // anything is written
      for (const OptTensor* t : {&running_mean, &running_var, &num_batches_tracked})
        if (has(*t)) torch::autograd::impl::bump_version(**t);
      at::AutoDispatchBelowADInplaceOrView below;
      r = cbr::conv_bn_relu_train_update_cuda(input, weight, conv_bias, bn_weight, bn_bias, eps,
                                              stride, padding, dilation, groups, running_mean,
                                              running_var, num_batches_tracked, momentum);
    } else {
      at::AutoDispatchBelowADInplaceOrView below;
      r = train_op().call(input, weight, conv_bias, bn_weight, bn_bias, eps, stride, padding,
                          dilation, groups);
    }
    return save_train(ctx, input, weight, conv_bias, bn_weight, bn_bias, stride, padding,
                      dilation, groups, r);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return train_backward(ctx, grads, 15, false);
  }
};

// conv_bn_add_relu_train: TrainFn's formulas (conv_bn_relu_backward with the mask) for input,
// conv weight / bias and BN weight / bias, and relu_mask_grad (grad_out where out > 0) for the
// residual.
struct TrainAddFn : public torch::autograd::Function<TrainAddFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                               const OptTensor& conv_bias, const OptTensor& bn_weight,
                               const OptTensor& bn_bias, const Tensor& residual, double eps,
                               at::IntArrayRef stride, at::IntArrayRef padding,
                               at::IntArrayRef dilation, int64_t groups) {
    TrainOut r;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      r = train_add_op().call(input, weight, conv_bias, bn_weight, bn_bias, residual, eps, stride,
                              padding, dilation, groups);
    }
    return save_train(ctx, input, weight, conv_bias, bn_weight, bn_bias, stride, padding,
                      dilation, groups, r);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return train_backward(ctx, grads, 11, true);
  }
};

TrainOut train_add_autograd(const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                            const OptTensor& bn_weight, const OptTensor& bn_bias,
                            const Tensor& residual, double eps, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  auto r = TrainAddFn::apply(input, weight, conv_bias, bn_weight, bn_bias, residual, eps, stride,
                             padding, dilation, groups);
  return {r[0], r[1], r[2], r[3], r[4]};
}

TrainOut train_autograd(const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                        const OptTensor& bn_weight, const OptTensor& bn_bias, double eps,
                        at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                        int64_t groups) {
  auto r = TrainFn::apply(input, weight, conv_bias, bn_weight, bn_bias, eps, stride, padding,
                          dilation, groups, OptTensor(), OptTensor(), OptTensor(), 0.0, false);
  return {r[0], r[1], r[2], r[3], r[4]};
}

struct EvalFn : public torch::autograd::Function<EvalFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& input, const Tensor& weight,
                               const OptTensor& bias, at::IntArrayRef stride,
                               at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                               int64_t impl) {
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      out = eval_op().call(input, weight, bias, stride, padding, dilation, groups, impl);
    }
    ctx->save_for_backward({input, weight, out});
    ctx->saved_data["stride"] = vec(stride);
    ctx->saved_data["padding"] = vec(padding);
    ctx->saved_data["dilation"] = vec(dilation);
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["has_bias"] = has(bias);
    ctx->saved_data["bias_dtype"] =
        static_cast<int64_t>(has(bias) ? bias->scalar_type() : at::kFloat);
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(8);
    const Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return result;
    auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    size_t edge = 0;
    const bool n_in = ctx->needs_input_grad(edge++);
    const bool n_w = ctx->needs_input_grad(edge++);
    const bool n_b = has_bias && ctx->needs_input_grad(edge++);
    if (!(n_in || n_w || n_b)) return result;
    const Tensor g = grad_out * saved[2].gt(0);
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const Tensor& weight = saved[1];
    std::vector<int64_t> bias_sizes = {weight.size(0)};
    const std::vector<int64_t> zero = {0, 0};
    const at::OptionalIntArrayRef bias_arg =
        n_b ? at::OptionalIntArrayRef(bias_sizes) : at::OptionalIntArrayRef();
    auto r = at::convolution_backward(g, saved[0], weight, bias_arg, stride, padding, dilation,
                                      false, zero, groups, {n_in, n_w, n_b});
    if (n_in) result[0] = std::get<0>(r);
    if (n_w) result[1] = std::get<1>(r);
    if (n_b) {
      const auto dt = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
      Tensor gb = std::get<2>(r);
      result[2] = gb.scalar_type() == dt ? gb : gb.to(dt);
    }
    return result;
  }
};

Tensor eval_autograd(const Tensor& input, const Tensor& weight, const OptTensor& bias,
                     at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                     int64_t groups, int64_t impl) {
  return EvalFn::apply(input, weight, bias, stride, padding, dilation, groups, impl)[0];
}

// Whether forward_composite may call the CUDA implementation directly (TrainFn with update):
// an eager call on plain CUDA tensors, running statistics contiguous, the switch not off.
bool eager_fast_path(const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                     const OptTensor& bn_weight, const OptTensor& bn_bias,
                     const OptTensor& running_mean, const OptTensor& running_var,
                     const OptTensor& num_batches_tracked) {
  if (!cbr::tile_enabled()) return false;
  if (!eager_cuda({}) || !plain_cuda(input) || !plain_cuda(weight) || input.numel() == 0)
    return false;
  for (const OptTensor* t : {&conv_bias, &bn_weight, &bn_bias, &num_batches_tracked})
    if (has(*t) && !plain_cuda(**t)) return false;
  for (const OptTensor* t : {&running_mean, &running_var})
    if (has(*t) && (!plain_cuda(**t) || !(*t)->is_contiguous())) return false;
  return true;
}

// The running statistics and num_batches_tracked after a training op r = (out, conv_out,
// save_mean, save_invstd, mask), in one small kernel (conv_bn_relu_update_stats); the statistics
// only where both are given.
void update_running(const TrainOut& r, const OptTensor& running_mean, const OptTensor& running_var,
                    const OptTensor& num_batches_tracked, double momentum, double eps) {
  const bool stats = has(running_mean) && has(running_var);
  if (!(stats || has(num_batches_tracked))) return;
  const Tensor& conv_out = std::get<1>(r);
  // an empty batch still counts as a step (num_batches_tracked), like BatchNorm2d
  const int64_t count = conv_out.numel() > 0 ? conv_out.numel() / conv_out.size(1) : 0;
  update_op().call(stats ? running_mean : OptTensor(), stats ? running_var : OptTensor(),
                   num_batches_tracked, std::get<2>(r), std::get<3>(r), momentum, eps, count);
}

// One training forward of a Conv2d -> BatchNorm2d -> ReLU module: the fused op, then the running
// statistics (and num_batches_tracked) in one small kernel; in an eager call on CUDA tensors the
// statistics go with the fused op instead (TrainFn's update: in its launch where it can).
Tensor forward_composite(const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                         const OptTensor& bn_weight, const OptTensor& bn_bias,
                         const OptTensor& running_mean, const OptTensor& running_var,
                         const OptTensor& num_batches_tracked, double momentum, double eps,
                         at::IntArrayRef stride, at::IntArrayRef padding,
                         at::IntArrayRef dilation, int64_t groups) {
  const bool stats = has(running_mean) && has(running_var);
  if ((stats || has(num_batches_tracked)) &&
      eager_fast_path(input, weight, conv_bias, bn_weight, bn_bias, running_mean, running_var,
                      num_batches_tracked)) {
    return TrainFn::apply(input, weight, conv_bias, bn_weight, bn_bias, eps, stride, padding,
                          dilation, groups, stats ? running_mean : OptTensor(),
                          stats ? running_var : OptTensor(), num_batches_tracked, momentum,
                          true)[0];
  }
  auto r = train_op().call(input, weight, conv_bias, bn_weight, bn_bias, eps, stride, padding,
                           dilation, groups);
  update_running(r, running_mean, running_var, num_batches_tracked, momentum, eps);
  return std::get<0>(r);
}

// One training forward of a Conv2d -> BatchNorm2d -> (+ residual) -> ReLU block: the fused op,
// then the running statistics and num_batches_tracked in one small kernel.
Tensor forward_add_composite(const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                             const OptTensor& bn_weight, const OptTensor& bn_bias,
                             const Tensor& residual, const OptTensor& running_mean,
                             const OptTensor& running_var, const OptTensor& num_batches_tracked,
                             double momentum, double eps, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  auto r = train_add_op().call(input, weight, conv_bias, bn_weight, bn_bias, residual, eps, stride,
                               padding, dilation, groups);
  update_running(r, running_mean, running_var, num_batches_tracked, momentum, eps);
  return std::get<0>(r);
}

// ---------------------------------------------------------------- CPU kernels (ATen)

bool is_cl(const Tensor& t) {
  return t.dim() == 4 && !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// Elements of t (logical NCHW) in memory order of the layout `cl` says.
Tensor memory_order(const Tensor& t, bool cl) {
  return cl ? t.permute({0, 2, 3, 1}).reshape(-1) : t.reshape(-1);
}

Tensor pack_bits(const Tensor& positive, bool cl) {
  Tensor flat = memory_order(positive, cl).to(at::kByte);
  const int64_t n = flat.numel();
  const int64_t pad = (8 - n % 8) % 8;
  if (pad) flat = at::constant_pad_nd(flat, {0, pad}, 0);
  const Tensor weights = at::tensor({1, 2, 4, 8, 16, 32, 64, 128}, flat.options().dtype(at::kLong));
  return (flat.reshape({-1, 8}).to(at::kLong) * weights).sum(1).to(at::kByte);
}

Tensor unpack_bits(const Tensor& mask, const Tensor& like, bool cl) {
  const Tensor shifts = at::arange(8, mask.options().dtype(at::kLong));
  Tensor bits = mask.to(at::kLong).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1);
  bits = bits.reshape(-1).narrow(0, 0, like.numel()).to(at::kBool);
  if (cl) return bits.reshape({like.size(0), like.size(2), like.size(3), like.size(1)}).permute({0, 3, 1, 2});
  return bits.reshape(like.sizes());
}

at::ScalarType acc_of(const Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

Tensor per_channel(const Tensor& t) { return t.reshape({1, -1, 1, 1}); }

void check_cpu(const char* op, const Tensor& input, const Tensor& weight, int64_t groups) {
  TORCH_CHECK(input.dim() == 4, op, ": input must be 4-D (N, C, H, W), got sizes ", input.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type(), op, ": conv_weight has dtype ",
              weight.scalar_type(), " but input has dtype ", input.scalar_type(),
              "; they must match");
  TORCH_CHECK(groups >= 1 && weight.dim() == 4 && weight.size(1) * groups == input.size(1), op,
              ": conv_weight must have shape [C_out, C_in / groups, kh, kw] with C_in = ",
              input.size(1), " and groups = ", groups, ", got ", weight.sizes());
}

// residual (may be null): out = relu(bn(conv) + residual) with the roundings of the CUDA kernel
// (bn_add_relu: the BatchNorm output and the sum each rounded to the input's dtype).
TrainOut train_cpu_impl(const char* op, const Tensor& input, const Tensor& weight,
                        const OptTensor& conv_bias, const OptTensor& bn_weight,
                        const OptTensor& bn_bias, double eps, at::IntArrayRef stride,
                        at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                        const Tensor* residual) {
  check_cpu(op, input, weight, groups);
  const std::vector<int64_t> zero = {0, 0};
  Tensor conv_out = at::convolution(input, weight, conv_bias, stride, padding, dilation, false,
                                    zero, groups);
  const bool cl = is_cl(conv_out);
  if (!cl) conv_out = conv_out.contiguous();
  const int64_t C = conv_out.size(1);
  for (const auto* p : {&bn_weight, &bn_bias}) {
    if (has(*p))
      TORCH_CHECK((*p)->dim() == 1 && (*p)->size(0) == C, op, ": ",
                  p == &bn_weight ? "bn_weight" : "bn_bias", " must have shape [", C,
                  "] (one value per output channel of the convolution), got ", (*p)->sizes());
  }
  TORCH_CHECK(conv_out.numel() == 0 || conv_out.numel() / C > 1, op,
              ": expected more than 1 value per channel when training, got conv output size ",
              conv_out.sizes());
  if (residual != nullptr) check_residual(op, *residual, conv_out);
  const auto acc = acc_of(input);
  if (conv_out.numel() == 0) {
    const auto z = at::zeros({C}, input.options().dtype(acc));
    return {at::empty_like(conv_out), conv_out, z, z.clone(),
            at::zeros({0}, input.options().dtype(at::kByte))};
  }
  const Tensor xa = conv_out.to(acc);
  auto vm = at::var_mean(xa, at::IntArrayRef({0, 2, 3}), /*correction=*/0, /*keepdim=*/false);
  const Tensor var = std::get<0>(vm), mean = std::get<1>(vm);
  const Tensor invstd = (var + eps).rsqrt();
  Tensor scale = has(bn_weight) ? bn_weight->to(acc) * invstd : invstd;
  Tensor y = (xa - per_channel(mean)) * per_channel(scale);
  if (has(bn_bias)) y = y + per_channel(bn_bias->to(acc));
  y = y.to(input.scalar_type());
  if (residual != nullptr) y = (y.to(acc) + residual->to(acc)).to(input.scalar_type());
  if (cl) y = y.contiguous(at::MemoryFormat::ChannelsLast);
  const Tensor mask = pack_bits(y.gt(0), cl);
  const Tensor out = at::relu(y);
  return {out, conv_out, mean, invstd, mask};
}

TrainOut train_cpu(const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                   const OptTensor& bn_weight, const OptTensor& bn_bias, double eps,
                   at::IntArrayRef stride, at::IntArrayRef padding, at::IntArrayRef dilation,
                   int64_t groups) {
  return train_cpu_impl("cudadoctor_ops.conv_bn_relu", input, weight, conv_bias, bn_weight,
                        bn_bias, eps, stride, padding, dilation, groups, nullptr);
}

TrainOut train_add_cpu(const Tensor& input, const Tensor& weight, const OptTensor& conv_bias,
                       const OptTensor& bn_weight, const OptTensor& bn_bias,
                       const Tensor& residual, double eps, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  return train_cpu_impl("cudadoctor_ops.conv_bn_add_relu", input, weight, conv_bias, bn_weight,
                        bn_bias, eps, stride, padding, dilation, groups, &residual);
}

Tensor relu_mask_grad_cpu(const Tensor& grad_out, const Tensor& conv_out, const Tensor& mask) {
  TORCH_CHECK(grad_out.sizes() == conv_out.sizes() &&
                  grad_out.scalar_type() == conv_out.scalar_type() && conv_out.dim() == 4,
              "cudadoctor_ops.relu_mask_grad: grad_out must match conv_out (", conv_out.sizes(),
              ", ", conv_out.scalar_type(), "), got ", grad_out.sizes(), ", ",
              grad_out.scalar_type());
  TORCH_CHECK(mask.scalar_type() == at::kByte && mask.numel() * 8 >= conv_out.numel(),
              "cudadoctor_ops.relu_mask_grad: mask must be the uint8 mask returned with conv_out");
  const bool cl = is_cl(conv_out);
  Tensor g = grad_out * unpack_bits(mask, conv_out, cl);
  return g.contiguous(cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
}

TrainOut backward_cpu(const Tensor& grad_out, const Tensor& input, const Tensor& weight,
                      const Tensor& conv_out, const OptTensor& bn_weight, const Tensor& save_mean,
                      const Tensor& save_invstd, const Tensor& mask, at::IntArrayRef stride,
                      at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                      std::array<bool, 5> output_mask) {
  check_cpu("cudadoctor_ops.conv_bn_relu_backward", input, weight, groups);
  const auto acc = acc_of(input);
  const bool cl = is_cl(conv_out);
  const auto empty = [&] { return at::empty({0}, input.options()); };
  Tensor gi = empty(), gw = empty(), gcb = empty(), gbw = empty(), gbb = empty();
  const int64_t C = conv_out.size(1);
  const int64_t M = C > 0 ? conv_out.numel() / C : 0;
  const auto pdtype = has(bn_weight) ? bn_weight->scalar_type() : acc;
  if (conv_out.numel() == 0) {
    if (output_mask[3]) gbw = at::zeros({C}, input.options().dtype(pdtype));
    if (output_mask[4]) gbb = at::zeros({C}, input.options().dtype(pdtype));
    if (output_mask[0]) gi = at::zeros_like(input);
    if (output_mask[1]) gw = at::zeros_like(weight);
    if (output_mask[2]) gcb = at::zeros({weight.size(0)}, input.options());
    return {gi, gw, gcb, gbw, gbb};
  }
  const Tensor pos = unpack_bits(mask, conv_out, cl);
  const Tensor g = grad_out.to(acc) * pos;
  const Tensor xmu = conv_out.to(acc) - per_channel(save_mean);
  const Tensor sg = g.sum(at::IntArrayRef({0, 2, 3}));
  const Tensor sgx = (g * xmu).sum(at::IntArrayRef({0, 2, 3}));
  if (output_mask[3]) gbw = (sgx * save_invstd).to(pdtype);
  if (output_mask[4]) gbb = sg.to(pdtype);
  if (output_mask[0] || output_mask[1] || output_mask[2]) {
    const Tensor w = has(bn_weight) ? bn_weight->to(acc) : at::ones({C}, save_mean.options());
    const Tensor k1 = w * save_invstd;
    const Tensor k2 = k1 * sg / static_cast<double>(M);
    const Tensor k3 = k1 * save_invstd * save_invstd * sgx / static_cast<double>(M);
    Tensor dconv = (g * per_channel(k1) - per_channel(k2) - xmu * per_channel(k3))
                       .to(conv_out.scalar_type());
    if (cl) dconv = dconv.contiguous(at::MemoryFormat::ChannelsLast);
    std::vector<int64_t> bias_sizes = {weight.size(0)};
    const std::vector<int64_t> zero = {0, 0};
    auto r = at::convolution_backward(dconv, input, weight, at::OptionalIntArrayRef(bias_sizes),
                                      stride, padding, dilation, false, zero, groups,
                                      {output_mask[0], output_mask[1], output_mask[2]});
    if (output_mask[0]) gi = std::get<0>(r).contiguous(is_cl(input) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    if (output_mask[1]) gw = std::get<1>(r).contiguous(is_cl(weight) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    if (output_mask[2]) gcb = std::get<2>(r);
  }
  return {gi, gw, gcb, gbw, gbb};
}

Tensor conv_bias_relu_cpu(const Tensor& input, const Tensor& weight, const OptTensor& bias,
                          at::IntArrayRef stride, at::IntArrayRef padding,
                          at::IntArrayRef dilation, int64_t groups, int64_t impl) {
  check_cpu("cudadoctor_ops.conv_bias_relu", input, weight, groups);
  TORCH_CHECK(impl >= 0 && impl <= 3, "cudadoctor_ops.conv_bias_relu: impl must be 0 (auto), 1 "
              "(epilogue kernel), 2 (direct TF32 kernel) or 3 (16-bit tensor-core kernel), got ",
              impl);  // one CPU path for all
  const std::vector<int64_t> zero = {0, 0};
  Tensor y = at::convolution(input, weight, std::nullopt, stride, padding, dilation, false, zero,
                             groups);
  if (!is_cl(y)) y = y.contiguous();
  if (has(bias)) {
    const auto acc = acc_of(input);
    y = (y.to(acc) + per_channel(bias->to(acc))).to(input.scalar_type());
  }
  return at::relu(y);
}

void update_stats_cpu(const OptTensor& running_mean, const OptTensor& running_var,
                      const OptTensor& num_batches_tracked, const Tensor& save_mean,
                      const Tensor& save_invstd, double momentum, double eps, int64_t count) {
  double m = momentum;
  if (has(num_batches_tracked)) {
    num_batches_tracked->add_(1);
    if (momentum < 0) m = 1.0 / static_cast<double>(num_batches_tracked->item<int64_t>());
  }
  if (!has(running_mean) || !has(running_var) || count <= 0) return;
  at::NoGradGuard no_grad;
  const Tensor var = (save_invstd.pow(-2) - eps).clamp_min(0) *
                     (static_cast<double>(count) / static_cast<double>(count - 1));
  running_mean->mul_(1 - m).add_(save_mean.to(running_mean->scalar_type()), m);
  running_var->mul_(1 - m).add_(var.to(running_var->scalar_type()), m);
}

}  // namespace
}  // namespace cbr_host
}  // namespace cudadoctor_ops

TORCH_LIBRARY_IMPL(cudadoctor_ops, Autograd, m) {
  m.impl("conv_bn_add_relu_train", &cudadoctor_ops::cbr_host::train_add_autograd);
  m.impl("conv_bn_relu_train", &cudadoctor_ops::cbr_host::train_autograd);
  m.impl("conv_bias_relu", &cudadoctor_ops::cbr_host::eval_autograd);
}

TORCH_LIBRARY_IMPL(cudadoctor_ops, CompositeImplicitAutograd, m) {
  m.impl("conv_bn_relu_forward", &cudadoctor_ops::cbr_host::forward_composite);
  m.impl("conv_bn_add_relu_forward", &cudadoctor_ops::cbr_host::forward_add_composite);
}

TORCH_LIBRARY_IMPL(cudadoctor_ops, CPU, m) {
  m.impl("conv_bn_relu_train", &cudadoctor_ops::cbr_host::train_cpu);
  m.impl("conv_bn_add_relu_train", &cudadoctor_ops::cbr_host::train_add_cpu);
  m.impl("relu_mask_grad", &cudadoctor_ops::cbr_host::relu_mask_grad_cpu);
  m.impl("conv_bn_relu_backward", &cudadoctor_ops::cbr_host::backward_cpu);
  m.impl("conv_bias_relu", &cudadoctor_ops::cbr_host::conv_bias_relu_cpu);
  m.impl("conv_bn_relu_update_stats", &cudadoctor_ops::cbr_host::update_stats_cpu);
}

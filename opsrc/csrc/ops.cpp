// Operator schemas of the cudadoctor_ops library: the ONE TORCH_LIBRARY block.
//
// Kernels live in csrc/*.cu files, each registering its implementations with
// TORCH_LIBRARY_IMPL(cudadoctor_ops, CUDA, m). Fake (meta) kernels and autograd formulas are
// registered from Python (cudadoctor_ops/*.py); autograd formulas in C++ (csrc/*_host.cpp). To add
// an op, append its m.def line below.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// Makes the shared object importable as `cudadoctor_ops._C`; the ops register at load time.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "cudadoctor_ops kernels (registered in torch.ops.cudadoctor_ops)",
      -1, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(cudadoctor_ops, m) {
  // ---- BatchNorm (csrc/batch_norm_*.cu, cudadoctor_ops/batch_norm.py) ----
  // Normalises over every dim but 1. training: batch statistics; else running statistics.
  // Returns (out, save_mean, save_invstd, reserve): save_* are per-channel, in the accumulation
  // dtype (float32, float64 for double input); reserve carries the rounding correction of
  // save_mean that the backward needs. Running statistics are NOT touched here: see
  // batch_norm_update_stats. activation: "none" or "relu".
  m.def(
      "batch_norm(Tensor input, Tensor? weight, Tensor? bias, Tensor? running_mean, "
      "Tensor? running_var, bool training, float eps, str activation) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // Gradients of batch_norm: (grad_input, grad_weight, grad_bias); entries whose output_mask is
  // false come back as empty tensors.
  m.def(
      "batch_norm_backward(Tensor grad_out, Tensor input, Tensor? weight, Tensor? bias, "
      "Tensor save_mean, Tensor save_invstd, Tensor reserve, bool training, str activation, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // running = (1 - momentum) * running + momentum * batch, with the unbiased batch variance
  // recovered from save_invstd (count = values per channel).
  m.def(
      "batch_norm_update_stats(Tensor(a!) running_mean, Tensor(b!) running_var, "
      "Tensor save_mean, Tensor save_invstd, float momentum, float eps, int count) -> ()");
  // One forward with F.batch_norm semantics (batch_norm, then batch_norm_update_stats when
  // training with running statistics); CompositeImplicitAutograd (csrc/batch_norm_host.cpp, where
  // batch_norm's autograd formula is registered too).
  m.def(
      "batch_norm_forward(Tensor input, Tensor? weight, Tensor? bias, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, bool training, float momentum, float eps, str activation) "
      "-> Tensor");

  // ---- Depthwise conv2d (csrc/depthwise*.cu, cudadoctor_ops/depthwise.py) ----
  // groups == input channels; weight [C*multiplier, 1, kh, kw]. impl: 0 auto (fast kernels where
  // they apply), 1 direct reference kernels, 2 / 4 forward on the first ("tiled_v1") / second
  // ("v2") generation fast kernels, 3 channels_last forward on the third ("nhwc_v3") for every
  // fast dtype (backward as 0). Output keeps input's layout (NCHW or channels_last). Autograd:
  // csrc/depthwise_host.cpp.
  m.def(
      "depthwise_conv2d(Tensor input, Tensor weight, Tensor? bias, int[2] stride, "
      "int[2] padding, int[2] dilation, int impl=0) -> Tensor");
  // Gradient w.r.t. input; `input` supplies the shape and layout only.
  m.def(
      "depthwise_conv2d_backward_input(Tensor grad_output, Tensor input, Tensor weight, "
      "int[2] stride, int[2] padding, int[2] dilation, int impl=0) -> Tensor");
  // (grad_weight, grad_bias); grad_bias has shape [0] when bias_grad is false.
  m.def(
      "depthwise_conv2d_backward_weight(Tensor grad_output, Tensor input, Tensor weight, "
      "int[2] stride, int[2] padding, int[2] dilation, bool bias_grad, int impl=0) "
      "-> (Tensor, Tensor)");

  // ---- Fused Conv2d + BatchNorm2d + ReLU (csrc/conv_bn_relu.cu, cudadoctor_ops/conv_bn_relu.py) ----
  // Training forward: conv (cuDNN via ATen, or depthwise_conv2d), batch statistics and one
  // fused BN + ReLU pass. Returns (out, conv_out, save_mean, save_invstd, mask): mask holds one
  // bit per element of out (memory order) set where out > 0. Running stats: see
  // batch_norm_update_stats.
  m.def(
      "conv_bn_relu_train(Tensor input, Tensor conv_weight, Tensor? conv_bias, Tensor? bn_weight, "
      "Tensor? bn_bias, float eps, int[2] stride, int[2] padding, int[2] dilation, int groups) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // (grad_input, grad_conv_weight, grad_conv_bias, grad_bn_weight, grad_bn_bias); entries whose
  // output_mask is false come back as empty tensors of shape [0].
  m.def(
      "conv_bn_relu_backward(Tensor grad_out, Tensor input, Tensor conv_weight, Tensor conv_out, "
      "Tensor? bn_weight, Tensor save_mean, Tensor save_invstd, Tensor mask, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups, bool[5] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // running = (1 - momentum) * running + momentum * batch (unbiased variance from save_invstd,
  // count values per channel); num_batches_tracked += 1 when given, and momentum < 0 means the
  // cumulative average 1 / num_batches_tracked (BatchNorm's momentum=None).
  m.def(
      "conv_bn_relu_update_stats(Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "Tensor(c!)? num_batches_tracked, Tensor save_mean, Tensor save_invstd, float momentum, "
      "float eps, int count) -> ()");
  // One training forward of a Conv2d -> BatchNorm2d -> ReLU module (conv_bn_relu_train, then
  // conv_bn_relu_update_stats); CompositeImplicitAutograd.
  m.def(
      "conv_bn_relu_forward(Tensor input, Tensor conv_weight, Tensor? conv_bias, "
      "Tensor? bn_weight, Tensor? bn_bias, Tensor(a!)? running_mean, Tensor(b!)? running_var, "
      "Tensor(c!)? num_batches_tracked, float momentum, float eps, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups) -> Tensor");
  // Conv2d -> BatchNorm2d -> (+ residual) -> ReLU, the tail of a ResNet block: as
  // conv_bn_relu_train with out = relu(bn(conv(input)) + residual) (residual: the convolution
  // output's sizes and dtype) and the mask that of out. Its backward is conv_bn_relu_backward's
  // plus relu_mask_grad for the residual.
  m.def(
      "conv_bn_add_relu_train(Tensor input, Tensor conv_weight, Tensor? conv_bias, "
      "Tensor? bn_weight, Tensor? bn_bias, Tensor residual, float eps, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  // grad_out where the bit mask (one bit per element of conv_out, memory order) is set, else 0,
  // in conv_out's layout: the gradient that reaches the residual of conv_bn_add_relu_train.
  m.def("relu_mask_grad(Tensor grad_out, Tensor conv_out, Tensor mask) -> Tensor");
  // One training forward of a Conv2d -> BatchNorm2d -> (+ residual) -> ReLU block
  // (conv_bn_add_relu_train, then conv_bn_relu_update_stats); CompositeImplicitAutograd.
  m.def(
      "conv_bn_add_relu_forward(Tensor input, Tensor conv_weight, Tensor? conv_bias, "
      "Tensor? bn_weight, Tensor? bn_bias, Tensor residual, Tensor(a!)? running_mean, "
      "Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, float momentum, float eps, "
      "int[2] stride, int[2] padding, int[2] dilation, int groups) -> Tensor");
  // Inference after folding BN into (weight, bias): relu(conv(input, weight) + bias).
  // impl: 0 auto (cuDNN fused conv+bias+ReLU where available), 1 conv + epilogue kernel, 2 the
  // direct TF32 kernel (float32 NCHW 3x3), 3 the 16-bit tensor-core kernel (channels_last 3x3);
  // 2 and 3 fall back to 0 where their kernel does not apply.
  m.def(
      "conv_bias_relu(Tensor input, Tensor weight, Tensor? bias, int[2] stride, int[2] padding, "
      "int[2] dilation, int groups, int impl=0) -> Tensor");

  // The training forward's BatchNorm + ReLU when the convolution produced the per-channel sums
  // itself (cuDNN's conv + pointwise + reduction graph, cudadoctor_ops/cudnn_stats.py): sums =
  // [sum(conv_out - shift), sum((conv_out - shift)^2)] per channel (float32 [2, C]), shift =
  // running_mean before this step when `shifted`, else 0. Updates the running statistics like
  // conv_bn_relu_update_stats. conv_out channels_last. -> (out, save_mean, save_invstd, mask)
  // as conv_bn_relu_train returns them.
  m.def(
      "conv_bn_relu_apply_sums(Tensor conv_out, Tensor sums, Tensor? bn_weight, Tensor? bn_bias, "
      "Tensor(a!)? running_mean, Tensor(b!)? running_var, Tensor(c!)? num_batches_tracked, "
      "float momentum, float eps, bool shifted) -> (Tensor, Tensor, Tensor, Tensor)");

  // The convolution of the training forward with per-channel sums of (y - shift) and their squares
  // computed in cuDNN's epilogue (csrc/cudnn_conv_stats.cpp; a CUDA kernel only in builds that
  // found nvidia-cudnn-frontend's headers). input channels_last float16 / bfloat16, groups 1.
  // -> (y channels_last, float32 [2, K] sums, status 1 shifted / 0 plain / -1 declined, reason).
  m.def(
      "cudnn_conv_stats(Tensor input, Tensor weight, int[2] stride, int[2] padding, "
      "int[2] dilation, Tensor? shift) -> (Tensor, Tensor, int, str)");

  // The 3x3 convolution (stride 1, padding 1, 64 -> 64 channels, float16 / bfloat16,
  // channels_last, width <= 89) of Conv+BN+ReLU's training forward on Hopper tensor cores, with
  // the sums conv_bn_relu_apply_sums takes computed in its epilogue: sums = [sum(y - shift),
  // sum((y - shift)^2)] per channel over N, H, W (float32 [2, 64]), shift float32 [64] or none
  // (0). Its CUDA kernel is in the separate module cudadoctor_ops._C_sm90a
  // (csrc_sm90a/conv3x3_wgmma.cu, sm_90a code), built where the arch list holds 9.0.
  // -> (y channels_last, sums)
  m.def("conv3x3_wgmma_stats(Tensor input, Tensor weight, Tensor? shift) -> (Tensor, Tensor)");

  // ---- further ops: append their m.def lines here ----
}

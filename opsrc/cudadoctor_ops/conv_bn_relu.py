"""Fused Conv2d -> BatchNorm2d -> ReLU on CUDA.

Public API:

* :func:`conv_bn_relu` -- ``relu(batch_norm(conv2d(input, conv_weight, conv_bias, ...)))`` with the
  exact semantics of the three torch modules in training mode (batch statistics, running
  statistics updated in place with the unbiased variance and ``momentum``) and in eval mode
  (running statistics). Differentiable in input, conv_weight, conv_bias, bn_weight and bn_bias.
* :class:`ConvBNReLU2d` -- a module with ``conv`` (:class:`torch.nn.Conv2d`) and ``bn``
  (:class:`torch.nn.BatchNorm2d`) submodules, so its ``state_dict`` is the one of
  ``nn.Sequential(OrderedDict(conv=..., bn=...))``.
* :func:`fuse_conv_bn_relu` -- rewrites an existing model in place: Conv2d -> BatchNorm2d -> ReLU
  chains inside ``nn.Sequential`` and the torchvision ResNet stem / BasicBlock / Bottleneck run
  through the fused op (the blocks' tails, Conv2d -> BatchNorm2d -> + identity -> ReLU, through
  its residual form), with the model's ``state_dict`` keys and values unchanged.

Training: the convolution runs through ATen (cuDNN), for depthwise weights the depthwise op, or for
float32 NCHW 3x3 convolutions on 56x56 images and larger the direct TF32 kernel (where torch lets
cuDNN use TF32; csrc/conv3x3_tf32.cu); then one reduction for the batch statistics and one fused BatchNorm + ReLU pass that also writes a
1-bit-per-element ReLU mask. Backward keeps the convolution output, the per-channel mean and
inverse std and that mask, and not the BatchNorm or ReLU output. Eval: BatchNorm folded into the
convolution (``W' = W * gamma / sqrt(var + eps)``, ``b' = (b - mean) * gamma / sqrt(var + eps) +
beta``), cached by the modules until a parameter or running statistic changes, and run as one
convolution + bias + ReLU (cuDNN's fused engine where available, else an epilogue kernel).

CPU tensors run the plain torch ops, so rewritten models still work off the GPU.

The environment variable ``CUDADOCTOR_OPS_CBR_V1=1`` selects the previous (v1) BatchNorm kernels for
channels_last tensors instead of the default v2 ones; it is read at every call, so one process can
time both. Both sets write the same mask and statistics (NCHW tensors always use the v1 kernels).
"""

from __future__ import annotations

import math
import os
import types
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cudnn_stats
from ._args import int_pair

__all__ = ["conv_bn_relu", "ConvBNReLU2d", "fuse_conv_bn_relu"]

_ops = torch.ops.cudadoctor_ops


def _has_cuda_kernel(qualname: str) -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA"))
    except Exception:  # noqa: BLE001 - op not defined in this build
        return False


_HAS_DEPTHWISE = _has_cuda_kernel("cudadoctor_ops::depthwise_conv2d")
_HAS_APPLY_SUMS = _has_cuda_kernel("cudadoctor_ops::conv_bn_relu_apply_sums")
# The Hopper convolution with BatchNorm's sums in its epilogue (csrc_sm90a/, module _C_sm90a),
# which the 16-bit channels_last training forward of 64 -> 64 3x3 layers takes on compute
# capability 9.0 GPUs (CUDADOCTOR_OPS_CBR_WGMMA=0: never)
_HAS_WGMMA = _has_cuda_kernel("cudadoctor_ops::conv3x3_wgmma_stats")
_DEVICES = ("cuda", "cpu")  # device types with kernels; others run the torch ops

# Inference implementations. "cudnn": one cuDNN fused conv+bias+ReLU call where cuDNN has an
# engine for it (else the epilogue path); "epilogue": the convolution, then one bias+ReLU kernel;
# "tf32": float32 NCHW 3x3 convolutions (stride 1, padding 1, groups 1, input channels a multiple
# of 8, output channels of 64) on the direct TF32 tensor-core kernel (csrc/conv3x3_tf32.cu) with
# bias and ReLU in its epilogue, where torch lets cuDNN use TF32 for float32 convolutions (its
# default), else "cudnn"; "auto": the fastest of those that apply (and, for NCHW input, of cudnn /
# epilogue with a channels_last convolution inside), timed once per shape on first use. The
# functional API treats "auto" as "cudnn". "hmma": float16 / bfloat16 channels_last 3x3
# convolutions (stride 1, padding 1, groups 1, input channels a multiple of 32, output channels
# of 64) on the implicit-GEMM tensor-core kernel (csrc/conv3x3_hmma.cu) with bias and ReLU in its
# epilogue, else "cudnn"; "auto" times it too where CUDADOCTOR_OPS_CBR_HMMA_EVAL=1.
EVAL_IMPLS = {"auto": 0, "cudnn": 0, "epilogue": 1, "tf32": 2, "hmma": 3}
_ENV_HMMA_EVAL = "CUDADOCTOR_OPS_CBR_HMMA_EVAL"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _pair(value, name: str) -> list[int]:
    return int_pair(value, name, "conv_bn_relu", ValueError)


def _uses_depthwise(input: Tensor, weight: Tensor, groups: int) -> bool:
    # Same rule as conv_bn_relu.cu: depthwise weights [C, 1, kh, kw] with groups == C go to the
    # depthwise op (not for float64), whose output keeps the input's memory format.
    c = input.shape[1]
    return (
        input.dtype != torch.float64
        and groups == c
        and c > 1
        and weight.shape[0] == c
        and weight.shape[1] == 1
        and _HAS_DEPTHWISE
    )


def _kernel_format(t: Tensor) -> torch.memory_format:
    # The layout the CUDA side keeps: channels_last when the tensor is channels_last and not
    # also plain contiguous, else contiguous (odd strides are copied).
    if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _conv_out_fake(input, weight, bias, stride, padding, dilation, groups) -> Tensor:
    out = torch.ops.aten.convolution(input, weight, bias, stride, padding, dilation, False, [0, 0], groups)
    if _uses_depthwise(input, weight, groups):
        return torch.empty_like(out, memory_format=_kernel_format(input))
    return torch.empty_like(out, memory_format=_kernel_format(out))


def _mask_bytes(numel: int) -> int:
    return (numel + 7) // 8


# ---------------------------------------------------------------- fake kernels


@torch.library.register_fake("cudadoctor_ops::conv_bn_relu_train")
def _train_fake(input, conv_weight, conv_bias, bn_weight, bn_bias, eps, stride, padding, dilation, groups):
    conv_out = _conv_out_fake(input, conv_weight, conv_bias, stride, padding, dilation, groups)
    c = conv_out.shape[1]
    acc = _acc_dtype(input.dtype)
    save_mean = input.new_empty((c,), dtype=acc)
    save_invstd = input.new_empty((c,), dtype=acc)
    mask = input.new_empty((_mask_bytes(conv_out.numel()),), dtype=torch.uint8)
    return torch.empty_like(conv_out), conv_out, save_mean, save_invstd, mask


@torch.library.register_fake("cudadoctor_ops::conv_bn_add_relu_train")
def _train_add_fake(input, conv_weight, conv_bias, bn_weight, bn_bias, residual, eps, stride, padding, dilation,
                    groups):
    return _train_fake(input, conv_weight, conv_bias, bn_weight, bn_bias, eps, stride, padding, dilation, groups)


@torch.library.register_fake("cudadoctor_ops::relu_mask_grad")
def _relu_mask_grad_fake(grad_out, conv_out, mask):
    return torch.empty_like(conv_out, memory_format=_kernel_format(conv_out))


@torch.library.register_fake("cudadoctor_ops::conv_bn_relu_backward")
def _backward_fake(
    grad_out, input, conv_weight, conv_out, bn_weight, save_mean, save_invstd, mask, stride, padding, dilation,
    groups, output_mask,
):
    def empty():
        return input.new_empty((0,))

    c = conv_out.shape[1]
    pdtype = bn_weight.dtype if bn_weight is not None else _acc_dtype(input.dtype)
    gi = torch.empty_like(input, memory_format=_kernel_format(input)) if output_mask[0] else empty()
    gw = torch.empty_like(conv_weight, memory_format=_kernel_format(conv_weight)) if output_mask[1] else empty()
    gcb = input.new_empty((conv_weight.shape[0],)) if output_mask[2] else empty()
    gbw = input.new_empty((c,), dtype=pdtype) if output_mask[3] else empty()
    gbb = input.new_empty((c,), dtype=pdtype) if output_mask[4] else empty()
    return gi, gw, gcb, gbw, gbb


@torch.library.register_fake("cudadoctor_ops::conv_bias_relu")
def _conv_bias_relu_fake(input, weight, bias, stride, padding, dilation, groups, impl=0):
    b = None if bias is None else bias.to(input.dtype)
    return _conv_out_fake(input, weight, b, stride, padding, dilation, groups)


@torch.library.register_fake("cudadoctor_ops::conv_bn_relu_update_stats")
def _update_stats_fake(running_mean, running_var, num_batches_tracked, save_mean, save_invstd, momentum, eps,
                       count):
    return None


@torch.library.register_fake("cudadoctor_ops::conv_bn_relu_apply_sums")
def _apply_sums_fake(conv_out, sums, bn_weight, bn_bias, running_mean, running_var, num_batches_tracked, momentum,
                     eps, shifted):
    c = conv_out.shape[1]
    out = torch.empty_like(conv_out, memory_format=torch.channels_last)
    stat = conv_out.new_empty((c,), dtype=torch.float32)
    return out, stat, stat.clone(), conv_out.new_empty((_mask_bytes(conv_out.numel()),), dtype=torch.uint8)


@torch.library.register_fake("cudadoctor_ops::conv3x3_wgmma_stats")
def _wgmma_stats_fake(input, weight, shift):
    y = torch.empty_like(input, memory_format=torch.channels_last)
    return y, input.new_empty((2, weight.shape[0]), dtype=torch.float32)


# ---------------------------------------------------------------- autograd
#
# The autograd formulas of conv_bn_relu_train and conv_bias_relu are C++ autograd Functions
# registered for the Autograd key (csrc/conv_bn_relu_host.cpp): a training step runs no Python in
# the op's forward or backward. conv_bn_relu_forward (train op + running statistics) is a
# CompositeImplicitAutograd op, so torch.compile traces through it.
#
# The one exception: with cuDNN computing the batch statistics in the convolution (cudnn_stats.py,
# eager only), the forward is that graph plus conv_bn_relu_apply_sums, and _CudnnStatsTrain
# connects them to the same backward op, which takes the same saved tensors.


class _CudnnStatsTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, gamma, beta, conv_out, sums, rm, rv, nbt, momentum, eps, shifted, stride,
                padding, dilation):
        out, save_mean, save_invstd, mask = _ops.conv_bn_relu_apply_sums(
            conv_out, sums, gamma, beta, rm, rv, nbt, momentum, eps, shifted)
        ctx.save_for_backward(input, weight, conv_out, gamma, save_mean, save_invstd, mask)
        ctx.conv_args = (list(stride), list(padding), list(dilation))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        input, weight, conv_out, gamma, save_mean, save_invstd, mask = ctx.saved_tensors
        need = ctx.needs_input_grad
        stride, padding, dilation = ctx.conv_args
        gi, gw, _, gg, gb = _ops.conv_bn_relu_backward(
            grad_out, input, weight, conv_out, gamma, save_mean, save_invstd, mask, stride, padding, dilation, 1,
            [need[0], need[1], False, need[2], need[3]])
        return ((gi if need[0] else None), (gw if need[1] else None), (gg if need[2] else None),
                (gb if need[3] else None)) + (None,) * 11


def _cudnn_stats_train(input, weight, conv_bias, gamma, beta, rm, rv, nbt, momentum, eps, stride, padding,
                       dilation, groups) -> Optional[Tensor]:
    """The training forward with cuDNN's statistics epilogue, or None where it does not run."""
    if not _HAS_APPLY_SUMS or not cudnn_stats.usable(input, weight, conv_bias, groups):
        return None
    stride, padding, dilation = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    shift = rm if (rm is not None and rv is not None and rm.dtype == torch.float32 and rm.is_contiguous()) else None
    r = cudnn_stats.conv_stats(input, weight, stride, padding, dilation, shift)
    if r is None:
        return None
    conv_out, sums, shifted = r
    if rm is None or rv is None:
        rm = rv = None
    return _CudnnStatsTrain.apply(input, weight, gamma, beta, conv_out, sums, rm, rv, nbt, float(momentum),
                                  float(eps), shifted, stride, padding, dilation)


# ---------------------------------------------------------------- functional API


def _check_args(input, conv_weight, bn_weight, running_mean, running_var, training, momentum, eps, groups):
    if not isinstance(input, Tensor) or input.dim() != 4:
        shape = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
        raise ValueError(f"conv_bn_relu: input must be a 4-D tensor (N, C, H, W), got {shape}")
    if not isinstance(conv_weight, Tensor) or conv_weight.dim() != 4:
        raise ValueError("conv_bn_relu: conv_weight must be a 4-D tensor [C_out, C_in / groups, kh, kw]")
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ValueError(f"conv_bn_relu: groups must be a positive int, got {groups!r}")
    if momentum is None or not isinstance(momentum, (int, float)) or not math.isfinite(momentum):
        raise ValueError(f"conv_bn_relu: momentum must be a finite float, got {momentum!r}")
    if not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"conv_bn_relu: eps must be a float >= 0, got {eps!r}")
    if not training and (running_mean is None or running_var is None):
        raise ValueError(
            "conv_bn_relu: running_mean and running_var must be given when training=False "
            "(they are the statistics used in eval mode)"
        )


_LOW = (torch.float16, torch.bfloat16)


def _check_tensors(input, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride, padding,
                   dilation, groups, training) -> None:
    """The checks of the kernels (conv_bn_relu.cu), done in Python before the call so that bad
    arguments never depend on a C++ exception crossing the extension boundary."""
    op = "conv_bn_relu"
    if input.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(f"{op}: input must be float32, float16, bfloat16 or float64, got {input.dtype}")
    if conv_weight.device != input.device:
        raise ValueError(f"{op}: conv_weight is on {conv_weight.device} but input is on {input.device}; "
                         "move both to the same device")
    if conv_weight.dtype != input.dtype:
        raise ValueError(f"{op}: conv_weight has dtype {conv_weight.dtype} but input has dtype {input.dtype}; "
                         "they must match")
    c_in, c_out = input.shape[1], conv_weight.shape[0]
    if c_out % groups or conv_weight.shape[1] * groups != c_in:
        raise ValueError(f"{op}: conv_weight must have shape [C_out, C_in / groups, kh, kw] with C_in = {c_in} "
                         f"and groups = {groups}, got {list(conv_weight.shape)}")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise ValueError(f"{op}: stride and dilation must be positive and padding >= 0, got stride {stride}, "
                         f"padding {padding}, dilation {dilation}")
    if conv_bias is not None and (conv_bias.shape != (c_out,) or conv_bias.dtype != input.dtype
                                  or conv_bias.device != input.device):
        raise ValueError(f"{op}: conv_bias must be a [{c_out}] tensor of the input's dtype and device, got "
                         f"{list(conv_bias.shape)} {conv_bias.dtype} on {conv_bias.device}")
    for t, name in ((bn_weight, "bn_weight"), (bn_bias, "bn_bias"), (running_mean, "running_mean"),
                    (running_var, "running_var")):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise ValueError(f"{op}: {name} must be a tensor or None, got {type(t).__name__}")
        if t.device != input.device:
            raise ValueError(f"{op}: {name} is on {t.device} but input is on {input.device}")
        if t.dim() != 1 or t.shape[0] != c_out:
            raise ValueError(f"{op}: {name} must have shape [{c_out}] (one value per output channel of the "
                             f"convolution), got {list(t.shape)}")
        if t.dtype != input.dtype and not (input.dtype in _LOW and t.dtype == torch.float32):
            extra = " or float32" if input.dtype in _LOW else ""
            raise ValueError(f"{op}: {name} has dtype {t.dtype} but input has dtype {input.dtype}; it must have "
                             f"the input's dtype{extra}")
    if training:
        n, _, h, w = input.shape
        kh, kw = conv_weight.shape[2], conv_weight.shape[3]
        ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
        wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
        if n * max(ho, 0) * max(wo, 0) == 1:
            raise ValueError(f"{op}: expected more than 1 value per channel when training, got conv output size "
                             f"{[n, c_out, ho, wo]}")


def _reference(input, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, training,
               momentum, eps, stride, padding, dilation, groups, residual=None) -> Tensor:
    y = F.conv2d(input, conv_weight, conv_bias, stride, padding, dilation, groups)
    y = F.batch_norm(y, running_mean, running_var, bn_weight, bn_bias, training, momentum, eps)
    if residual is not None:
        y = y + residual
    return F.relu(y)


def _check_residual(input, conv_weight, residual, stride, padding, dilation) -> None:
    op = "conv_bn_relu"
    if not isinstance(residual, Tensor):
        raise ValueError(f"{op}: residual must be a tensor or None, got {type(residual).__name__}")
    n, _, h, w = input.shape
    kh, kw = conv_weight.shape[2], conv_weight.shape[3]
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    want = (n, conv_weight.shape[0], ho, wo)
    if tuple(residual.shape) != want:
        raise ValueError(f"{op}: residual must have the convolution output's shape {list(want)}, got "
                         f"{list(residual.shape)}")
    if residual.device != input.device or residual.dtype != input.dtype:
        raise ValueError(f"{op}: residual ({residual.dtype} on {residual.device}) must have the input's dtype and "
                         f"device ({input.dtype} on {input.device})")


def fold_bn(conv_weight: Tensor, conv_bias: Optional[Tensor], bn_weight: Optional[Tensor],
            bn_bias: Optional[Tensor], running_mean: Tensor, running_var: Tensor, eps: float,
            dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """(W', b') with conv(x, W') + b' == batch_norm(conv(x, W, b)) in eval mode.

    Computed in float32 (float64 for float64 weights) and returned in ``dtype`` (default: the
    weight's dtype). Differentiable in every argument.
    """
    acc = _acc_dtype(conv_weight.dtype)
    scale = torch.rsqrt(running_var.to(acc) + eps)
    if bn_weight is not None:
        scale = scale * bn_weight.to(acc)
    shift = -running_mean.to(acc)
    if conv_bias is not None:
        shift = shift + conv_bias.to(acc)
    b = shift * scale
    if bn_bias is not None:
        b = b + bn_bias.to(acc)
    w = conv_weight.to(acc) * scale.reshape(-1, 1, 1, 1)
    out_dtype = dtype or conv_weight.dtype
    return w.to(out_dtype), b.to(out_dtype)


def conv_bn_relu(
    input: Tensor,
    conv_weight: Tensor,
    conv_bias: Optional[Tensor] = None,
    bn_weight: Optional[Tensor] = None,
    bn_bias: Optional[Tensor] = None,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    training: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    eval_impl: str = "auto",
    residual: Optional[Tensor] = None,
) -> Tensor:
    """``relu(batch_norm(conv2d(input, conv_weight, conv_bias, stride, padding, dilation, groups),
    running_mean, running_var, bn_weight, bn_bias, training, momentum, eps) [+ residual])``.

    input: (N, C_in, H, W) CUDA tensor, float32 / float16 / bfloat16 (float64 too), contiguous or
    channels_last. conv_weight / conv_bias have the input's dtype; bn_weight, bn_bias and the
    running statistics have the input's dtype or float32. training=True normalises with the batch
    statistics and updates running_mean / running_var in place; training=False uses them (BN
    folded into the convolution; eval_impl "cudnn" (= "auto" here), "epilogue", "tf32" or "hmma"). CPU
    tensors run the torch ops.

    residual (the tail of a ResNet block, ``relu(bn(conv(x)) + identity)``): a tensor of the
    convolution output's shape, dtype and device added after the BatchNorm, before the ReLU. In
    training one fused op (statistics, then one pass writing the output and its 1-bit mask; the
    backward sends grad * mask to the residual); in eval the folded convolution, then the sum and
    the ReLU.
    """
    _check_args(input, conv_weight, bn_weight, running_mean, running_var, training, momentum, eps, groups)
    stride_, padding_, dilation_ = _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    _check_tensors(input, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, stride_, padding_,
                   dilation_, groups, training)
    if residual is not None:
        _check_residual(input, conv_weight, residual, stride_, padding_, dilation_)
    if input.device.type not in _DEVICES:
        return _reference(input, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, training,
                          momentum, eps, stride_, padding_, dilation_, groups, residual)
    if eval_impl not in EVAL_IMPLS:
        raise ValueError(f"conv_bn_relu: eval_impl must be one of {sorted(EVAL_IMPLS)}, got {eval_impl!r}")
    if training and residual is not None:
        return _ops.conv_bn_add_relu_forward(
            input, conv_weight, conv_bias, bn_weight, bn_bias, residual, running_mean, running_var, None,
            float(momentum), float(eps), stride_, padding_, dilation_, groups,
        )
    if training:
        out = _cudnn_stats_train(input, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, None,
                                 momentum, eps, stride_, padding_, dilation_, groups)
        if out is not None:
            return out
        return _ops.conv_bn_relu_forward(
            input, conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, None, float(momentum),
            float(eps), stride_, padding_, dilation_, groups,
        )
    w, b = fold_bn(conv_weight, conv_bias, bn_weight, bn_bias, running_mean, running_var, float(eps))
    if input.is_contiguous(memory_format=torch.channels_last) and not input.is_contiguous():
        w = w.contiguous(memory_format=torch.channels_last)
    if residual is not None:
        return F.relu(F.conv2d(input, w, b, stride_, padding_, dilation_, groups) + residual)
    return _ops.conv_bias_relu(input, w, b, stride_, padding_, dilation_, groups, EVAL_IMPLS[eval_impl])


# ---------------------------------------------------------------- modules


class _FoldCache:
    """BN-folded (W', b') of one conv/bn pair, keyed on the tensors' identities and versions."""

    def __init__(self) -> None:
        self.key = None
        self.weight: Optional[Tensor] = None
        self.bias: Optional[Tensor] = None
        self.weight_cl: Optional[Tensor] = None  # channels_last copy for the tuned NCHW variants
        self.choice = None  # (input shape, tuned variant name)
        self.fast = None  # _EvalFast of the last cached eval call, or None


# (input shape, dtype, channels_last, weight shape, conv args, device) -> name of the fastest variant
_TUNED: dict = {}
_VARIANTS = ("cudnn", "epilogue", "cudnn, channels_last inside", "epilogue, channels_last inside", "tf32", "hmma")


def _tf32_shape(input: Tensor, weight: Tensor, conv_args: tuple) -> bool:
    """Whether the "tf32" variant's kernel takes this convolution (csrc/conv3x3_tf32.h: applies;
    whether TF32 is allowed is checked at each call)."""
    stride, padding, dilation, groups = conv_args
    return (
        input.dtype == torch.float32 and input.dim() == 4 and input.is_contiguous() and weight.dim() == 4
        and tuple(weight.shape[2:]) == (3, 3) and groups == 1 and _pair(stride, "stride") == [1, 1]
        and _pair(padding, "padding") == [1, 1] and _pair(dilation, "dilation") == [1, 1]
        and input.shape[1] % 8 == 0 and weight.shape[0] % 64 == 0
    )


def _hmma_shape(input: Tensor, weight: Tensor, conv_args: tuple) -> bool:
    """Whether the "hmma" variant's kernel takes this convolution (csrc/conv3x3_hmma.h: applies;
    the device's compute capability is checked at each call)."""
    stride, padding, dilation, groups = conv_args
    return (
        input.dtype in (torch.float16, torch.bfloat16) and weight.dtype == input.dtype and input.dim() == 4
        and weight.dim() == 4 and not input.is_contiguous()
        and input.is_contiguous(memory_format=torch.channels_last) and input.data_ptr() % 16 == 0
        and tuple(weight.shape[2:]) == (3, 3) and groups == 1 and _pair(stride, "stride") == [1, 1]
        and _pair(padding, "padding") == [1, 1] and _pair(dilation, "dilation") == [1, 1]
        and input.shape[1] % 32 == 0 and weight.shape[0] % 64 == 0
    )


# conv_bias_relu's impl of the variants that call it on the input as given (the "channels_last
# inside" ones convert around it, and a repeated call of theirs takes the full path)
_VARIANT_IMPL = {"cudnn": 0, "epilogue": 1, "tf32": 2, "hmma": 3}


def _run_variant(name: str, input: Tensor, cache: "_FoldCache", conv_args: tuple) -> Tensor:
    impl = _VARIANT_IMPL.get(name)
    if impl is not None:
        return _eval_op(input, cache.weight, cache.bias, *conv_args, impl)
    if cache.weight_cl is None:
        cache.weight_cl = cache.weight.contiguous(memory_format=torch.channels_last)
    impl = 0 if name.startswith("cudnn") else 1
    x = input.contiguous(memory_format=torch.channels_last)
    return _eval_op(x, cache.weight_cl, cache.bias, *conv_args, impl).contiguous()


def _time_ms(fn, reps: int = 5) -> float:
    """GPU time per call of fn: the calls are queued behind a sleep kernel, so the host's launch
    time (tens of microseconds per call from Python, as much as the GPU work of a small layer)
    does not enter the measurement."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(_SLEEP_CYCLES)  # about 1 ms of GPU time while the calls below are queued
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


_SLEEP_CYCLES = 2_000_000
_TUNE_ROUNDS = 3


def _tuned_variant(input: Tensor, cache: "_FoldCache", conv_args: tuple, channels_last: bool) -> str:
    """The fastest inference variant for this shape, timed once per process and shape: every
    candidate in each of _TUNE_ROUNDS interleaved rounds, its best round kept."""
    key = (tuple(input.shape), input.dtype, channels_last, tuple(cache.weight.shape), tuple(map(str, conv_args)),
           input.device)
    name = _TUNED.get(key)
    if name is not None:
        return name
    candidates = list(_VARIANTS[:2])
    if not channels_last and input.dtype != torch.float64 and input.shape[1] > 1:
        candidates += list(_VARIANTS[2:4])
    if not channels_last and _tf32_shape(input, cache.weight, conv_args):
        candidates.append("tf32")
    if channels_last and os.environ.get(_ENV_HMMA_EVAL) == "1" and _hmma_shape(input, cache.weight, conv_args):
        candidates.append("hmma")
    if torch.cuda.is_current_stream_capturing():
        return "cudnn"
    times = {n: float("inf") for n in candidates}
    for _ in range(_TUNE_ROUNDS):
        for n in candidates:
            times[n] = min(times[n], _time_ms(lambda n=n: _run_variant(n, input, cache, conv_args)))
    name = min(times, key=times.get)
    _TUNED[key] = name
    return name


def tuned_eval_choices() -> dict:
    """The inference variant picked per shape so far (for benchmarks and debugging)."""
    return {str(k[:5]): v for k, v in _TUNED.items()}


def _padded(conv: nn.Conv2d, input: Tensor) -> tuple[Tensor, object]:
    """(input, padding) for the convolution op: a string padding made explicit; a padding mode
    other than zeros applied to the input (then padding 0)."""
    padding = conv.padding
    if isinstance(padding, str):
        padding = conv.__dict__.get("_cbr_padding") or _explicit_padding(conv)
    if conv.padding_mode != "zeros":
        input = F.pad(input, conv._reversed_padding_repeated_twice, mode=conv.padding_mode)
        padding = (0, 0)
    return input, padding


class _NoTensor:
    """Stands for an absent parameter (None) in _EvalFast's version and storage tuples."""

    _version = -1

    @staticmethod
    def data_ptr() -> int:
        return -1


_NONE = _NoTensor()


class _EvalFast:
    """What one cached eval call of _cbr_forward depended on, so that the next call with the same
    modules, tensors (identity, version, storage), input geometry and modes can go straight to
    the op (_eval_fast) instead of re-deriving the same choice: in an eager inference loop each
    layer's host time is of the order of its GPU time, and that derivation was a quarter of it."""

    __slots__ = ("choice", "eval_impl", "impl", "tensors", "weight", "bias", "gamma", "beta", "rv", "rm",
                 "versions", "ptrs", "eps", "conv_attrs", "shape", "strides", "dtype", "device", "devtype", "args")

    def __init__(self, cache, eval_impl, impl, tensors, eps, conv, input, args):
        self.choice = cache.choice
        self.eval_impl = eval_impl
        self.impl = impl
        self.tensors = tensors  # as the modules hold them, None included (identity checks)
        w, b, g, be, rv, rm = (_NONE if t is None else t for t in tensors)
        self.weight, self.bias, self.gamma, self.beta, self.rv, self.rm = w, b, g, be, rv, rm
        self.versions = (w._version, b._version, g._version, be._version, rv._version, rm._version)
        self.ptrs = (w.data_ptr(), b.data_ptr(), g.data_ptr(), be.data_ptr(), rv.data_ptr(), rm.data_ptr())
        self.eps = eps
        self.conv_attrs = (conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode)
        self.shape = input.shape
        self.strides = input.stride()
        self.dtype = input.dtype
        self.device = input.get_device()
        self.devtype = input.device.type
        self.args = args


def _eval_fast(f: _EvalFast, conv: nn.Conv2d, bn: nn.BatchNorm2d, cache: _FoldCache, input: Tensor,
               eval_impl: str) -> Optional[Tensor]:
    """The cached eval call again, where nothing it depended on has changed; else None."""
    cp, bp, bb = conv._parameters, bn._parameters, bn._buffers
    t = f.tensors
    w, b, g, be, rv, rm = f.weight, f.bias, f.gamma, f.beta, f.rv, f.rm
    if (
        eval_impl != f.eval_impl or cache.choice is not f.choice or bn.training
        or cp["weight"] is not t[0] or cp.get("bias") is not t[1] or bp.get("weight") is not t[2]
        or bp.get("bias") is not t[3] or bb.get("running_var") is not t[4]
        or bb.get("running_mean") is not t[5] or bn.eps != f.eps or input.dtype != f.dtype
        or input.shape != f.shape or input.stride() != f.strides or input.get_device() != f.device
        or torch.is_grad_enabled() or torch.is_autocast_enabled(f.devtype)
        or (w._version, b._version, g._version, be._version, rv._version, rm._version) != f.versions
        or (w.data_ptr(), b.data_ptr(), g.data_ptr(), be.data_ptr(), rv.data_ptr(), rm.data_ptr()) != f.ptrs
        or (conv.stride, conv.padding, conv.dilation, conv.groups, conv.padding_mode) != f.conv_attrs
    ):
        return None
    return _eval_op(input, cache.weight, cache.bias, *f.args, f.impl)


def _cbr_forward(conv: nn.Conv2d, bn: nn.BatchNorm2d, cache: _FoldCache, input: Tensor, eval_impl: str) -> Tensor:
    """Forward of conv -> bn -> relu with the modules' semantics (train/eval, momentum=None).

    Kept lean: it runs once per layer and step, and its host time adds up when the GPU work of
    a layer is a few tens of microseconds. A repeated eval call takes _eval_fast.
    """
    fast = cache.fast
    if fast is not None and not torch.compiler.is_compiling():
        out = _eval_fast(fast, conv, bn, cache, input, eval_impl)
        if out is not None:
            return out
        cache.fast = None
    cp, bp, bb = conv._parameters, bn._parameters, bn._buffers
    weight, bias = cp["weight"], cp.get("bias")
    gamma, beta = bp.get("weight"), bp.get("bias")
    rm, rv = bb.get("running_mean"), bb.get("running_var")
    training = bn.training
    use_batch_stats = training or (rm is None and rv is None)
    input, padding = _padded(conv, input)
    if input.device.type not in _DEVICES:
        momentum = bn.momentum
        if training and bn.track_running_stats and bb.get("num_batches_tracked") is not None:
            bb["num_batches_tracked"].add_(1)
            momentum = 1.0 / float(bb["num_batches_tracked"]) if momentum is None else momentum
        track = not training or bn.track_running_stats
        return _reference(input, weight, bias, gamma, beta, rm if track else None, rv if track else None,
                          use_batch_stats, momentum or 0.0, bn.eps, conv.stride, padding, conv.dilation, conv.groups)
    autocast = torch.is_autocast_enabled(input.device.type)
    if autocast:
        ac = torch.get_autocast_dtype(input.device.type)
        input = input.to(ac)
        if use_batch_stats:
            weight = weight.to(ac)
            bias = None if bias is None else bias.to(ac)
    elif input.dtype != weight.dtype or input.device != weight.device:
        # what F.conv2d would refuse; refused here, before any kernel sees it
        raise ValueError(
            f"conv_bn_relu: input ({input.dtype} on {input.device}) and the conv weight ({weight.dtype} on "
            f"{weight.device}) must have the same dtype and device"
        )
    if use_batch_stats:
        if training and bn.track_running_stats:
            nbt = bb.get("num_batches_tracked")
            momentum = -1.0 if bn.momentum is None else float(bn.momentum)
        else:  # eval without running statistics, or training without tracking them
            nbt, rm, rv, momentum = None, None, None, 0.0
        if not torch.compiler.is_compiling():
            cache.key = None  # running statistics are about to change (kernels do not bump versions)
            cache.fast = None
        if training:
            out = _cudnn_stats_train(input, weight, bias, gamma, beta, rm, rv, nbt, momentum, bn.eps, conv.stride,
                                     padding, conv.dilation, conv.groups)
            if out is not None:
                return out
        return _forward_op(input, weight, bias, gamma, beta, rm, rv, nbt, momentum, bn.eps, conv.stride, padding,
                           conv.dilation, conv.groups)
    # eval: folded weights, cached unless gradients must flow into the parameters
    channels_last = input.is_contiguous(memory_format=torch.channels_last) and not input.is_contiguous()
    conv_args = (conv.stride, padding, conv.dilation, conv.groups)
    differentiable = torch.is_grad_enabled() and (
        weight.requires_grad or (gamma is not None and gamma.requires_grad)
        or (beta is not None and beta.requires_grad) or (bias is not None and bias.requires_grad)
    )
    if differentiable or torch.compiler.is_compiling():
        w, b = fold_bn(weight, bias, gamma, beta, rm, rv, bn.eps, input.dtype)
        if channels_last:
            w = w.contiguous(memory_format=torch.channels_last)
        return _eval_op(input, w, b, *conv_args, EVAL_IMPLS[eval_impl])
    key = (
        weight._version, weight.data_ptr(), rm._version, rm.data_ptr(), rv._version, rv.data_ptr(),
        None if gamma is None else (gamma._version, gamma.data_ptr()),
        None if beta is None else (beta._version, beta.data_ptr()),
        None if bias is None else (bias._version, bias.data_ptr()), id(weight), id(rm), id(rv), id(gamma), id(beta),
        id(bias), bn.eps, input.dtype, channels_last,
    )
    if cache.key != key:
        with torch.no_grad():
            w, b = fold_bn(weight, bias, gamma, beta, rm, rv, bn.eps, input.dtype)
            if channels_last:
                w = w.contiguous(memory_format=torch.channels_last)
        cache.key, cache.weight, cache.bias, cache.weight_cl, cache.choice = key, w, b, None, None
    if eval_impl != "auto" or input.device.type != "cuda":
        impl = EVAL_IMPLS[eval_impl]
        out = _eval_op(input, cache.weight, cache.bias, *conv_args, impl)
    else:
        choice = cache.choice
        if choice is None or choice[0] != input.shape:
            name = _tuned_variant(input, cache, conv_args, channels_last)
            choice = cache.choice = (input.shape, name)
        impl = _VARIANT_IMPL.get(choice[1])
        out = _run_variant(choice[1], input, cache, conv_args)
    if impl is not None and not autocast and conv.padding_mode == "zeros" and not torch.is_grad_enabled():
        cache.fast = _EvalFast(cache, eval_impl, impl, (weight, bias, gamma, beta, rv, rm), bn.eps, conv, input,
                               conv_args)
    return out


_forward_op = _ops.conv_bn_relu_forward.default
_eval_op = _ops.conv_bias_relu.default
_forward_add_op = _ops.conv_bn_add_relu_forward.default


def _cbr_add_forward(conv: nn.Conv2d, bn: nn.BatchNorm2d, input: Tensor, residual: Tensor) -> Tensor:
    """relu(bn(conv(input)) + residual) with the modules' semantics: in training mode (and on a
    device with kernels) the fused op conv_bn_add_relu_forward; else conv, the BatchNorm2d's own
    forward, the sum and the ReLU as separate torch ops (inference, other devices)."""
    if not bn.training or input.device.type not in _DEVICES:
        y = nn.BatchNorm2d.forward(bn, nn.Conv2d.forward(conv, input))
        return F.relu(y + residual)
    cp, bp, bb = conv._parameters, bn._parameters, bn._buffers
    weight, bias = cp["weight"], cp.get("bias")
    gamma, beta = bp.get("weight"), bp.get("bias")
    input, padding = _padded(conv, input)
    if torch.is_autocast_enabled(input.device.type):
        ac = torch.get_autocast_dtype(input.device.type)
        input, weight = input.to(ac), weight.to(ac)
        bias = None if bias is None else bias.to(ac)
    if residual.dtype != input.dtype:
        residual = residual.to(input.dtype)
    if bn.track_running_stats:
        rm, rv, nbt = bb.get("running_mean"), bb.get("running_var"), bb.get("num_batches_tracked")
        momentum = -1.0 if bn.momentum is None else float(bn.momentum)
    else:
        rm = rv = nbt = None
        momentum = 0.0
    return _forward_add_op(input, weight, bias, gamma, beta, residual, rm, rv, nbt, momentum, bn.eps, conv.stride,
                           padding, conv.dilation, conv.groups)


def _explicit_padding(conv: nn.Conv2d) -> tuple[int, int]:
    if conv.padding == "valid":
        return (0, 0)
    # "same" (stride 1): torch pads total = d * (k - 1), the extra element on the right/bottom
    pads = []
    for d, k in zip(conv.dilation, conv.kernel_size):
        total = d * (k - 1)
        if total % 2:
            raise ValueError("asymmetric 'same' padding")
        pads.append(total // 2)
    return tuple(pads)


class ConvBNReLU2d(nn.Module):
    """Conv2d -> BatchNorm2d -> ReLU as one fused CUDA op (training and eval).

    ``conv`` and ``bn`` are ordinary :class:`torch.nn.Conv2d` / :class:`torch.nn.BatchNorm2d`
    submodules (state_dict keys ``conv.weight``, ``bn.running_mean``, ...), so weights load from
    ``nn.Sequential(OrderedDict(conv=..., bn=..., relu=...))``. Train/eval follows ``bn``'s mode.
    eval_impl: "auto" (the fastest variant, timed once per shape), "cudnn" (cuDNN fused
    conv+bias+ReLU where available), "epilogue" (convolution, then one bias+ReLU kernel) or
    "tf32" (float32 NCHW 3x3: the direct TF32 kernel where torch allows TF32 convolutions) or
    "hmma" (float16 / bfloat16 channels_last 3x3: the implicit-GEMM tensor-core kernel).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride=1,
        padding=0,
        dilation=1,
        groups: int = 1,
        bias: bool = False,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        eval_impl: str = "auto",
    ) -> None:
        super().__init__()
        if eval_impl not in EVAL_IMPLS:
            raise ValueError(f"ConvBNReLU2d: eval_impl must be one of {sorted(EVAL_IMPLS)}, got {eval_impl!r}")
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                              device=device, dtype=dtype)
        self.bn = nn.BatchNorm2d(out_channels, eps, momentum, affine, track_running_stats, device=device,
                                 dtype=dtype)
        self.eval_impl = eval_impl
        self._fold_cache = _FoldCache()

    @classmethod
    def from_modules(cls, conv: nn.Conv2d, bn: nn.BatchNorm2d, eval_impl: str = "auto") -> "ConvBNReLU2d":
        """Wraps existing modules (shared, not copied)."""
        _check_fusable(conv, bn)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.conv = conv
        self.bn = bn
        self.eval_impl = eval_impl
        self._fold_cache = _FoldCache()
        return self

    def forward(self, input: Tensor) -> Tensor:
        m = self._modules  # not nn.Module.__getattr__: a microsecond per lookup on the eager path
        return _cbr_forward(m["conv"], m["bn"], self._fold_cache, input, self.eval_impl)


# ---------------------------------------------------------------- model rewriter


class _FusedConv2d(nn.Conv2d):
    """An nn.Conv2d whose forward runs conv -> (its BatchNorm) -> ReLU fused.

    The BatchNorm stays registered where it was (so state_dict keys do not move) and becomes a
    pass-through; this conv holds a plain reference to it.
    """

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]
        return _cbr_forward(self, self._cbr_bn, self._cbr_cache, input, self._cbr_eval_impl)


class _FusedConvAdd2d(nn.Conv2d):
    """An nn.Conv2d whose forward(input, residual) runs conv -> (its BatchNorm) -> + residual ->
    ReLU fused: the tail of a ResNet block. Its BatchNorm stays registered where it was (a
    pass-through); called without a residual it is that conv followed by that BatchNorm."""

    def forward(self, input: Tensor, residual: Optional[Tensor] = None) -> Tensor:  # type: ignore[override]
        if residual is None:
            return nn.BatchNorm2d.forward(self._cbr_bn, nn.Conv2d.forward(self, input))
        return _cbr_add_forward(self, self._cbr_bn, input, residual)


class _AbsorbedBatchNorm2d(nn.BatchNorm2d):
    """A BatchNorm2d whose work is done by the preceding fused conv: forward passes through."""

    def forward(self, input: Tensor) -> Tensor:  # type: ignore[override]
        return input


def _check_fusable(conv: nn.Module, bn: nn.Module) -> None:
    if not isinstance(conv, nn.Conv2d) or not isinstance(bn, nn.BatchNorm2d):
        raise ValueError("expected an nn.Conv2d followed by an nn.BatchNorm2d")
    if conv.out_channels != bn.num_features:
        raise ValueError(
            f"conv has {conv.out_channels} output channels but the BatchNorm2d has {bn.num_features} features"
        )


def _fusable(conv: nn.Module, bn: nn.Module, relu: Optional[nn.Module]) -> bool:
    if type(conv) is not nn.Conv2d or type(bn) is not nn.BatchNorm2d:
        return False
    if relu is not None and type(relu) is not nn.ReLU:
        return False
    if conv.out_channels != bn.num_features or conv.transposed:
        return False
    if isinstance(conv.padding, str):
        try:
            conv.__dict__["_cbr_padding"] = _explicit_padding(conv)
        except ValueError:
            return False
    return True


def _absorb(conv: nn.Conv2d, bn: nn.BatchNorm2d, eval_impl: str) -> None:
    conv.__class__ = _FusedConv2d
    bn.__class__ = _AbsorbedBatchNorm2d
    conv.__dict__["_cbr_bn"] = bn
    conv.__dict__["_cbr_cache"] = _FoldCache()
    conv.__dict__["_cbr_eval_impl"] = eval_impl


def _absorb_tail(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
    conv.__class__ = _FusedConvAdd2d
    bn.__class__ = _AbsorbedBatchNorm2d
    conv.__dict__["_cbr_bn"] = bn


def _torchvision_kind(module: nn.Module) -> Optional[str]:
    """"BasicBlock", "Bottleneck" or "ResNet" for torchvision's unmodified classes, else None."""
    cls = type(module)
    if cls.__module__ != "torchvision.models.resnet" or cls.__name__ not in ("BasicBlock", "Bottleneck", "ResNet"):
        return None
    try:
        from torchvision.models import resnet as tvr
    except Exception:  # noqa: BLE001 - torchvision is optional
        return None
    ref = getattr(tvr, cls.__name__, None)
    if ref is None or cls is not ref:
        return None
    # an instance-level forward override means someone changed the block: leave it alone
    if "forward" in module.__dict__ or "_forward_impl" in module.__dict__:
        return None
    return cls.__name__


def _basic_block_forward(self, x: Tensor) -> Tensor:
    identity = x
    out = self.conv1(x)  # conv1 + bn1 + relu fused
    out = self.conv2(out)
    out = self.bn2(out)
    if self.downsample is not None:
        identity = self.downsample(x)
    out += identity
    return self.relu(out)


def _bottleneck_forward(self, x: Tensor) -> Tensor:
    identity = x
    out = self.conv1(x)  # conv1 + bn1 + relu fused
    out = self.conv2(out)  # conv2 + bn2 + relu fused
    out = self.conv3(out)
    out = self.bn3(out)
    if self.downsample is not None:
        identity = self.downsample(x)
    out += identity
    return self.relu(out)


def _basic_block_forward_tail(self, x: Tensor) -> Tensor:
    identity = x if self.downsample is None else self.downsample(x)
    out = self.conv1(x)  # conv1 + bn1 + relu fused
    return self.conv2(out, identity)  # conv2 + bn2 + identity + relu fused


def _bottleneck_forward_tail(self, x: Tensor) -> Tensor:
    identity = x if self.downsample is None else self.downsample(x)
    out = self.conv1(x)  # conv1 + bn1 + relu fused
    out = self.conv2(out)  # conv2 + bn2 + relu fused
    return self.conv3(out, identity)  # conv3 + bn3 + identity + relu fused


def _resnet_forward_impl(self, x: Tensor) -> Tensor:
    x = self.conv1(x)  # conv1 + bn1 + relu fused
    x = self.maxpool(x)
    x = self.layer1(x)
    x = self.layer2(x)
    x = self.layer3(x)
    x = self.layer4(x)
    x = self.avgpool(x)
    x = torch.flatten(x, 1)
    return self.fc(x)


def _fuse_torchvision(module: nn.Module, kind: str, eval_impl: str, residual: bool) -> tuple[int, int]:
    """(Conv -> BN -> ReLU chains, Conv -> BN -> + identity -> ReLU tails) fused in the block."""
    pairs = [("conv1", "bn1")]
    if kind == "Bottleneck":
        pairs.append(("conv2", "bn2"))
    fused = 0
    if not all(_fusable(getattr(module, c, None), getattr(module, b, None), module.relu) for c, b in pairs):
        return 0, 0
    tail = {"BasicBlock": ("conv2", "bn2"), "Bottleneck": ("conv3", "bn3")}.get(kind)
    with_tail = (
        residual and tail is not None
        and _fusable(getattr(module, tail[0], None), getattr(module, tail[1], None), module.relu)
    )
    for c, b in pairs:
        _absorb(getattr(module, c), getattr(module, b), eval_impl)
        fused += 1
    if with_tail:
        _absorb_tail(getattr(module, tail[0]), getattr(module, tail[1]))
    if kind == "BasicBlock":
        module.forward = types.MethodType(_basic_block_forward_tail if with_tail else _basic_block_forward, module)
    elif kind == "Bottleneck":
        module.forward = types.MethodType(_bottleneck_forward_tail if with_tail else _bottleneck_forward, module)
    else:
        module._forward_impl = types.MethodType(_resnet_forward_impl, module)
    return fused, int(with_tail)


def _fuse_sequential(seq: nn.Sequential, eval_impl: str) -> int:
    names = list(seq._modules.keys())
    fused = 0
    i = 0
    while i + 2 < len(names):
        conv, bn, relu = (seq._modules[names[i + k]] for k in range(3))
        if _fusable(conv, bn, relu):
            _absorb(conv, bn, eval_impl)
            # the ReLU object may be used elsewhere: only this slot becomes a pass-through
            seq._modules[names[i + 2]] = nn.Identity()
            fused += 1
            i += 3
        else:
            i += 1
    return fused


def fuse_conv_bn_relu(model: nn.Module, eval_impl: str = "auto", residual: bool = True) -> nn.Module:
    """Swaps Conv2d -> BatchNorm2d -> ReLU chains of ``model`` for the fused op, in place.

    Rewritten: three consecutive ``nn.Conv2d``, ``nn.BatchNorm2d``, ``nn.ReLU`` children of an
    ``nn.Sequential``; torchvision's ResNet stem and its BasicBlock / Bottleneck blocks (the
    conv -> bn -> relu chains inside, also with their shared ReLU module). Modules of other types
    (subclasses included) and other blocks are left as they are. The conv becomes a fused
    Conv2d, the BatchNorm2d a pass-through that keeps its parameters and buffers, the ReLU slot of
    a Sequential an ``nn.Identity``: ``state_dict()`` keys and values are unchanged, and so are
    the outputs in train and eval mode. Returns ``model``; ``model._cbr_fused`` counts the chains.

    residual (default True): also the tail of each torchvision BasicBlock / Bottleneck, its last
    conv -> bn -> (+ identity) -> relu, as one fused op in training (``conv_bn_relu(...,
    residual=identity)``); ``model._cbr_fused_tails`` counts them. False leaves the tails as they are.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"fuse_conv_bn_relu: expected an nn.Module, got {type(model).__name__}")
    if eval_impl not in EVAL_IMPLS:
        raise ValueError(f"fuse_conv_bn_relu: eval_impl must be one of {sorted(EVAL_IMPLS)}, got {eval_impl!r}")
    fused = tails = 0
    for module in list(model.modules()):
        if isinstance(module, nn.Sequential):
            fused += _fuse_sequential(module, eval_impl)
            continue
        kind = _torchvision_kind(module)
        if kind is not None:
            f, t = _fuse_torchvision(module, kind, eval_impl, bool(residual))
            fused += f
            tails += t
    model.__dict__["_cbr_fused"] = model.__dict__.get("_cbr_fused", 0) + fused
    model.__dict__["_cbr_fused_tails"] = model.__dict__.get("_cbr_fused_tails", 0) + tails
    return model


def sanitize_exercise(quick: bool = False, device: str = "cuda") -> int:
    """Runs every kernel path once on small shapes (``python -m cudadoctor_ops.sanitize
    conv_bn_relu`` under compute-sanitizer); returns the number of fused calls. quick: float32 and
    float16 only."""
    calls = 0
    # (N, C_in, H, W, C_out, groups): vector / 8-element groups, odd sizes (scalar paths), depthwise;
    # 32 -> 64 channels: the 16-bit tensor-core kernel under eval_impl "hmma" (channels_last)
    cases = [(2, 8, 8, 8, 16, 1), (3, 5, 7, 5, 6, 1), (2, 8, 9, 9, 8, 8), (2, 16, 4, 4, 16, 1),
             (1, 32, 5, 7, 64, 1)]
    dtypes = (torch.float32, torch.float16) if quick else (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    for n, ci, h, w, co, g in cases:
        for dtype in dtypes:
            for layout in ("nchw", "channels_last"):
                x = torch.randn(n, ci, h, w, device=device, dtype=dtype)
                if layout == "channels_last":
                    x = x.contiguous(memory_format=torch.channels_last)
                pdt = torch.float64 if dtype == torch.float64 else torch.float32
                cw = (torch.randn(co, ci // g, 3, 3, device=device, dtype=dtype) * 0.3).requires_grad_(True)
                gw = (torch.rand(co, device=device, dtype=pdt) + 0.5).requires_grad_(True)
                gb = torch.randn(co, device=device, dtype=pdt).requires_grad_(True)
                rm = torch.zeros(co, device=device, dtype=pdt)
                rv = torch.ones(co, device=device, dtype=pdt)
                xg = x.detach().requires_grad_(True)
                y = conv_bn_relu(xg, cw, None, gw, gb, rm, rv, True, 0.1, 1e-5, 1, 1, 1, g)
                y.backward(torch.randn_like(y))
                calls += 1
                r = torch.randn_like(y).requires_grad_(True)
                y = conv_bn_relu(xg, cw, None, gw, gb, rm, rv, True, 0.1, 1e-5, 1, 1, 1, g, residual=r)
                y.backward(torch.randn_like(y))
                calls += 1
                for impl in EVAL_IMPLS:
                    y = conv_bn_relu(xg, cw, None, gw, gb, rm, rv, False, 0.1, 1e-5, 1, 1, 1, g, eval_impl=impl)
                    y.backward(torch.randn_like(y))
                    calls += 1
    # 64 -> 64, 16-bit channels_last training: the forward on conv3x3_wgmma_stats (compute
    # capability 9.0, _C_sm90a built; else cuDNN's convolution), one tile of 17 rows per image, 7
    # of them inside it. Not float32 / float64 at this shape: there initcheck flagged the reads of
    # the channels_last float32 convolution's output (cuDNN's kernel), as it does for cuDNN's 1x1
    # kernels (_smoke.py's residual cases)
    for dtype in (torch.float16,) if quick else (torch.float16, torch.bfloat16):
        x = torch.randn(2, 64, 7, 5, device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
        cw = (torch.randn(64, 64, 3, 3, device=device, dtype=dtype) * 0.1).requires_grad_(True)
        gw = (torch.rand(64, device=device) + 0.5).requires_grad_(True)
        gb = torch.randn(64, device=device).requires_grad_(True)
        rm, rv = torch.zeros(64, device=device), torch.ones(64, device=device)
        xg = x.detach().requires_grad_(True)
        y = conv_bn_relu(xg, cw, None, gw, gb, rm, rv, True, 0.1, 1e-5, 1, 1, 1, 1)
        y.backward(torch.randn_like(y))
        calls += 1
    return calls

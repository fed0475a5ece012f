"""BatchNorm with an optional fused ReLU, on CUDA.

``batch_norm`` has the semantics of ``torch.nn.functional.batch_norm`` (batch statistics and an
in-place update of the running statistics with the unbiased variance when training, the running
statistics in eval mode, optional affine parameters) plus ``activation="relu"``.
``BatchNorm1d/2d/3d`` are drop-in subclasses of torch's modules (same parameters, buffers and
state_dict) with an ``activation`` argument; on a tensor that is not on a CUDA device (a model
moved to the CPU, meta tensors) they run torch's own ``F.batch_norm`` (and ReLU), like torch's
modules.

Ops (schemas in csrc/ops.cpp, kernels in csrc/batch_norm_*.cu, autograd and the composite in
csrc/batch_norm_host.cpp):
  cudadoctor_ops::batch_norm               functional forward, with autograd (C++)
  cudadoctor_ops::batch_norm_backward      its backward
  cudadoctor_ops::batch_norm_update_stats  in-place running-statistics update
  cudadoctor_ops::batch_norm_forward       batch_norm + batch_norm_update_stats in one call
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["batch_norm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d"]

ACTIVATIONS = ("none", "relu")

# the op overload looked up once (calls through it skip the packet's overload resolution)
_BN_FORWARD = torch.ops.cudadoctor_ops.batch_norm_forward.default


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _kernel_memory_format(x: Tensor) -> torch.memory_format:
    """The layout the CUDA kernels produce for an input like ``x`` (see batch_norm_common.cuh)."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if (
        x.dim() == 5
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last_3d)
    ):
        return torch.channels_last_3d
    return torch.contiguous_format


@torch.library.register_fake("cudadoctor_ops::batch_norm")
def _batch_norm_fake(input, weight, bias, running_mean, running_var, training, eps, activation):
    c = input.shape[1]
    acc = _acc_dtype(input.dtype)
    out = torch.empty(input.shape, dtype=input.dtype, device=input.device).contiguous(
        memory_format=_kernel_memory_format(input)
    )
    stats = [input.new_empty((c,), dtype=acc) for _ in range(3)]
    return out, stats[0], stats[1], stats[2]


@torch.library.register_fake("cudadoctor_ops::batch_norm_backward")
def _batch_norm_backward_fake(
    grad_out, input, weight, bias, save_mean, save_invstd, reserve, training, activation, output_mask
):
    c = input.shape[1]
    acc = _acc_dtype(input.dtype)
    if output_mask[0]:
        gi = torch.empty(input.shape, dtype=input.dtype, device=input.device).contiguous(
            memory_format=_kernel_memory_format(input)
        )
    else:
        gi = input.new_empty((0,))
    wdt = weight.dtype if weight is not None else acc
    bdt = bias.dtype if bias is not None else acc
    gw = input.new_empty((c,) if output_mask[1] else (0,), dtype=wdt)
    gb = input.new_empty((c,) if output_mask[2] else (0,), dtype=bdt)
    return gi, gw, gb


@torch.library.register_fake("cudadoctor_ops::batch_norm_update_stats")
def _batch_norm_update_stats_fake(running_mean, running_var, save_mean, save_invstd, momentum, eps, count):
    return None


# batch_norm's autograd formula is a C++ autograd Function (csrc/batch_norm_host.cpp): no Python
# runs in the backward, and the non-differentiable outputs get no zero-filled gradients.


def _verify_batch_size(size) -> None:
    values = size[0]
    for s in size[2:]:
        values *= s
    if values == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")


_LOW = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double"}


def _dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _check_param(t: Optional[Tensor], name: str, input: Tensor) -> None:
    """The checks of the CUDA kernel (batch_norm_common.cuh), done before the call."""
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"cudadoctor_ops.batch_norm: {name} must be a tensor or None, got {type(t).__name__}")
    c = input.shape[1]
    if t.device != input.device:
        raise RuntimeError(
            f"cudadoctor_ops.batch_norm: {name} is on {t.device} but input is on {input.device}; "
            "move both to the same CUDA device"
        )
    if t.dim() != 1 or t.shape[0] != c:
        raise RuntimeError(
            f"cudadoctor_ops.batch_norm: {name} must have shape [{c}] (one value per channel of "
            f"input, dim 1), got {list(t.shape)}"
        )
    if t.dtype != input.dtype and not (input.dtype in _LOW and t.dtype == torch.float32):
        extra = " or float32" if input.dtype in _LOW else ""
        raise RuntimeError(
            f"cudadoctor_ops.batch_norm: {name} has dtype {_dtype_name(t.dtype)} but input has dtype "
            f"{_dtype_name(input.dtype)}; {name} must have the input's dtype{extra}"
        )


def batch_norm(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
    activation: str = "none",
) -> Tensor:
    """``torch.nn.functional.batch_norm`` on CUDA, optionally followed by a fused ReLU.

    input: (N, C, *) CUDA tensor, float32/float16/bfloat16 (float64 too), contiguous or
    channels_last (other strides are copied first). weight, bias, running_mean, running_var:
    [C] tensors of the input's dtype (or float32 for half/bfloat16 input), each optional.
    training=True uses the batch statistics and updates running_mean/running_var in place
    (running = (1 - momentum) * running + momentum * batch, unbiased variance); training=False
    uses the running statistics. activation: "none" or "relu".
    """
    # One call into C++ (csrc/batch_norm_host.cpp): checks, forward, autograd node and the
    # running-statistics update, which on eager CUDA tensors runs in the forward's own launch
    # (under torch.compile the composite op traces to batch_norm + batch_norm_update_stats, each
    # with its fake kernel). The Python checks below run only when that call fails, to turn
    # whatever failed into the error that names the bad argument; nothing was written then.
    try:
        return _BN_FORWARD(
            input, weight, bias, running_mean, running_var, bool(training), float(momentum), float(eps), activation
        )
    except Exception:
        _check_arguments(input, running_mean, running_var, weight, bias, training, momentum, activation)
        raise


def _check_arguments(input, running_mean, running_var, weight, bias, training, momentum, activation) -> None:
    """The argument errors of batch_norm with Python's exception types (ValueError, TypeError)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"batch_norm: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(input, Tensor) or input.dim() < 2:
        shape = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
        raise ValueError(f"batch_norm: input must be a tensor of shape (N, C, *), got {shape}")
    if input.device.type != "cuda":
        raise ValueError(
            f"batch_norm: input is on {input.device}; cudadoctor_ops.batch_norm runs on CUDA "
            "tensors only (use torch.nn.functional.batch_norm on the CPU)"
        )
    if momentum is None or not isinstance(momentum, (int, float)) or not math.isfinite(momentum):
        raise ValueError(f"batch_norm: momentum must be a finite float, got {momentum!r}")
    _check_param(weight, "weight", input)
    _check_param(bias, "bias", input)
    _check_param(running_mean, "running_mean", input)
    _check_param(running_var, "running_var", input)
    if training:
        _verify_batch_size(input.shape)


class _FusedBatchNorm:
    """Forward of torch's _BatchNorm, routed to cudadoctor_ops.batch_norm (+ activation)."""

    def __init__(self, num_features: int, *args, activation: str = "none", **kwargs) -> None:
        # every other argument goes to torch's constructor unchanged (its signature varies
        # across torch versions, e.g. the keyword-only `bias` of newer releases)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        super().__init__(num_features, *args, **kwargs)
        self.activation = activation

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track_running_stats
        args = (self.running_mean if keep else None, self.running_var if keep else None, self.weight,
                self.bias, use_batch_stats, factor, self.eps)
        if input.device.type != "cuda":
            # the kernels are CUDA only: elsewhere the module is torch's, as a drop-in must be
            y = F.batch_norm(input, *args)
            return F.relu(y) if self.activation == "relu" else y
        return batch_norm(input, *args, self.activation)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", activation={self.activation!r}"


class BatchNorm1d(_FusedBatchNorm, torch.nn.BatchNorm1d):
    """torch.nn.BatchNorm1d on cudadoctor_ops kernels, with ``activation="none"|"relu"``."""


class BatchNorm2d(_FusedBatchNorm, torch.nn.BatchNorm2d):
    """torch.nn.BatchNorm2d on cudadoctor_ops kernels, with ``activation="none"|"relu"``."""


class BatchNorm3d(_FusedBatchNorm, torch.nn.BatchNorm3d):
    """torch.nn.BatchNorm3d on cudadoctor_ops kernels, with ``activation="none"|"relu"``."""

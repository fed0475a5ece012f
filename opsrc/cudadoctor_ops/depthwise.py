"""Depthwise 2-D convolution (``groups == in_channels``) on CUDA.

Public API:

* :func:`depthwise_conv2d` -- ``F.conv2d(input, weight, bias, stride, padding, dilation,
  groups=C)`` for a weight of shape ``[C * multiplier, 1, kh, kw]``; differentiable in input,
  weight and bias.
* :class:`DepthwiseConv2d` -- a drop-in :class:`torch.nn.Conv2d` subclass with ``groups`` fixed to
  ``in_channels`` and the same ``state_dict``.

Kernels: specialised fast paths (3x3, 5x5, 7x7 at stride 1 and 2, dilation 1, multiplier 1,
float32/float16/bfloat16, NCHW and channels_last) and direct reference kernels for everything else
(any kernel size, stride, dilation, padding, multiplier; float64 too). ``impl="direct"`` or the
environment variable ``CUDADOCTOR_OPS_DEPTHWISE_IMPL=direct`` forces the reference kernels;
``impl="tiled_v1"`` runs the forward on the first-generation tiled kernels instead of the current
ones, ``impl="v2"`` on the second-generation ones, ``impl="nhwc_v3"`` runs the channels_last
forward on the third-generation kernel (shared-memory tiles staged with cp.async) for every fast
dtype, float32 included, and ``impl="nhwc_v4"`` on the fourth-generation direct kernel (no input
staging; float16/bfloat16 only, what ``"auto"`` tries first for those dtypes unless
``CUDADOCTOR_OPS_DW_V4=0``; its block shape from ``CUDADOCTOR_OPS_DW_V4_CFG=0..5`` and
whether a thread loads its first kernel row before the weight barrier from
``CUDADOCTOR_OPS_DW_V4_HOIST=0/1``, both by default by shape), so that they can be timed in one
run. The stride-1 input gradient runs a forward kernel on the flipped filter:
``"auto"`` tries the fourth-generation kernel first there as well, while ``"nhwc_v4"`` does not
select it there (that path runs the second-generation kernel for it).
For contiguous float32 at stride 1 with a 3x3 filter, padding 1 along W and W % 4 == 0,
``"auto"`` runs a warp kernel first, in the forward and in the stride-1 input gradient (no shared
memory: each lane loads its own 16 bytes of every input row and takes the neighbouring columns
from the next lanes by shuffles); ``CUDADOCTOR_OPS_DW_V2_SHFL=0`` keeps the second-generation
kernel there, ``=2 / 4 / 8`` sets its output rows per warp and also runs it for 5x5 (padding 2).
``"v2"`` never runs it.
The output keeps the input's memory format (channels_last in, channels_last out).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from ._args import int_pair

__all__ = ["depthwise_conv2d", "DepthwiseConv2d"]

_IMPLS = {"auto": 0, "direct": 1, "tiled_v1": 2, "nhwc_v3": 3, "v2": 4, "nhwc_v4": 5}
_ENV_IMPL = "CUDADOCTOR_OPS_DEPTHWISE_IMPL"

_IMPORT_IMPL = os.environ.get(_ENV_IMPL, "auto") or "auto"

_ops = torch.ops.cudadoctor_ops


def _pair(value: int | Sequence[int], name: str) -> list[int]:
    return int_pair(value, name, "depthwise_conv2d", TypeError)


def _impl_code(impl: str | None) -> int:
    if impl is None and torch.compiler.is_compiling():
        # Traced code reads no environment; compiled graphs use the value seen at import.
        impl = _IMPORT_IMPL
    name = impl if impl is not None else os.environ.get(_ENV_IMPL, "auto") or "auto"
    if name not in _IMPLS:
        raise ValueError(
            f"depthwise_conv2d: impl must be one of {sorted(_IMPLS)}, got {name!r}"
            + ("" if impl is not None else f" (from ${_ENV_IMPL})")
        )
    return _IMPLS[name]


def _memory_format(t: torch.Tensor) -> torch.memory_format:
    # Same rule as the CUDA side: channels_last only when the tensor is channels_last and not
    # also plain contiguous (C == 1 or H == W == 1 are both; those stay NCHW).
    if not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    return torch.contiguous_format


def _output_hw(input: torch.Tensor, weight: torch.Tensor, stride, padding, dilation, op: str):
    """Checks shapes and arguments like the CUDA side does; returns (Co, Ho, Wo)."""
    if input.dim() != 4:
        raise RuntimeError(f"{op}: input must be 4-D (N, C, H, W), got {input.dim()}-D")
    if weight.dtype != input.dtype:
        raise RuntimeError(
            f"{op}: weight dtype {weight.dtype} does not match input dtype {input.dtype}"
        )
    if weight.device != input.device:
        raise RuntimeError(
            f"{op}: weight is on {weight.device} but input is on {input.device}; move both to "
            "the same CUDA device"
        )
    C = input.shape[1]
    if (
        weight.dim() != 4
        or weight.shape[1] != 1
        or C <= 0
        or weight.shape[0] <= 0
        or weight.shape[0] % C != 0
        or weight.shape[2] <= 0
        or weight.shape[3] <= 0
    ):
        raise RuntimeError(
            f"{op}: weight must have shape [C*multiplier, 1, kh, kw] with C = {C} input channels "
            f"(groups == C), got weight sizes {list(weight.shape)}"
        )
    sh, sw = stride
    ph, pw = padding
    dh, dw = dilation
    if sh <= 0 or sw <= 0:
        raise RuntimeError(f"{op}: stride must be positive, got {list(stride)}")
    if ph < 0 or pw < 0:
        raise RuntimeError(f"{op}: padding must be non-negative, got {list(padding)}")
    if dh <= 0 or dw <= 0:
        raise RuntimeError(f"{op}: dilation must be positive, got {list(dilation)}")
    H, W = input.shape[2], input.shape[3]
    kh, kw = weight.shape[2], weight.shape[3]
    eh, ew = dh * (kh - 1) + 1, dw * (kw - 1) + 1
    if H + 2 * ph < eh or W + 2 * pw < ew:
        raise RuntimeError(
            f"{op}: padded input {H + 2 * ph}x{W + 2 * pw} is smaller than the dilated kernel "
            f"{eh}x{ew}"
        )
    return weight.shape[0], (H + 2 * ph - eh) // sh + 1, (W + 2 * pw - ew) // sw + 1


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_args(input, weight, bias, stride, padding, dilation) -> None:
    op = "depthwise_conv2d"
    if input.dtype not in _DTYPES:
        raise RuntimeError(
            f"{op}: input dtype must be float32, float16, bfloat16 or float64, got {input.dtype}"
        )
    Co, _, _ = _output_hw(input, weight, stride, padding, dilation, op)
    if bias is not None:
        if bias.device != input.device:
            raise RuntimeError(f"{op}: bias is on {bias.device} but input is on {input.device}")
        if bias.dtype != input.dtype:
            raise RuntimeError(
                f"{op}: bias dtype {bias.dtype} does not match input dtype {input.dtype}"
            )
        if bias.dim() != 1 or bias.shape[0] != Co:
            raise RuntimeError(f"{op}: bias must have shape [{Co}], got {list(bias.shape)}")


# ---- fake (meta) kernels -------------------------------------------------------------------


@torch.library.register_fake("cudadoctor_ops::depthwise_conv2d")
def _forward_fake(input, weight, bias, stride, padding, dilation, impl=0):
    Co, Ho, Wo = _output_hw(input, weight, stride, padding, dilation, "depthwise_conv2d")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != Co):
        raise RuntimeError(f"depthwise_conv2d: bias must have shape [{Co}], got {list(bias.shape)}")
    return torch.empty(
        (input.shape[0], Co, Ho, Wo),
        dtype=input.dtype,
        device=input.device,
        memory_format=_memory_format(input),
    )


@torch.library.register_fake("cudadoctor_ops::depthwise_conv2d_backward_input")
def _backward_input_fake(grad_output, input, weight, stride, padding, dilation, impl=0):
    _output_hw(input, weight, stride, padding, dilation, "depthwise_conv2d_backward_input")
    return torch.empty(
        tuple(input.shape), dtype=input.dtype, device=input.device,
        memory_format=_memory_format(input),
    )


@torch.library.register_fake("cudadoctor_ops::depthwise_conv2d_backward_weight")
def _backward_weight_fake(grad_output, input, weight, stride, padding, dilation, bias_grad, impl=0):
    Co, _, _ = _output_hw(input, weight, stride, padding, dilation,
                          "depthwise_conv2d_backward_weight")
    gw = torch.empty(tuple(weight.shape), dtype=input.dtype, device=input.device)
    gb = torch.empty((Co if bias_grad else 0,), dtype=input.dtype, device=input.device)
    return gw, gb


# ---- autograd --------------------------------------------------------------------------------


# The autograd formula of depthwise_conv2d is a C++ autograd Function (csrc/depthwise_host.cpp):
# grad_input from depthwise_conv2d_backward_input, grad_weight and grad_bias from
# depthwise_conv2d_backward_weight, with the forward's impl; no Python runs in the backward.


# ---- public API ------------------------------------------------------------------------------


def depthwise_conv2d(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    *,
    impl: str | None = None,
) -> torch.Tensor:
    """Depthwise convolution, equal to ``F.conv2d(..., groups=input.shape[1])``.

    ``weight`` is ``[C * multiplier, 1, kh, kw]``; ``stride``, ``padding`` and ``dilation`` are
    ints or (h, w) pairs. ``impl``: ``"auto"`` (default; fast kernels where they apply) or
    ``"direct"`` (reference kernels) or ``"tiled_v1"`` / ``"v2"`` (forward on the first- /
    second-generation fast kernels) or ``"nhwc_v3"`` / ``"nhwc_v4"`` (channels_last forward on the
    third- / fourth-generation kernel where it applies); ``None`` reads
    ``$CUDADOCTOR_OPS_DEPTHWISE_IMPL``.
    Inputs must be CUDA tensors of one dtype (float32, float16, bfloat16 or float64).
    """
    for name, t in (("input", input), ("weight", weight), ("bias", bias)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"depthwise_conv2d: {name} must be a tensor, got {type(t).__name__}")
    if input.device.type != "cuda":
        raise RuntimeError(
            f"depthwise_conv2d: input must be a CUDA tensor, got device {input.device}; "
            "use torch.nn.functional.conv2d(..., groups=C) on other devices"
        )
    stride, padding, dilation = (
        _pair(stride, "stride"), _pair(padding, "padding"), _pair(dilation, "dilation")
    )
    # Arguments are checked here, before the op: the CUDA side repeats the checks, but an error
    # raised from there is the second line of defence, not the interface.
    _check_args(input, weight, bias, stride, padding, dilation)
    return _ops.depthwise_conv2d(input, weight, bias, stride, padding, dilation, _impl_code(impl))


class DepthwiseConv2d(nn.Conv2d):
    """``nn.Conv2d`` with ``groups = in_channels`` that runs :func:`depthwise_conv2d` on CUDA.

    Same constructor arguments as ``nn.Conv2d`` (``out_channels`` defaults to ``in_channels`` and
    must be a multiple of it; ``groups``, if given, must equal ``in_channels``), same parameters
    and ``state_dict``. Inputs on other devices, ``padding_mode`` other than ``"zeros"`` and
    ``padding="same"`` that needs uneven padding run ``nn.Conv2d.forward``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int | None = None,
        kernel_size: int | tuple[int, int] = 3,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int | None = None,
        bias: bool = True,
        padding_mode: str = "zeros",
        device=None,
        dtype=None,
    ) -> None:
        if out_channels is None:
            out_channels = in_channels
        if groups is not None and groups != in_channels:
            raise ValueError(
                f"DepthwiseConv2d: groups must equal in_channels ({in_channels}), got {groups}"
            )
        if in_channels <= 0 or out_channels % in_channels != 0:
            raise ValueError(
                "DepthwiseConv2d: out_channels must be a positive multiple of in_channels, got "
                f"in_channels={in_channels}, out_channels={out_channels}"
            )
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=in_channels,
            bias=bias,
            padding_mode=padding_mode,
            device=device,
            dtype=dtype,
        )

    def _int_padding(self) -> list[int] | None:
        if not isinstance(self.padding, str):
            return list(self.padding)
        if self.padding == "valid":
            return [0, 0]
        pads = []
        for d, k in zip(self.dilation, self.kernel_size):
            total = d * (k - 1)
            if total % 2:
                return None
            pads.append(total // 2)
        return pads

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        pad = self._int_padding()
        if pad is None or self.padding_mode != "zeros" or input.device.type != "cuda":
            return super().forward(input)
        return depthwise_conv2d(
            input, self.weight, self.bias, self.stride, pad, self.dilation
        )


# ---- hooks of `python -m cudadoctor_ops.bench depthwise` / `python -m cudadoctor_ops.sanitize depthwise`


def bench_rows(args, timer, copy_tbps):
    """Benchmark rows of this op (see cudadoctor_ops.bench_depthwise)."""
    from .bench_depthwise import bench_rows as rows

    return rows(args, timer, copy_tbps)


def sanitize_exercise() -> int:
    """Runs every kernel variant once on small shapes (for compute-sanitizer); returns the count.

    Fast paths (k 3/5/7, stride 1/2, float32/float16/bfloat16, NCHW and channels_last; forward
    on both the current and the previous, "tiled_v1", kernels) and the
    direct kernels (dilation, multiplier, even kernel, wide padding), forward and backward, each
    checked against F.conv2d in float64; raises AssertionError on a mismatch.
    """
    import torch.nn.functional as F

    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    gen = torch.Generator(device="cuda").manual_seed(0)

    def one(n, c, h, w, k, s, p, d, m, dtype, cl):
        x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        wt = torch.randn(c * m, 1, k, k, device="cuda", generator=gen).to(dtype)
        b = torch.randn(c * m, device="cuda", generator=gen).to(dtype)
        for t in (x, wt, b):
            t.requires_grad_(True)
        out = depthwise_conv2d(x, wt, b, s, p, d)
        g = torch.randn(out.shape, device="cuda", generator=gen).to(dtype)
        out.backward(g)
        # Reference on the CPU, so that the sanitizer watches only this op's kernels.
        xr, wr, br = (t.detach().cpu().double().requires_grad_(True) for t in (x, wt, b))
        ref = F.conv2d(xr, wr, br, s, p, d, groups=c)
        ref.backward(g.cpu().double())
        for name, got, r in (("out", out, ref), ("grad_input", x.grad, xr.grad),
                             ("grad_weight", wt.grad, wr.grad), ("grad_bias", b.grad, br.grad)):
            err = (got.cpu().double() - r).abs().max().item() / max(r.abs().max().item(), 1e-6)
            assert err <= tol[dtype], (
                f"depthwise {name} mismatch {err:.2e}: {(n, c, h, w)} k{k} s{s} p{p} d{d} m{m} "
                f"{dtype} channels_last={cl}"
            )

    count = 0
    for k in (3, 5, 7):
        for s in (1, 2):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for cl in (False, True):
                    one(2, 16, 13, 11, k, s, k // 2, 1, 1, dtype, cl)
                    count += 1
    # Forward only, W a multiple of 8: the 16-byte chunk loads of the NCHW kernels (W = 11 above
    # takes their element loads), the channels_last 16-byte kernels, and tall tiles (many planes).
    def fwd_only(n, c, h, w, k, s, dtype, cl):
        x = torch.randn(n, c, h, w, device="cuda", generator=gen).to(dtype)
        if cl:
            x = x.contiguous(memory_format=torch.channels_last)
        wt = torch.randn(c, 1, k, k, device="cuda", generator=gen).to(dtype)
        b = torch.randn(c, device="cuda", generator=gen).to(dtype)
        ref = F.conv2d(x.cpu().double(), wt.cpu().double(), b.cpu().double(), s, k // 2, 1, c)
        for impl in ("auto", "tiled_v1"):
            out = depthwise_conv2d(x, wt, b, s, k // 2, impl=impl)
            err = (out.cpu().double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
            assert err <= tol[dtype], (
                f"depthwise forward ({impl}) mismatch {err:.2e}: {(n, c, h, w)} k{k} s{s}"
            )

    for k in (3, 5, 7):
        for s in (1, 2):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for cl in (False, True):
                    fwd_only(1, 16, 12, 16, k, s, dtype, cl)
                    count += 1
    for k, s in ((3, 1), (5, 2)):
        fwd_only(1, 1024, 9, 16, k, s, torch.float32, False)
        count += 1
    for args in ((2, 8, 9, 10, 3, 1, 2, 2, 1), (2, 4, 7, 9, 3, 2, 1, 1, 2),
                 (1, 8, 12, 12, 4, 1, 2, 1, 1), (2, 8, 13, 13, 3, 1, 4, 1, 1),
                 (2, 8, 10, 9, 5, 2, 4, 1, 1)):
        for cl in (False, True):
            one(*args, torch.float32, cl)
            count += 1
    torch.cuda.synchronize()
    return count

"""The convolution of Conv+BN+ReLU's training forward with BatchNorm's batch statistics computed in
its epilogue, through cuDNN's graph API (the optional ``nvidia-cudnn-frontend`` package): from C++
(``cudadoctor_ops.cudnn_conv_stats``, csrc/cudnn_conv_stats.cpp) where the wheel was built with the
frontend's headers installed, else through the frontend's Python API.

One cuDNN graph per block shape: conv_fprop -> Y (written out, channels_last), D = Y - shift (the
running mean before this step, or none), and two ADD reductions over N, H, W: sum(D) and
sum(D * D) in float32. cuDNN compiles it into one kernel (on the H200:
``cudnn_generated_fort_native_sm90_convFwd_pointwise_reduction_reduction``, 1.08-1.16x the time of
the convolution alone, scripts/cudnn_fusion_probe.py), so the BatchNorm that follows needs no pass
of its own over the data for statistics: ``conv_bn_relu_apply_sums`` turns the sums into
mean / invstd, updates the running statistics and writes out + mask in one elementwise pass.

Opt-in: CUDADOCTOR_OPS_CBR_CUDNN_STATS=1 (read at every call), for float16 / bfloat16
channels_last inputs, groups 1, no conv bias, channels multiple of 8, when the C++ op has a kernel
or the frontend imports. On the H200 (torch 2.11, cuDNN 9.19, frontend 1.14.1; bench_cbr,
(32,64,56,56)->64 fp16 and (64,128,28,28)->128 bf16), through the Python API, it took the GPU
time of the training forward from 45.8 to 43.1 us and from 50.0 to 51.5 us (CUDA-graph replays,
two runs of the bench), while an eager call took 0.21-0.24 ms of wall time (host-bound: the
frontend's Python execute) against 0.05-0.11 ms without it: a small GPU gain paid for in host
time, hence off by default. The C++ op (the same graph) has not been timed yet. A shape cuDNN has no engine for
is remembered and runs the usual path; so does every call under torch.compile, a dispatch mode,
or a CUDA-graph capture whose graph is not built yet (building synchronises). Graphs are built on
first use of a shape (cuDNN compiles the kernel at run time) and kept for the process.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
from torch import Tensor

ENV = "CUDADOCTOR_OPS_CBR_CUDNN_STATS"

_lock = threading.Lock()
_frontend = None  # the imported module, False when it failed
_import_error: Optional[str] = None
_handles: dict[int, int] = {}
_plans: dict[tuple, Optional["_Plan"]] = {}
_why: dict[tuple, str] = {}  # shapes without an engine, and cuDNN's reason
calls = 0  # forwards that ran this path (tests read it)


def _cpp_available() -> bool:
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("cudadoctor_ops::cudnn_conv_stats", "CUDA"))
    except Exception:  # noqa: BLE001 - op not defined in this build
        return False


_CPP = _cpp_available()  # the wheel's C++ op (csrc/cudnn_conv_stats.cpp) has a CUDA kernel


class _Plan:
    __slots__ = ("graph", "X", "W", "Y", "SH", "S1", "S2", "workspace", "shifted")


def _load():
    global _frontend, _import_error
    if _frontend is None:
        with _lock:
            if _frontend is None:
                try:
                    import cudnn  # nvidia-cudnn-frontend

                    _frontend = cudnn
                except Exception as e:  # noqa: BLE001 - any import failure means "not available"
                    _frontend, _import_error = False, f"{type(e).__name__}: {e}"
    return _frontend or None


def status() -> dict:
    """Whether the path is available, and the shapes cuDNN declined (with its reason)."""
    fe = None if _CPP else _load()
    return {
        "enabled": os.environ.get(ENV, "") == "1",
        "backend": "c++" if _CPP else ("python" if fe is not None else None),
        "frontend": None if fe is None else getattr(fe, "__version__", "?"),
        "import_error": _import_error,
        "graphs": sum(1 for p in _plans.values() if p is not None),
        "declined": {str(k): v for k, v in _why.items()},
        "calls": calls,
    }


def usable(input: Tensor, weight: Tensor, conv_bias: Optional[Tensor], groups: int) -> bool:
    """Cheap checks first; the frontend is imported only for inputs the path can take."""
    if os.environ.get(ENV, "") != "1":
        return False
    if not (input.is_cuda and input.dim() == 4 and weight.dim() == 4 and groups == 1 and conv_bias is None):
        return False
    if input.dtype not in (torch.float16, torch.bfloat16) or weight.dtype != input.dtype:
        return False
    if input.numel() == 0 or input.shape[1] % 8 or weight.shape[0] % 8:
        return False
    if input.is_contiguous() or not input.is_contiguous(memory_format=torch.channels_last):
        return False
    if input.data_ptr() % 16 or weight.data_ptr() % 16:
        return False
    if torch.compiler.is_compiling():
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if _get_current_dispatch_mode() is not None:
        return False
    return _CPP or _load() is not None


def available() -> bool:
    """Whether a backend exists (the C++ op's kernel, or the frontend's Python API)."""
    return _CPP or _load() is not None


def _handle(fe, device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    h = _handles.get(idx)
    if h is None:
        with torch.cuda.device(idx):
            h = _handles[idx] = fe.create_handle()
    return h


def _channels_last_strides(shape) -> list[int]:
    n, c, h, w = shape
    return [h * w * c, 1, w * c, c]


def _build(fe, handle, dtype, x_shape, w_shape, y_shape, stride, padding, dilation, shifted) -> _Plan:
    dt = fe.data_type.HALF if dtype == torch.float16 else fe.data_type.BFLOAT16
    f32 = fe.data_type.FLOAT
    k = w_shape[0]
    g = fe.pygraph(io_data_type=dt, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    p = _Plan()
    p.X = g.tensor(name="X", dim=list(x_shape), stride=_channels_last_strides(x_shape), data_type=dt)
    p.W = g.tensor(name="W", dim=list(w_shape), stride=_channels_last_strides(w_shape), data_type=dt)
    p.Y = g.conv_fprop(image=p.X, weight=p.W, padding=list(padding), stride=list(stride), dilation=list(dilation))
    p.Y.set_output(True).set_data_type(dt).set_dim(list(y_shape)).set_stride(_channels_last_strides(y_shape))
    d = p.Y
    p.SH = None
    if shifted:
        p.SH = g.tensor(name="SHIFT", dim=[1, k, 1, 1], stride=[k, 1, k, k], data_type=f32)
        d = g.sub(a=p.Y, b=p.SH)
    p.S1 = g.reduction(input=d, mode=fe.reduction_mode.ADD)
    p.S2 = g.reduction(input=g.mul(a=d, b=d), mode=fe.reduction_mode.ADD)
    for t in (p.S1, p.S2):
        t.set_output(True).set_data_type(f32).set_dim([1, k, 1, 1]).set_stride([k, 1, k, k])
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([fe.heur_mode.A, fe.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    p.graph = g
    p.workspace = max(int(g.get_workspace_size()), 1)
    p.shifted = shifted
    return p


def conv_stats(input: Tensor, weight: Tensor, stride, padding, dilation,
               shift: Optional[Tensor]) -> Optional[tuple[Tensor, Tensor, bool]]:
    """(conv output, channels_last; float32 [2, K] sums of (y - shift) and (y - shift)^2; whether
    the sums are shifted), or None where this path does not run (the caller then runs the usual
    one). shift: a contiguous float32 [K] tensor (the running mean), or None."""
    global calls
    key = (input.device.index, tuple(input.shape), tuple(weight.shape), tuple(stride), tuple(padding),
           tuple(dilation), input.dtype, shift is not None)
    if _CPP:
        # detached: the op has no autograd formula (the caller's autograd.Function owns the graph);
        # the op makes the weight channels_last itself
        y, sums, state, why = torch.ops.cudadoctor_ops.cudnn_conv_stats(
            input.detach(), weight.detach(), list(stride), list(padding), list(dilation), shift)
        if state < 0:
            _why[key] = why
            return None
        calls += 1
        return y, sums, bool(state)
    fe = _load()
    if fe is None:
        return None
    n, c, h, w = input.shape
    k, _, kh, kw = weight.shape
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (w + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    if ho <= 0 or wo <= 0 or n * ho * wo <= 1:
        return None
    shifted = shift is not None
    plan = _plans.get(key, False)
    if plan is False:
        if torch.cuda.is_current_stream_capturing():
            return None  # building a graph synchronises, which a capture does not allow
        plan = None
        # the shifted graph first; where cuDNN has no engine for it, the plain sums
        for with_shift in ((True, False) if shifted else (False,)):
            try:
                plan = _build(fe, _handle(fe, input.device), input.dtype, (n, c, h, w), (k, c, kh, kw),
                              (n, k, ho, wo), stride, padding, dilation, with_shift)
                break
            except Exception as e:  # noqa: BLE001 - cuDNN's "no engine" comes in several types
                text = str(e).strip()
                _why[key + (with_shift,)] = f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"
        _plans[key] = plan
    if plan is None:
        return None
    if not weight.is_contiguous(memory_format=torch.channels_last):
        weight = weight.contiguous(memory_format=torch.channels_last)
    y = torch.empty((n, ho, wo, k), dtype=input.dtype, device=input.device).permute(0, 3, 1, 2)
    sums = torch.empty((2, k), dtype=torch.float32, device=input.device)
    ws = torch.empty(plan.workspace, dtype=torch.uint8, device=input.device)
    feeds = {plan.X: input.data_ptr(), plan.W: weight.data_ptr(), plan.Y: y.data_ptr(),
             plan.S1: sums[0].data_ptr(), plan.S2: sums[1].data_ptr()}
    if plan.shifted:
        feeds[plan.SH] = shift.data_ptr()
    handle = _handle(fe, input.device)
    fe.set_stream(handle=handle, stream=torch.cuda.current_stream(input.device).cuda_stream)
    try:
        plan.graph.execute(feeds, ws.data_ptr(), handle=handle)
    except Exception as e:  # noqa: BLE001 - nothing was written: the usual path runs instead
        _plans[key] = None
        _why[key] = f"execute: {type(e).__name__}: {str(e).strip()[:300]}"
        return None
    calls += 1
    return y, sums, plan.shifted

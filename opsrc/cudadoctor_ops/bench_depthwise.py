"""Depthwise section of the operator benchmark, against torch's F.conv2d(groups=C).

    python -m cudadoctor_ops.bench depthwise [--quick] [--json-out PATH]

Both are timed in the same run with the bench's timer (cudadoctor_ops.bench.Timer). Forward
compares ``depthwise_conv2d`` with ``F.conv2d(..., groups=C)``; backward compares our
input-gradient plus weight-gradient ops with ``aten.convolution_backward`` asked for the same two
gradients. Byte model (the fewest bytes a correct kernel moves): forward reads the input and
writes the output; backward reads grad_output and the input and writes grad_input. TB/s is shown
against the device-to-device copy bandwidth measured in the same run. Targets: forward >= 2x and
backward >= 1.5x on the fp32 NCHW shapes; >= 1x on the fp16/bf16 channels_last MobileNetV2 /
EfficientNet-B0 layers at batch 64. A row whose result differs from torch's is never "met".

Forward rows also time the previous generation of fast kernels (``impl=4``, "v2") in the
same run: each forward row carries ``prev_ms`` and ``prev_ratio`` (torch / previous) in the JSON,
a progress line per shape gives new, previous and torch side by side, and a summary of the three
is printed before the table.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F

# (name, N, C, H, W, k, stride)
FP32_TARGETS = [
    ("target", 1, 64, 128, 128, 3, 1),
    ("target", 8, 64, 128, 128, 3, 1),
    ("target", 1, 256, 128, 128, 3, 1),
    ("target", 32, 12, 112, 112, 5, 1),
    ("target", 64, 32, 112, 112, 3, 1),
]

# Depthwise layers of MobileNetV2 and EfficientNet-B0 at 224x224 input, batch 64 (deduplicated).
MOBILE_LAYERS = [
    ("mnv2/effb0", 64, 32, 112, 112, 3, 1),
    ("mnv2/effb0", 64, 96, 112, 112, 3, 2),
    ("mnv2/effb0", 64, 144, 56, 56, 3, 1),
    ("mnv2", 64, 144, 56, 56, 3, 2),
    ("mnv2", 64, 192, 28, 28, 3, 1),
    ("mnv2", 64, 192, 28, 28, 3, 2),
    ("mnv2", 64, 384, 14, 14, 3, 1),
    ("mnv2", 64, 576, 14, 14, 3, 1),
    ("mnv2", 64, 576, 14, 14, 3, 2),
    ("mnv2", 64, 960, 7, 7, 3, 1),
    ("effb0", 64, 144, 56, 56, 5, 2),
    ("effb0", 64, 240, 28, 28, 5, 1),
    ("effb0", 64, 240, 28, 28, 3, 2),
    ("effb0", 64, 480, 14, 14, 3, 1),
    ("effb0", 64, 480, 14, 14, 5, 1),
    ("effb0", 64, 672, 14, 14, 5, 1),
    ("effb0", 64, 672, 14, 14, 5, 2),
    ("effb0", 64, 1152, 7, 7, 5, 1),
    ("effb0", 64, 1152, 7, 7, 3, 1),
]


def _tensors(n, c, h, w, k, s, dtype, layout):
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
    if layout == "NHWC":
        x = x.contiguous(memory_format=torch.channels_last)
    wt = torch.randn(c, 1, k, k, device="cuda", dtype=dtype)
    p = k // 2
    ho = (h + 2 * p - k) // s + 1
    wo = (w + 2 * p - k) // s + 1
    g = torch.randn(n, c, ho, wo, device="cuda", dtype=dtype)
    if layout == "NHWC":
        g = g.contiguous(memory_format=torch.channels_last)
    return x, wt, g, p


_SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _rel_err(got, ref) -> float:
    return (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)


_IMPL_AUTO, _IMPL_PREV = 0, 4  # "v2" (impl 4): the previous default fast kernels


def backward_calls(g, x, wt, st, pd, dl):
    """(ours, torch's): calls that return the input and weight gradients (dX, dW) of a depthwise
    convolution of x [N, C, H, W] with wt [C, 1, k, k] given grad_output g (bias gradient off)."""
    ops = torch.ops.cudadoctor_ops
    c = x.shape[1]

    def ours():
        gi = ops.depthwise_conv2d_backward_input(g, x, wt, st, pd, dl, _IMPL_AUTO)
        gw, _ = ops.depthwise_conv2d_backward_weight(g, x, wt, st, pd, dl, False, _IMPL_AUTO)
        return gi, gw

    def theirs():
        gi, gw, _ = torch.ops.aten.convolution_backward(
            g, x, wt, None, st, pd, dl, False, [0, 0], c, [True, True, False]
        )
        return gi, gw

    return ours, theirs


def _row_type():
    from .bench import Row

    @dataclasses.dataclass
    class DepthwiseRow(Row):
        # Forward rows: the previous fast kernels (impl=4, "v2") timed in the same run, and torch / them.
        prev_ms: float = 0.0
        prev_ratio: float = 0.0

    return DepthwiseRow


def _case_rows(timer, copy_tbps, group, n, c, h, w, k, s, dtype, layout, target_fwd, target_bwd):
    from .bench import _progress

    Row = _row_type()

    ops = torch.ops.cudadoctor_ops
    x, wt, g, p = _tensors(n, c, h, w, k, s, dtype, layout)
    st, pd, dl = [s, s], [p, p], [1, 1]

    def fwd_ours():
        return ops.depthwise_conv2d(x, wt, None, st, pd, dl, _IMPL_AUTO)

    def fwd_prev():
        return ops.depthwise_conv2d(x, wt, None, st, pd, dl, _IMPL_PREV)

    def fwd_torch():
        return F.conv2d(x, wt, None, s, p, 1, c)

    bwd_ours, bwd_torch = backward_calls(g, x, wt, st, pd, dl)

    # Same answer as torch first (a wrong fast kernel must not pass as a fast one).
    ref_fwd = fwd_torch()
    ok_fwd = _rel_err(fwd_ours(), ref_fwd) <= _TOL[dtype]
    ok_prev = _rel_err(fwd_prev(), ref_fwd) <= _TOL[dtype]
    del ref_fwd
    (gi, gw), (gi_r, gw_r) = bwd_ours(), bwd_torch()
    ok_bwd = max(_rel_err(gi, gi_r), _rel_err(gw, gw_r)) <= _TOL[dtype]
    del gi, gw, gi_r, gw_r

    esz = x.element_size()
    rows = []
    for kind, ours, theirs, nbytes, target, ok in (
        ("fwd", fwd_ours, fwd_torch, (x.numel() + g.numel()) * esz, target_fwd, ok_fwd),
        ("bwd dX+dW", bwd_ours, bwd_torch, (2 * x.numel() + g.numel()) * esz, target_bwd, ok_bwd),
    ):
        row = Row("depthwise", f"{kind} k{k} s{s} {group}", (n, c, h, w), _SHORT[dtype],
                  layout.lower(), *timer.pair(ours, theirs), nbytes, target)
        row.finish(copy_tbps)
        if kind == "fwd":
            row.prev_ms = timer(fwd_prev)
            row.prev_ratio = row.torch_ms / row.prev_ms if row.prev_ms > 0 else 0.0
            print(f"  depthwise fwd k{k} s{s} {group} {(n, c, h, w)} {_SHORT[dtype]} "
                  f"{layout.lower()}: new {row.ours_ms:.4f} ms, v2 {row.prev_ms:.4f} ms, "
                  f"torch {row.torch_ms:.4f} ms -> new {row.ratio:.2f}x, v2 "
                  f"{row.prev_ratio:.2f}x of torch; new/v2 {row.prev_ms / row.ours_ms:.2f}x"
                  + ("" if ok_prev else "  (v2 RESULT MISMATCH)"),
                  file=sys.stderr, flush=True)
        if not ok:
            row.ok = False
            print(f"  depthwise {kind} {(n, c, h, w)} k{k} s{s} {_SHORT[dtype]} {layout}: "
                  "RESULT MISMATCH against torch", file=sys.stderr, flush=True)
        rows.append(row)
        _progress(row)
    return rows


def bench_rows(args, timer, copy_tbps) -> list:
    """Rows for ``python -m cudadoctor_ops.bench depthwise`` (targets of the depthwise issue)."""
    quick = bool(getattr(args, "quick", False))
    cases = [(c, torch.float32, "NCHW", 2.0, 1.5) for c in FP32_TARGETS]
    mobile = MOBILE_LAYERS[:4] if quick else MOBILE_LAYERS
    for dtype in (torch.float16, torch.bfloat16):
        cases += [(c, dtype, "NHWC", 1.0, 1.0) for c in mobile]
    rows = []
    for (group, n, c, h, w, k, s), dtype, layout, tf, tb in cases:
        rows += _case_rows(timer, copy_tbps, group, n, c, h, w, k, s, dtype, layout, tf, tb)
        torch.cuda.empty_cache()
    if not getattr(args, "json", False):
        print(forward_summary(rows))
    return rows


def forward_summary(rows) -> str:
    """Forward rows: current kernels, previous (v2) kernels and torch side by side."""
    lines = ["depthwise forward: current kernels vs previous (v2) vs torch, same run",
             f"  {'shape':<34} {'dtype':<5} {'layout':<6} {'new ms':>8} {'prev ms':>8} "
             f"{'torch ms':>8} {'new/torch':>9} {'prev/torch':>8} {'new vs prev':>9}"]
    for r in rows:
        if not r.kind.startswith("fwd") or not getattr(r, "prev_ms", 0.0):
            continue
        shape = f"{r.kind.split()[1]} {r.kind.split()[2]} " + "x".join(str(v) for v in r.shape)
        lines.append(f"  {shape:<34} {r.dtype:<5} {r.layout:<6} {r.ours_ms:>8.4f} {r.prev_ms:>8.4f} "
                     f"{r.torch_ms:>8.4f} {r.ratio:>8.2f}x {r.prev_ratio:>7.2f}x "
                     f"{r.prev_ms / r.ours_ms:>8.2f}x")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Same as ``python -m cudadoctor_ops.bench depthwise [options]``."""
    from .bench import main as bench_main

    return bench_main(["depthwise", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())

"""Benchmark of cudadoctor_ops.depthwise_conv2d against torch's F.conv2d(groups=C).

    python -m cudadoctor_ops.bench_depthwise [--quick] [--json PATH]

Both are timed in the same run with the same method: the median of CUDA-event times of single
calls, each preceded by a 256 MiB buffer write that evicts the L2 cache (as triton's do_bench).
Forward compares ``depthwise_conv2d`` with ``F.conv2d(..., groups=C)``; backward compares our
input-gradient plus weight-gradient ops with ``aten.convolution_backward`` asked for the same two
gradients. Byte model (the fewest bytes a correct kernel moves): forward reads the input and
writes the output; backward reads grad_output and the input and writes grad_input. TB/s is shown
against the device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

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


class Timer:
    """Median GPU time of fn() in ms, with an L2-evicting write before every call."""

    def __init__(self, reps: int = 50, warmup: int = 5) -> None:
        self.reps = reps
        self.warmup = warmup
        self.flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy bandwidth in TB/s (bytes read + written)."""
    n = 512 * 1024 * 1024 // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


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


def bench_case(timer, copy_tbs, group, n, c, h, w, k, s, dtype, layout, check=True):
    ops = torch.ops.cudadoctor_ops
    x, wt, g, p = _tensors(n, c, h, w, k, s, dtype, layout)
    st, pd, dl = [s, s], [p, p], [1, 1]
    rows = []

    def fwd_ours():
        return ops.depthwise_conv2d(x, wt, None, st, pd, dl, 0)

    def fwd_torch():
        return F.conv2d(x, wt, None, s, p, 1, c)

    def bwd_ours():
        gi = ops.depthwise_conv2d_backward_input(g, x, wt, st, pd, dl, 0)
        gw, _ = ops.depthwise_conv2d_backward_weight(g, x, wt, st, pd, dl, False, 0)
        return gi, gw

    def bwd_torch():
        return torch.ops.aten.convolution_backward(
            g, x, wt, None, st, pd, dl, False, [0, 0], c, [True, True, False]
        )

    if check:
        ref = fwd_torch().float()
        err = (fwd_ours().float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        gi_r, gw_r, _ = bwd_torch()
        gi, gw = bwd_ours()
        e_gi = (gi.float() - gi_r.float()).abs().max().item() / max(gi_r.abs().max().item(), 1e-6)
        e_gw = (gw.float() - gw_r.float()).abs().max().item() / max(gw_r.abs().max().item(), 1e-6)
        err_b = max(e_gi, e_gw)
    else:
        err = err_b = float("nan")
    esz = x.element_size()
    out_numel = g.numel()
    for direction, ours_fn, torch_fn, nbytes, e in (
        ("fwd", fwd_ours, fwd_torch, (x.numel() + out_numel) * esz, err),
        ("bwd", bwd_ours, bwd_torch, (2 * x.numel() + out_numel) * esz, err_b),
    ):
        t_ours = timer(ours_fn)
        t_torch = timer(torch_fn)
        tbs = nbytes / (t_ours * 1e-3) / 1e12
        rows.append(
            {
                "group": group,
                "dir": direction,
                "shape": [n, c, h, w],
                "k": k,
                "stride": s,
                "dtype": str(dtype).replace("torch.", ""),
                "layout": layout,
                "ours_ms": t_ours,
                "torch_ms": t_torch,
                "ratio": t_torch / t_ours,
                "tbs": tbs,
                "pct_copy": 100.0 * tbs / copy_tbs,
                "max_rel_err": e,
            }
        )
    return rows


def _fmt(r) -> str:
    shape = "x".join(str(v) for v in r["shape"])
    return (
        f"{r['dir']:<4} {r['group']:<10} {shape:<16} k{r['k']} s{r['stride']} "
        f"{r['dtype']:<8} {r['layout']:<4} {r['ours_ms']:9.4f} {r['torch_ms']:9.4f} "
        f"{r['ratio']:6.2f}x {r['tbs']:6.2f} {r['pct_copy']:6.1f}% {r['max_rel_err']:.1e}"
    )


def run(quick: bool = False, reps: int = 50) -> dict:
    timer = Timer(reps=reps)
    copy_tbs = copy_bandwidth(timer)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"copy bandwidth {copy_tbs:.2f} TB/s")
    print(f"{'dir':<4} {'group':<10} {'N,C,H,W':<16} k  s  {'dtype':<8} {'lay':<4} "
          f"{'ours ms':>9} {'torch ms':>9} {'ratio':>7} {'TB/s':>6} {'%copy':>7} relerr")
    rows = []
    cases = [(c, torch.float32, "NCHW") for c in FP32_TARGETS]
    mobile = MOBILE_LAYERS[:4] if quick else MOBILE_LAYERS
    for dtype in (torch.float16, torch.bfloat16):
        cases += [(c, dtype, "NHWC") for c in mobile]
    if not quick:
        cases += [(c, torch.float32, "NHWC") for c in FP32_TARGETS]
        cases += [(c, torch.float16, "NCHW") for c in FP32_TARGETS]
    for (group, n, c, h, w, k, s), dtype, layout in cases:
        for r in bench_case(timer, copy_tbs, group, n, c, h, w, k, s, dtype, layout):
            rows.append(r)
            print(_fmt(r), flush=True)

    # Target summary.
    def worst(pred):
        sel = [r["ratio"] for r in rows if pred(r)]
        return min(sel) if sel else float("nan")

    tgt = lambda r: r["group"] == "target" and r["layout"] == "NCHW" and r["dtype"] == "float32"
    mob = lambda r: r["group"] != "target" and r["dtype"] in ("float16", "bfloat16")
    summary = {
        "fwd fp32 NCHW target shapes (>= 2.0x)": worst(lambda r: tgt(r) and r["dir"] == "fwd"),
        "bwd fp32 NCHW target shapes (>= 1.5x)": worst(lambda r: tgt(r) and r["dir"] == "bwd"),
        "fwd fp16/bf16 NHWC mobile layers (>= 1.0x)": worst(lambda r: mob(r) and r["dir"] == "fwd"),
        "bwd fp16/bf16 NHWC mobile layers (>= 1.0x)": worst(lambda r: mob(r) and r["dir"] == "bwd"),
    }
    print("\nworst ratio per target:")
    for name, val in summary.items():
        limit = float(name.split(">= ")[1].rstrip("x)"))
        print(f"  {name:<46} {val:6.2f}x  {'met' if val >= limit else 'NOT met'}")
    return {"copy_tbs": copy_tbs, "rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cudadoctor_ops.bench depthwise", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--reps", type=int, default=50, help="timed calls per measurement")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("depthwise bench: no CUDA GPU visible; nothing to measure", file=sys.stderr)
        return 2
    import cudadoctor_ops  # noqa: F401  (loads the ops)

    result = run(quick=args.quick, reps=args.reps)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Runs every depthwise_conv2d kernel variant once on small shapes (for compute-sanitizer).

    compute-sanitizer --tool memcheck python scripts/depthwise_sanitize.py [--small]

Forward, input gradient and weight gradient, fast paths (k 3/5/7, stride 1/2, float32/float16/
bfloat16, NCHW and channels_last) and the direct kernels (dilation, multiplier, odd kernel).
Exits 1 when a result differs from F.conv2d beyond tolerance.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import cudadoctor_ops

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def one(n, c, h, w, k, s, p, d, m, dtype, cl, impl) -> float:
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype)
    if cl:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    wt = torch.randn(c * m, 1, k, k, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(c * m, device="cuda", dtype=dtype, requires_grad=True)
    out = cudadoctor_ops.depthwise_conv2d(x, wt, b, s, p, d, impl=impl)
    g = torch.randn_like(out)
    out.backward(g)
    xr, wr, br = (t.detach().float().requires_grad_(True) for t in (x, wt, b))
    ref = F.conv2d(xr, wr, br, s, p, d, groups=c)
    ref.backward(g.float())
    errs = []
    for got, r in ((out, ref), (x.grad, xr.grad), (wt.grad, wr.grad), (b.grad, br.grad)):
        errs.append((got.float() - r).abs().max().item() / max(r.abs().max().item(), 1e-6))
    return max(errs)


def main() -> int:
    small = "--small" in sys.argv
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    bad = 0
    runs = 0
    dtypes = (torch.float32, torch.float16) if small else (torch.float32, torch.float16, torch.bfloat16)
    for k in (3, 5, 7):
        for s in (1, 2):
            for dtype in dtypes:
                for cl in (False, True):
                    e = one(2, 16, 13, 11, k, s, k // 2, 1, 1, dtype, cl, "auto")
                    runs += 1
                    if e > TOL[dtype]:
                        bad += 1
                        print(f"MISMATCH k{k} s{s} {dtype} cl={cl}: {e:.2e}")
    for args in ((2, 8, 9, 10, 3, 1, 2, 2, 1), (2, 4, 7, 9, 3, 2, 1, 1, 2), (1, 8, 12, 12, 4, 1, 2, 1, 1),
                 (2, 8, 13, 13, 3, 1, 4, 1, 1)):
        for cl in (False, True):
            e = one(*args, torch.float32, cl, "auto")
            runs += 1
            if e > TOL[torch.float32]:
                bad += 1
                print(f"MISMATCH direct {args} cl={cl}: {e:.2e}")
    torch.cuda.synchronize()
    print(f"depthwise_sanitize: {runs} runs, {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

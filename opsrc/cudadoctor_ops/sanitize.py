"""Small driver that runs every kernel path of the ops once, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python -m cudadoctor_ops.sanitize batch_norm

Shapes are small (sanitizer runs are slow) but cover each path: vector and scalar loads, NCHW
and channels-last, every dtype, training and eval, ReLU, tails that do not fill a block.
Other ops add a function to SECTIONS or expose ``sanitize_exercise()`` in their module.
Exits 0 after printing one line per section; kernel errors surface as exceptions (exit 1).
"""

from __future__ import annotations

import importlib
import sys

import torch


def _batch_norm() -> int:
    from .batch_norm import batch_norm

    calls = 0
    shapes = [(4, 16, 8, 8), (3, 5, 7, 3), (2, 1, 9, 9), (17, 24), (2, 6, 3, 4, 5), (5, 3, 1, 1)]
    for k, shape in enumerate(shapes):
        layouts = ["nchw"] + (["nhwc"] if len(shape) in (4, 5) else [])
        dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64) if k < 2 else (torch.float32,)
        for layout in layouts:
            for dtype in dtypes:
                c = shape[1]
                x = torch.randn(shape, device="cuda", dtype=dtype)
                if layout == "nhwc":
                    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
                    x = x.contiguous(memory_format=fmt)
                pdt = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
                for training in (True, False):
                    for activation in ("none", "relu"):
                        xg = x.detach().requires_grad_(True)
                        w = (torch.rand(c, device="cuda", dtype=pdt) + 0.5).requires_grad_(True)
                        b = torch.randn(c, device="cuda", dtype=pdt).requires_grad_(True)
                        rm = torch.zeros(c, device="cuda", dtype=pdt)
                        rv = torch.ones(c, device="cuda", dtype=pdt)
                        y = batch_norm(xg, rm, rv, w, b, training, 0.1, 1e-5, activation)
                        y.backward(torch.randn_like(y))
                        calls += 1
                # parameter grads only (no grad_input): the finalize-only path
                for training in (True, False):
                    w = (torch.rand(c, device="cuda", dtype=pdt) + 0.5).requires_grad_(True)
                    b = torch.randn(c, device="cuda", dtype=pdt).requires_grad_(True)
                    rm = torch.zeros(c, device="cuda", dtype=pdt)
                    rv = torch.ones(c, device="cuda", dtype=pdt)
                    batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5, "relu").sum().backward()
                    calls += 1
                # eval backward without parameter grads (no reduction pass)
                xg = x.detach().requires_grad_(True)
                rm = torch.zeros(c, device="cuda", dtype=pdt)
                rv = torch.ones(c, device="cuda", dtype=pdt)
                batch_norm(xg, rm, rv, None, None, False).sum().backward()
                calls += 1
    # empty batch and an unaligned (offset) view that forces the scalar path
    batch_norm(torch.randn(0, 4, 3, 3, device="cuda"), None, None, training=True)
    base = torch.randn(4 * 8 * 16 + 1, device="cuda")
    batch_norm(base[1:].view(4, 8, 16), None, None, training=True)
    torch.cuda.synchronize()
    return calls + 2


SECTIONS = {"batch_norm": _batch_norm}


def main(argv: list[str]) -> int:
    import cudadoctor_ops  # noqa: F401

    names = argv or ["batch_norm"]
    for name in names:
        if name in SECTIONS:
            n = SECTIONS[name]()
        else:
            mod = importlib.import_module(f"cudadoctor_ops.{name}")
            n = mod.sanitize_exercise()
        torch.cuda.synchronize()
        print(f"sanitize {name}: {n} calls ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

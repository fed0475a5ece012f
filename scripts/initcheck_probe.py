"""Which reads does compute-sanitizer's initcheck flag around a channels-last float16 convolution?

    python scripts/initcheck_probe.py            runs every case under `compute-sanitizer --tool initcheck`
    python scripts/initcheck_probe.py CASE       one case, plainly (what the sanitizer runs)

Cases (N=2, C_in=8, C_out=16, 6x10 image, float16 channels_last, no conv bias):
  torch_k1    cuDNN's 1x1 convolution, then torch's own kernels read its output (clone, sum)
  torch_k3    the same with a 3x3 convolution
  ours_k1     cudadoctor_ops.conv_bn_relu training forward + backward, 1x1 (no residual)
  res_k1      the same with a residual (the ResNet block tail), 1x1
  res_k3      the same with a residual, 3x3
  torch_f32_I / ours_f32_I   (I = 0 .. 4) the float32 channels_last cases of
              `python -m cudadoctor_ops.sanitize conv_bn_relu` (its (N, C_in, H, W, C_out, groups)
              list, 3x3, padding 1): cuDNN's convolution then torch's clone and sum / our
              training forward + backward
Prints the error count of each case (`f32` as the only argument: the f32 cases alone).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

CASES = ["torch_k1", "torch_k3", "ours_k1", "res_k1", "res_k3"]
# sanitize_exercise's cases (conv_bn_relu.py)
F32_SHAPES = [(2, 8, 8, 8, 16, 1), (3, 5, 7, 5, 6, 1), (2, 8, 9, 9, 8, 8), (2, 16, 4, 4, 16, 1), (1, 32, 5, 7, 64, 1)]
F32_CASES = [f"{who}_f32_{i}" for i in range(len(F32_SHAPES)) for who in ("torch", "ours")]


def run_f32(name: str) -> None:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    n, ci, h, w_, co, g = F32_SHAPES[int(name.rsplit("_", 1)[1])]
    x = torch.randn(n, ci, h, w_, device="cuda").contiguous(memory_format=torch.channels_last)
    w = torch.randn(co, ci // g, 3, 3, device="cuda") * 0.3
    if name.startswith("torch"):
        y = F.conv2d(x, w, None, 1, 1, 1, g)
        z = y.clone()
        print(name, float(z.sum()), float(y.abs().sum()))
        torch.cuda.synchronize()
        return
    import cudadoctor_ops

    xr, wr = x.requires_grad_(True), w.requires_grad_(True)
    bw = (torch.rand(co, device="cuda") + 0.5).requires_grad_(True)
    bb = torch.randn(co, device="cuda").requires_grad_(True)
    rm, rv = torch.zeros(co, device="cuda"), torch.ones(co, device="cuda")
    out = cudadoctor_ops.conv_bn_relu(xr, wr, None, bw, bb, rm, rv, True, 0.1, 1e-5, 1, 1, 1, g)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(name, float(out.sum()), float(xr.grad.abs().sum()))


def run_case(name: str) -> None:
    import torch
    import torch.nn.functional as F

    if "_f32_" in name:
        run_f32(name)
        return

    torch.manual_seed(0)
    k = 3 if name.endswith("k3") else 1
    dev = "cuda"
    x = torch.randn(2, 8, 6, 10, device=dev, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(16, 8, k, k, device=dev) * 0.3).half()
    if name.startswith("torch"):
        y = F.conv2d(x, w, None, 1, k // 2)
        z = y.clone()
        print(name, float(z.float().sum()), float(y.float().abs().sum()))
        torch.cuda.synchronize()
        return
    import cudadoctor_ops

    xr = x.detach().requires_grad_(True)
    wr = w.detach().requires_grad_(True)
    bw = torch.ones(16, device=dev, requires_grad=True)
    bb = torch.zeros(16, device=dev, requires_grad=True)
    rm, rv = torch.zeros(16, device=dev), torch.ones(16, device=dev)
    r = None
    if name.startswith("res"):
        r = torch.randn(2, 16, 6, 10, device=dev, dtype=torch.float16).contiguous(
            memory_format=torch.channels_last).requires_grad_(True)
    kw = {"residual": r} if r is not None else {}
    out = cudadoctor_ops.conv_bn_relu(xr, wr, None, bw, bb, rm, rv, True, 0.1, 1e-5, 1, k // 2, 1, 1, **kw)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(name, float(out.float().sum()), float(xr.grad.float().abs().sum()))


def main(argv: list[str]) -> int:
    if argv and argv[0] != "f32":
        run_case(argv[0])
        return 0
    san = os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer")
    for name in F32_CASES if argv else CASES + F32_CASES:
        p = subprocess.run([san, "--tool", "initcheck", "--print-limit", "4", sys.executable, __file__, name],
                           capture_output=True, text=True, timeout=300)
        out = p.stdout + p.stderr
        m = re.search(r"ERROR SUMMARY: (\d+) error", out)
        # the frame lines under each report: "=========     at <function>(...)+0x.. in file:line"
        kernels = sorted({m2.group(1)[:90] for m2 in re.finditer(r"^=+\s+at (.+?)(?:\+0x[0-9a-f]+)?(?: in .*)?$", out,
                                                                  re.M)})[:6]
        print(f"{name}: exit {p.returncode}, errors {m.group(1) if m else '?'}; flagged at {kernels}", flush=True)
        if m and m.group(1) != "0":
            print("\n".join(l for l in out.splitlines() if "Uninitialized" in l or "by thread" in l)[:1200])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

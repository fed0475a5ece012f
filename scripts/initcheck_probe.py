"""Which reads does compute-sanitizer's initcheck flag around a channels-last float16 convolution?

    python scripts/initcheck_probe.py            runs every case under `compute-sanitizer --tool initcheck`
    python scripts/initcheck_probe.py CASE       one case, plainly (what the sanitizer runs)

Cases (N=2, C_in=8, C_out=16, 6x10 image, float16 channels_last, no conv bias):
  torch_k1    cuDNN's 1x1 convolution, then torch's own kernels read its output (clone, sum)
  torch_k3    the same with a 3x3 convolution
  ours_k1     cudadoctor_ops.conv_bn_relu training forward + backward, 1x1 (no residual)
  res_k1      the same with a residual (the ResNet block tail), 1x1
  res_k3      the same with a residual, 3x3
Prints the error count of each case.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

CASES = ["torch_k1", "torch_k3", "ours_k1", "res_k1", "res_k3"]


def run_case(name: str) -> None:
    import torch
    import torch.nn.functional as F

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
    if argv:
        run_case(argv[0])
        return 0
    san = os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer")
    for name in CASES:
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

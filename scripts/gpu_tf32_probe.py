"""Conv+BN+ReLU inference of float32 NCHW 3x3 blocks: the direct TF32 kernel (conv_bias_relu impl 2,
csrc/conv3x3_tf32.cu) against cuDNN's fused convolution + bias + ReLU (impl 0) and torch's eager
Conv2d -> BatchNorm2d -> ReLU in eval mode, all with torch's default TF32 setting for cuDNN.

    python scripts/gpu_tf32_probe.py [--rep-ms MS]

Per block: max error of each against the float64 block (relative to the largest output), then
ms per call with the bench's timer (eager calls, L2 flushed) and in CUDA-graph replay, and the
ratio eager / ours. Runs on a CUDA machine with cudadoctor_ops installed.
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

# (N, C_in, H, W), C_out: the bench's float32 headline block and the stride-1 3x3 layers of
# ResNet-50 at batch 64
SHAPES = [((32, 64, 56, 56), 64), ((64, 64, 56, 56), 64), ((64, 128, 28, 28), 128),
          ((64, 256, 14, 14), 256), ((64, 512, 7, 7), 512)]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rep-ms", type=float, default=40)
    args = parser.parse_args(argv)
    import cudadoctor_ops  # noqa: F401
    from cudadoctor_ops.bench import Timer
    from cudadoctor_ops.bench_cbr import graph_ms
    from cudadoctor_ops.conv_bn_relu import fold_bn

    ops = torch.ops.cudadoctor_ops
    timer = Timer(rep_ms=args.rep_ms)
    print(f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}, "
          f"allow_tf32 {torch.backends.cudnn.allow_tf32}, {torch.cuda.get_device_name()}")
    print(f"{'block':<28}{'err eager':>10}{'err cudnn':>10}{'err tf32':>10}"
          f"{'eager ms':>10}{'cudnn ms':>10}{'tf32 ms':>10}{'x cudnn':>8}{'x tf32':>8}"
          f"{'g eager':>9}{'g cudnn':>9}{'g tf32':>9}{'gx cudnn':>9}{'gx tf32':>9}")
    for shape, co in SHAPES:
        torch.manual_seed(0)
        conv = nn.Conv2d(shape[1], co, 3, 1, 1, bias=False)
        bn = nn.BatchNorm2d(co)
        with torch.no_grad():
            bn.running_mean.copy_(torch.randn(co) * 0.1)
            bn.running_var.copy_(torch.rand(co) + 0.5)
            bn.weight.copy_(torch.rand(co) + 0.5)
            bn.bias.copy_(torch.randn(co) * 0.2)
        eager = nn.Sequential(conv, bn, nn.ReLU(inplace=True)).cuda().eval()
        x = torch.randn(shape, device="cuda")
        with torch.no_grad():
            ref = copy.deepcopy(eager).double()(x.double())
            w, b = fold_bn(conv.weight, None, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps,
                           torch.float32)
        scale = ref.abs().max().item()

        def run(impl, w=w, b=b, x=x):
            return ops.conv_bias_relu(x, w, b, [1, 1], [1, 1], [1, 1], 1, impl)

        fns = {"eager": lambda: eager(x), "cudnn": lambda: run(0), "tf32": lambda: run(2)}
        errs, times, graphs = {}, {}, {}
        with torch.no_grad():
            for name, fn in fns.items():
                errs[name] = (fn().double() - ref).abs().max().item() / scale
            for name, fn in fns.items():
                times[name] = timer(fn)
            for name, fn in fns.items():
                graphs[name] = graph_ms(timer, fn)
            # a second eager pass, the other way round: the lower of the two per variant
            for name, fn in reversed(list(fns.items())):
                times[name] = min(times[name], timer(fn))

        def ratio(d, k):
            return f"{d['eager'] / d[k]:.2f}" if d.get(k) and d.get("eager") else "-"

        def ms(v):
            return f"{v:.4f}" if v else "-"

        label = f"{tuple(shape)}->{co}"
        print(f"{label:<28}{errs['eager']:>10.2e}{errs['cudnn']:>10.2e}{errs['tf32']:>10.2e}"
              f"{ms(times['eager']):>10}{ms(times['cudnn']):>10}{ms(times['tf32']):>10}"
              f"{ratio(times, 'cudnn'):>8}{ratio(times, 'tf32'):>8}"
              f"{ms(graphs['eager']):>9}{ms(graphs['cudnn']):>9}{ms(graphs['tf32']):>9}"
              f"{ratio(graphs, 'cudnn'):>9}{ratio(graphs, 'tf32'):>9}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

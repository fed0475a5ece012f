"""Times cuDNN convolutions of the Conv+BN+ReLU benchmark shapes with torch's default algorithm
choice (cudnn.benchmark=False) and with benchmark-selected algorithms, in one process.

    python scripts/gpu_conv_probe.py [--resnet]
"""
from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F


def bench(fn, iters=50):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=iters, return_mode="median")


def case(shape, k, dtype, cl, bench_mode):
    torch.backends.cudnn.benchmark = bench_mode
    n, c, h, w = shape
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt).requires_grad_()
    wt = torch.randn(k, c, 3, 3, device="cuda", dtype=dtype).to(memory_format=fmt).requires_grad_()
    y = F.conv2d(x, wt, padding=1)
    g = torch.randn_like(y)

    def bwd_call():  # the input and weight gradients, as autograd's ConvolutionBackward calls them
        return torch.ops.aten.convolution_backward(g, x, wt, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                   [True, True, False])

    fwd = bench(lambda: F.conv2d(x, wt, padding=1))
    bwd = bench(bwd_call)
    return fwd, bwd, graphed(lambda: F.conv2d(x, wt, padding=1)), graphed(bwd_call)


def graphed(fn):
    """Median replay time of a CUDA graph of fn (GPU time only; the algorithm is chosen in the
    warm-up calls before the capture): bench_cbr.graph_ms with this script's timer."""
    from cudadoctor_ops.bench_cbr import graph_ms

    t = graph_ms(bench, fn)
    return float("nan") if t is None else t


def main() -> int:
    cases = [
        ((32, 64, 56, 56), 64, torch.float16, True),
        ((32, 64, 56, 56), 64, torch.float32, False),
        ((64, 128, 28, 28), 128, torch.bfloat16, True),
        ((64, 64, 56, 56), 64, torch.bfloat16, True),
        ((64, 256, 14, 14), 256, torch.bfloat16, True),
        ((64, 512, 7, 7), 512, torch.bfloat16, True),
        ((64, 64, 56, 56), 64, torch.float16, True),
        ((64, 128, 28, 28), 128, torch.float16, True),
    ]
    print(f"{torch.__version__} cudnn {torch.backends.cudnn.version()} tf32 {torch.backends.cudnn.allow_tf32}")
    print("us; def: cudnn.benchmark=False, bm: True; eager calls (do_bench) | CUDA-graph replays")
    print(f"{'shape':22} {'K':>4} {'dtype':9} {'cl':3} {'fwd def':>8} {'fwd bm':>8} {'bwd def':>8} {'bwd bm':>8}"
          f" | {'fwd def':>8} {'fwd bm':>8} {'bwd def':>8} {'bwd bm':>8}")
    for shape, k, dt, cl in cases:
        d = case(shape, k, dt, cl, False)
        b = case(shape, k, dt, cl, True)
        cols = " ".join(f"{v * 1e3:8.1f}" for v in (d[0], b[0], d[1], b[1]))
        gcols = " ".join(f"{v * 1e3:8.1f}" for v in (d[2], b[2], d[3], b[3]))
        print(f"{str(shape):22} {k:4} {str(dt)[6:]:9} {int(cl):3} {cols} | {gcols}", flush=True)
    torch.backends.cudnn.benchmark = False
    if "--resnet" in sys.argv:
        import torchvision

        res = {}
        for mode in (False, True, False, True):
            torch.backends.cudnn.benchmark = mode
            torch.manual_seed(0)
            m = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
            opt = torch.optim.SGD(m.parameters(), lr=0.01)
            x = torch.randn(64, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
            t = torch.randint(0, 1000, (64,), device="cuda")

            def step():
                with torch.autocast("cuda", torch.bfloat16):
                    loss = F.cross_entropy(m(x), t)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            for _ in range(8):
                step()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                s, e = torch.cuda.Event(True), torch.cuda.Event(True)
                s.record()
                for _ in range(10):
                    step()
                e.record()
                torch.cuda.synchronize()
                ts.append(64 * 10 / (s.elapsed_time(e) / 1e3))
            res.setdefault(mode, []).append(statistics.median(ts))
        print(f"ResNet-50 bs64 bf16 channels_last eager img/s: default {res[False]}  benchmark {res[True]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

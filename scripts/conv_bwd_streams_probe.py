"""Times a convolution's backward as torch runs it (input gradient, then weight gradient, one
stream) against the two gradients on two streams (the weight gradient on a side stream forked
from and joined back to the current one), for the Conv+BN+ReLU benchmark shapes and the
convolutions of a ResNet-50 (channels_last bfloat16, batch 64 and 128).

    python scripts/conv_bwd_streams_probe.py [quick]

(scripts/gpu_conv_probe.py times the forward convolutions.)

Per case: GPU time of one backward in a CUDA-graph replay (median over replays of a graph of
20 backwards, so host time does not count) and the time of an eager call (triton do_bench with
its L2 flush), one stream / two streams, and their ratio.
"""
from __future__ import annotations

import statistics
import sys

import torch

BWD = torch.ops.aten.convolution_backward.default


def conv_bwd(g, x, w, stride, pad, mask):
    return BWD(g, x, w, None, [stride, stride], [pad, pad], [1, 1], False, [0, 0], 1, mask)


def make(shape, k, ks, stride, dtype, cl):
    n, c, h, w_ = shape
    fmt = torch.channels_last if cl else torch.contiguous_format
    x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
    wt = (torch.randn(k, c, ks, ks, device="cuda", dtype=dtype) * 0.05).to(memory_format=fmt)
    pad = ks // 2
    y = torch.nn.functional.conv2d(x, wt, stride=stride, padding=pad)
    g = torch.randn_like(y)
    return x, wt, g, pad


def graph_us(fn, reps=20, rounds=15):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def eager_us(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=60, return_mode="median") * 1000


def case(label, shape, k, ks, stride, dtype, cl=True):
    x, wt, g, pad = make(shape, k, ks, stride, dtype, cl)
    side = torch.cuda.Stream()

    def one():
        conv_bwd(g, x, wt, stride, pad, [True, True, False])

    def two():
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            conv_bwd(g, x, wt, stride, pad, [False, True, False])
        conv_bwd(g, x, wt, stride, pad, [True, False, False])
        cur.wait_stream(side)

    # the two ways give the same gradients (same kernels, other streams)
    gi1, gw1, _ = conv_bwd(g, x, wt, stride, pad, [True, True, False])
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        gw2 = conv_bwd(g, x, wt, stride, pad, [False, True, False])[1]
    gi2 = conv_bwd(g, x, wt, stride, pad, [True, False, False])[0]
    cur.wait_stream(side)
    same = torch.equal(gi1, gi2) and torch.equal(gw1, gw2)
    g1, g2 = graph_us(one), graph_us(two)
    e1, e2 = eager_us(one), eager_us(two)
    print(f"{label:<44} graph {g1:8.1f} / {g2:8.1f} us  {g1 / g2:5.2f}x   eager {e1:8.1f} / {e2:8.1f} us"
          f"  {e1 / e2:5.2f}x  same={same}", flush=True)


def resnet_convs(n):
    # (label, input shape, out channels, kernel, stride) of the distinct convolutions of ResNet-50
    rows = [(f"stem 7x7 s2 3->64 224", (n, 3, 224, 224), 64, 7, 2)]
    for (hw, cin_first, cin, mid, out, s) in [(56, 64, 256, 64, 256, 1), (56, 256, 512, 128, 512, 2),
                                              (28, 512, 1024, 256, 1024, 2),
                                              (14, 1024, 2048, 512, 2048, 2)]:
        hw2 = hw // s
        rows.append((f"1x1 {cin_first}->{mid} {hw}", (n, cin_first, hw, hw), mid, 1, 1))
        rows.append((f"3x3 s{s} {mid}->{mid} {hw}", (n, mid, hw, hw), mid, 3, s))
        rows.append((f"1x1 {mid}->{out} {hw2} (tail)", (n, mid, hw2, hw2), out, 1, 1))
        rows.append((f"1x1 {out}->{mid} {hw2}", (n, out, hw2, hw2), mid, 1, 1))
        if s == 2:
            rows.append((f"3x3 s1 {mid}->{mid} {hw2}", (n, mid, hw2, hw2), mid, 3, 1))
    return rows


def main(argv) -> int:
    torch.backends.cudnn.benchmark = True
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}; one stream / two streams", flush=True)
    case("fp16 NHWC (32,64,56,56)->64 3x3", (32, 64, 56, 56), 64, 3, 1, torch.float16)
    case("bf16 NHWC (64,128,28,28)->128 3x3", (64, 128, 28, 28), 128, 3, 1, torch.bfloat16)
    case("fp32 NCHW (32,64,56,56)->64 3x3", (32, 64, 56, 56), 64, 3, 1, torch.float32, cl=False)
    if "quick" in argv:
        return 0
    for n in (64, 128):
        for label, shape, k, ks, s in resnet_convs(n):
            case(f"bf16 NHWC bs{n} {label}", shape, k, ks, s, torch.bfloat16)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Kernels to look at under Nsight Compute, run once each between cudaProfilerStart/Stop.

    ncu --profile-from-start off --section SpeedOfLight ... python scripts/gpu_ncu.py [dw] [bn] [bnh] [bnbig] [bnstats] [tile] [bwdtile] [dws] [dwk5] [hmma] [cbrapply]

Each case runs ours and torch's version twice before the profiled region (so lazy set-up, cuDNN
heuristics and caches stay out of it), then once inside it.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import cudadoctor_ops as ops
from gpu_profile import bn_tensors, dw_tensors  # scripts/ is sys.path[0] when run as a script


def backward_cases(tag, x, w, b, rm, rv):
    """BatchNorm's training backward (no ReLU) through autograd, ours and torch's, on x."""
    xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))
    gy = torch.randn_like(x)
    yo = ops.batch_norm(xg, rm.clone(), rv.clone(), wg, bg, True)
    yt = F.batch_norm(xg, rm.clone(), rv.clone(), wg, bg, True)
    return [(tag + " backward ours",
             lambda y=yo, i=(xg, wg, bg), g=gy: torch.autograd.grad(y, i, g, retain_graph=True)),
            (tag + " backward torch",
             lambda y=yt, i=(xg, wg, bg), g=gy: torch.autograd.grad(y, i, g, retain_graph=True))]


def cases(parts):
    out = []
    if "dw" in parts:
        for n, c, h, w, k, s in [(64, 672, 14, 14, 5, 1), (64, 960, 7, 7, 3, 1), (64, 144, 56, 56, 3, 1)]:
            x, wt = dw_tensors(n, c, h, w, k, torch.float16, True)
            p = k // 2
            out.append((f"dw {(n, c, h, w)} k{k} s{s} fp16 nhwc ours",
                        lambda x=x, wt=wt, s=s, p=p: ops.depthwise_conv2d(x, wt, None, s, p)))
            out.append((f"dw {(n, c, h, w)} k{k} s{s} fp16 nhwc torch",
                        lambda x=x, wt=wt, s=s, p=p, c=c: F.conv2d(x, wt, None, s, p, 1, c)))
    if "bn" in parts:
        for shape, dt, cl in [((64, 512, 7, 7), torch.float16, True), ((32, 256, 28, 28), torch.float32, False),
                              ((64, 2048, 7, 7), torch.float32, False)]:
            x, w, b, rm, rv = bn_tensors(shape, dt, cl)
            tag = f"bn {shape} {dt} {'nhwc' if cl else 'nchw'} train fwd"
            out.append((tag + " ours", lambda x=x, rm=rm, rv=rv, w=w, b=b: ops.batch_norm(x, rm, rv, w, b, True)))
            out.append((tag + " torch", lambda x=x, rm=rm, rv=rv, w=w, b=b: F.batch_norm(x, rm, rv, w, b, True)))
    if "bnh" in parts:
        # channels_last float16 training forwards below cuDNN's speed: what each side launches
        for shape in [(64, 64, 56, 56), (64, 128, 28, 28), (64, 1024, 14, 14)]:
            x, w, b, rm, rv = bn_tensors(shape, torch.float16, True)
            tag = f"bn {shape} float16 nhwc train fwd"
            out.append((tag + " ours", lambda x=x, rm=rm, rv=rv, w=w, b=b: ops.batch_norm(x, rm, rv, w, b, True)))
            out.append((tag + " torch", lambda x=x, rm=rm, rv=rv, w=w, b=b: F.batch_norm(x, rm, rv, w, b, True)))
    if "bnbig" in parts:
        # the 102 MB channels-last float16 rows below 0.95x: every kernel of the training
        # forward and of the backward, ours and cuDNN's (ncu flushes the caches before each, as
        # the bench's L2 flush does)
        x, w, b, rm, rv = bn_tensors((256, 64, 56, 56), torch.float16, True)
        tag = "bn (256, 64, 56, 56) float16 nhwc"
        # (default arguments bind this case's tensors: later parts reuse the names)
        out.append((tag + " train fwd ours",
                    lambda x=x, rm=rm, rv=rv, w=w, b=b: ops.batch_norm(x, rm, rv, w, b, True)))
        out.append((tag + " train fwd torch",
                    lambda x=x, rm=rm, rv=rv, w=w, b=b: F.batch_norm(x, rm, rv, w, b, True)))
        out += backward_cases(tag, x, w, b, rm, rv)
    if "bnstats" in parts:
        # the channels-last float16 training forward of the three-launch path alone (run once per
        # CUDADOCTOR_OPS_BN_STATS_PIPE setting: the statistics kernel's variants)
        for shape in [(256, 64, 56, 56), (64, 256, 56, 56)]:
            x, w, b, rm, rv = bn_tensors(shape, torch.float16, True)
            out.append((f"bn {shape} float16 nhwc train fwd ours",
                        lambda x=x, rm=rm, rv=rv, w=w, b=b: ops.batch_norm(x, rm, rv, w, b, True)))
    if "tile" in parts:
        # the one-launch channels-last kernels at Conv+BN+ReLU's (32,64,56,56) float16 (12.8 MB):
        # where their time goes (e.g. NCU_SECTIONS="WarpStateStats SourceCounters" for stall
        # reasons per source line: loads, the grid barriers, the merges)
        x, w, b, rm, rv = bn_tensors((32, 64, 56, 56), torch.float16, True)
        tag = "bn (32, 64, 56, 56) float16 nhwc"
        out.append((tag + " train fwd relu ours",
                    lambda x=x, rm=rm, rv=rv, w=w, b=b: ops.batch_norm(x, rm, rv, w, b, True,
                                                                       activation="relu")))
        out.append((tag + " train fwd torch",
                    lambda x=x, rm=rm, rv=rv, w=w, b=b: F.batch_norm(x, rm, rv, w, b, True)))
        xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))
        gy = torch.randn_like(x)
        yo = ops.batch_norm(xg, rm.clone(), rv.clone(), wg, bg, True, activation="relu")
        out.append((tag + " backward relu ours",
                    lambda y=yo, i=(xg, wg, bg), g=gy: torch.autograd.grad(y, i, g, retain_graph=True)))
    if "bwdtile" in parts:
        # bn_bwd_tile_nhwc with rows in shared memory (float16 channels-last backward without ReLU,
        # 6.4M elements) against cuDNN's semi-persistent backward
        for shape in [(32, 64, 56, 56), (64, 128, 28, 28)]:
            out += backward_cases(f"bn {shape} float16 nhwc", *bn_tensors(shape, torch.float16, True))
    if "hmma" in parts:
        # the 16-bit tensor-core 3x3 convolution (conv_bias_relu impl 3) against cuDNN's (impl 0) on
        # Conv+BN+ReLU's float16 (32,64,56,56)->64 layer and a 7x7 one, conv + ReLU
        for (n, c, h, w), k in [((32, 64, 56, 56), 64), ((64, 512, 7, 7), 512)]:
            x = torch.randn(n, c, h, w, device="cuda", dtype=torch.float16).contiguous(
                memory_format=torch.channels_last)
            wt = (torch.randn(k, c, 3, 3, device="cuda", dtype=torch.float16) * 0.05).contiguous(
                memory_format=torch.channels_last)
            conv = torch.ops.cudadoctor_ops.conv_bias_relu
            for label, impl in (("hmma", 3), ("cudnn", 0)):
                out.append((f"conv3x3+relu {(n, c, h, w)}->{k} fp16 nhwc {label}",
                            lambda x=x, wt=wt, impl=impl, conv=conv: conv(x, wt, None, [1, 1], [1, 1], [1, 1], 1,
                                                                          impl)))
    if "cbrapply" in parts:
        # Conv+BN+ReLU's training forward at (32,64,56,56)->64 float16 channels_last (the wgmma
        # convolution, then cbr_apply_sums_nhwc_v3) and at (64,128,28,28)->128 bfloat16 (cuDNN, the
        # statistics, cbr_apply_nhwc_v2), against torch.relu over a tensor of the same size: an
        # elementwise pass that reads and writes as much (ncu --kernel-name picks the kernels)
        for (n, c, h, w), dt in [((32, 64, 56, 56), torch.float16), ((64, 128, 28, 28), torch.bfloat16)]:
            torch.manual_seed(0)
            ref = torch.nn.Sequential(torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c),
                                      torch.nn.ReLU()).cuda().to(dt).to(memory_format=torch.channels_last)
            fused = ops.fuse_conv_bn_relu(ref)
            x = torch.randn(n, c, h, w, device="cuda", dtype=dt).contiguous(memory_format=torch.channels_last)
            out.append((f"cbr train fwd {(n, c, h, w)} {dt} ours", lambda f=fused, x=x: f(x)))
            out.append((f"relu {(n, c, h, w)} {dt} torch", lambda x=x: torch.relu(x)))
    # single depthwise forward rows: dws, (1,64,128,128) float32 3x3, below its 2x target;
    # dwk5, (64,240,28,28) float16 channels_last 5x5, the forward row cuDNN's fp16 kernel still wins
    for part, (n, c, h, w), k, dt, cl in [("dws", (1, 64, 128, 128), 3, torch.float32, False),
                                          ("dwk5", (64, 240, 28, 28), 5, torch.float16, True)]:
        if part not in parts:
            continue
        x, wt = dw_tensors(n, c, h, w, k, dt, cl)
        tag = f"dw {(n, c, h, w)} k{k} s1 {'fp32' if dt == torch.float32 else 'fp16'} {'nhwc' if cl else 'nchw'}"
        out.append((tag + " ours", lambda x=x, wt=wt, p=k // 2: ops.depthwise_conv2d(x, wt, None, 1, p)))
        out.append((tag + " torch", lambda x=x, wt=wt, p=k // 2, c=c: F.conv2d(x, wt, None, 1, p, 1, c)))
    return out


def main() -> None:
    torch.backends.cudnn.benchmark = True
    todo = cases(sys.argv[1:] or ["dw", "bn"])
    for _, fn in todo:
        fn()
        fn()
    torch.cuda.synchronize()
    for name, fn in todo:
        print(f"### {name}", flush=True)
        torch.cuda.nvtx.range_push(name)
        torch.cuda.profiler.start()
        fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()

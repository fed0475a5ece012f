"""Kernel-level breakdown of cudadoctor_ops against torch on a few cases, for tuning.

    python scripts/gpu_profile.py [bn] [cbr] [cbrnchw] [cbrbf16] [cbrfp16] [dw] [cbrstats] [bnmiss] [dwt] [dwmiss] [cbrapply]

Per case and side (ours / torch): the GPU time of one call from CUDA events with an L2 flush
before it (as the bench measures), the host time of one call (perf_counter over 200 calls without
a sync: what the CPU spends enqueuing), and the kernels one call launches with their mean
durations from torch.profiler. Prints plain text. cbrstats: Conv+BN+ReLU's training forward with
the batch statistics from cuDNN's convolution (CUDADOCTOR_OPS_CBR_CUDNN_STATS=1, needs
nvidia-cudnn-frontend) against the default forward, both ours. cbrnchw: the float32 NCHW
ResNet-50 layers whose BatchNorm cannot take the one-launch kernel (output H*W % 8 != 0), and
BatchNorm alone on two of those outputs.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import cudadoctor_ops as ops


def gpu_ms(fn, reps: int = 50) -> float:
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    v = sorted(s.elapsed_time(e) for s, e in ts)
    return v[len(v) // 2]


def host_us(fn, reps: int = 200, hold_ms: float = 0.0) -> float:
    """Host microseconds per call over reps calls without a sync; hold_ms > 0 queues a sleep
    kernel of that many ms first, so that no call waits on the GPU (steady-state host time)."""
    fn()
    torch.cuda.synchronize()
    if hold_ms > 0:
        from cudadoctor_ops.bench_cbr import gpu_sleep

        gpu_sleep(hold_ms)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def kernels(fn, reps: int = 20) -> list[tuple[str, float, int]]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        if ev.device_type.name != "CUDA":
            continue
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        out.append((ev.key[:90], t / max(ev.count, 1), ev.count // reps))
    return sorted(out, key=lambda r: -r[1] * r[2])


def show(name: str, ours, theirs, labels=("ours", "torch")) -> None:
    print(f"\n=== {name}")
    for side, fn in zip(labels, (ours, theirs)):
        try:
            g, h = gpu_ms(fn), host_us(fn)
            print(f"  {side:5s} gpu {g * 1000:8.1f} us   host {h:7.1f} us/call")
            for k, t, n in kernels(fn):
                print(f"        {t:8.1f} us x{n}  {k}")
        except Exception as exc:  # noqa: BLE001
            print(f"  {side}: {type(exc).__name__}: {exc}")


def bn_tensors(shape, dtype, channels_last):
    """(x, weight, bias, running_mean, running_var) of one BatchNorm case, float32 parameters."""
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    w, b = torch.rand(c, device="cuda") + 0.5, torch.randn(c, device="cuda")
    rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
    return x, w, b, rm, rv


def dw_tensors(n, c, h, w, k, dtype, channels_last):
    """(x, weight) of one depthwise case: [n, c, h, w] input, [c, 1, k, k] weight."""
    mf = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=mf)
    return x, torch.randn(c, 1, k, k, device="cuda", dtype=dtype)


def bn_case(shape, dt, cl, with_eval: bool) -> None:
    """One BatchNorm case: training forward, eval (when with_eval) and backward, ours and torch's."""
    x, w, b, rm, rv = bn_tensors(shape, dt, cl)
    tag = f"BN {shape} {dt} {'nhwc' if cl else 'nchw'}"
    show(tag + " train fwd", lambda: ops.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5),
         lambda: F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5))
    if with_eval:
        show(tag + " eval", lambda: ops.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5),
             lambda: F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5))
    xg, wg, bg = (t.detach().requires_grad_(True) for t in (x, w, b))
    gy = torch.randn_like(x)
    yo = ops.batch_norm(xg, rm.clone(), rv.clone(), wg, bg, True, 0.1, 1e-5)
    yt = F.batch_norm(xg, rm.clone(), rv.clone(), wg, bg, True, 0.1, 1e-5)
    show(tag + " backward", lambda: torch.autograd.grad(yo, (xg, wg, bg), gy, retain_graph=True),
         lambda: torch.autograd.grad(yt, (xg, wg, bg), gy, retain_graph=True))


def bn() -> None:
    for shape, dt, cl in [((64, 256, 14, 14), torch.float16, True), ((64, 2048, 7, 7), torch.float32, False),
                          ((32, 256, 28, 28), torch.float32, False), ((256, 64, 56, 56), torch.float16, True),
                          ((64, 512, 28, 28), torch.float32, False)]:
        bn_case(shape, dt, cl, with_eval=True)


def bnmiss() -> None:
    """The BatchNorm rows below 0.95x in the late-2026 benches: float16 channels-last."""
    for shape in [(64, 1024, 14, 14), (64, 256, 56, 56), (64, 64, 112, 112), (256, 64, 56, 56),
                  (64, 128, 28, 28), (64, 256, 14, 14)]:
        bn_case(shape, torch.float16, True, with_eval=False)


def dwt() -> None:
    """The depthwise forward target row still below 2x: (1,64,128,128) 3x3 fp32 NCHW."""
    x, wt = dw_tensors(1, 64, 128, 128, 3, torch.float32, False)
    show("DW (1, 64, 128, 128) k3 s1 float32 nchw fwd", lambda: ops.depthwise_conv2d(x, wt, None, 1, 1),
         lambda: F.conv2d(x, wt, None, 1, 1, 1, 64))


def _cbr_cases(cases) -> None:
    """Conv3x3+BN+ReLU, ours (fuse_conv_bn_relu) against the eager block: ((n, cin, h, w, cout),
    stride, dtype, channels_last) per case."""
    for (n, ci, h, w_, co), st, dt, cl in cases:
        mf = torch.channels_last if cl else torch.contiguous_format
        # low-precision conv, float32 BatchNorm parameters (as under autocast, and as the bench)
        eager = torch.nn.Sequential(torch.nn.Conv2d(ci, co, 3, st, 1, bias=False), torch.nn.BatchNorm2d(co),
                                    torch.nn.ReLU()).cuda()
        eager[0].to(dt)
        eager = eager.to(memory_format=mf)
        fused = ops.fuse_conv_bn_relu(__import__("copy").deepcopy(eager))
        x = torch.randn(n, ci, h, w_, device="cuda", dtype=dt).contiguous(memory_format=mf).requires_grad_(True)
        tag = f"CBR {(n, ci, h, w_, co)} s{st} {dt} {'nhwc' if cl else 'nchw'}"
        eager.train()
        fused.train()
        show(tag + " train fwd", lambda: fused(x), lambda: eager(x))
        gy = torch.randn_like(eager(x))

        def fb(m):
            def run():
                m(x).backward(gy)
            return run
        show(tag + " fwd+bwd", fb(fused), fb(eager))
        eager.eval()
        fused.eval()
        with torch.no_grad():
            xd = x.detach()
            show(tag + " eval", lambda: fused(xd), lambda: eager(xd))


def cbr() -> None:
    _cbr_cases([((32, 64, 56, 56, 64), 1, torch.float16, True),
                ((32, 64, 56, 56, 64), 1, torch.float32, False),
                ((64, 128, 28, 28, 128), 1, torch.bfloat16, True)])


def cbrnchw() -> None:
    """ResNet-50's float32 NCHW 3x3 layers whose output plane has H*W % 8 != 0 (no one-launch
    bn_fused_nchw with the mask; slower than eager in training on the H200), and one with
    H*W % 8 == 0 for comparison."""
    _cbr_cases([((64, 256, 14, 14, 256), 1, torch.float32, False),
                ((64, 512, 7, 7, 512), 1, torch.float32, False),
                ((64, 256, 28, 28, 256), 2, torch.float32, False),
                ((64, 128, 28, 28, 128), 1, torch.float32, False)])
    # BatchNorm alone on the same outputs (no mask): how its NCHW kernels fare at H*W % 8 != 0
    for shape in [(64, 256, 14, 14), (64, 512, 7, 7)]:
        bn_case(shape, torch.float32, False, with_eval=False)


def cbrbf16() -> None:
    """ResNet-50's bfloat16 channels-last 3x3 layers with 14x14 and 7x7 outputs (below the 1.3x /
    1.2x training targets in CUDA graphs on the H200)."""
    _cbr_cases([((64, 256, 14, 14, 256), 1, torch.bfloat16, True),
                ((64, 512, 7, 7, 512), 1, torch.bfloat16, True),
                ((64, 512, 14, 14, 512), 2, torch.bfloat16, True)])


def cbrfp16() -> None:
    """The float16 channels-last (32,64,56,56)->64 block alone (its backward's BatchNorm part is
    the 6.4M-element one that bn_bwd_tile_nhwc runs with rows in shared memory)."""
    _cbr_cases([((32, 64, 56, 56, 64), 1, torch.float16, True)])


def with_env(var: str, value: str, fn):
    """fn with os.environ[var] = value around each call (for switches read at every call)."""
    def run():
        old = os.environ.get(var)
        os.environ[var] = value
        try:
            return fn()
        finally:
            if old is None:
                del os.environ[var]
            else:
                os.environ[var] = old
    return run


def cbrstats() -> None:
    env = "CUDADOCTOR_OPS_CBR_CUDNN_STATS"
    for (n, ci, h, w_, co), dt in [((32, 64, 56, 56, 64), torch.float16), ((64, 128, 28, 28, 128), torch.bfloat16)]:
        block = torch.nn.Sequential(torch.nn.Conv2d(ci, co, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(co),
                                    torch.nn.ReLU()).cuda()
        block[0].to(dt)
        fused = ops.fuse_conv_bn_relu(block.to(memory_format=torch.channels_last)).train()
        x = torch.randn(n, ci, h, w_, device="cuda", dtype=dt).contiguous(memory_format=torch.channels_last)
        show(f"CBR {(n, ci, h, w_, co)} {dt} nhwc train fwd, cuDNN statistics vs default",
             with_env(env, "1", lambda: fused(x)), with_env(env, "0", lambda: fused(x)), ("stats", "default"))
        from cudadoctor_ops import cudnn_stats
        print("  ", cudnn_stats.status())


def _dw_cases(cases) -> None:
    for n, c, h, w_, k, s, dt, cl in cases:
        x, wt = dw_tensors(n, c, h, w_, k, dt, cl)
        p = k // 2
        tag = f"DW {(n, c, h, w_)} k{k} s{s} {dt} {'nhwc' if cl else 'nchw'}"
        show(tag + " fwd", lambda: ops.depthwise_conv2d(x, wt, None, s, p),
             lambda: F.conv2d(x, wt, None, s, p, 1, c))
        y = F.conv2d(x, wt, None, s, p, 1, c)
        g = torch.randn_like(y)
        xg, wg = x.detach().requires_grad_(True), wt.detach().requires_grad_(True)
        yo = ops.depthwise_conv2d(xg, wg, None, s, p)
        yt = F.conv2d(xg, wg, None, s, p, 1, c)
        show(tag + " bwd", lambda: torch.autograd.grad(yo, (xg, wg), g, retain_graph=True),
             lambda: torch.autograd.grad(yt, (xg, wg), g, retain_graph=True))


def dw() -> None:
    _dw_cases([(64, 144, 56, 56, 3, 1, torch.float16, True),
               (64, 96, 112, 112, 3, 2, torch.float16, True),
               (64, 576, 14, 14, 3, 1, torch.bfloat16, True),
               (64, 1152, 7, 7, 5, 1, torch.float16, True),
               (64, 240, 28, 28, 5, 1, torch.float16, True),
               (1, 64, 128, 128, 3, 1, torch.float32, False)])


def dwmiss() -> None:
    """The channels-last depthwise rows of the late-2026 benches below cuDNN: 3x3 on 7x7 planes
    (forward and backward) and the (64,192,28,28) backward."""
    _dw_cases([(64, 960, 7, 7, 3, 1, torch.float16, True),
               (64, 960, 7, 7, 3, 1, torch.bfloat16, True),
               (64, 1152, 7, 7, 3, 1, torch.float16, True),
               (64, 192, 28, 28, 3, 1, torch.float16, True)])


def cbrapply() -> None:
    """conv_bn_relu_apply_sums alone on the fp16 block's conv output (32,64,56,56) channels_last
    (the wgmma path's apply, one launch): with the running statistics and num_batches_tracked to
    update (the completion counter: each block counts itself after a fence) and without (a plain
    launch), against torch.relu over the same tensor (an elementwise pass of the same size)."""
    y = torch.randn(32, 64, 56, 56, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    d = y.double()
    sums = torch.stack([d.sum((0, 2, 3)), (d * d).sum((0, 2, 3))]).float().contiguous()
    w, b = torch.rand(64, device="cuda") + 0.5, torch.randn(64, device="cuda")
    rm, rv, nbt = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    apply = torch.ops.cudadoctor_ops.conv_bn_relu_apply_sums
    show("apply_sums (32, 64, 56, 56) fp16 nhwc: update / none",
         lambda: apply(y, sums, w, b, rm, rv, nbt, 0.1, 1e-5, False),
         lambda: apply(y, sums, w, b, None, None, None, 0.1, 1e-5, False), labels=("upd", "none"))
    show("apply_sums with update / torch.relu (32, 64, 56, 56) fp16 nhwc",
         lambda: apply(y, sums, w, b, rm, rv, nbt, 0.1, 1e-5, False), lambda: torch.relu(y))


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name())
    torch.backends.cudnn.benchmark = True
    for part in sys.argv[1:] or ["bn", "cbr", "dw"]:
        {"bn": bn, "cbr": cbr, "cbrnchw": cbrnchw, "cbrbf16": cbrbf16, "cbrfp16": cbrfp16, "dw": dw, "cbrstats": cbrstats, "bnmiss": bnmiss,
         "dwt": dwt, "dwmiss": dwmiss, "cbrapply": cbrapply}[part]()

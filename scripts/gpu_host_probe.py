"""Host time against GPU time of one call: Conv+BN+ReLU blocks (fused and eager) and a ResNet-50 step.

    python scripts/gpu_host_probe.py [blocks] [resnet] [profile] [torchprof] [blockprof] [kernels]
                                     [streams] [resgrad] [evalhost] [bs=N ...]

Each call is issued while the GPU is held by a sleep kernel, so nothing the call queues can block
the host: "host ms" is the wall time of the Python call (launches, dispatch, allocation), "gpu ms"
the time between CUDA events recorded around it (the queued kernels back to back). A call whose
host time exceeds its GPU time is host-bound in an eager loop; a host time near the sleep means
the call synchronised. `profile` prints cProfile's top entries for the fused calls; `torchprof`
torch.profiler's self CPU time per op (and CUDA runtime call) over three ResNet-50 steps;
`blockprof` the same over five forward+backward calls of each headline block, fused and eager;
`evalhost` the eval call of each headline block against the ops it ends in (with `profile`, its
cProfile); `kernels` the GPU time per kernel over two steps of the fused model with and without
the block tails fused. `streams` / `resgrad` add to `resnet` a fused model whose steps run with the
convolution's backward on two streams / the residual's gradient in its own pass (instead of the
model without fused tails). bs=N (repeatable) sets the ResNet-50 batch sizes (default 64 and 128; `kernels` takes
the first, default 128).
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

from cudadoctor_ops import bench_cbr as B

def host_gpu(fn, sleep_ms: float, reps: int = 15) -> tuple[float, float]:
    """Medians over reps of bench_cbr.host_gpu_ms (host ms, GPU ms of one call)."""
    fn()
    times = [B.host_gpu_ms(fn, sleep_ms) for _ in range(reps)]
    return statistics.median(h for h, _ in times), statistics.median(g for _, g in times)


def profile(fn, n: int = 30, top: int = 18) -> str:
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def blocks(do_profile: bool) -> None:
    print("| block | kind | fused host / gpu ms | eager host / gpu ms |")
    print("|---|---|---|---|")
    for shape, k, st, dt, lay in B.HEADLINE:
        x, eager, fused = B._blocks(shape, k, st, B._DT[dt], lay)
        xg = x.detach().requires_grad_(True)
        gy = torch.randn_like(eager(xg))

        def fb(m):
            def run():
                m(xg).backward(gy)

            return run

        rows = {}
        eager.train()
        fused.train()
        rows["train fwd"] = [host_gpu(lambda m=m: m(xg), 5) for m in (fused, eager)]
        rows["fwd+bwd"] = [host_gpu(fb(m), 10) for m in (fused, eager)]
        if do_profile:
            print(f"\n### cProfile fused fwd+bwd {shape}->{k} {dt} {lay} (30 calls)\n```\n{profile(fb(fused))}```\n")
        eager.eval()
        fused.eval()
        with torch.no_grad():
            rows["eval"] = [host_gpu(lambda m=m: m(x), 5) for m in (fused, eager)]
        for kind, ((hf, gf), (he, ge)) in rows.items():
            print(f"| {shape}->{k} {dt} {lay} | {kind} | {hf:.3f} / {gf:.3f} | {he:.3f} / {ge:.3f} |", flush=True)
        del x, xg, eager, fused, gy
        torch.cuda.empty_cache()


def loop_host_us(fn, n: int = 200) -> float:
    """Host microseconds per call of fn in a loop of n calls issued while the GPU runs a sleep
    kernel longer than the loop (steady state: warm caches, no waiting on the GPU)."""
    from gpu_profile import host_us  # scripts/ is sys.path[0] when run as a script

    return host_us(fn, n, hold_ms=n * 0.5)


def eval_host(do_profile: bool) -> None:
    """Eval (no_grad) host / GPU ms of one call per headline block: the fused module with each
    eval_impl, the bare ops it ends in (conv_bias_relu impl 0 / 1 on the cached folded weights),
    F.conv2d alone and the eager Sequential; then cProfile of the fused module's eval calls."""
    import importlib

    import torch.nn.functional as F

    M = importlib.import_module("cudadoctor_ops.conv_bn_relu")  # the module, not the function

    print("| block | call | host / gpu ms |")
    print("|---|---|---|")
    for shape, k, st, dt, lay in B.HEADLINE:
        x, eager, fused = B._blocks(shape, k, st, B._DT[dt], lay)
        eager.eval()
        fused.eval()
        name = f"{shape}->{k} {dt} {lay}"
        with torch.no_grad():
            rows = []
            for impl in ("auto", "cudnn", "epilogue"):
                fused.eval_impl = impl
                rows.append((f"fused eval_impl={impl}", host_gpu(lambda: fused(x), 5)))
            fused.eval_impl = "auto"
            fused(x)
            c = fused._fold_cache
            args = (fused.conv.stride, fused.conv.padding, fused.conv.dilation, fused.conv.groups)
            for impl in (0, 1):
                rows.append((f"op conv_bias_relu impl {impl}",
                             host_gpu(lambda impl=impl: M._eval_op(x, c.weight, c.bias, *args, impl), 5)))
            rows.append(("F.conv2d", host_gpu(lambda: F.conv2d(x, c.weight, c.bias, *args), 5)))
            rows.append(("eager Sequential", host_gpu(lambda: eager(x), 5)))
            for label, (h, g) in rows:
                print(f"| {name} | {label} | {h:.4f} / {g:.4f} |", flush=True)
            print(f"| {name} | tuned choice: {c.choice[1] if c.choice else None} | |")
            loops = [("fused", lambda: fused(x)),
                     ("op impl 0", lambda: M._eval_op(x, c.weight, c.bias, *args, 0)),
                     ("F.conv2d", lambda: F.conv2d(x, c.weight, c.bias, *args)),
                     ("eager", lambda: eager(x))]
            us = {label: [] for label, _ in loops}
            for _ in range(3):  # interleaved rounds, best kept
                for label, fn in loops:
                    us[label].append(loop_host_us(fn))
            print(f"| {name} | host us per call in a loop of 200 (GPU held): "
                  + ", ".join(f"{label} {min(v):.1f}" for label, v in us.items()) + " |", flush=True)
            if do_profile:
                print(f"\n### cProfile fused eval {name} (30 calls)\n```\n{profile(lambda: fused(x))}```\n")
        del x, eager, fused
        torch.cuda.empty_cache()


def sgd_step(model, x, y):
    """One bf16-autocast SGD training step of model on (x, y) as a function (bench_cbr.sgd_step),
    after 3 warm-up calls."""
    step = B.sgd_step(model, [(x, y)])
    for _ in range(3):
        step(0)
    return lambda: step(0)


# `variants`: (name, {VAR: value}) models of the fused kind whose steps run with those switches
# set (switches read at every call), beside eager and the default fused model
VARIANTS = {
    "streams": ("fused, two-stream conv backward", {"CUDADOCTOR_OPS_CBR_BWD_STREAMS": "1"}),
    "resgrad": ("fused, separate residual gradient", {"CUDADOCTOR_OPS_CBR_RES_GRAD_FUSED": "0"}),
}


def with_env(env: dict, fn):
    """fn with the environment variables of env set around each call."""
    import os

    def run():
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in old.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v

    return run


def resnet(batches=(64, 128), do_profile: bool = False, variants=()) -> None:
    import torchvision

    from cudadoctor_ops.conv_bn_relu import fuse_conv_bn_relu

    for batch in batches:
        torch.manual_seed(0)
        base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
        models = {"eager": copy.deepcopy(base), "fused": fuse_conv_bn_relu(copy.deepcopy(base))}
        if not variants:
            models["fused, no tails"] = fuse_conv_bn_relu(copy.deepcopy(base), residual=False)
        for name, _ in variants:
            models[name] = fuse_conv_bn_relu(copy.deepcopy(base))
        del base
        x = torch.randn(batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (batch,), device="cuda")
        steps = {}
        for name, model in models.items():
            env = dict(variants).get(name)
            if env:  # the warm-up steps with the switches too
                steps[name] = with_env(env, with_env(env, lambda m=model: sgd_step(m, x, y))())
            else:
                steps[name] = sgd_step(model, x, y)
        torch.cuda.synchronize()
        loop = {}
        names = list(models)
        for rnd in range(4):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(10):
                    steps[name]()
                torch.cuda.synchronize()
                loop.setdefault(name, []).append(batch * 10 / (time.perf_counter() - t0))
        for name, v in loop.items():
            print(f"resnet50 bs{batch} {name}: back-to-back loop of 10 steps, {statistics.median(v):.0f} img/s "
                  f"(rounds {', '.join(f'{a:.0f}' for a in v)})", flush=True)
        res = {}
        for rnd in range(3):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                h, g = host_gpu(steps[name], 120, reps=5)
                res.setdefault(name, []).append((h, g))
        for name, v in res.items():
            h = statistics.median(a for a, _ in v)
            g = statistics.median(b for _, b in v)
            print(f"resnet50 bs{batch} {name}: host {h:.2f} ms, gpu {g:.2f} ms per step "
                  f"({batch / (max(h, g) / 1e3):.0f} img/s if host and GPU overlap fully)", flush=True)
        if do_profile:
            print(f"\n### cProfile fused ResNet-50 step bs{batch} (5 steps)\n```\n{profile(steps['fused'], 5, 25)}```\n")
        del models, steps
        torch.cuda.empty_cache()


def torch_profile(batch: int = 64) -> None:
    """Self CPU time per op and CUDA runtime call over 3 ResNet-50 steps, eager and fused."""
    import torchvision
    from torch.profiler import ProfilerActivity, profile as tprofile

    from cudadoctor_ops.conv_bn_relu import fuse_conv_bn_relu

    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    for name, model in (("eager", copy.deepcopy(base)), ("fused", fuse_conv_bn_relu(copy.deepcopy(base)))):
        step = sgd_step(model, x, y)
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                B.gpu_sleep(60)
                step()
                torch.cuda.synchronize()  # one step per sleep: its launches never fill the driver's queue
        print(f"\n### torch.profiler ResNet-50 bs{batch} {name}, 3 steps, by self CPU time\n```")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))
        print("```", flush=True)
        del model, step
        torch.cuda.empty_cache()


def kernels(batch: int = 128, top: int = 30) -> None:
    """GPU time per kernel over 2 ResNet-50 steps of the fused model with and without the block
    tails fused (torch.profiler, self device time)."""
    import torchvision
    from torch.profiler import ProfilerActivity, profile as tprofile

    from cudadoctor_ops.conv_bn_relu import fuse_conv_bn_relu

    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device="cuda")
    for name, model in (("fused", fuse_conv_bn_relu(copy.deepcopy(base))),
                        ("fused, no tails", fuse_conv_bn_relu(copy.deepcopy(base), residual=False))):
        step = sgd_step(model, x, y)
        torch.cuda.synchronize()
        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        try:
            table = ka.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=90)
        except Exception:  # older key name
            table = ka.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=90)
        print(f"\n### kernels, ResNet-50 bs{batch} {name}, 2 steps, by GPU time\n```\n{table}\n```", flush=True)
        del model, step
        torch.cuda.empty_cache()


def block_profile(top: int = 30) -> None:
    """torch.profiler of 5 forward+backward calls of each headline block, fused and eager: self CPU
    time per op and CUDA runtime call, each call issued behind a sleep kernel (so a launch never
    waits on a full queue and a synchronising call shows as such)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    for shape, k, st, dt, lay in B.HEADLINE:
        x, eager, fused = B._blocks(shape, k, st, B._DT[dt], lay)
        xg = x.detach().requires_grad_(True)
        gy = torch.randn_like(eager(xg))
        for name, m in (("fused", fused), ("eager", eager)):
            m.train()
            for _ in range(3):
                m(xg).backward(gy)
            torch.cuda.synchronize()
            with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    B.gpu_sleep(5)
                    m(xg).backward(gy)
                    torch.cuda.synchronize()
            print(f"\n### torch.profiler {name} fwd+bwd {shape}->{k} {dt} {lay}, 5 calls, by self CPU time\n```")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
            print("```", flush=True)
        del x, xg, eager, fused, gy
        torch.cuda.empty_cache()


def main(argv) -> int:
    parts = {a for a in argv if not a.startswith("bs=")} or {"blocks", "resnet"}
    bs = [int(a[3:]) for a in argv if a.startswith("bs=")]
    torch.backends.cudnn.benchmark = False
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if "blocks" in parts:
        blocks("profile" in parts)
    if "evalhost" in parts:
        eval_host("profile" in parts)
    if "resnet" in parts:
        resnet(tuple(bs) or (64, 128), do_profile="profile" in parts,
               variants=[VARIANTS[p] for p in sorted(parts & set(VARIANTS))])
    if "kernels" in parts:
        kernels(bs[0] if bs else 128)
    if "torchprof" in parts:
        torch_profile()
    if "blockprof" in parts:
        block_profile()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

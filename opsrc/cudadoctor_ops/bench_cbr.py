"""Benchmarks of the fused Conv2d -> BatchNorm2d -> ReLU against eager torch and torch.compile.

    python -m cudadoctor_ops.bench cbr [--quick]        (rows in the shared bench table)
    python -m cudadoctor_ops.bench_cbr [--quick] [--no-compile] [--no-resnet] [--json]

Per (shape, dtype, layout), measured in the same run: training forward (autograd recording, as in
a training step), forward + backward, and eval forward, for the fused module, eager
Conv2d + BatchNorm2d + ReLU and ``torch.compile`` of that eager block. Saved-for-backward memory:
bytes the autograd graph holds after the forward once the output itself is dropped (what backward
keeps alive), and the peak of the forward. A torchvision ResNet-50 training step (channels_last,
bf16 autocast, SGD) after ``fuse_conv_bn_relu`` against the unfused model, at batch 64 and 128
(``--resnet-batch``): images/s, the host and GPU time of one step, and the loss of 20 steps from
the same seed and data. On the H200 machine batch 64 is host-bound (about 21-26 ms of Python and
launches per step against 15-17 ms of GPU work, both models), so its images/s follow the CPU and
move by 10% between rounds; batch 128 is GPU-bound and repeats to within 1%.

Two times per layer kind. The plain row ("train fwd", "fwd+bwd", "eval fwd") times one call of the
Python module with the shared timer, which flushes L2 before every call: it includes whatever host
time (Python, dispatch, launches) the flush kernel does not hide, so it moves between processes when
a call's host time is longer than the flush. Ours and eager are timed in the order ours, eager,
eager, ours, each side keeping the lower of its two medians (``pair_ms``, as in the shared bench).
The "(graph)" row times a replay of one call captured in a CUDA graph with the same timer: the GPU
time of the same kernels, without host time.

The ResNet-50 images/s are measured in interleaved rounds (eager then fused, the order alternating
per round) and reported as the median over rounds with the min-max range, so that a drift of the
GPU or host over the run hits both models alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (N, C, H, W) -> K, stride, dtype, layout, label
HEADLINE = [
    ((32, 64, 56, 56), 64, 1, "fp16", "nhwc"),
    ((32, 64, 56, 56), 64, 1, "fp32", "nchw"),
    ((64, 128, 28, 28), 128, 1, "bf16", "nhwc"),
]
# the 3x3 convolutions of ResNet-50 (torchvision, stride on the 3x3) at batch 64
RESNET50_3X3 = [
    ((64, 64, 56, 56), 64, 1),
    ((64, 128, 56, 56), 128, 2),
    ((64, 128, 28, 28), 128, 1),
    ((64, 256, 28, 28), 256, 2),
    ((64, 256, 14, 14), 256, 1),
    ((64, 512, 14, 14), 512, 2),
    ((64, 512, 7, 7), 512, 1),
]
TARGETS = {"train fwd": 1.3, "train fwd vs compile": 1.0, "fwd+bwd": 1.2, "eval fwd": 1.5}
GRAPH = " (graph)"
# the kinds of a case in table order; "<kind> (graph)" is the CUDA-graph replay of "<kind>"
KINDS = ("train fwd", "train fwd" + GRAPH, "train fwd vs compile", "fwd+bwd", "fwd+bwd" + GRAPH,
         "fwd+bwd vs compile", "eval fwd", "eval fwd" + GRAPH, "eval fwd epilogue")


def _target(kind: str):
    """Target speedup of a kind; a graph row has the target of the kind it replays."""
    return TARGETS.get(kind[: -len(GRAPH)] if kind.endswith(GRAPH) else kind)


def _median_range(values) -> tuple[float, list]:
    """(median, [min, max]) of a non-empty sequence of numbers."""
    vals = [float(v) for v in values]
    return statistics.median(vals), [min(vals), max(vals)]


def _round_orders(rounds: int) -> list[tuple[str, str]]:
    """Which model each interleaved round times first: eager first in even rounds, fused in odd."""
    return [("eager", "fused") if r % 2 == 0 else ("fused", "eager") for r in range(max(1, int(rounds)))]


def _blocks(shape, k, stride, dtype, layout):
    from .conv_bn_relu import ConvBNReLU2d

    n, c, h, w = shape
    torch.manual_seed(0)
    conv = nn.Conv2d(c, k, 3, stride, 1, bias=False)
    bn = nn.BatchNorm2d(k)
    eager = nn.Sequential(conv, bn, nn.ReLU(inplace=True)).cuda()
    eager[0].to(dtype)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if layout == "nhwc":
        eager = eager.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    fused_conv, fused_bn = copy.deepcopy(eager[0]), copy.deepcopy(eager[1])
    fused = ConvBNReLU2d.from_modules(fused_conv, fused_bn)
    return x, eager, fused


def _held_bytes(fn, x) -> tuple[int, int]:
    """(bytes held by the graph after forward with the output dropped, peak bytes of forward)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = fn(x)
    loss = y.float().sum()
    peak = torch.cuda.max_memory_allocated() - before
    del y
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    del loss
    return held, peak


def _timer(rep_ms: float):
    """The shared bench Timer; a plain do_bench / CUDA-event timer if that module is unavailable."""
    try:
        from .bench import Timer

        return Timer(rep_ms=rep_ms)
    except Exception:  # noqa: BLE001 - keep this benchmark usable on its own
        pass

    def timer(fn):
        try:
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))
        except ImportError:
            pass
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(50):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        return sorted(s.elapsed_time(e) for s, e in times)[len(times) // 2]

    return timer


def _settle() -> None:
    """Wait for the device after a failed capture or timing; errors here are not ours to report."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass


def graph_ms(timer, fn, errors: list | None = None, stream=None, attempts: int = 2):
    """Milliseconds of one replay of fn captured in a CUDA graph (GPU time only), or None.

    fn runs 3 times on a side stream first (allocations, lazy initialisation and tuning happen
    outside the capture, as torch.cuda.graph requires), then one call is captured and the timer
    times ``g.replay``. ``stream``: the side stream, which is also the capture stream (give the
    stream a backward's forward ran on: autograd runs each backward op on its forward op's
    stream); default a new one. A failed capture is tried again up to ``attempts`` times in all
    (the first capture of an autograd backward in a process has failed where later ones did not).
    Any exception (capture unsupported by a kernel or library, a host sync inside fn, ...) gives
    None, with its text appended to ``errors``.
    """
    for attempt in range(max(1, attempts)):
        try:
            side = stream if stream is not None else torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                fn()
            torch.cuda.synchronize()
            return float(timer(g.replay))
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            if errors is not None:
                errors.append(f"attempt {attempt + 1}: {type(exc).__name__}: {exc}"[:300])
            _settle()
    return None


def pair_ms(timer, ours_fn, eager_fn) -> tuple[float, float]:
    """(ours, eager) ms. With the shared bench Timer, its ``pair``: each side timed twice in the
    order ours, eager, eager, ours and its lower median kept, so that neither side gains from going
    second; a plain timer function times each once."""
    pair = getattr(timer, "pair", None)
    if pair is not None:
        return pair(ours_fn, eager_fn)
    return timer(ours_fn), timer(eager_fn)


def graph_pair_into(res: dict, kind: str, timer, ours_fn, eager_fn) -> None:
    """res[kind + " (graph)"] = (ours, eager) replay ms when both captured; a side whose capture
    failed for good gets its last error in res["graph_error"] (one that failed once and then
    worked is no error)."""
    ms = {}
    for who, fn in (("ours", ours_fn), ("eager", eager_fn)):
        errors: list = []
        ms[who] = graph_ms(timer, fn, errors)
        if ms[who] is None and errors:
            res.setdefault("graph_error", {})[f"{kind} {who}"] = errors[-1]
    if ms["ours"] is not None and ms["eager"] is not None:
        res[kind + GRAPH] = (ms["ours"], ms["eager"])


def bench_case(timer, shape, k, stride, dt, layout, compile_block: bool) -> dict:
    dtype = _DT[dt]
    x, eager, fused = _blocks(shape, k, stride, dtype, layout)
    res: dict = {"shape": shape, "k": k, "stride": stride, "dtype": dt, "layout": layout}
    xg = x.detach().requires_grad_(True)
    gy = None

    def fwd(m):
        return lambda: m(xg)

    def fwd_bwd(m):
        def run():
            y = m(xg)
            y.backward(gy)

        return run

    def graph_pair(kind, ours_fn, eager_fn):
        graph_pair_into(res, kind, timer, ours_fn, eager_fn)

    eager.train()
    fused.train()
    gy = torch.randn_like(eager(xg))
    # correctness spot-check of this very case
    ref = eager(xg)
    out = fused(xg)
    res["max_rel_err"] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    del ref, out
    # the convolution alone, forward and backward (input + weight grads), for the breakdown
    conv = eager[0]
    y0 = conv(x)
    g0 = torch.randn_like(y0)
    res["conv_fwd_ms"] = timer(lambda: F.conv2d(x, conv.weight, None, conv.stride, conv.padding))
    res["conv_bwd_ms"] = timer(
        lambda: torch.ops.aten.convolution_backward(
            g0, x, conv.weight, None, list(conv.stride), list(conv.padding), [1, 1], False, [0, 0], 1,
            [True, True, False],
        )
    )
    del y0
    res["train fwd"] = pair_ms(timer, fwd(fused), fwd(eager))
    graph_pair("train fwd", fwd(fused), fwd(eager))
    res["fwd+bwd"] = pair_ms(timer, fwd_bwd(fused), fwd_bwd(eager))
    # the timed calls above allocated the .grad tensors; replays accumulate into them
    graph_pair("fwd+bwd", fwd_bwd(fused), fwd_bwd(eager))
    if compile_block:
        try:
            compiled = torch.compile(copy.deepcopy(eager))
            compiled(xg)
            fwd_bwd(compiled)()
            res["train fwd vs compile"] = (res["train fwd"][0], timer(fwd(compiled)))
            res["fwd+bwd vs compile"] = (res["fwd+bwd"][0], timer(fwd_bwd(compiled)))
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
            res["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
    xg.grad = None
    for p in list(eager.parameters()) + list(fused.parameters()):
        p.grad = None
    held_f, peak_f = _held_bytes(lambda t: fused(t), xg)
    held_e, peak_e = _held_bytes(lambda t: eager(t), xg)
    res["saved_bytes"] = {"ours": held_f, "eager": held_e, "ours_peak": peak_f, "eager_peak": peak_e}
    eager.eval()
    fused.eval()
    with torch.no_grad():
        res["eval fwd"] = pair_ms(timer, lambda: fused(x), lambda: eager(x))
        graph_pair("eval fwd", lambda: fused(x), lambda: eager(x))
        from .conv_bn_relu import _TUNED

        res["eval_variant"] = list(_TUNED.values())[-1] if _TUNED else "-"
        fused.eval_impl = "epilogue"
        res["eval fwd epilogue"] = (timer(lambda: fused(x)), res["eval fwd"][1])
        fused.eval_impl = "auto"
    return res


_STEP_SLEEP_MS = 60  # GPU sleep ahead of one timed ResNet-50 step at batch 64 (scaled with the batch)
RESNET_BATCHES = (64, 128)  # default batch sizes of the ResNet-50 step


def gpu_sleep(ms: float) -> None:
    """Queues a sleep kernel of about ``ms`` milliseconds on the current stream (the cycles per ms
    of conv_bn_relu's tuner, which queues its timed calls behind one the same way)."""
    from .conv_bn_relu import _SLEEP_CYCLES  # about 1 ms

    torch.cuda._sleep(int(ms * _SLEEP_CYCLES))


def sgd_step(model, data):
    """step(i): one bf16-autocast SGD training step of model on data[i % len(data)] = (x, y);
    returns the loss tensor."""
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=1e-4)

    def step(i):
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def host_gpu_ms(fn, sleep_ms: float = 5.0) -> tuple[float, float]:
    """(host ms, GPU ms) of one call of fn, issued while the GPU runs a sleep kernel of about
    ``sleep_ms``: the host time is the wall time of the Python call (nothing it queues can block
    it while the GPU is busy, as long as its launches fit the driver's queue), the GPU time that
    between CUDA events recorded around the call (its kernels back to back). A host time near
    ``sleep_ms`` means fn synchronised with the GPU."""
    torch.cuda.synchronize()
    gpu_sleep(sleep_ms)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    end.record()
    end.synchronize()
    return (t1 - t0) * 1e3, start.elapsed_time(end)


def resnet50_step(steps: int = 20, batch: int = 64, timed: int = 10, rounds: int = 5) -> dict:
    """ResNet-50 training steps, eager vs fused, same init and data, bf16 autocast, batch ``batch``.

    Loss: ``steps`` steps of each model from the same weights and data. Speed: after 3 warm-up
    steps of each, ``rounds`` rounds, each timing ``timed`` steps of eager and ``timed`` steps of
    fused (which goes first alternates per round); images/s are the median over rounds, with the
    [min, max] range, and ``speedup`` is median fused / median eager. Then, per model, the host
    and GPU time of one step (:func:`host_gpu_ms`, median of 5): where the host time exceeds the
    GPU time the loop is host-bound and images/s measure the Python / launch time of the machine's
    CPU more than the GPU work.
    """
    try:
        import torchvision
    except Exception as exc:  # noqa: BLE001 - torchvision is optional
        return {"skipped": f"torchvision not importable: {exc}"}
    from .conv_bn_relu import fuse_conv_bn_relu

    torch.manual_seed(0)
    base = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    eager = copy.deepcopy(base)
    fused = fuse_conv_bn_relu(copy.deepcopy(base))
    del base
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [
        (
            torch.randn(batch, 3, 224, 224, device="cuda", generator=gen).contiguous(memory_format=torch.channels_last),
            torch.randint(0, 1000, (batch,), device="cuda", generator=gen),
        )
        for _ in range(4)
    ]

    step_e, step_f = sgd_step(eager, data), sgd_step(fused, data)
    losses_e, losses_f = [], []
    for i in range(steps):
        losses_e.append(step_e(i).item())
        losses_f.append(step_f(i).item())

    def ips(step):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(timed):
            step(i)
        torch.cuda.synchronize()
        return batch * timed / (time.perf_counter() - t0)

    models = {"eager": step_e, "fused": step_f}
    for step in models.values():
        for i in range(3):
            step(i)
    torch.cuda.synchronize()
    per_round: dict = {"eager": [], "fused": []}
    orders = _round_orders(rounds)
    for order in orders:
        for name in order:
            per_round[name].append(ips(models[name]))
    med_e, range_e = _median_range(per_round["eager"])
    med_f, range_f = _median_range(per_round["fused"])
    step_ms = {}
    for name, step in models.items():
        times = [host_gpu_ms(lambda: step(0), sleep_ms=_STEP_SLEEP_MS * batch / 64) for _ in range(5)]
        step_ms[name] = {"host_ms": statistics.median(h for h, _ in times),
                         "gpu_ms": statistics.median(g for _, g in times)}
    max_rel = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses_f, losses_e))
    return {
        "batch": batch,
        "step_ms": step_ms,
        "fused_chains": fused.__dict__.get("_cbr_fused", 0),
        "fused_tails": fused.__dict__.get("_cbr_fused_tails", 0),
        "images_per_s_eager": med_e,
        "images_per_s_fused": med_f,
        "images_per_s_eager_range": range_e,
        "images_per_s_fused_range": range_f,
        "images_per_s_eager_rounds": per_round["eager"],
        "images_per_s_fused_rounds": per_round["fused"],
        "rounds": len(orders),
        "speedup": med_f / med_e,
        "losses_eager": losses_e,
        "losses_fused": losses_f,
        "max_rel_loss_diff": max_rel,
    }


def _cases(quick: bool, which: str = "all"):
    cases = [] if which == "resnet" else [(s, k, 1, dt, lay) for s, k, _, dt, lay in HEADLINE]
    if not quick and which != "headline":
        for s, k, st in RESNET50_3X3:
            cases.append((s, k, st, "bf16", "nhwc"))
            cases.append((s, k, st, "fp32", "nchw"))
    seen, out = set(), []
    for c in cases:
        if c not in seen:
            seen.add(c)
            out.append(c)
    return out


def run(timer, quick: bool = False, compile_block: bool = True, progress=None, which: str = "all") -> list[dict]:
    results = []
    for shape, k, st, dt, lay in _cases(quick, which):
        headline = (shape, k, 1, dt, lay) in [(s, kk, 1, d, l) for s, kk, _, d, l in HEADLINE]
        r = bench_case(timer, shape, k, st, dt, lay, compile_block and headline)
        results.append(r)
        if progress:
            progress(r)
        torch.cuda.empty_cache()
    return results


def bench_rows(args, timer, copy_tbps) -> list:
    """Rows of the shared table (python -m cudadoctor_ops.bench cbr)."""
    from .bench import Row

    rows = []

    def progress(r):
        sb = r["saved_bytes"]
        print(
            f"  conv_bn_relu {r['shape']}->{r['k']} s{r['stride']} {r['dtype']} {r['layout']}: "
            f"saved-for-backward {sb['ours'] / 2**20:.1f} MiB vs eager {sb['eager'] / 2**20:.1f} MiB "
            f"({sb['ours'] / max(sb['eager'], 1):.2f}x, target <= 0.75x); forward peak "
            f"{sb['ours_peak'] / 2**20:.1f} vs {sb['eager_peak'] / 2**20:.1f} MiB; max rel err {r['max_rel_err']:.2e}; "
            f"eval variant: {r.get('eval_variant')}"
            + (f"; compile failed: {r['compile_error']}" if "compile_error" in r else "")
            + "".join(f"; graph capture failed ({k}): {v}" for k, v in r.get("graph_error", {}).items()),
            file=sys.stderr,
            flush=True,
        )

    results = run(timer, quick=getattr(args, "quick", False), compile_block=True, progress=progress)
    for r in results:
        n, c, h, w = r["shape"]
        nbytes = _DT[r["dtype"]].itemsize * (n * c * h * w + 4 * n * r["k"] * (h // r["stride"]) * (w // r["stride"]))
        for kind in KINDS:
            if kind not in r:
                continue
            ours, theirs = r[kind]
            row = Row("conv_bn_relu", kind, r["shape"] + (r["k"],), r["dtype"], r["layout"], ours, theirs, nbytes,
                      _target(kind) or 0.0)
            rows.append(row.finish(copy_tbps))
    for res in resnet50_steps(getattr(args, "resnet_batch", None) or RESNET_BATCHES, rounds=getattr(args, "rounds", 5)):
        if "skipped" not in res:
            print("  " + _fmt_resnet(res), file=sys.stderr, flush=True)
        print(f"  resnet50 train step: {json.dumps(res)}", file=sys.stderr, flush=True)
    return rows


def _fmt_range(rng) -> str:
    return f"{rng[0]:.0f}-{rng[1]:.0f}" if rng else "-"


def _fmt_step_ms(resnet: dict) -> str:
    """'; one step, host / GPU ms: eager a / b, fused c / d (host-bound)' or '' without timings."""
    sm = resnet.get("step_ms")
    if not sm or "eager" not in sm or "fused" not in sm:
        return ""
    e, f = sm["eager"], sm["fused"]
    bound = "host-bound" if e["host_ms"] > e["gpu_ms"] else "GPU-bound"
    return (f"; one step, host / GPU ms: eager {e['host_ms']:.1f} / {e['gpu_ms']:.1f}, fused {f['host_ms']:.1f} / "
            f"{f['gpu_ms']:.1f} (eager {bound}; GPU time {e['gpu_ms'] / max(f['gpu_ms'], 1e-9):.2f}x)")


def _fmt_resnet(resnet: dict) -> str:
    """The ResNet-50 summary line: medians and min-max ranges of the interleaved rounds, and the
    host and GPU time of one step."""
    return (
        f"ResNet-50 bs{resnet.get('batch', 64)} bf16 channels_last train step: {resnet['images_per_s_fused']:.0f} "
        f"img/s fused ({_fmt_range(resnet.get('images_per_s_fused_range'))}) vs {resnet['images_per_s_eager']:.0f} "
        f"({_fmt_range(resnet.get('images_per_s_eager_range'))}) eager, {resnet['speedup']:.2f}x median of "
        f"{resnet.get('rounds', '?')} interleaved rounds (target >= 1.1x); {resnet['fused_chains']} chains"
        f"{' + ' + str(resnet['fused_tails']) + ' block tails' if resnet.get('fused_tails') else ''} fused; "
        f"loss max rel diff over {len(resnet['losses_eager'])} steps {resnet['max_rel_loss_diff']:.2e}"
        + _fmt_step_ms(resnet)
    )


def _resnet_list(resnet) -> list:
    """The ResNet-50 results as a list (one dict per batch size); {} or None: none."""
    if not resnet:
        return []
    return list(resnet) if isinstance(resnet, (list, tuple)) else [resnet]


def _fmt(results: list[dict], resnet: dict, header: bool = True) -> str:
    lines = [f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}"] if header else []
    head = ["shape->K s", "dtype", "layout", "kind", "ours ms", "ref ms", "ratio", "target", "met"]
    table = [head]
    notes = []
    for r in results:
        label = f"{r['shape']}->{r['k']} s{r['stride']}"
        for kind in KINDS:
            if kind not in r:
                continue
            ours, theirs = r[kind]
            ratio = theirs / ours
            tgt = _target(kind)
            shown = kind
            if kind in ("eval fwd", "eval fwd" + GRAPH):
                shown = f"eval fwd [{r.get('eval_variant')}]" + (GRAPH if kind.endswith(GRAPH) else "")
            table.append([label, r["dtype"], r["layout"], shown, f"{ours:.4f}", f"{theirs:.4f}", f"{ratio:.2f}x",
                          f">={tgt}x" if tgt else "-", ("yes" if ratio >= tgt else "NO") if tgt else "-"])
        table.append([label, r["dtype"], r["layout"], "conv alone fwd / bwd", f"{r['conv_fwd_ms']:.4f}",
                      f"{r['conv_bwd_ms']:.4f}", "-", "-", "-"])
        sb = r["saved_bytes"]
        ratio = sb["ours"] / max(sb["eager"], 1)
        table.append([label, r["dtype"], r["layout"], "saved MiB", f"{sb['ours'] / 2**20:.1f}",
                      f"{sb['eager'] / 2**20:.1f}", f"{ratio:.2f}x", "<=0.75x", "yes" if ratio <= 0.75 else "NO"])
        for what, err in r.get("graph_error", {}).items():
            notes.append(f"{label} {r['dtype']} {r['layout']}: graph capture of {what} failed: {err}")
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        lines.append("  ".join(v.ljust(widths[j]) for j, v in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.extend(notes)
    for res in _resnet_list(resnet):
        lines.append("")
        if "skipped" in res:
            lines.append(f"ResNet-50: {res['skipped']}")
        else:
            lines.append(_fmt_resnet(res))
            lines.append("  eager: " + " ".join(f"{v:.4f}" for v in res["losses_eager"]))
            lines.append("  fused: " + " ".join(f"{v:.4f}" for v in res["losses_fused"]))
    return "\n".join(lines)


def _batch_list(text: str) -> list[int]:
    """'64,128' -> [64, 128]: positive batch sizes, for --resnet-batch."""
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive batch sizes separated by commas, got {text!r}")
    return out


def resnet50_steps(batches, rounds: int = 5) -> list[dict]:
    """resnet50_step once per batch size; stops after a skip (no torchvision)."""
    out = []
    for batch in batches:
        res = resnet50_step(batch=batch, rounds=rounds)
        out.append(res)
        torch.cuda.empty_cache()
        if "skipped" in res:
            break
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudadoctor_ops.bench_cbr", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the three headline shapes")
    parser.add_argument("--cases", choices=["all", "headline", "resnet"], default="all",
                        help="headline: the three target shapes; resnet: ResNet-50's 3x3 layers (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the eager block")
    parser.add_argument("--no-resnet", action="store_true", help="skip the ResNet-50 training step")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--json-out", metavar="PATH", help="also write the JSON results to PATH")
    parser.add_argument("--rep-ms", type=float, default=60, help="measuring time per timing (ms)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved eager/fused rounds of the ResNet-50 images/s (default 5)")
    parser.add_argument("--resnet-batch", type=_batch_list, default=list(RESNET_BATCHES), metavar="B[,B...]",
                        help="batch sizes of the ResNet-50 training step (default 64,128: on the H200 "
                             "machine 64 is host-bound, 128 GPU-bound)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cudadoctor_ops.bench_cbr: no CUDA GPU visible; the benchmarks need one.", file=sys.stderr)
        return 2
    import cudadoctor_ops  # noqa: F401  (loads the kernels)

    timer = _timer(args.rep_ms)

    def progress(r):
        print(_fmt([r], {}, header=False), file=sys.stderr, flush=True)

    results = run(timer, quick=args.quick, compile_block=not args.no_compile, progress=progress, which=args.cases)
    resnet = [] if args.no_resnet else resnet50_steps(args.resnet_batch, rounds=args.rounds)
    doc = json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": results,
                      "resnet50": resnet}, default=list)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as fh:
            fh.write(doc)
    if args.json:
        print(doc)
    else:
        print(_fmt(results, resnet))
    return 0


if __name__ == "__main__":
    sys.exit(main())

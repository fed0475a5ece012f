"""The one-launch (cooperative) BatchNorm backward against float64 torch (GPU only).

CUDADOCTOR_OPS_BN_FUSED_BWD=1 forces bn_bwd_fused_{nchw,nhwc} whenever a backward has a reduction
and grad_input is wanted (and the grid can be resident), 0 the multi-kernel path (reduce ->
[finalize ->] apply); unset, the one-launch kernel runs up to 16 MiB of contiguous input and 32 MiB
of channels-last input. The switch is read
once per process, so every setting runs in a child process that loops over the cases and prints
JSON: one child per (switch, layout), and one with the switch unset that checks which kernels the
size limit picks.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest

import torch

# every test takes the `ops` fixture (tests/ops/conftest.py): the cudadoctor_ops module, or a
# skip with the reason when there is no CUDA GPU or no build
pytestmark = pytest.mark.gpu

_COMMON = textwrap.dedent(
    """
    import json, sys
    import torch
    import torch.nn.functional as F
    import cudadoctor_ops

    OPS = torch.ops.cudadoctor_ops
    EPS = 1e-5


    def fmt_of(layout, shape):
        if layout == "channels_last" and len(shape) == 4:
            return torch.channels_last
        return torch.contiguous_format


    def make_inputs(shape, dtype, fmt, seed, device="cuda"):
        # x (mean 0.5, std 2) and grad_out in `dtype` and memory format `fmt`, weight / bias
        # (float32 for half input, bfloat16 for bfloat16 input), float32 running statistics
        gen = torch.Generator().manual_seed(seed)
        c = shape[1]
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
        x = x.to(device).contiguous(memory_format=fmt)
        gy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        gy = gy.to(device).contiguous(memory_format=fmt)
        pdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        w = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).to(pdt).to(device)
        b = (torch.randn(c, generator=gen, dtype=torch.float64) * 0.3).to(pdt).to(device)
        rm = (torch.randn(c, generator=gen, dtype=torch.float64) * 0.1).float().to(device)
        rv = (torch.rand(c, generator=gen, dtype=torch.float64) + 0.5).float().to(device)
        return x, gy, w, b, rm, rv


    def tile_stash_rows(name):
        # SR of bn_bwd_tile_nhwc<T, CT, M, SR, ST> without streamed rows (ST == 0; 0: registers
        # only; -1: another kernel or the streamed variant)
        import re

        m = re.search(r"bn_bwd_tile_nhwc<[^<>]*, (\\d+), (\\d+)>", name)
        return int(m.group(1)) if m and m.group(2) == "0" else -1


    def tile_streamed(name):
        # whether name is the streamed bn_bwd_tile_nhwc (ST > 0)
        import re

        m = re.search(r"bn_bwd_tile_nhwc<[^<>]*, (\\d+), (\\d+)>", name)
        return bool(m) and m.group(2) != "0"


    def kernels(fn):
        # names of the BatchNorm backward kernels that fn launches; None when profiling fails
        try:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            names = set()
            for e in prof.events():
                for key in ("bn_bwd_singleread_nchw", "bn_bwd_fused_nchw", "bn_bwd_fused_nhwc", "bn_bwd_tile_nhwc",
                            "bn_bwd_reduce_nchw",
                            "bn_bwd_reduce_nhwc", "bn_bwd_apply_nchw", "bn_bwd_apply_nhwc",
                            "bn_bwd_finalize"):
                    if key in e.name:
                        names.add(key)
                if tile_stash_rows(e.name) > 0:
                    names.add("bn_bwd_tile_nhwc+stash")
                if tile_streamed(e.name):
                    names.add("bn_bwd_tile_nhwc+stream")
            return sorted(names)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            return "profiler failed: " + repr(exc)


    def backward_kernels(shape, dtype, layout, training, mask, act="relu"):
        # the kernels one batch_norm_backward call launches (activation `act`)
        fmt = fmt_of(layout, shape)
        x = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=fmt)
        c = shape[1]
        w = torch.rand(c, device="cuda") + 0.5
        b = torch.randn(c, device="cuda")
        rm, rv = torch.zeros(c, device="cuda"), torch.ones(c, device="cuda")
        _, sm, si, rs = OPS.batch_norm(x, w, b, rm, rv, training, EPS, act)
        gy = torch.randn_like(x)
        return kernels(lambda: OPS.batch_norm_backward(gy, x, w, b, sm, si, rs, training, act,
                                                       list(mask)))
    """
)

_CHILD = _COMMON + textwrap.dedent(
    """
    layout = sys.argv[1]  # "nchw" or "channels_last"
    DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    # odd sizes (scalar V=1 paths: H*W = 35 contiguous, C = 13 channels-last), one value per plane
    # (2 per channel), a big plane (several slices per channel), more channels than resident
    # blocks (several items per block), and ResNet-50's 14x14 BatchNorm at batch 64
    SHAPES = [(3, 24, 5, 7), (4, 13, 6, 6), (2, 8, 1, 1), (4, 8, 64, 64), (4, 4096, 3, 3),
              (64, 256, 14, 14)]
    MASKS = [(True, True, True), (True, False, False), (True, True, False), (True, False, True),
             (False, True, True), (False, True, False), (False, False, True)]


    def err(actual, expected, scale=1.0):
        # max abs error relative to the largest expected value (at least `scale`)
        return ((actual.double() - expected).abs().max() / expected.abs().max().clamp_min(scale)).item()


    records = []
    seed = 0
    for shape in SHAPES:
        fmt = fmt_of(layout, shape)
        c = shape[1]
        for dname, dtype in DTYPES.items():
            seed += 1
            x, gy0, w, b, rm, rv = make_inputs(shape, dtype, fmt, seed)
            for training in (True, False):
                for act in ("none", "relu"):
                    for affine in (True, False):
                        wa, ba = (w, b) if affine else (None, None)
                        x64 = x.double().requires_grad_(True)
                        w64 = (w.double() if affine else torch.ones(c, dtype=torch.float64, device="cuda")).requires_grad_(True)
                        b64 = (b.double() if affine else torch.zeros(c, dtype=torch.float64, device="cuda")).requires_grad_(True)
                        y64 = F.batch_norm(x64, rm.double(), rv.double(), w64, b64, training, 0.1, EPS)
                        gy = gy0
                        if act == "relu":
                            # at the ReLU's kink the kernel's mask (float32 arithmetic) and
                            # float64's may differ; a zero incoming gradient there makes both agree
                            gy = torch.where(y64.detach().abs() > 1e-3, gy0, torch.zeros_like(gy0))
                            gy = gy.contiguous(memory_format=fmt)
                            y64 = torch.relu(y64)
                        rx, rw, rb = torch.autograd.grad(y64, (x64, w64, b64), gy.double())
                        # grad_input = A * g + B * (x - mean) + D cancels to ~0 when a channel has
                        # few values (2 with shape (2, 8, 1, 1)): its rounding error scales with
                        # the terms, A * |g| with A = weight * invstd, not with the result
                        dims = [0] + list(range(2, len(shape)))
                        var64 = x64.detach().var(dims, unbiased=False) if training else rv.double()
                        a64 = w64.detach().abs() * (var64 + EPS).rsqrt()
                        dx_scale = max(1.0, (a64.max() * gy.double().abs().max()).item())
                        case = dict(shape=list(shape), dtype=dname, training=training, act=act, affine=affine)

                        def check(how, mask, dx, gw, gb):
                            r = dict(case, how=how, mask=list(mask))
                            r["dx"] = err(dx, rx, dx_scale) if mask[0] else None
                            r["gw"] = err(gw, rw) if mask[1] else None
                            r["gb"] = err(gb, rb) if mask[2] else None
                            r["layout_ok"] = (not mask[0]) or dx.is_contiguous(memory_format=fmt)
                            r["shape_ok"] = ((not mask[0]) or tuple(dx.shape) == tuple(shape)) and \\
                                ((not mask[1]) or tuple(gw.shape) == (c,)) and ((not mask[2]) or tuple(gb.shape) == (c,))
                            r["absent_empty"] = all(t.numel() == 0 for t, m in zip((dx, gw, gb), mask) if not m)
                            records.append(r)

                        _, sm, si, rs = OPS.batch_norm(x, wa, ba, rm, rv, training, EPS, act)
                        for mask in MASKS:
                            dx, gw, gb = OPS.batch_norm_backward(gy, x, wa, ba, sm, si, rs, training, act, list(mask))
                            check("op", mask, dx, gw, gb)
                        if affine:
                            # through autograd: all three grads, and weight/bias only (input not
                            # requiring grad)
                            for x_grad in (True, False):
                                xi = x.detach().clone().requires_grad_(x_grad)
                                wi, bi = w.detach().clone().requires_grad_(True), b.detach().clone().requires_grad_(True)
                                y = cudadoctor_ops.batch_norm(xi, rm.clone(), rv.clone(), wi, bi, training, 0.1, EPS, act)
                                inputs = (xi, wi, bi) if x_grad else (wi, bi)
                                grads = torch.autograd.grad(y, inputs, gy)
                                if x_grad:
                                    check("autograd", (True, True, True), *grads)
                                else:
                                    check("autograd", (False, True, True), torch.empty(0), *grads)

    # which kernels ran (small tensor, so the one-launch kernel applies whenever it is on)
    sel_shape = (8, 32, 7, 7)
    selection = {
        "train_all": backward_kernels(sel_shape, torch.float32, layout, True, (True, True, True)),
        "eval_all": backward_kernels(sel_shape, torch.float32, layout, False, (True, True, True)),
        "train_params_only": backward_kernels(sel_shape, torch.float32, layout, True, (False, True, True)),
        "eval_input_only": backward_kernels(sel_shape, torch.float32, layout, False, (True, False, False)),
        "train_all_half": backward_kernels(sel_shape, torch.float16, layout, True, (True, True, True)),
        # without ReLU: the channels-last 16-bit cases bn_bwd_tile_nhwc takes
        "train_none_half": backward_kernels(sel_shape, torch.float16, layout, True, (True, True, True), "none"),
        "eval_none_bf16": backward_kernels(sel_shape, torch.bfloat16, layout, False, (True, True, True), "none"),
        "train_none_half_input_only": backward_kernels(sel_shape, torch.float16, layout, True, (True, False, False),
                                                       "none"),
        "train_none_half_params_only": backward_kernels(sel_shape, torch.float16, layout, True, (False, True, True),
                                                        "none"),
    }
    print(json.dumps({"records": records, "selection": selection}))
    """
)

_AUTO_CHILD = _COMMON + textwrap.dedent(
    """
    out = {}
    for layout in ("nchw", "channels_last"):
        # exactly the limit of float32 input (one-launch: 16 MiB contiguous, 32 MiB channels-last),
        # one image more (multi-kernel), and ResNet-50's 14x14 BatchNorm at batch 64 in float16
        # (6.4 MB, one-launch)
        n = 64 if layout == "nchw" else 128
        for shape, dtype in (((n, 256, 16, 16), torch.float32), ((n + 1, 256, 16, 16), torch.float32),
                             ((64, 256, 14, 14), torch.float16)):
            key = f"{layout} {list(shape)} {str(dtype).replace('torch.', '')}"
            out[key] = backward_kernels(shape, dtype, layout, True, (True, True, True))
    # without ReLU, channels-last 16-bit: bn_bwd_tile_nhwc wherever a resident grid holds every row
    # in registers (ResNet-50's 14x14 and 7x7 BatchNorms at batch 64); rows beyond the registers
    # in shared memory (the stash variant): the 6.4M-element float16 / bfloat16 tensors
    # (ResNet-50's (64,128,28,28) and (64,512,14,14), Conv+BN+ReLU's (32,64,56,56) block); past
    # that (25.7 MB) the streamed variant
    for shape, dtype in (((64, 256, 14, 14), torch.float16), ((64, 512, 7, 7), torch.bfloat16),
                         ((64, 256, 28, 28), torch.float16), ((32, 64, 56, 56), torch.float16),
                         ((64, 128, 28, 28), torch.bfloat16), ((64, 512, 14, 14), torch.float16)):
        key = f"channels_last {list(shape)} {str(dtype).replace('torch.', '')} none"
        out[key] = backward_kernels(shape, dtype, "channels_last", True, (True, True, True), "none")
    print(json.dumps(out))
    """
)

# (atol relative to the largest reference value, at least 1) per input dtype
TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 1.5e-2}


def _run_child(ops, code, args, env_value, singleread=None, extra=None, tile=None):
    env = dict(os.environ)
    for name in ("CUDADOCTOR_OPS_BN_FUSED_BWD", "CUDADOCTOR_OPS_BN_SINGLEREAD",
                 "CUDADOCTOR_OPS_BN_BWD_NR", "CUDADOCTOR_OPS_BN_FIN_BLOCK", "CUDADOCTOR_OPS_BN_BWD_TILE",
                 "CUDADOCTOR_OPS_BN_BWD_TILE_STASH", "CUDADOCTOR_OPS_BN_BWD_TILE_CT",
                 "CUDADOCTOR_OPS_BN_BWD_STREAM", "CUDADOCTOR_OPS_BN_BWD_STREAM_SPLITS",
                 "CUDADOCTOR_OPS_BN_BWD_GROUPS"):
        env.pop(name, None)
    env.update(extra or {})
    if tile is not None:
        env["CUDADOCTOR_OPS_BN_BWD_TILE"] = tile
    if env_value is not None:
        env["CUDADOCTOR_OPS_BN_FUSED_BWD"] = env_value
    if singleread is not None:
        env["CUDADOCTOR_OPS_BN_SINGLEREAD"] = singleread
    # the child imports the same cudadoctor_ops as this process (an in-place build in opsrc/ too)
    root = str(pathlib.Path(ops.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_OLD_NHWC = {"CUDADOCTOR_OPS_BN_BWD_NR": "0", "CUDADOCTOR_OPS_BN_FIN_BLOCK": "0"}


@pytest.mark.parametrize("layout,fused,singleread,extra,tile", [
    ("nchw", "0", "0", None, "0"), ("nchw", "1", "0", None, "0"), ("channels_last", "0", None, None, "0"),
    ("channels_last", "1", None, None, "0"), ("nchw", "0", "1", None, "0"),
    ("channels_last", "0", None, _OLD_NHWC, "0"), ("channels_last", None, None, None, None),
], ids=["nchw-0-0", "nchw-1-0", "channels_last-0", "channels_last-1", "nchw-0-1", "channels_last-0-nr0-fin0",
        "channels_last-tile"])
def test_backward_vs_float64_with_and_without_the_one_launch_kernel(ops, layout, fused, singleread, extra, tile):
    """grad_input / grad_weight / grad_bias of every output_mask combination (through the op and
    through autograd, weight/bias-only included), training and eval, with and without ReLU and
    affine parameters, float32 / float16 / bfloat16, against float64 torch. With
    CUDADOCTOR_OPS_BN_SINGLEREAD=1 the contiguous cases with small channels run
    bn_bwd_singleread_nchw (one block per channel in shared memory) instead. Channels-last
    multi-kernel runs without ReLU take the reduce / apply kernels built without the ReLU test and
    the block-per-channel finalize; CUDADOCTOR_OPS_BN_BWD_NR=0 and _FIN_BLOCK=0 the earlier ones.
    Every case but the last runs with CUDADOCTOR_OPS_BN_BWD_TILE=0; the last with every switch
    unset, where the channels-last float16 / bfloat16 backward without ReLU (grad_input and a
    reduction wanted) takes bn_bwd_tile_nhwc: 5 of the 6 shapes (C = 13 is not a multiple of 8),
    ResNet-50's (64, 256, 14, 14) included."""
    res = _run_child(ops, _CHILD, [layout], fused, singleread, extra, tile)
    records = res["records"]
    # 6 shapes x 3 dtypes x 2 modes x 2 activations: 7 masks with and without affine + 2 autograd
    assert len(records) == 6 * 3 * 2 * 2 * (7 * 2 + 2)
    bad = []
    for r in records:
        tol = TOL[r["dtype"]]
        for k in ("dx", "gw", "gb"):
            if r[k] is not None and not r[k] <= tol:  # also catches NaN
                bad.append(f"{k} err {r[k]:.2e} > {tol:.0e}: {r}")
        if not (r["layout_ok"] and r["shape_ok"] and r["absent_empty"]):
            bad.append(f"layout/shape/empty outputs wrong: {r}")
    assert not bad, f"{len(bad)} failures, first ones:\n" + "\n".join(bad[:20])

    sel = res["selection"]
    if any(isinstance(v, str) for v in sel.values()):
        warnings.warn(f"kernel selection not checked: {sel}")
        return
    one = "bn_bwd_fused_nhwc" if layout == "channels_last" else "bn_bwd_fused_nchw"
    tile_keys = ("train_none_half", "eval_none_bf16")
    if tile is None:  # everything at its default
        for key in tile_keys:
            assert sel[key] == ["bn_bwd_tile_nhwc"], (key, sel)
        # ReLU recomputed from x, or no grad_input: not the tile kernel
        for key in ("train_all", "eval_all", "train_all_half", "train_none_half_params_only"):
            assert "bn_bwd_tile_nhwc" not in sel[key], (key, sel)
        assert sel["train_all_half"] == [one], sel
        assert sel["train_none_half_input_only"] == ["bn_bwd_tile_nhwc"], sel
        return
    assert not any("bn_bwd_tile_nhwc" in v for v in sel.values()), sel
    for key in ("train_all", "eval_all", "train_all_half") + tile_keys:
        if singleread == "1":
            assert sel[key] == ["bn_bwd_singleread_nchw"], (key, sel)
        elif fused == "1":
            assert sel[key] == [one], (key, sel)
        else:
            assert not any("fused" in k for k in sel[key]) and any("reduce" in k for k in sel[key]), (key, sel)
    # no grad_input, or no reduction: never the one-launch kernel
    for key in ("train_params_only", "eval_input_only"):
        assert not any("fused" in k for k in sel[key]), (key, sel)
    assert not any("reduce" in k for k in sel["eval_input_only"]), sel


def test_one_launch_backward_size_limit(ops):
    """With CUDADOCTOR_OPS_BN_FUSED_BWD unset the one-launch backward runs up to 16 MiB of
    contiguous input and 32 MiB of channels-last input (without ReLU, 16-bit channels-last input
    takes bn_bwd_tile_nhwc first: with its rows in registers, in registers and shared memory, or,
    past that and up to 128 MiB, with the rest streamed);
    contiguous inputs whose channel (x plus grad_out) fits 112 KiB, with at least one channel per
    SM, run the single-read kernel instead."""
    sel = _run_child(ops, _AUTO_CHILD, [], None)
    if any(isinstance(v, str) for v in sel.values()):
        pytest.skip(f"kernel names not available: {sel}")
    for key, names in sel.items():
        layout = key.split()[0]
        one = "bn_bwd_fused_nhwc" if layout == "channels_last" else "bn_bwd_fused_nchw"
        if key.endswith(" none"):
            if "[64, 256, 28, 28]" in key:
                # 12.8M elements: past the stash, so the streamed variant
                want = ["bn_bwd_tile_nhwc", "bn_bwd_tile_nhwc+stream"]
            elif any(s in key for s in ("[32, 64, 56, 56]", "[64, 128, 28, 28]", "[64, 512, 14, 14]")):
                # the stash fits these on a GPU of 132 SMs (an H200); elsewhere either tile variant
                want = ["bn_bwd_tile_nhwc", "bn_bwd_tile_nhwc+stash"]
                if torch.cuda.get_device_properties(0).multi_processor_count != 132 and "bn_bwd_tile_nhwc" in names:
                    want = names
            else:
                want = ["bn_bwd_tile_nhwc"]
            assert names == want, (key, names)
        elif layout == "nchw" and "[64, 256, 14, 14]" in key and torch.cuda.get_device_properties(0).multi_processor_count <= 256:
            assert names == ["bn_bwd_singleread_nchw"], (key, names)
        elif "[65, 256, 16, 16]" in key or "[129, 256, 16, 16]" in key:
            assert one not in names and any("reduce" in k for k in names), (key, names)
        else:
            assert names == [one], (key, names)


_STASH_CHILD = _COMMON + textwrap.dedent(
    """
    # channels-last 16-bit tensors whose rows a resident grid cannot hold in registers alone: on
    # an H200, bn_bwd_tile_nhwc keeps the rest in shared memory. (32,64,56,56): one tile of 64 over
    # 256 splits, 5 rows in shared memory; (16,96,56,56): tiles of 32 (or, with
    # CUDADOCTOR_OPS_BN_BWD_TILE_CT=64, a half-idle second tile of 64); (17,40,61,67): an odd row
    # count, a second tile with one pack, 1 row in shared memory for only part of the threads
    SHAPES = [(32, 64, 56, 56), (16, 96, 56, 56), (17, 40, 61, 67)]
    records = []
    seed = 100
    for shape in SHAPES:
        c = shape[1]
        for dtype in (torch.float16, torch.bfloat16):
            seed += 1
            x, gy, w, b, rm, rv = make_inputs(shape, dtype, torch.channels_last, seed)
            for training in (True, False):
                x64 = x.double().requires_grad_(True)
                w64 = w.double().requires_grad_(True)
                b64 = b.double().requires_grad_(True)
                y64 = F.batch_norm(x64, rm.double(), rv.double(), w64, b64, training, 0.1, EPS)
                rx, rw, rb = torch.autograd.grad(y64, (x64, w64, b64), gy.double())
                # grad_input's rounding error scales with A * |g| (A = weight * invstd), as above
                var64 = x64.detach().var((0, 2, 3), unbiased=False) if training else rv.double()
                a64 = w.double().abs() * (var64 + EPS).rsqrt()
                dx_scale = max(1.0, (a64.max() * gy.double().abs().max()).item())
                _, sm, si, rs = OPS.batch_norm(x, w, b, rm, rv, training, EPS, "none")
                for mask in ((True, True, True), (True, False, False)):
                    run = lambda: OPS.batch_norm_backward(gy, x, w, b, sm, si, rs, training, "none", list(mask))
                    dx, gw, gb = run()
                    r = dict(shape=list(shape), dtype=str(dtype)[6:], training=training, mask=list(mask))
                    r["dx"] = ((dx.double() - rx).abs().max() / dx_scale).item()
                    r["gw"] = ((gw.double() - rw).abs().max() / rw.abs().max().clamp_min(1)).item() if mask[1] else None
                    r["gb"] = ((gb.double() - rb).abs().max() / rb.abs().max().clamp_min(1)).item() if mask[2] else None
                    r["cl"] = dx.is_contiguous(memory_format=torch.channels_last)
                    # run twice: every block of a tile must compute the same coefficients
                    r["repeat_equal"] = bool(torch.equal(run()[0], dx))
                    r["kernels"] = kernels(run)
                    records.append(r)
            del x, gy
    print(json.dumps({"records": records, "sms": torch.cuda.get_device_properties(0).multi_processor_count}))
    """
)


@pytest.mark.parametrize("extra", [None, {"CUDADOCTOR_OPS_BN_BWD_TILE_CT": "64"}, {"CUDADOCTOR_OPS_BN_BWD_GROUPS": "0"}],
                         ids=["default", "ct64", "groups0"])
def test_tile_backward_stash_vs_float64(ops, extra):
    """bn_bwd_tile_nhwc with rows in shared memory (the 6.4M-element channels-last float16 /
    bfloat16 backward without ReLU, with and without the parameter gradients, training and eval)
    against float64 torch: grad_input, grad_weight, grad_bias, channels-last output, and the same
    grad_input from a second call. On an H200 (132 SMs) every one of these that needs a reduction
    runs the stash variant, with the default tile widths and with tiles of 64 forced; by default
    over group partials (bwd_group_partial: (32,64,56,56) has 256 splits, 16 groups),
    with CUDADOCTOR_OPS_BN_BWD_GROUPS=0 without them."""
    res = _run_child(ops, _STASH_CHILD, [], None, extra=extra)
    _check_tile_records(res, "bn_bwd_tile_nhwc+stash", res["sms"] == 132)


def _check_tile_records(res, variant, check_kernels):
    """The records of _STASH_CHILD's loop (3 shapes x 2 dtypes x training / eval x 2 output
    masks): errors within tolerance, channels-last grad_input, repeatable, and with check_kernels
    every call that needs a reduction on bn_bwd_tile_nhwc's `variant` (eval grad_input alone on
    the apply kernel, no reduction)."""
    records = res["records"]
    assert len(records) == 3 * 2 * 2 * 2
    bad = []
    for r in records:
        tol = TOL[r["dtype"]]
        for k in ("dx", "gw", "gb"):
            if r[k] is not None and not r[k] <= tol:
                bad.append(f"{k} err {r[k]:.2e} > {tol:.0e}: {r}")
        if not (r["cl"] and r["repeat_equal"]):
            bad.append(f"layout or repeatability: {r}")
        if check_kernels and isinstance(r["kernels"], list):
            # eval without parameter gradients needs no reduction: the apply kernel alone
            reduces = r["training"] or r["mask"][1] or r["mask"][2]
            if reduces and r["kernels"] != ["bn_bwd_tile_nhwc", variant]:
                bad.append(f"not {variant}: {r}")
            if not reduces and any("tile" in k or "reduce" in k for k in r["kernels"]):
                bad.append(f"a reduction for eval grad_input alone: {r}")
    assert not bad, f"{len(bad)} failures, first ones:\n" + "\n".join(bad[:20])


# the stash child's loop on tensors small enough for a test, run with the streamed variant forced
# and its splits capped: (8,64,16,16) (2048 rows, one tile of 64, 2 splits: 32 rows per thread, 4
# in registers, 12 in shared memory, 16 streamed), (5,40,23,29) (3335 rows, tiles of 32 with a
# second tile of one pack, or with CUDADOCTOR_OPS_BN_BWD_TILE_CT=64 one half-idle tile; a
# partial last streamed batch) and (3,24,31,37) (3441 rows, C = 24: three packs of a tile of 32)
_STREAM_CHILD = _STASH_CHILD.replace(
    "SHAPES = [(32, 64, 56, 56), (16, 96, 56, 56), (17, 40, 61, 67)]",
    "SHAPES = [(8, 64, 16, 16), (5, 40, 23, 29), (3, 24, 31, 37)]",
)


@pytest.mark.parametrize("splits,extra", [("2", None), ("3", {"CUDADOCTOR_OPS_BN_BWD_TILE_CT": "64"}), ("1", None)],
                         ids=["2-default", "3-ct64", "1-default"])
def test_tile_backward_streamed_rows_vs_float64(ops, splits, extra):
    """bn_bwd_tile_nhwc's streamed variant (CUDADOCTOR_OPS_BN_BWD_STREAM=1, its splits capped by
    _STREAM_SPLITS so that small tensors have rows beyond its registers and shared memory):
    channels-last float16 / bfloat16 backward without ReLU, with and without the parameter
    gradients, training and eval, against float64 torch, channels-last output, the same grad_input
    from a second call, and every call that needs a reduction on the streamed kernel; with
    CUDADOCTOR_OPS_BN_BWD_GROUPS=1, the 2 or 3 splits' partials in one group partial."""
    env = {"CUDADOCTOR_OPS_BN_BWD_STREAM": "1", "CUDADOCTOR_OPS_BN_BWD_STREAM_SPLITS": splits,
           "CUDADOCTOR_OPS_BN_BWD_GROUPS": "1"}
    env.update(extra or {})
    assert "SHAPES = [(8, 64, 16, 16)" in _STREAM_CHILD
    res = _run_child(ops, _STREAM_CHILD, [], None, extra=env)
    _check_tile_records(res, "bn_bwd_tile_nhwc+stream", True)

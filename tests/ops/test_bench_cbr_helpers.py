"""Pure helpers of cudadoctor_ops.bench_cbr: round order, median/range, targets, the table and the
ResNet-50 line, and graph_ms's failure path. These run without a GPU and without the compiled
extension (the module is loaded from its file; its package imports are inside functions).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import sys

import pytest

torch = pytest.importorskip("torch")

PATH = pathlib.Path(__file__).resolve().parents[2] / "opsrc" / "cudadoctor_ops" / "bench_cbr.py"


@pytest.fixture(scope="module")
def bc():
    spec = importlib.util.spec_from_file_location("bench_cbr_under_test", PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_round_orders_alternate_and_cover_both(bc):
    orders = bc._round_orders(5)
    assert orders == [("eager", "fused"), ("fused", "eager")] * 2 + [("eager", "fused")]
    assert all(sorted(o) == ["eager", "fused"] for o in orders)
    assert bc._round_orders(0) == [("eager", "fused")]


def test_median_range(bc):
    assert bc._median_range([3.0, 1.0, 2.0]) == (2.0, [1.0, 3.0])
    assert bc._median_range([4, 1, 2, 3]) == (2.5, [1.0, 4.0])
    assert bc._median_range([7]) == (7.0, [7.0, 7.0])


def test_graph_kinds_have_the_target_of_their_kind(bc):
    for kind in ("train fwd", "fwd+bwd", "eval fwd"):
        assert kind + bc.GRAPH in bc.KINDS
        assert bc._target(kind + bc.GRAPH) == bc.TARGETS[kind]
        assert bc.KINDS.index(kind + bc.GRAPH) == bc.KINDS.index(kind) + 1
    assert bc._target("eval fwd epilogue") is None


def _case(with_graph: bool) -> dict:
    r = {
        "shape": (32, 64, 56, 56), "k": 64, "stride": 1, "dtype": "fp16", "layout": "nhwc",
        "max_rel_err": 1e-3, "conv_fwd_ms": 0.1, "conv_bwd_ms": 0.2,
        "train fwd": (0.10, 0.15), "fwd+bwd": (0.30, 0.39), "eval fwd": (0.05, 0.08),
        "eval fwd epilogue": (0.06, 0.08), "eval_variant": "cudnn",
        "saved_bytes": {"ours": 2**20, "eager": 2**21, "ours_peak": 2**21, "eager_peak": 2**22},
    }
    if with_graph:
        r["train fwd (graph)"] = (0.08, 0.12)
        r["fwd+bwd (graph)"] = (0.25, 0.36)
        r["graph_error"] = {"eval fwd ours": "RuntimeError: capture failed"}
    return r


def _resnet() -> dict:
    return {
        "fused_chains": 16, "images_per_s_eager": 2680.0, "images_per_s_fused": 3131.0,
        "images_per_s_eager_range": [2547.0, 2700.0], "images_per_s_fused_range": [3050.0, 3200.0],
        "images_per_s_eager_rounds": [2547.0, 2680.0, 2700.0, 2690.0, 2600.0],
        "images_per_s_fused_rounds": [3050.0, 3131.0, 3200.0, 3140.0, 3100.0],
        "rounds": 5, "speedup": 3131.0 / 2680.0, "losses_eager": [6.9, 6.8], "losses_fused": [6.9, 6.8],
        "max_rel_loss_diff": 1e-3,
    }


def test_fmt_rows_with_and_without_graph_timings(bc):
    text = bc._fmt([_case(True), _case(False)], _resnet(), header=False)
    lines = text.splitlines()
    graph_rows = [ln for ln in lines if "(graph)" in ln and "failed" not in ln]
    assert len(graph_rows) == 2  # train fwd and fwd+bwd of the first case; eval did not capture
    train_g = next(ln for ln in graph_rows if "train fwd (graph)" in ln)
    assert "1.50x" in train_g and ">=1.3x" in train_g and "yes" in train_g
    fb_g = next(ln for ln in graph_rows if "fwd+bwd (graph)" in ln)
    assert "1.44x" in fb_g and ">=1.2x" in fb_g
    # the graph row follows its kind's row
    kinds = [re.split(r"\s{2,}", ln)[3] if ln.count("  ") >= 3 else "" for ln in lines]
    i = kinds.index("train fwd")
    assert kinds[i + 1] == "train fwd (graph)"
    j = kinds.index("fwd+bwd")
    assert kinds[j + 1] == "fwd+bwd (graph)"
    assert any("graph capture of eval fwd ours failed: RuntimeError: capture failed" in ln for ln in lines)
    assert sum("eval fwd [cudnn]" in ln and "(graph)" not in ln for ln in lines) == 2


def test_fmt_eval_graph_row_keeps_variant(bc):
    r = _case(False)
    r["eval fwd (graph)"] = (0.04, 0.07)
    text = bc._fmt([r], {}, header=False)
    assert "eval fwd [cudnn] (graph)" in text


def test_resnet_line(bc):
    line = bc._fmt_resnet(_resnet())
    assert "3131 img/s fused (3050-3200) vs 2680 (2547-2700) eager, 1.17x median of 5 interleaved rounds" in line
    text = bc._fmt([], _resnet(), header=False)
    assert line in text
    assert "ResNet-50: no torchvision" in bc._fmt([], {"skipped": "no torchvision"}, header=False)


def test_resnet_line_with_batch_and_step_times(bc):
    r = _resnet()
    r["batch"] = 128
    r["step_ms"] = {"eager": {"host_ms": 25.7, "gpu_ms": 29.4}, "fused": {"host_ms": 22.7, "gpu_ms": 25.8}}
    line = bc._fmt_resnet(r)
    assert line.startswith("ResNet-50 bs128 ")
    assert "one step, host / GPU ms: eager 25.7 / 29.4, fused 22.7 / 25.8 (eager GPU-bound; GPU time 1.14x)" in line
    r["step_ms"]["eager"]["host_ms"] = 30.0
    assert "(eager host-bound;" in bc._fmt_resnet(r)
    r["fused_tails"] = 16
    assert "16 chains + 16 block tails fused;" in bc._fmt_resnet(r)
    # without step times (older results): the line ends with the loss check
    assert bc._fmt_resnet(_resnet()).endswith("steps 1.00e-03")
    assert "bs64" in bc._fmt_resnet(_resnet())


def test_fmt_takes_one_resnet_result_or_a_list(bc):
    one, two = _resnet(), dict(_resnet(), batch=128)
    text = bc._fmt([], [one, two], header=False)
    assert text.count("ResNet-50 bs") == 2 and "ResNet-50 bs128" in text
    assert bc._fmt([], one, header=False).count("ResNet-50 bs") == 1
    assert "ResNet-50" not in bc._fmt([], [], header=False)
    assert bc._resnet_list({}) == [] and bc._resnet_list(None) == []


def test_batch_list_argument(bc):
    import argparse

    assert bc._batch_list("64,128") == [64, 128]
    assert bc._batch_list("256") == [256]
    for bad in ("", "0", "-4", "64,x", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="positive batch sizes"):
            bc._batch_list(bad)


def test_results_serialise(bc):
    r = _case(True)
    r["eval fwd (graph)"] = None
    doc = json.loads(json.dumps({"cases": [r], "resnet50": _resnet()}, default=list))
    assert doc["cases"][0]["train fwd (graph)"] == [0.08, 0.12]


def test_graph_ms_reports_failure_instead_of_raising(bc):
    def broken():
        raise RuntimeError("boom")

    errors: list = []
    assert bc.graph_ms(lambda fn: 1.0, broken, errors) is None
    # tried twice (the default), each failure reported with its attempt
    assert [e.split(":")[0] for e in errors] == ["attempt 1", "attempt 2"]
    assert all("RuntimeError" in e and "boom" in e for e in errors) or not torch.cuda.is_available()
    errors.clear()
    assert bc.graph_ms(lambda fn: 1.0, broken, errors, attempts=1) is None
    assert len(errors) == 1
    assert bc.graph_ms(lambda fn: 1.0, broken) is None  # no error list: still no exception


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_ms_retries_a_failed_capture_on_the_given_stream(bc):
    x = torch.ones(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    seen = []

    def fn():
        seen.append((torch.cuda.current_stream() == side, torch.cuda.is_current_stream_capturing()))
        if len(seen) == 4:  # the first attempt's capture
            raise RuntimeError("first capture fails")
        x.add_(1.0)

    errors: list = []
    assert bc.graph_ms(lambda f: (f(), torch.cuda.synchronize(), 0.25)[2], fn, errors, stream=side) == 0.25
    assert len(errors) == 1 and "first capture fails" in errors[0]
    # every call ran on the given stream; calls 4 and 8 were the two captures
    assert all(on_side for on_side, _ in seen) and [c for _, c in seen] == [False] * 3 + [True] + [False] * 3 + [True]
    assert torch.all(x == 8.0).item()  # 3 + 3 warm-up calls and the timer's one replay


def test_graph_pair_reports_only_final_capture_failures(bc, monkeypatch):
    # graph_ms stand-in: "ours" failed once and then worked; "eager" failed on both attempts
    def fake_graph_ms(timer, fn, errors=None, stream=None, attempts=2):
        if fn == "ours":
            errors.append("attempt 1: RuntimeError: transient")
            return 0.5
        errors += ["attempt 1: RuntimeError: first", "attempt 2: RuntimeError: last"]
        return None

    monkeypatch.setattr(bc, "graph_ms", fake_graph_ms)
    res: dict = {}
    bc.graph_pair_into(res, "train fwd", None, "ours", "eager")
    assert res["graph_error"] == {"train fwd eager": "attempt 2: RuntimeError: last"}
    assert "train fwd (graph)" not in res  # one side missing: no ratio row
    monkeypatch.setattr(bc, "graph_ms", lambda timer, fn, errors=None, **kw: {"ours": 0.5, "eager": 0.75}[fn])
    res = {}
    bc.graph_pair_into(res, "fwd+bwd", None, "ours", "eager")
    assert res == {"fwd+bwd (graph)": (0.5, 0.75)}


def test_pair_ms_times_both_sides_symmetrically(bc, monkeypatch):
    # the shared bench's Timer (its pair(): ours, eager, eager, ours, each side's lower time kept),
    # with the timing of one function replaced by a script
    spec = importlib.util.spec_from_file_location("bench_under_test", PATH.parent / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    order = []
    times = {"ours": iter([2.0, 1.5]), "eager": iter([3.0, 3.5])}

    class Timer(bench.Timer):
        def __call__(self, fn):
            order.append(fn)
            return next(times[fn])

    assert bc.pair_ms(Timer(), "ours", "eager") == (1.5, 3.0)
    assert order == ["ours", "eager", "eager", "ours"]
    # a plain timer function: each side once, ours first
    seen = []
    assert bc.pair_ms(lambda fn: seen.append(fn) or {"ours": 1.0, "eager": 2.0}[fn], "ours", "eager") == (1.0, 2.0)
    assert seen == ["ours", "eager"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_ms_times_a_replay(bc):
    x = torch.ones(1 << 20, device="cuda")
    calls = []

    def timer(fn):
        fn()
        torch.cuda.synchronize()
        calls.append(fn)
        return 0.5

    assert bc.graph_ms(timer, lambda: x.mul_(2.0)) == 0.5
    assert len(calls) == 1
    # 3 warm-up calls on the side stream and one replay by the timer; the capture itself runs nothing
    assert torch.all(x == 16.0).item()

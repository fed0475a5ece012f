"""cudadoctor_ops.bench without a GPU: its arguments (--graph included), the exit status when no
GPU is visible, and the table with CUDA-graph rows next to the host-inclusive ones. The module is
loaded from its file (no compiled extension needed)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

PATH = pathlib.Path(__file__).resolve().parents[2] / "opsrc" / "cudadoctor_ops" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_under_test", PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, main() would run the benchmarks")
def test_no_gpu_exits_2_with_a_reason(bench, capsys):
    assert bench.main(["batch_norm", "--graph", "--quick"]) == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err


def test_unknown_flag_is_refused(bench):
    with pytest.raises(SystemExit) as exc:
        bench.main(["batch_norm", "--no-such-flag"])
    assert exc.value.code == 2


def test_graph_rows_carry_their_own_verdict(bench, monkeypatch):
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "TEST GPU")
    host = bench.Row("batch_norm", "backward", (64, 512, 7, 7), "fp16", "nhwc", 0.10, 0.08, 5 << 20).finish(4.0)
    graph = bench.Row("batch_norm", "backward (graph)", (64, 512, 7, 7), "fp16", "nhwc", 0.02, 0.03,
                      5 << 20).finish(4.0)
    assert not host.ok and graph.ok  # 0.8x vs 1.5x against the default 0.95x target
    text = bench.render([host, graph], 4.0, "test timer")
    lines = [ln for ln in text.splitlines() if ln.startswith("batch_norm")]
    assert len(lines) == 2
    assert "backward (graph)" in lines[1] and lines[1].rstrip().endswith("yes")
    assert lines[0].rstrip().endswith("NO")
    assert "1/2 rows meet their target" in text


def test_x_format_names_the_memory_format_of_the_input(bench):
    x = torch.empty(2, 3, 4, 5)
    assert bench.x_format(x) == torch.contiguous_format
    assert bench.x_format(x.contiguous(memory_format=torch.channels_last)) == torch.channels_last
    # one channel: channels_last and contiguous at once, so contiguous
    one = torch.empty(2, 1, 4, 5).contiguous(memory_format=torch.channels_last)
    assert bench.x_format(one) == torch.contiguous_format
    assert bench.x_format(torch.empty(6, 7)) == torch.contiguous_format


@pytest.mark.gpu
def test_graph_bench_runs_every_quick_case_on_a_gpu(ops, tmp_path):
    """`bench batch_norm --quick --graph` on a GPU: exit 0, and a graph row for the training
    forward and the backward of every case. Before the benchmark tensors came from the CPU
    generator, the second case's CUDA random numbers failed after the first case's graph capture
    of torch's BatchNorm ("Offset increment outside graph capture") and the bench ended in a
    traceback."""
    import json
    import os
    import subprocess

    out = tmp_path / "rows.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(ops.__file__).parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "cudadoctor_ops.bench", "batch_norm", "--quick", "--graph", "--rep-ms", "5",
         "--json-out", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    cases = {(tuple(r["shape"]), r["dtype"], r["layout"]) for r in rows}
    assert len(cases) >= 2, cases  # the failure needed a case after a capture
    for case in cases:
        kinds = {r["kind"] for r in rows if (tuple(r["shape"]), r["dtype"], r["layout"]) == case}
        failed = [ln for ln in proc.stderr.splitlines() if "graph capture failed" in ln]
        assert {"train fwd (graph)", "backward (graph)"} <= kinds, (case, kinds, failed)


def test_pair_times_ours_theirs_theirs_ours_and_keeps_each_sides_lower_median(bench):
    calls = []
    medians = {"ours": iter([2.0, 1.5]), "theirs": iter([3.0, 3.5])}

    class ScriptedTimer(bench.Timer):
        def __call__(self, fn):
            side = fn()
            calls.append(side)
            return next(medians[side])

    assert ScriptedTimer().pair(lambda: "ours", lambda: "theirs") == (1.5, 3.0)
    assert calls == ["ours", "theirs", "theirs", "ours"]

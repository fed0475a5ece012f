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

"""The torch child probe against fake torch packages that raise, segfault or hang on import."""

import json
import os
import sys
import time

import pytest
from fakes.runner import recorded
from fakes.trees import FAKES

from cudadoctor.probes.torch_probe import MARK, TORCH_TAG, interpret, run_child
from cudadoctor.runner import Result, Runner


def _probe(env_extra, timeout=20.0, python=sys.executable):
    env = dict(os.environ, **env_extra)
    res = run_child(Runner(), python, env, timeout)
    return interpret(res, python, timeout)


def test_torch_that_raises_on_import():
    t0 = time.monotonic()
    py, torch = _probe({"PYTHONPATH": str(FAKES / "torch_raises")})
    assert time.monotonic() - t0 < 15
    assert torch["import_error"] == "libcudnn.so.9: cannot open shared object file: No such file or directory (fake torch)"
    assert torch["import_error_type"] == "ImportError"
    assert torch["version"] is None
    assert torch["path"] == str(FAKES / "torch_raises" / "torch")
    assert py["version"] == "%d.%d.%d" % sys.version_info[:3]


def test_torch_that_segfaults_on_import():
    t0 = time.monotonic()
    py, torch = _probe({"PYTHONPATH": str(FAKES / "torch_segfault")})
    assert time.monotonic() - t0 < 15
    assert "killed by signal 11" in torch["import_error"]
    assert torch["import_error"].endswith("while importing torch")
    assert py["executable"]  # what ran before the crash is kept


def test_torch_that_hangs_on_import_is_bounded():
    t0 = time.monotonic()
    _, torch = _probe({"PYTHONPATH": str(FAKES / "torch_hang")}, timeout=3)
    elapsed = time.monotonic() - t0
    assert elapsed < 3 + 4, elapsed  # timeout plus kill and drain
    assert torch["import_error"] == "timed out after 3s while importing torch"


def test_torch_not_installed(tmp_path):
    # an interpreter that sees no site-packages: the same Python started with -S
    fake_python = tmp_path / "python"
    fake_python.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    fake_python.chmod(0o755)
    py, torch = _probe({"PYTHONPATH": ""}, python=str(fake_python))
    assert torch["import_error"] == "No module named 'torch'"
    assert torch["version"] is None
    assert py["version"]


def test_interpreter_missing():
    py, torch = _probe({}, python="/nonexistent/python3")
    assert torch["version"] is None
    assert "not found" in torch["import_error"]
    assert "error" in torch
    assert py["executable"] == "/nonexistent/python3"


def _line(stage, torch, **extra):
    return MARK + json.dumps({"stage": stage, "python": {"version": "3.11.9", "executable": "/usr/bin/python3"},
                              "torch": torch, **extra})


GPU_TORCH = {"version": "2.5.1+cu121", "cuda": "12.1", "arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
             "cxx11_abi": False, "cudnn": "9.1.0", "cuda_available": True, "device_error": None, "import_error": None,
             "probe_mode": "full", "devices": [{"index": 0, "name": "NVIDIA GeForce RTX 5090", "cc": "12.0"}]}


def test_interpret_recorded_cpu_host():
    text = recorded("torch-child-cpu-host-torch2.14.1-cu130.txt")
    py, torch = interpret(Result(("python3", "-c", "...", "auto", TORCH_TAG), 0, text, ""), "python3", 20)
    assert torch["version"] == "2.14.1+cu130"
    assert torch["cuda"] == "13.0"
    assert "sm_90" in torch["arch_list"]
    assert torch["cxx11_abi"] is True
    assert torch["import_error"] is None and torch["device_error"] is None
    assert torch["probe_stage"] == "done"
    assert py["version"] == "3.11.7"


def test_interpret_crash_during_kernel_launch():
    out = "\n".join([_line("import", dict(GPU_TORCH)), _line("launch", dict(GPU_TORCH))]) + "\n"
    res = Result(("python3",), -11, out, "", error="python3: killed by signal 11")
    _, torch = interpret(res, "python3", 20)
    assert torch["import_error"] is None
    assert torch["device_error"] == "killed by signal 11 (SIGSEGV) while launching a kernel"


def test_interpret_device_error_text_kept_verbatim():
    t = dict(GPU_TORCH, device_error="CUDA error: no kernel image is available for execution on the device\n"
                                     "CUDA kernel errors might be asynchronously reported at some other API call")
    _, torch = interpret(Result(("python3",), 0, _line("done", t) + "\n", ""), "python3", 20)
    assert torch["device_error"].startswith("CUDA error: no kernel image is available")


def test_interpret_garbage_output():
    _, torch = interpret(Result(("python3",), 1, "Segmentation fault\n" + MARK + "{not json", "boom"), "python3", 20)
    assert torch["version"] is None
    assert "status 1" in torch["import_error"]


@pytest.mark.parametrize("stdout", ["", "random text\n", MARK + "[]\n"])
def test_interpret_never_raises(stdout):
    _, torch = interpret(Result(("python3",), None, stdout, "", error="python3: timed out after 20s"), "python3", 20)
    assert torch["import_error"].startswith("timed out after 20s")


def test_full_probe_records_launch_error_verbatim():
    """Core load finds a device, so the child imports torch for real and launches a kernel."""
    _, torch = _probe({"PYTHONPATH": str(FAKES / "torch_no_kernel_image")})
    assert torch["probe_mode"] == "full"
    assert torch["version"] == "2.3.1+cu121" and torch["cuda"] == "12.1"
    assert torch["arch_list"][-1] == "sm_90"
    assert torch["cxx11_abi"] is False
    assert torch["cudnn"] == "9.1.0"
    assert torch["cuda_available"] is True
    assert torch["devices"][0]["name"] == "NVIDIA GeForce RTX 5090" and torch["devices"][0]["cc"] == "12.0"
    assert torch["device_error"].startswith("CUDA error: no kernel image is available for execution on the device\n")
    assert torch["import_error"] is None
    assert any("sm_120 is not compatible" in w for w in torch["warnings"])


def test_full_probe_segfault_during_launch():
    t0 = time.monotonic()
    _, torch = _probe({"PYTHONPATH": str(FAKES / "torch_no_kernel_image"), "FAKE_TORCH_LAUNCH": "segfault"})
    assert time.monotonic() - t0 < 15
    assert torch["import_error"] is None
    assert torch["version"] == "2.3.1+cu121"
    assert torch["device_error"] == "killed by signal 11 (SIGSEGV) while launching a kernel"


def test_child_reports_the_interpreters_python_h(tmp_path):
    """The probed interpreter's include folder and whether Python.h is in it: this one has its headers;
    an interpreter whose sysconfig include folder lacks Python.h (a distribution Python without its -dev
    package; faked here with a sitecustomize) is reported as such."""
    import sysconfig

    py, _ = _probe({})
    assert py["include_dir"] == sysconfig.get_paths()["include"]
    assert py["has_python_h"] is os.path.isfile(os.path.join(py["include_dir"], "Python.h")) is True
    empty = tmp_path / "include"
    empty.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sysconfig\n_real = sysconfig.get_paths\n"
        f"sysconfig.get_paths = lambda *a, **k: dict(_real(*a, **k), include={str(empty)!r})\n")
    py, _ = _probe({"PYTHONPATH": str(site)})
    assert py["include_dir"] == str(empty) and py["has_python_h"] is False


def test_collect_facts_carries_the_python_h_fact():
    from cudadoctor.probes import collect_facts

    py = collect_facts()["python"]
    assert py["has_python_h"] is True and py["include_dir"].endswith(f"python{sys.version_info[0]}.{sys.version_info[1]}")


def test_glibcxx_max_reads_the_newest_label(tmp_path):
    from cudadoctor.probes.compiler import glibcxx_max

    lib = tmp_path / "libstdc++.so.6"
    lib.write_bytes(b"\x7fELF\0GLIBCXX_3.4\0GLIBCXX_3.4.9\0GLIBCXX_3.4.30\0GLIBCXX_3.4.29\0CXXABI_1.3.13\0")
    assert glibcxx_max(str(lib)) == "3.4.30"
    script = tmp_path / "libstdc++.so"
    script.write_text("/* GNU ld script */\nINPUT(-lstdc++_real)\n")
    assert glibcxx_max(str(script)) is None and glibcxx_max(str(tmp_path / "nope")) is None
    assert glibcxx_max(None) is None


def test_probe_reports_the_libstdcxx_python_maps_with_torch_loaded():
    pytest.importorskip("torch")
    from cudadoctor.probes import collect_facts

    py = collect_facts(torch_timeout=120)["python"]
    assert os.path.basename(py["libstdcxx"]).startswith("libstdc++.so") and os.path.isfile(py["libstdcxx"])
    assert py["libstdcxx_glibcxx"].startswith("3.4.")

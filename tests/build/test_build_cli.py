"""`cudadoctor build` on the command line, without building: refusals, plans, matrices, daemon errors.
Every refusal here happens before any container starts: DOCKER_HOST points at nothing, so any
attempt to reach a daemon would turn into the exit-2 daemon error instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


FIX = Path(__file__).resolve().parents[1] / "fixtures"
EXT = str(FIX / "ext_min")
NO_DAEMON = "unix:///nonexistent/cudadoctor-test.sock"


def cli(*args: str, env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e["DOCKER_HOST"] = NO_DAEMON
    e.pop("CUDADOCTOR_DEBUG", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "cudadoctor", "build", *args], capture_output=True, text=True,
                          env=e, timeout=timeout)


def assert_paragraph(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("cudadoctor: error: ")


def test_arch_nvcc_cannot_target_refused_before_docker(tmp_path):
    r = cli(EXT, "--arch", "3.5,8.6", "--cuda", "13.0", "--toolkit", "pip", "--out", str(tmp_path))
    assert r.returncode == 1, r.stderr
    assert_paragraph(r)
    assert "cannot compile for sm_35" in r.stderr
    assert "removed in CUDA 12.0" in r.stderr
    assert "Fix: drop 3.5" in r.stderr
    assert "Docker daemon" not in r.stderr  # refused before any daemon was asked
    assert list(tmp_path.iterdir()) == []


def test_unpublished_torch_cuda_pair_refused(tmp_path):
    r = cli(EXT, "--arch", "8.6", "--torch", "2.14.1", "--cuda", "11.8", "--out", str(tmp_path))
    assert r.returncode == 1
    assert_paragraph(r)
    assert "never published for CUDA 11.8" in r.stderr


def test_compiler_nvcc_rejects_refused(tmp_path):
    r = cli(EXT, "--arch", "8.6", "--torch", "9.9", "--cuda", "12.0", "--base-image",
            "nvidia/cuda:12.0.1-devel-ubuntu24.04", "--out", str(tmp_path))
    assert r.returncode == 1
    assert_paragraph(r)
    assert "rejects g++ 13" in r.stderr


def test_no_daemon_is_exit_2_paragraph(tmp_path):
    r = cli(EXT, "--arch", "8.6", "--toolkit", "pip", "--base-image", "cudadoctor/base:bookworm-x",
            "--out", str(tmp_path), "--no-pip-config")
    assert r.returncode == 2, r.stderr
    assert_paragraph(r)
    try:
        import docker  # noqa: F401
    except ImportError:  # machines without the SDK get told how to install it
        assert "needs the `docker` Python package" in r.stderr and "--backend local" in r.stderr
        return
    assert "no Docker daemon answered at " + NO_DAEMON in r.stderr
    assert "DOCKER_HOST" in r.stderr and "dockerd" in r.stderr and "--backend local" in r.stderr


def test_bad_source_and_arguments(tmp_path):
    r = cli(str(tmp_path / "nope"), "--arch", "8.6")
    assert r.returncode == 2 and "is not a folder" in r.stderr
    assert_paragraph(r)
    r = cli(str(tmp_path), "--arch", "8.6")
    assert r.returncode == 2 and "neither setup.py nor pyproject.toml" in r.stderr
    r = cli(EXT)
    assert r.returncode == 2 and "no architectures given" in r.stderr
    r = cli(EXT, "--arch", "8.6,potato")
    assert r.returncode == 2 and "potato" in r.stderr
    assert_paragraph(r)
    r = cli(EXT, "--arch", "8.6", "--backend", "podman")
    assert r.returncode == 2 and "unknown backend" in r.stderr
    r = cli(EXT, "--arch", "8.6", "--ca-bundle", str(tmp_path / "missing.pem"))
    assert r.returncode == 2 and "--ca-bundle" in r.stderr


def test_plan_json(tmp_path):
    r = cli(EXT, "--arch", "8.6,8.9", "--toolkit", "pip", "--plan", "--out", str(tmp_path), "-j", "3")
    assert r.returncode == 0, r.stderr
    plans = json.loads(r.stdout)
    assert plans[0]["target"]["local_label"] == "cu130torch2.14"
    assert plans[0]["env"]["TORCH_CUDA_ARCH_LIST"] == "8.6;8.9"
    assert plans[0]["jobs"] == 3
    assert plans[0]["image"]["tag"].startswith("cudadoctor/build:cu130-torch2.14.1-pip-")


def test_matrix_and_github_matrix(tmp_path):
    m = tmp_path / "targets.toml"
    m.write_text('[defaults]\narch = "8.6,8.9"\n[[target]]\ntorch = "2.14.1"\n[[target]]\ntorch = "2.14.1"\ncuda = "12.6"\n')
    r = cli(EXT, "--matrix", str(m), "--emit-github-matrix")
    assert r.returncode == 0, r.stderr
    gh = json.loads(r.stdout)
    assert [(e["cuda"], e["label"]) for e in gh["include"]] == [("13.0", "cu130torch2.14"), ("12.6", "cu126torch2.14")]
    bad = tmp_path / "bad.toml"
    bad.write_text('[[target]]\ntorch = "2.14.1"\ncuda = "12.1"\narch = "8.6"\n')
    r = cli(EXT, "--matrix", str(bad), "--emit-github-matrix")
    assert r.returncode == 1 and "never published" in r.stderr
    r = cli(EXT, "--matrix", str(tmp_path / "absent.toml"))
    assert r.returncode == 2 and "cannot read the matrix file" in r.stderr

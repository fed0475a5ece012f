"""opsrc/setup.py's choice of build settings for csrc/cudnn_conv_stats.cpp (no compiler runs): where
the cuDNN frontend's headers come from, the cuDNN library, and libnvrtc with a run path relative to
the installed package where the frontend calls NVRTC."""

from __future__ import annotations

import pathlib
import sys

import pytest

SETUP = pathlib.Path(__file__).resolve().parents[2] / "opsrc" / "setup.py"


def _helpers(monkeypatch) -> dict:
    """setup.py's definitions, up to (not including) the module-level calls that build."""
    pytest.importorskip("torch.utils.cpp_extension", reason="setup.py imports torch's build helpers")
    src = SETUP.read_text()
    monkeypatch.chdir(SETUP.parent)  # setup.py changes into its folder; restored after the test
    ns = {"__file__": str(SETUP), "__name__": "opsrc_setup_under_test"}
    exec(compile(src[: src.index("_FE, _FE_WHY = _cudnn_frontend()")], str(SETUP), "exec"), ns)
    return ns


def _touch(path: pathlib.Path) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site-packages with torch's nvidia/cudnn headers and library, first on sys.path."""
    s = tmp_path / "site"
    _touch(s / "nvidia" / "cudnn" / "include" / "cudnn.h")
    _touch(s / "nvidia" / "cudnn" / "lib" / "libcudnn.so.9")
    monkeypatch.setattr(sys, "path", [str(s)] + sys.path)
    monkeypatch.delenv("CUDADOCTOR_OPS_CUDNN_FE", raising=False)
    return s


def test_frontend_headers_from_the_environment_variable(tmp_path, site, monkeypatch):
    ns = _helpers(monkeypatch)
    fe = tmp_path / "frontend" / "include"
    _touch(fe / "cudnn_frontend.h")
    monkeypatch.setenv("CUDNN_FRONTEND_INCLUDE", str(fe))
    settings, why = ns["_cudnn_frontend"]()
    assert settings is not None, why
    assert settings["include_dirs"][:2] == [str(fe), str(site / "nvidia" / "cudnn" / "include")]
    assert settings["libraries"] == [":libcudnn.so.9"] and settings["extra_link_args"] == []
    assert why == f"frontend headers in {fe}"

    monkeypatch.setenv("CUDADOCTOR_OPS_CUDNN_FE", "0")
    assert ns["_cudnn_frontend"]() == (None, "CUDADOCTOR_OPS_CUDNN_FE=0")


def test_a_frontend_calling_nvrtc_links_it_with_a_run_path_next_to_torch(tmp_path, site, monkeypatch):
    ns = _helpers(monkeypatch)
    fe = tmp_path / "frontend" / "include"
    _touch(fe / "cudnn_frontend.h")
    _touch(fe / "cudnn_frontend" / "experimental" / "nvrtc_shim.h")
    monkeypatch.setenv("CUDNN_FRONTEND_INCLUDE", str(fe))
    # no libnvrtc anywhere (only this site on the path, no toolkit): no kernel, and the reason says so
    monkeypatch.setattr(sys, "path", [str(site)])
    monkeypatch.setitem(ns, "CUDA_HOME", str(tmp_path / "no-toolkit"))
    settings, why = ns["_cudnn_frontend"]()
    assert settings is None and "needs NVRTC" in why
    _touch(site / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13")
    settings, why = ns["_cudnn_frontend"]()
    assert settings is not None, why
    assert settings["libraries"] == [":libcudnn.so.9", ":libnvrtc.so.13"]
    assert str(site / "nvidia" / "cu13" / "lib") in settings["library_dirs"]
    assert settings["extra_link_args"] == ["-Wl,-rpath,$ORIGIN/../nvidia/cu13/lib"]


def test_missing_pieces_are_named(tmp_path, monkeypatch):
    ns = _helpers(monkeypatch)
    monkeypatch.delenv("CUDADOCTOR_OPS_CUDNN_FE", raising=False)
    monkeypatch.setenv("CUDNN_FRONTEND_INCLUDE", str(tmp_path / "nowhere"))
    settings, why = ns["_cudnn_frontend"]()
    assert settings is None and why == f"no cudnn_frontend.h in CUDNN_FRONTEND_INCLUDE={tmp_path / 'nowhere'}"
    fe = tmp_path / "frontend" / "include"
    _touch(fe / "cudnn_frontend.h")
    monkeypatch.setenv("CUDNN_FRONTEND_INCLUDE", str(fe))
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty-site")])
    settings, why = ns["_cudnn_frontend"]()
    assert settings is None and "libcudnn.so.9" in why


@pytest.mark.parametrize(
    ("archs", "built"),
    [("9.0", True), ("8.6;9.0+PTX", True), ("8.6 9.0a", True), ("8.0 8.6 8.9", False), ("9.0", False)],
    ids=["9.0", "list-with-ptx", "a-suffix", "no-9.0", "switched-off"],
)
def test_sm90a_module_follows_the_arch_list(monkeypatch, archs, built):
    """setup.py builds cudadoctor_ops._C_sm90a (csrc_sm90a/, sm_90a code) exactly where
    TORCH_CUDA_ARCH_LIST holds 9.0, unless CUDADOCTOR_OPS_SM90A=0; the reason names the list."""
    ns = _helpers(monkeypatch)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
    monkeypatch.delenv("CUDADOCTOR_OPS_SM90A", raising=False)
    if not built and "9.0" in archs:
        monkeypatch.setenv("CUDADOCTOR_OPS_SM90A", "0")
    ok, why = ns["_sm90a"]()
    assert ok is built, why
    assert ("CUDADOCTOR_OPS_SM90A=0" in why) if "9.0" in archs and not built else (archs.replace(";", " ") in why)

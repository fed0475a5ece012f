"""Shared helpers of the operator tests (tests/ops).

The GPU tests import ``cudadoctor_ops`` from an installed wheel or, failing that, from an in-place
build in opsrc/ (``cd opsrc && python setup.py build_ext --inplace``). Without a CUDA GPU or
without a build they skip with the reason.
"""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
OPSRC = REPO / "opsrc"


def _import_ops():
    try:
        return importlib.import_module("cudadoctor_ops"), None
    except ImportError as exc:
        first = exc
    if str(OPSRC) not in sys.path:
        sys.path.insert(0, str(OPSRC))
        for name in [m for m in sys.modules if m == "cudadoctor_ops" or m.startswith("cudadoctor_ops.")]:
            del sys.modules[name]
        try:
            return importlib.import_module("cudadoctor_ops"), None
        except ImportError as exc:
            return None, f"{first}; from opsrc/: {exc}"
    return None, str(first)


@pytest.fixture(scope="session")
def ops():
    """The cudadoctor_ops module on a CUDA machine; skips with the reason otherwise."""
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU and a CUDA build of torch (none visible)")
    return _built_ops()


@pytest.fixture(scope="session")
def ops_built():
    """The cudadoctor_ops module wherever it is built (CPU-only machines too); skips otherwise."""
    return _built_ops()


def _built_ops():
    mod, why = _import_ops()
    if mod is None:
        pytest.skip(
            "cudadoctor_ops is not built (pip install --no-build-isolation --no-deps ./opsrc, "
            f"or build_ext --inplace in opsrc/): {why}"
        )
    return mod

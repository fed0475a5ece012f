"""Every scenario in tests/fixtures/scenarios gets the verdict its expert gave it, and the corpus
covers every finding id with at least two positive and one negative case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cudadoctor.doctor import diagnose
from cudadoctor.rules import load_rules

SCENARIOS = sorted((Path(__file__).parent / "fixtures" / "scenarios").glob("*.json"))
CATALOGUE = [
    "NO_GPU", "NO_DRIVER", "DRIVER_LIBRARY_MISMATCH", "DRIVER_TOO_OLD", "TOOLKIT_NEWER_THAN_DRIVER",
    "TORCH_CPU_ONLY", "TORCH_NO_KERNEL_IMAGE", "EXT_NO_KERNEL_IMAGE", "EXT_ABI_MISMATCH", "NVCC_MISSING",
    "NVCC_TORCH_MAJOR_MISMATCH", "NVCC_TORCH_MINOR_MISMATCH", "TOOLKIT_CONFLICT", "TOOLKIT_INCOMPLETE",
    "HOST_COMPILER_UNSUPPORTED", "ARCH_LIST_UNSUPPORTED", "ARCH_LIST_EXCLUDES_GPU", "WSL_LINUX_DRIVER",
    "WSL_LIBCUDA_MISSING", "CONTAINER_NO_GPU", "CONTAINER_CAPABILITIES", "LD_LIBRARY_PATH_SHADOW",
    "CUDA_VISIBLE_DEVICES_HIDES", "NINJA_MISSING", "HOST_COMPILER_STATIC_LIBSTDCXX", "EXT_STATIC_CXX_RUNTIME",
    "TORCH_IMPORT_FAILED", "TORCH_MISSING", "BUILD_ISOLATION_HIDES_TORCH", "PYTHON_HEADERS_MISSING",
    "EXT_LOADED_BEFORE_TORCH", "BUILD_OUT_OF_MEMORY", "LIBSTDCXX_TOO_OLD",
    "CXX_STANDARD_TOO_OLD",
]


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _registered() -> set[str]:
    return set(load_rules())


def _needs_missing_rule(expect: dict) -> str | None:
    """An id the scenario needs reported whose rule module is not in this checkout yet."""
    need = [expect.get("primary")] + list(expect.get("also") or [])
    missing = [i for i in need if i and i not in _registered()]
    return missing[0] if missing else None


def test_corpus_is_there():
    assert len(SCENARIOS) >= 9


@pytest.mark.parametrize("path", SCENARIOS, ids=[p.stem for p in SCENARIOS])
def test_scenario(path: Path):
    sc = _load(path)
    expect = sc["expect"]
    missing = _needs_missing_rule(expect)
    if missing:
        pytest.skip(f"rule {missing} is not registered (rules/extensions.py not in this checkout)")
    report = diagnose(sc["facts"])
    found = [f["id"] for f in report["findings"]]
    errors = [f["id"] for f in report["findings"] if f["severity"] == "error"]
    assert "INTERNAL_RULE_ERROR" not in found, report["findings"]
    primary = expect.get("primary")
    if primary is None:
        assert errors == [], f"healthy scenario got errors {errors}"
    else:
        assert primary in found, f"{primary} not reported; got {found}"
        if primary in errors:
            assert errors[0] == primary, f"{primary} is not the first error: {errors}"
    for fid in expect.get("also") or []:
        assert fid in found, f"also-expected {fid} not reported; got {found}"
    for fid in expect.get("absent") or []:
        assert fid not in found, f"{fid} must not be reported; got {found}"
    if expect.get("fix_contains"):
        fix = next(f for f in report["findings"] if f["id"] == primary)["fix"]
        assert any(expect["fix_contains"] in line for line in fix), f"{expect['fix_contains']!r} not in {fix}"


def test_every_finding_has_fix_or_is_info():
    for path in SCENARIOS:
        report = diagnose(_load(path)["facts"])
        for f in report["findings"]:
            assert f["detail"], (path.name, f["id"])
            assert f["facts"], (path.name, f["id"])
            if f["severity"] != "info":
                assert f["fix"], (path.name, f["id"])


def _coverage() -> dict[str, tuple[int, int]]:
    pos: dict[str, int] = {i: 0 for i in CATALOGUE}
    neg: dict[str, int] = {i: 0 for i in CATALOGUE}
    for path in SCENARIOS:
        expect = _load(path)["expect"]
        for fid in [expect.get("primary")] + list(expect.get("also") or []):
            if fid in pos:
                pos[fid] += 1
        for fid in expect.get("absent") or []:
            if fid in neg:
                neg[fid] += 1
    return {i: (pos[i], neg[i]) for i in CATALOGUE}


def test_catalogue_coverage():
    registered = _registered()
    check = [i for i in CATALOGUE if not i.startswith("EXT_") or i in registered]
    cov = _coverage()
    short = {i: cov[i] for i in check if cov[i][0] < 2 or cov[i][1] < 1}
    assert not short, f"ids with < 2 positive or < 1 negative scenario (positive, negative): {short}"


def test_every_catalogue_id_has_a_rule():
    registered = _registered()
    own = [i for i in CATALOGUE if not i.startswith("EXT_")]
    assert not [i for i in own if i not in registered]

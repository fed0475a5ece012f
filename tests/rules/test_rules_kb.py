"""Knowledge tables the rules read (driver_cuda, host_compilers, torch_wheels) and the queries on them."""

from __future__ import annotations

import pytest

from cudadoctor.knowledge import load_table
from cudadoctor.rules import _kb
from cudadoctor.versions import CudaVersion, parse


@pytest.mark.parametrize("name", ["driver_cuda", "host_compilers", "torch_wheels"])
def test_every_row_has_a_source(name):
    rows = load_table(name)
    assert rows and all(r.get("source") for r in rows)


def test_driver_minimums_rise_with_cuda():
    rel = sorted(((CudaVersion.parse(r["cuda"]), parse(r["linux"])) for r in load_table("driver_cuda")
                  if r["kind"] == "release"), key=lambda t: t[0])
    assert all(a[1] < b[1] for a, b in zip(rel, rel[1:]))


@pytest.mark.parametrize("driver,os_name,cuda", [("535.183.01", "linux", "12.2"), ("470.57.02", "linux", "11.4"),
                                                 ("580.95.05", "linux", "13.0"), ("551.61", "windows", "12.4"),
                                                 ("V550.54.15", "linux", "12.4"), ("nonsense", "linux", None)])
def test_cuda_of_driver(driver, os_name, cuda):
    got = _kb.cuda_of_driver(driver, os_name)
    assert (str(got) if got else None) == cuda


@pytest.mark.parametrize("major,floor", [(11, "450.80.02"), (12, "525.60.13"), (13, "580.65.06")])
def test_minor_compat_floors(major, floor):
    assert _kb.minor_compat_floor(major) == floor


@pytest.mark.parametrize("nvcc,family,top", [("12.0", "gcc", 12), ("12.6", "gcc", 13), ("12.8", "gcc", 14),
                                             ("13.0", "gcc", 15), ("11.8", "clang", 14), ("99.1", "gcc", None)])
def test_compiler_max(nvcc, family, top):
    assert _kb.compiler_max(CudaVersion.parse(nvcc), family) == top


def test_new_cuda_release_is_a_data_change(monkeypatch):
    real = _kb.load_table

    def with_new_row(name):
        rows = real(name)
        if name == "host_compilers":
            rows = rows + ({"cuda": "13.4", "gcc_max": 16, "clang_max": 22, "source": "test row"},)
        if name == "driver_cuda":
            rows = rows + ({"kind": "release", "cuda": "13.4", "linux": "600.10", "source": "test row"},)
        return rows

    monkeypatch.setattr(_kb, "load_table", with_new_row)
    assert _kb.compiler_max(CudaVersion(13, 4), "gcc") == 16
    assert str(_kb.cuda_of_driver("600.20")) == "13.4"
    assert _kb.min_driver(CudaVersion(13, 4)) == "600.10"


def test_wheels_parse_and_defaults_unique_per_release():
    ws = _kb.wheels()
    assert len(ws) == len(load_table("torch_wheels"))
    by_release: dict[str, int] = {}
    for w in ws:
        by_release[w.torch] = by_release.get(w.torch, 0) + w.pypi_default
        assert w.index_url == f"https://download.pytorch.org/whl/{w.tag}"
        assert w.tag == w.cuda.tag
    assert all(n == 1 for n in by_release.values()), by_release


def test_pick_wheel_keeps_installed_series_and_pins_it():
    d = _kb.DriverView("570.124.06", CudaVersion(12, 8), "linux")
    w, pin = _kb.pick_wheel(driver=d, ccs=["8.6"], current_torch="2.6.0+cu124")
    assert (pin, w.tag) == ("2.6.0", "cu126")
    w, pin = _kb.pick_wheel(driver=d, ccs=["8.6"], current_torch="2.7.0.dev20250310+cu124")
    assert (pin, w.tag) == ("2.7.0", "cu128")


def test_pick_wheel_with_nothing_known_gives_newest():
    w, pin = _kb.pick_wheel()
    assert pin == max((x.release for x in _kb.wheels())).base_version

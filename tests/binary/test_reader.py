"""The ELF / cubin / fatbin reader and inspect_path over binaries compiled with nvcc 13.0
(tests/fixtures/binaries/build.sh lists the exact -gencode sets)."""

import json
import os
import zipfile
from pathlib import Path

import pytest

from cudadoctor.binary import BinaryFormatError, read_binary
from cudadoctor.inspect import (
    MANIFEST_NAME,
    driver_for_cuda,
    inspect_path,
    installed_extension_entries,
    ptx_cuda,
    verdict,
    verdicts,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "binaries"

EXPECTED = {
    "sm86_sm89_ptx89.o": ("object", ["sm_86", "sm_89"], ["compute_89"]),
    "libkern_sm86_sm89_ptx89.so": ("shared-object", ["sm_86", "sm_89"], ["compute_89"]),
    "sm80_sm90a_ptx80_compressed.fatbin": ("fatbin", ["sm_80", "sm_90a"], ["compute_80"]),
    "ptx80_only.fatbin": ("fatbin", [], ["compute_80"]),
    "sm87.cubin": ("cubin", ["sm_87"], []),
    "sm120.cubin": ("cubin", ["sm_120"], []),
    "libkern_sm87.so": ("shared-object", ["sm_87"], []),
    "sm100f_sm120_ptx100f_ptx90a.fatbin": ("fatbin", ["sm_100f", "sm_120"], ["compute_90a", "compute_100f"]),
    "lto86_rdc.o": ("object", [], []),
    "libstatic_rt.so": ("shared-object", [], []),  # host-only (throw.cpp), for the C++ runtime check
    "libshared_rt.so": ("shared-object", [], []),
}


def test_lto_ir_entries():
    info = read_binary(FIX / "lto86_rdc.o")
    assert info.lto == ["lto_86"] and [e.kind for e in info.entries] == ["lto"]
    (e,) = inspect_path(FIX / "lto86_rdc.o")
    assert e["lto"] == ["lto_86"]
    assert verdicts([e], ["8.6"]) == []  # nothing loadable to judge


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reader_matches_gencode(name):
    info = read_binary(FIX / name)
    fmt, sass, ptx = EXPECTED[name]
    assert (info.format, info.sass, info.ptx) == (fmt, sass, ptx)


def test_compressed_fatbin_entries():
    info = read_binary(FIX / "sm80_sm90a_ptx80_compressed.fatbin")
    assert {e.compression for e in info.entries} == {"zstd"}
    for e in info.entries:
        assert 0 < e.compressed_size <= e.size < e.decompressed_size
    ptx = [e for e in info.entries if e.kind == "ptx"]
    assert [e.ptx_isa for e in ptx] == ["9.0"]  # nvcc 13.0 writes PTX ISA 9.0


def test_uncompressed_ptx_isa_from_text_and_suffix_flags():
    info = read_binary(FIX / "sm100f_sm120_ptx100f_ptx90a.fatbin")
    assert {e.compression for e in info.entries} == {None}
    assert {e.arch: e.ptx_isa for e in info.entries if e.kind == "ptx"} == {"compute_100f": "9.0", "compute_90a": "9.0"}


def test_shared_object_links_cudart_13():
    info = read_binary(FIX / "libkern_sm86_sm89_ptx89.so")
    assert "libcudart.so.13" in info.needed
    assert info.cuda_major == "13"


def test_entry_shape_is_facts_v1():
    (e,) = inspect_path(FIX / "sm86_sm89_ptx89.o")
    for key in ("path", "sass", "ptx", "built_with", "load_error"):
        assert key in e
    assert e["ptx_isa"] == {"compute_89": "9.0"}
    assert set(e["built_with"]) == {"torch", "cuda", "cxx11_abi"}
    json.dumps(e)


def test_folder_reads_every_binary_and_skips_sources():
    entries = inspect_path(FIX)
    names = sorted(os.path.basename(e["path"]) for e in entries)
    assert names == sorted(EXPECTED)


def _wheel(tmp_path, manifest=None):
    whl = tmp_path / "cdops-0.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(FIX / "libkern_sm86_sm89_ptx89.so", "cdops/_C.so")
        z.write(FIX / "libkern_sm87.so", "cdops/lib/libjetson.so.1")
        z.writestr("cdops/__init__.py", "")
        if manifest is not None:
            z.writestr(f"cdops-0.1.dist-info/{MANIFEST_NAME}", json.dumps(manifest))
    return whl


def test_wheel_every_shared_object_and_manifest(tmp_path):
    man = {"torch": "2.14.1", "cuda": "13.0", "cxx11_abi": True, "torch_cuda_arch_list": "8.6;8.9+PTX"}
    entries = inspect_path(_wheel(tmp_path, man))
    by = {e["path"].split("!")[1]: e for e in entries}
    assert set(by) == {"cdops/_C.so", "cdops/lib/libjetson.so.1"}
    assert by["cdops/_C.so"]["sass"] == ["sm_86", "sm_89"]
    assert by["cdops/lib/libjetson.so.1"]["sass"] == ["sm_87"]
    assert by["cdops/_C.so"]["manifest"] == man
    assert by["cdops/_C.so"]["built_with"] == {"torch": "2.14.1", "cuda": "13.0", "cxx11_abi": True}


def test_wheel_without_manifest_uses_linked_cudart(tmp_path):
    entries = inspect_path(_wheel(tmp_path))
    assert all("manifest" not in e for e in entries)
    assert {e["built_with"]["cuda"] for e in entries} == {"13"}


def test_damaged_inputs_raise_typed_errors(tmp_path):
    bad = tmp_path / "x.so"
    bad.write_bytes(b"")
    with pytest.raises(BinaryFormatError):
        inspect_path(bad)
    bad.write_bytes(b"hello world, not an ELF")
    with pytest.raises(BinaryFormatError) as ei:
        inspect_path(bad)
    assert ei.value.exit_code == 2
    whl = tmp_path / "broken.whl"
    whl.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(BinaryFormatError):
        inspect_path(whl)
    with pytest.raises(BinaryFormatError):
        inspect_path(tmp_path / "missing.so")


def test_damaged_member_of_folder_is_reported_not_raised(tmp_path):
    (tmp_path / "ok.so").write_bytes((FIX / "libkern_sm87.so").read_bytes())
    (tmp_path / "bad.so").write_bytes((FIX / "libkern_sm87.so").read_bytes()[:3000])
    entries = {os.path.basename(e["path"]): e for e in inspect_path(tmp_path)}
    assert entries["ok.so"]["sass"] == ["sm_87"]
    assert "error" in entries["bad.so"]


# --- verdict rules over real fixtures ---------------------------------------------------------


def _entry(name):
    (e,) = inspect_path(FIX / name)
    return e


@pytest.mark.parametrize(
    "name,cc,runs,via",
    [
        ("sm86_sm89_ptx89.o", "8.9", True, "sass"),
        ("sm86_sm89_ptx89.o", "8.6", True, "sass"),
        ("sm86_sm89_ptx89.o", "8.0", False, None),   # 8.6 SASS does not run on 8.0
        ("sm86_sm89_ptx89.o", "9.0", True, "ptx"),   # compute_89 JIT on 9.0
        ("ptx80_only.fatbin", "9.0", True, "ptx"),   # compute_80 PTX on 9.0: JIT
        ("ptx80_only.fatbin", "7.5", False, None),
        ("sm80_sm90a_ptx80_compressed.fatbin", "9.0", True, "sass"),  # 9.0a on 9.0
        ("sm80_sm90a_ptx80_compressed.fatbin", "10.0", True, "ptx"),  # not 9.0a SASS; compute_80 JIT
        ("sm87.cubin", "8.7", True, "sass"),
        ("sm87.cubin", "8.9", False, None),          # Jetson 8.7 only on 8.7
        ("sm87.cubin", "8.6", False, None),
        ("sm120.cubin", "12.1", True, "sass"),
        ("sm120.cubin", "10.0", False, None),
        ("sm100f_sm120_ptx100f_ptx90a.fatbin", "10.3", True, "sass"),  # sm_100f on 10.3
        ("sm100f_sm120_ptx100f_ptx90a.fatbin", "12.1", True, "sass"),  # sm_120 on 12.1
        ("sm100f_sm120_ptx100f_ptx90a.fatbin", "9.0", True, "ptx"),    # compute_90a only on 9.0
        ("sm100f_sm120_ptx100f_ptx90a.fatbin", "11.0", False, None),   # neither family nor 90a
    ],
)
def test_verdicts(name, cc, runs, via):
    v = verdict(_entry(name), cc)
    assert (v["runs"], v["via"]) == (runs, via)


def test_ptx_jit_needs_driver_of_ptx_isa():
    v = verdict(_entry("ptx80_only.fatbin"), "9.0")
    assert v["needs_driver_cuda"] == "13.0"
    assert v["needs_driver"] == driver_for_cuda("13.0")
    assert v["needs_driver"].startswith("580.")
    old = verdict(_entry("ptx80_only.fatbin"), "9.0", driver_cuda="12.4")
    assert old["runs"] is False and "13.0" in old["reason"]


def test_ptx_isa_table():
    assert ptx_cuda("9.0") == "13.0"
    assert ptx_cuda("7.8") == "11.8"
    assert ptx_cuda("8.6") == "12.8"
    assert ptx_cuda("99.1") is None and ptx_cuda(None) is None


def test_verdicts_skip_files_without_device_code():
    es = [{"path": "cpu.so", "sass": [], "ptx": []}, {"path": "bad.so", "error": "x"}, _entry("sm87.cubin")]
    vs = verdicts(es, ["8.7", "9.0"])
    assert [(os.path.basename(v["path"]), v["gpu"], v["runs"]) for v in vs] == [
        ("sm87.cubin", "8.7", True), ("sm87.cubin", "9.0", False)]


def test_installed_extension_entries_finds_package_without_import(tmp_path, monkeypatch):
    pkg = tmp_path / "fakeops"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "sub" / "_C.so").write_bytes((FIX / "libkern_sm86_sm89_ptx89.so").read_bytes())
    dist = tmp_path / "fakeops-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeops\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("fakeops\n")
    (dist / MANIFEST_NAME).write_text(json.dumps({"torch": "2.14.1", "cuda": "13.0", "cxx11_abi": True}))
    monkeypatch.syspath_prepend(str(tmp_path))
    entries = installed_extension_entries("fakeops")
    assert len(entries) == 1
    assert entries[0]["sass"] == ["sm_86", "sm_89"]
    assert entries[0]["built_with"]["torch"] == "2.14.1"
    assert installed_extension_entries("no_such_package_here") == []


def test_installed_file_gets_the_manifest_of_its_own_distribution(tmp_path):
    site = tmp_path / "site-packages"
    (site / "cdops").mkdir(parents=True)
    so = site / "cdops" / "_C.so"
    so.write_bytes((FIX / "libkern_sm87.so").read_bytes())
    (site / "other.so").write_bytes((FIX / "libkern_sm87.so").read_bytes())
    for dist, owned, torch in (("cdops-0.1.dist-info", "cdops/_C.so", "2.14.1"), ("zzz-1.dist-info", "zzz/x.py", "1.0")):
        (site / dist).mkdir()
        (site / dist / "RECORD").write_text(f"{owned},sha256=abc,1\n")
        (site / dist / MANIFEST_NAME).write_text(json.dumps({"torch": torch}))
    (e,) = inspect_path(so)
    assert e["manifest"] == {"torch": "2.14.1"}
    by = {os.path.basename(x["path"]): x for x in inspect_path(site)}
    assert by["_C.so"]["built_with"]["torch"] == "2.14.1"
    assert "manifest" not in by["other.so"]

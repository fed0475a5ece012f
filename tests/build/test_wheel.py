"""The finished wheel: label, manifest, RECORD, and the post-build SASS/PTX verification."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cudadoctor.build import plan as P
from cudadoctor.build.manifest import (
    MANIFEST_NAME, finish_wheel, make_manifest, read_manifest, source_hash, split_wheel_name,
)
from cudadoctor.build.verify import missing, verify
from cudadoctor.errors import RefusedError

BIN = Path(__file__).resolve().parents[1] / "fixtures" / "binaries"
FAT = BIN / "libkern_sm86_sm89_ptx89.so"  # SASS sm_86, sm_89; PTX compute_89
SM87 = BIN / "libkern_sm87.so"


def make_wheel(tmp: Path, members: dict[str, bytes], *, dist="demo_ops", version="0.1.0") -> Path:
    info = f"{dist}-{version}.dist-info"
    files = dict(members)
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: cp311-cp311-linux_x86_64\n"
    files[f"{info}/top_level.txt"] = dist.encode() + b"\n"
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = tmp / f"{dist}-{version}-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
    return path


@pytest.fixture
def fat_wheel(tmp_path):
    return make_wheel(tmp_path, {"demo_ops/__init__.py": b"", "demo_ops/_C.so": FAT.read_bytes()})


def test_verify_accepts_requested_archs(fat_wheel):
    archs = verify(fat_wheel, ["sm_86", "sm_89"], ["compute_89"])
    assert archs == {"demo_ops/_C.so": {"sass": ["sm_86", "sm_89"], "ptx": ["compute_89"]}}


def test_verify_fails_on_missing_sass_naming_the_member(fat_wheel):
    with pytest.raises(RefusedError) as e:
        verify(fat_wheel, ["sm_86", "sm_90"], [])
    assert "demo_ops/_C.so lacks sm_90" in str(e.value)
    assert e.value.exit_code == 1


def test_verify_fails_on_missing_ptx(fat_wheel):
    with pytest.raises(RefusedError, match="lacks compute_86"):
        verify(fat_wheel, ["sm_86"], ["compute_86"])


def test_verify_checks_every_shared_object(tmp_path):
    whl = make_wheel(tmp_path, {"demo_ops/_C.so": FAT.read_bytes(), "demo_ops/_D.so": SM87.read_bytes()})
    with pytest.raises(RefusedError) as e:
        verify(whl, ["sm_86"], [])
    assert "demo_ops/_D.so lacks sm_86" in str(e.value)
    assert "_C.so lacks" not in str(e.value)


def test_verify_fails_without_device_code(tmp_path):
    whl = make_wheel(tmp_path, {"demo_ops/__init__.py": b""})
    with pytest.raises(RefusedError, match="no CUDA device code"):
        verify(whl, ["sm_86"], [])


def test_missing_ignores_host_only_objects():
    sos = {"a.so": {"sass": ["sm_86"], "ptx": []}, "host.so": {"sass": [], "ptx": []}}
    assert missing(sos, ["sm_86"], []) == {}
    assert missing(sos, ["sm_86", "sm_89"], []) == {"a.so": ["sm_89"]}


def test_missing_accepts_arch_specific_module_for_a_requested_arch():
    so = {"pkg/_C.so": {"sass": ["sm_86", "sm_90"], "ptx": []},
          "pkg/_C_sm90a.so": {"sass": ["sm_90a"], "ptx": []}}
    assert missing(so, ["sm_86", "sm_90"], []) == {}
    # the portable module still has to hold every requested arch
    so["pkg/_C.so"]["sass"] = ["sm_86"]
    assert missing(so, ["sm_86", "sm_90"], []) == {"pkg/_C.so": ["sm_90"]}


def test_missing_reports_arch_specific_module_for_an_arch_not_requested():
    so = {"pkg/_C.so": {"sass": ["sm_86"], "ptx": []}, "pkg/_C_sm90a.so": {"sass": ["sm_90a"], "ptx": []}}
    assert missing(so, ["sm_86"], []) == {"pkg/_C_sm90a.so": ["arch-specific sm_90a for an arch not requested"]}
    # sm_90a next to portable code is no add-on: it must hold the requested archs like any other
    so = {"pkg/_C.so": {"sass": ["sm_90", "sm_90a"], "ptx": []}}
    assert missing(so, ["sm_86", "sm_90"], []) == {"pkg/_C.so": ["sm_86"]}


def test_finish_wheel_label_manifest_record(fat_wheel, tmp_path):
    plan = P.make_plan(P.TargetSpec(arch="8.6,8.9+PTX"), source="/s", out=str(tmp_path))
    archs = verify(fat_wheel, plan.target.sass, plan.target.ptx)
    info = {"torch": "2.14.1+cu130", "torch_cuda": "13.0", "nvcc": "13.0.88", "host_compiler": "c++ 12.2.0",
            "glibc": "2.36", "cxx11_abi": True, "python": "3.11.2"}
    manifest = make_manifest(plan, info, archs, "ab" * 32)
    out = tmp_path / "dist"
    final = finish_wheel(fat_wheel, out, plan.label, manifest)
    assert final.name == "demo_ops-0.1.0+cu130torch2.14-cp311-cp311-linux_x86_64.whl"
    assert split_wheel_name(final.name)[1] == "0.1.0+cu130torch2.14"
    got = read_manifest(final)
    for key in ("torch", "cuda", "nvcc", "host_compiler", "glibc", "cxx11_abi", "python", "source_hash"):
        assert got[key] is not None, key
    assert got["shared_objects"]["demo_ops/_C.so"]["sass"] == ["sm_86", "sm_89"]
    assert got["requested"] == {"sass": ["sm_86", "sm_89"], "ptx": ["compute_89"]}
    with zipfile.ZipFile(final) as z:
        names = z.namelist()
        info_dir = "demo_ops-0.1.0+cu130torch2.14.dist-info"
        assert f"{info_dir}/{MANIFEST_NAME}" in names
        assert not any(n.startswith("demo_ops-0.1.0.dist-info/") for n in names)
        assert b"Version: 0.1.0+cu130torch2.14" in z.read(f"{info_dir}/METADATA")
        for line in z.read(f"{info_dir}/RECORD").decode().splitlines():
            name, digest, size = line.split(",")
            if name.endswith("RECORD"):
                continue
            data = z.read(name)
            want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == want and int(size) == len(data), name
    # inspect reads the manifest back
    from cudadoctor.inspect import inspect_path

    entries = inspect_path(str(final))
    assert entries[0]["built_with"]["torch"] == "2.14.1+cu130"


def test_finished_wheel_installs(fat_wheel, tmp_path):
    plan = P.make_plan(P.TargetSpec(arch="8.6"), source="/s", out=str(tmp_path))
    final = finish_wheel(fat_wheel, tmp_path / "dist", plan.label, {"schema": "x"})
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target),
                        str(final)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (target / "demo_ops" / "_C.so").is_file()
    assert (target / "demo_ops-0.1.0+cu130torch2.14.dist-info" / MANIFEST_NAME).is_file()


def test_source_hash_changes_with_content(tmp_path):
    (tmp_path / "a.cu").write_text("x")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "junk.o").write_text("ignored")
    h1 = source_hash(tmp_path)
    (tmp_path / "build" / "more.txt").write_text("still ignored")
    assert source_hash(tmp_path) == h1
    (tmp_path / "a.cu").write_text("y")
    assert source_hash(tmp_path) != h1

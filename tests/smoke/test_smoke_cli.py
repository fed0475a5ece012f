"""`cudadoctor smoke` without a GPU: install, import, manifest and arch checks, the skipped exit
code, runs on the CPU (through the hidden --device cpu) for the result handling, and bad wheels."""

from __future__ import annotations

import json
import zipfile

import pytest

from cudadoctor.cli import main
from cudadoctor.smoke import EXIT_CANNOT_RUN, EXIT_FAILED, EXIT_PASSED, EXIT_SKIPPED

from smoke_wheels import FAILING_CASES, PASSING_CASES, make_wheel, package_files

torch = pytest.importorskip("torch")
TORCH = {"torch": torch.__version__.split("+")[0], "cuda": torch.version.cuda,
         "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI)}
NO_GPU = not torch.cuda.is_available()
needs_no_gpu = pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU path; this machine has a CUDA GPU")


def smoke(capsys, *args):
    code = main(["smoke", *map(str, args)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def smoke_json(capsys, *args):
    code, out, err = smoke(capsys, *args, "--json")
    report = json.loads(out)
    assert report["exit_code"] == code
    return code, report


def check(report, name):
    return next(c for c in report["checks"] if c["name"] == name)


@needs_no_gpu
def test_no_gpu_skips_runs_with_distinct_exit_code_after_all_checks(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(so="libkern_sm86_sm89_ptx89.so"), manifest=TORCH)
    code, out, _err = smoke(capsys, whl)
    assert code == EXIT_SKIPPED == 3
    for line in ("✓ install", "✓ import", "✓ manifest", "• archs", "✓ cases"):
        assert line in out
    assert "no GPU" in out and "SKIPPED (exit 3)" in out
    code, rep = smoke_json(capsys, whl)
    assert rep["status"] == "skipped" and rep["results"] == []
    assert [c["name"] for c in rep["checks"]] == ["install", "import", "manifest", "archs", "cases"]
    assert rep["target"]["imported_from"].startswith(rep["target"]["installed_to"])
    assert any("no GPU" in s for s in rep["skipped"])
    assert rep["ops"] == ["double", "square"]
    assert rep["binaries"][0]["sass"] == ["sm_86", "sm_89"]


@needs_no_gpu
def test_predicts_no_kernel_image_for_a_requested_gpu_before_running(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(so="libkern_sm87.so"), manifest=TORCH)
    code, rep = smoke_json(capsys, whl, "--gpu", "9.0")
    assert code == EXIT_FAILED
    assert [f["id"] for f in rep["findings"]] == ["EXT_NO_KERNEL_IMAGE"]
    assert check(rep, "archs")["ok"] is False and "no kernel image" in check(rep, "archs")["detail"]
    assert rep["verdicts"][0]["gpu"] == "9.0" and rep["verdicts"][0]["runs"] is False
    assert any("TORCH_CUDA_ARCH_LIST" in fx for fx in rep["findings"][0]["fix"])
    # PTX compute_89 JIT-compiles on 9.0: no finding
    whl2 = make_wheel(tmp_path, name="ptxext", files=package_files("ptxext", so="libkern_sm86_sm89_ptx89.so"),
                      manifest=TORCH)
    code, rep = smoke_json(capsys, whl2, "--gpu", "9.0", "--gpu", "8.6")
    assert code == EXIT_SKIPPED and rep["findings"] == []
    assert {(v["gpu"], v["via"]) for v in rep["verdicts"]} == {("9.0", "ptx"), ("8.6", "sass")}


@pytest.mark.parametrize("manifest,why", [
    ({"torch": "2.9.1", "cuda": TORCH["cuda"], "cxx11_abi": TORCH["cxx11_abi"]}, "built against torch 2.9.1"),
    ({"torch": TORCH["torch"], "cuda": TORCH["cuda"], "cxx11_abi": not TORCH["cxx11_abi"]}, "_GLIBCXX_USE_CXX11_ABI"),
    ({"built_with": {"torch": TORCH["torch"], "cuda": "11.8", "cxx11_abi": TORCH["cxx11_abi"]}}, "built with CUDA 11.8"),
])
def test_manifest_against_runtime_reports_abi_mismatch(tmp_path, capsys, manifest, why):
    whl = make_wheel(tmp_path, files=package_files(so="libkern_sm86_sm89_ptx89.so"), manifest=manifest)
    code, rep = smoke_json(capsys, whl, "--tools", "none")
    assert code == EXIT_FAILED and rep["status"] == "fail"
    ids = [f["id"] for f in rep["findings"]]
    assert ids == ["EXT_ABI_MISMATCH"]
    assert why in rep["findings"][0]["detail"]
    assert check(rep, "manifest")["ok"] is False
    code, out, _ = smoke(capsys, whl, "--tools", "none")
    assert "EXT_ABI_MISMATCH" in out and "✗ manifest" in out and "FAIL (exit 1)" in out


def test_manifest_for_another_python_fails_the_manifest_check(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(), manifest=dict(TORCH, python="2.7.18"))
    code, rep = smoke_json(capsys, whl, "--tools", "none")
    assert code == EXIT_FAILED and "built for Python 2.7.18" in check(rep, "manifest")["detail"]


def test_import_error_with_undefined_symbol_is_a_failure_and_an_abi_finding(tmp_path, capsys):
    init = ('raise ImportError("/x/fakeext/_C.so: undefined symbol: '
            '_ZN3c106detail14torchCheckFailEPKcS2_jRKSs")\n')
    whl = make_wheel(tmp_path, files=package_files(init=init, so="libkern_sm86_sm89_ptx89.so"))
    code, rep = smoke_json(capsys, whl)
    assert code == EXIT_FAILED
    assert check(rep, "import")["ok"] is False and "undefined symbol" in check(rep, "import")["detail"]
    assert [f["id"] for f in rep["findings"]] == ["EXT_ABI_MISMATCH"]
    assert any("does not import" in s for s in rep["skipped"])


def test_a_crash_during_import_is_a_result(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(init="import os\nos.abort()\n"))
    code, rep = smoke_json(capsys, whl)
    assert code == EXIT_FAILED
    assert "signal 6" in check(rep, "import")["detail"]


def test_package_without_smoke_cases_is_skipped_not_passed(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(cases=None))
    code, rep = smoke_json(capsys, whl, "--device", "cpu", "--tools", "none")
    assert code == EXIT_SKIPPED
    assert check(rep, "cases")["ok"] is None and "no smoke cases" in " ".join(rep["skipped"])


def test_broken_case_module_fails(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(cases="SMOKE_CASES = [{'name': 'x'}, 42]\n"))
    code, rep = smoke_json(capsys, whl, "--device", "cpu", "--tools", "none")
    assert code == EXIT_FAILED
    assert "lacks inputs, run, reference" in check(rep, "cases")["detail"]


def test_cases_run_in_children_against_references(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(cases=PASSING_CASES))
    code, rep = smoke_json(capsys, whl, "--device", "cpu", "--tools", "none")
    assert code == EXIT_PASSED and rep["status"] == "pass"
    cells = {(r["op"], r["tool"]): r for r in rep["results"]}
    assert set(cells) == {("double", "run"), ("square", "run")}
    assert [c["case"] for c in cells[("double", "run")]["cases"]] == ["double/basic", "double/grad"]
    assert all(c["status"] == "pass" for r in rep["results"] for c in r["cases"])
    # with sanitizer tools asked for, a CPU run cannot give them: skipped, not passed
    code, rep = smoke_json(capsys, whl, "--device", "cpu", "--tools", "memcheck")
    assert code == EXIT_SKIPPED
    assert {r["status"] for r in rep["results"] if r["tool"] == "memcheck"} == {"skipped"}


def test_wrong_results_errors_crashes_and_hangs_become_table_cells(tmp_path, capsys):
    whl = make_wheel(tmp_path, name="badext", files=package_files("badext", cases=FAILING_CASES))
    code, rep = smoke_json(capsys, whl, "--device", "cpu", "--tools", "none", "--timeout", "15")
    assert code == EXIT_FAILED
    status = {r["op"]: r["status"] for r in rep["results"]}
    assert status == {"good": "pass", "wrong": "fail", "raises": "fail", "crash": "crash", "hang": "timeout"}
    wrong = next(r for r in rep["results"] if r["op"] == "wrong")
    details = {c["case"]: c["detail"] for c in wrong["cases"]}
    assert "12 of 12 values differ" in details["wrong/off_by_one"]
    assert "shape (11,), reference (12,)" in details["wrong/shape"]
    code, out, _ = smoke(capsys, whl, "--device", "cpu", "--tools", "none", "--timeout", "15")
    assert "CRASH" in out and "TIMEOUT" in out and "killed by signal 6 during crash/abort" in out


CORRUPT = {
    "garbage": lambda p: p.write_bytes(b"this is not a zip file at all"),
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
    "crc": lambda p: _flip_member_byte(p),
    "no_dist_info": lambda p: _rewrite_without(p, ".dist-info/"),
    "no_wheel_file": lambda p: _rewrite_without(p, ".dist-info/WHEEL"),
    "bad_manifest": lambda p: _replace_member(p, "cudadoctor_build.json", b"{not json"),
}


def _members(p):
    with zipfile.ZipFile(p) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _rewrite(p, members):
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        for n, d in members:
            z.writestr(n, d)


def _rewrite_without(p, part):
    _rewrite(p, [(n, d) for n, d in _members(p) if part not in n])


def _replace_member(p, suffix, data):
    _rewrite(p, [(n, data if n.endswith(suffix) else d) for n, d in _members(p)])


def _flip_member_byte(p):
    _rewrite(p, _members(p))  # stored, so member bytes are found verbatim
    raw = bytearray(p.read_bytes())
    i = raw.index(b"a test package")
    raw[i] ^= 0x20
    p.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind", sorted(CORRUPT))
def test_corrupt_wheel_exits_2_with_one_paragraph(tmp_path, capsys, kind):
    whl = make_wheel(tmp_path, files=package_files(), manifest=TORCH)
    CORRUPT[kind](whl)
    code, out, err = smoke(capsys, whl)
    assert code == EXIT_CANNOT_RUN == 2
    assert out == ""
    assert err.startswith("cudadoctor: error: cannot smoke-test ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args,needle", [
    (["/no/such/file.whl"], "no such file"),
    (["--installed", "surely_not_an_installed_package_xyz"], "no installed package named"),
    ([], "nothing to test"),
    (["x.whl", "--tools", "memcheck,leakcheck"], "'leakcheck'"),
    (["x.whl", "--gpu", "ampere-ish"], "not a compute capability"),
    (["x.whl", "--timeout", "0"], "--timeout"),
    (["--installed", "pkg.whl"], "takes a package name"),
])
def test_bad_arguments_exit_2(capsys, tmp_path, args, needle):
    code, out, err = smoke(capsys, *args)
    assert code == 2 and needle in err and "Traceback" not in err


def test_not_a_wheel_name_and_directory(tmp_path, capsys):
    p = tmp_path / "thing.zip"
    p.write_bytes(b"PK")
    code, _out, err = smoke(capsys, p)
    assert code == 2 and "not a wheel name" in err
    code, _out, err = smoke(capsys, tmp_path)
    assert code == 2 and "directory" in err


def test_wheel_for_another_platform_fails_install_check(tmp_path, capsys):
    whl = make_wheel(tmp_path, files=package_files(), tag="cp27-cp27mu-win_amd64")
    code, rep = smoke_json(capsys, whl)
    assert code == EXIT_FAILED
    assert check(rep, "install")["ok"] is False and "not a supported wheel" in check(rep, "install")["detail"]


def test_manifest_can_name_the_case_module(tmp_path, capsys):
    files = package_files(cases=None)
    files["fakeext/checks.py"] = PASSING_CASES
    whl = make_wheel(tmp_path, files=files, manifest=dict(TORCH, smoke_cases="fakeext.checks"))
    code, rep = smoke_json(capsys, whl, "--device", "cpu", "--tools", "none")
    assert code == EXIT_PASSED
    assert "fakeext.checks" in check(rep, "cases")["detail"]

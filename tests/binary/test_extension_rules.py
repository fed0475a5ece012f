"""EXT_NO_KERNEL_IMAGE and EXT_ABI_MISMATCH from real inspections of the nvcc fixtures."""

from pathlib import Path

from cudadoctor.inspect import inspect_path
from cudadoctor.rules import Facts, evaluate
from cudadoctor.rules.extensions import ext_abi_mismatch, ext_no_kernel_image

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "binaries"
TORCH = {"version": "2.14.1+cu130", "cuda": "13.0", "cxx11_abi": True}


def facts(exts, ccs, driver_cuda="13.0", torch=TORCH):
    return {
        "schema": "cudadoctor.facts/1",
        "gpus": [{"index": i, "name": f"GPU{i}", "cc": cc} for i, cc in enumerate(ccs)],
        "driver": {"version": "580.95.05", "cuda": driver_cuda},
        "torch": torch,
        "extensions": exts,
    }


def ids(findings):
    return [f.id for f in findings]


def test_no_kernel_image_fires_for_jetson_only_build_on_h200():
    exts = inspect_path(FIX / "libkern_sm87.so")
    out = ext_no_kernel_image(Facts(facts(exts, ["9.0"])))
    assert ids(out) == ["EXT_NO_KERNEL_IMAGE"]
    assert "sm_87" in out[0].detail and any("TORCH_CUDA_ARCH_LIST=\"9.0+PTX\"" in fx for fx in out[0].fix)


def test_no_kernel_image_silent_when_sass_or_ptx_covers_gpu():
    exts = inspect_path(FIX / "libkern_sm86_sm89_ptx89.so")
    assert ext_no_kernel_image(Facts(facts(exts, ["8.9"]))) == []
    assert ext_no_kernel_image(Facts(facts(exts, ["9.0"]))) == []  # compute_89 JIT, driver 13.0 is enough


def test_ptx_newer_than_driver_fires():
    exts = inspect_path(FIX / "ptx80_only.fatbin")
    out = ext_no_kernel_image(Facts(facts(exts, ["9.0"], driver_cuda="12.4")))
    assert ids(out) == ["EXT_NO_KERNEL_IMAGE"] and "driver" in out[0].title
    assert any("580." in fx for fx in out[0].fix)


def test_no_kernel_image_ignores_missing_or_odd_facts():
    for f in ({}, {"extensions": None}, {"extensions": [None, 3, {"path": 1}], "gpus": [{"cc": "9.0"}]},
              facts([{"path": "x.so", "sass": "sm_80"}], ["9.0"]), facts([{"path": "cpu.so", "sass": [], "ptx": []}], ["9.0"]),
              facts(inspect_path(FIX / "libkern_sm87.so"), [])):
        assert ext_no_kernel_image(Facts(f)) == []
        assert ext_abi_mismatch(Facts(f)) == []


def test_gpu_cc_from_name_when_cc_missing():
    f = facts(inspect_path(FIX / "libkern_sm87.so"), [])
    f["gpus"] = [{"index": 0, "name": "NVIDIA H200"}]
    assert ids(ext_no_kernel_image(Facts(f))) == ["EXT_NO_KERNEL_IMAGE"]


def test_abi_mismatch_from_manifest():
    exts = inspect_path(FIX / "libkern_sm86_sm89_ptx89.so")
    exts[0]["built_with"] = {"torch": "2.13.0", "cuda": "13.0", "cxx11_abi": True}
    out = ext_abi_mismatch(Facts(facts(exts, ["8.9"])))
    assert ids(out) == ["EXT_ABI_MISMATCH"] and "torch 2.13.0" in out[0].detail
    exts[0]["built_with"] = {"torch": "2.14.0", "cuda": "13.0", "cxx11_abi": False}
    out = ext_abi_mismatch(Facts(facts(exts, ["8.9"])))
    assert ids(out) == ["EXT_ABI_MISMATCH"] and "CXX11_ABI=0" in out[0].detail
    exts[0]["built_with"] = {"torch": "2.14.0", "cuda": "12", "cxx11_abi": True}
    assert "CUDA 12" in ext_abi_mismatch(Facts(facts(exts, ["8.9"])))[0].detail
    exts[0]["built_with"] = {"torch": "2.14.0+cu130", "cuda": "13", "cxx11_abi": 1}
    assert ext_abi_mismatch(Facts(facts(exts, ["8.9"]))) == []


def test_abi_mismatch_from_load_error():
    exts = [{"path": "/site/torch_cluster/_version_cuda.so", "sass": ["sm_80"], "ptx": [], "built_with": {},
             "load_error": "OSError: /site/torch_cluster/_version_cuda.so: undefined symbol: "
                           "_ZNK3c107SymBool10guard_boolEPKcl"}]
    out = ext_abi_mismatch(Facts(facts(exts, ["8.0"])))
    assert ids(out) == ["EXT_ABI_MISMATCH"] and "_ZNK3c107SymBool10guard_boolEPKcl" in out[0].detail


def test_evaluate_reports_both():
    exts = inspect_path(FIX / "libkern_sm87.so")
    exts[0]["built_with"]["torch"] = "2.12.0"
    found = ids(evaluate(facts(exts, ["9.0"])))
    assert "EXT_NO_KERNEL_IMAGE" in found and "EXT_ABI_MISMATCH" in found


def test_check_ext_option_feeds_the_rules(capsys):
    import json as _json

    from cudadoctor.cli import main

    scen = Path(__file__).resolve().parents[1] / "fixtures" / "scenarios" / "105-healthy-h200-torch211-cu130-container.json"
    code = main(["check", "--from", str(scen), "--json", "--ext", str(FIX / "libkern_sm87.so")])
    report = _json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["findings"][0]["id"] == "EXT_NO_KERNEL_IMAGE"
    assert report["facts"]["extensions"][0]["sass"] == ["sm_87"]
    code = main(["check", "--from", str(scen), "--json", "--ext", str(FIX / "libkern_sm86_sm89_ptx89.so")])
    report = _json.loads(capsys.readouterr().out)
    assert "EXT_NO_KERNEL_IMAGE" not in [f["id"] for f in report["findings"]]  # compute_89 JITs on the H200
    assert main(["check", "--from", str(scen), "--ext", str(FIX / "kern.cu")]) == 2
    assert main(["check", "--from", str(scen), "--ext-package", "no_such_package_xyz"]) == 2

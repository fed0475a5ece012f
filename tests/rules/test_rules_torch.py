"""torch rules: CPU-only builds and builds without kernels for the GPU; the wheel they recommend."""

import pytest

from factsbuilder import facts, finding, ids


def test_cpu_build_on_gpu_machine():
    f = facts(torch={"version": "2.5.1+cpu", "cuda": None, "arch_list": [], "cuda_available": False})
    fd = finding(f, "TORCH_CPU_ONLY")
    assert ids(f)[0] == "TORCH_CPU_ONLY"
    assert fd["fix"][0] == "pip uninstall -y torch"
    # driver 12.4, RTX 4090: the 2.5.1 cu124 wheel fits
    assert "pip install torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124" in fd["fix"]


def test_cpu_build_by_null_cuda_and_not_available():
    f = facts(torch={"version": "2.3.1", "cuda": None, "arch_list": None, "cuda_available": False})
    assert "TORCH_CPU_ONLY" in ids(f)


def test_cpu_build_without_gpu_is_fine():
    f = facts(gpus=[], driver={"version": None, "kernel_module": None, "cuda": None, "libcuda": [], "device_nodes": []},
              torch={"version": "2.5.1+cpu", "cuda": None, "cuda_available": False})
    assert "TORCH_CPU_ONLY" not in ids(f)


def test_unknown_cuda_but_available_is_not_cpu():
    f = facts(torch={"version": "1.4.0", "cuda": None, "arch_list": None, "cuda_available": True})
    assert "TORCH_CPU_ONLY" not in ids(f)


def test_rtx5090_on_cu126_wheel():
    f = facts(driver={"version": "570.124.04", "kernel_module": "570.124.04", "cuda": "12.8"},
              gpus=[{"index": 0, "name": "NVIDIA GeForce RTX 5090", "cc": "12.0"}],
              torch={"version": "2.6.0+cu126", "cuda": "12.6"})
    fd = finding(f, "TORCH_NO_KERNEL_IMAGE")
    assert ids(f)[0] == "TORCH_NO_KERNEL_IMAGE"
    assert fd["fix"] == ["pip install torch==2.7.1 --index-url https://download.pytorch.org/whl/cu128"]
    assert "gpus[0].cc" in fd["facts"]


def test_old_gpu_dropped_from_new_wheel():
    f = facts(driver={"cuda": "12.4"}, gpus=[{"index": 0, "name": "GeForce GTX 1080", "cc": "6.1"}],
              torch={"version": "2.7.1+cu128", "cuda": "12.8",
                     "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]})
    fd = finding(f, "TORCH_NO_KERNEL_IMAGE")
    # same torch release; cu126 runs on the 12.4 driver by minor-version compatibility and has SASS
    # sm_60, which runs on 6.1 (no PTX JIT needed)
    assert fd["fix"] == ["pip install torch==2.7.1 --index-url https://download.pytorch.org/whl/cu126"]


def test_minor_compat_wheels():
    from cudadoctor.rules._kb import DriverView, Wheel, pick_wheel
    from cudadoctor.versions import CudaVersion

    d = DriverView("560.35.03", CudaVersion(12, 6), "linux")
    # RTX 5090 on a 12.6 driver: cu128 runs by minor-version compatibility and has SASS sm_120
    got = pick_wheel(driver=d, ccs=["12.0"], current_torch="2.7.1")
    assert got is not None and got[0].tag == "cu128" and got[1] == "2.7.1"
    # PTX does not count under minor-version compatibility: the driver cannot JIT newer PTX
    w = Wheel("9.9.0", CudaVersion(12, 8), "cu128", False, ("9.0",), "9.0", True, "u")
    assert w.covers("10.0") and not w.covers("10.0", sass_only=True)


def test_no_wheel_for_driver_below_every_floor():
    from cudadoctor.rules._kb import DriverView, pick_wheel
    from cudadoctor.versions import CudaVersion

    assert pick_wheel(driver=DriverView("390.48", CudaVersion(9, 1), "linux"), ccs=["6.1"]) is None


def test_ptx_covers_newer_gpu():
    f = facts(gpus=[{"index": 0, "name": "X", "cc": "12.0"}], driver={"cuda": "12.8"},
              torch={"version": "2.7.1+cu128", "cuda": "12.8", "arch_list": ["sm_90", "compute_90"]})
    assert "TORCH_NO_KERNEL_IMAGE" not in ids(f)


def test_sass_same_family_higher_minor():
    f = facts(gpus=[{"index": 0, "name": "A10", "cc": "8.6"}], torch={"arch_list": ["sm_80"]})
    assert "TORCH_NO_KERNEL_IMAGE" not in ids(f)


def test_cc_from_name_when_missing():
    f = facts(driver={"version": "570.124.04", "kernel_module": "570.124.04", "cuda": "12.8"},
              gpus=[{"index": 0, "name": "NVIDIA GeForce RTX 5090", "cc": None}],
              torch={"version": "2.6.0+cu126", "cuda": "12.6"})
    assert "TORCH_NO_KERNEL_IMAGE" in ids(f)


def test_device_error_without_arch_list():
    f = facts(torch={"arch_list": None,
                     "device_error": "CUDA error: no kernel image is available for execution on the device"})
    assert "TORCH_NO_KERNEL_IMAGE" in ids(f)


@pytest.mark.parametrize("version", ["2.7.0.dev20250310+cu124", "2.6.0a0+ecf3bae40a.nv25.01", "garbage", ""])
def test_odd_torch_versions_do_not_crash(version):
    f = facts(torch={"version": version, "cuda": "cu121"})
    assert "INTERNAL_RULE_ERROR" not in ids(f)


def test_import_warning_without_arch_list():
    f = facts(gpus=[{"index": 0, "name": "NVIDIA GeForce RTX 5090", "cc": "12.0"}],
              driver={"cuda": "12.8", "version": "570.124.04", "kernel_module": "570.124.04"},
              torch={"version": "2.6.0+cu126", "cuda": "12.6", "arch_list": None,
                     "warnings": ["NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with "
                                  "the current PyTorch installation."]})
    fd = finding(f, "TORCH_NO_KERNEL_IMAGE")
    assert "sm_120" in fd["detail"]
    assert fd["fix"] == ["pip install torch==2.7.1 --index-url https://download.pytorch.org/whl/cu128"]


def _ids(facts_dict):
    from cudadoctor.rules import evaluate

    return [f.id for f in evaluate(facts_dict)]


def test_torch_import_failed_names_the_crash_and_how_to_see_it():
    from cudadoctor.rules import evaluate

    fs = evaluate({"python": {"executable": "/venv/bin/python"},
                   "torch": {"import_error": "killed by signal 11 (SIGSEGV) while importing torch"}})
    f = next(x for x in fs if x.id == "TORCH_IMPORT_FAILED")
    assert f.severity == "error" and "SIGSEGV" in f.detail
    assert any("-X faulthandler" in c for c in f.fix)


def test_torch_import_failed_defers_to_ld_library_path_for_library_errors():
    facts = {"torch": {"import_error": "OSError: libcudnn.so.9: cannot open shared object file"},
             "env": {"LD_LIBRARY_PATH": "/opt/cudnn/lib"}}
    assert "TORCH_IMPORT_FAILED" not in _ids(facts)
    facts["env"] = {}
    assert "TORCH_IMPORT_FAILED" in _ids(facts)


def test_torch_missing_is_info_not_an_import_failure():
    ids = _ids({"torch": {"import_error": "ModuleNotFoundError: No module named 'torch'"}})
    assert "TORCH_MISSING" in ids and "TORCH_IMPORT_FAILED" not in ids


def test_build_isolation_needs_both_the_message_and_the_isolated_build():
    text = "Getting requirements to build wheel ... error\nModuleNotFoundError: No module named 'torch'"
    assert "BUILD_ISOLATION_HIDES_TORCH" in _ids({"torch": {"version": "2.5.1"}, "error_text": text})
    # the same message outside a build is not this finding
    assert "BUILD_ISOLATION_HIDES_TORCH" not in _ids({"torch": {"version": "2.5.1"},
                                                      "error_text": "ModuleNotFoundError: No module named 'torch'"})
    # torch really missing: TORCH_MISSING, not build isolation
    ids = _ids({"torch": {"import_error": "No module named 'torch'"}, "error_text": text})
    assert "BUILD_ISOLATION_HIDES_TORCH" not in ids and "TORCH_MISSING" in ids


def test_torch_import_timeout_says_it_may_be_slow_not_hung_and_how_to_wait_longer():
    from cudadoctor.rules import evaluate

    fs = evaluate({"python": {"executable": "/venv/bin/python"},
                   "torch": {"import_error": "timed out after 20s while loading torch._C"}})
    f = next(x for x in fs if x.id == "TORCH_IMPORT_FAILED")
    assert f.title == "importing torch did not finish in time"
    assert "timed out after 20s" in f.detail and "cold disk cache" in f.detail
    assert f.fix[0].startswith("cudadoctor check --torch-timeout 180")
    assert any("-X faulthandler" in c for c in f.fix)
    # a crash is not called slow
    crash = next(x for x in evaluate({"torch": {"import_error": "killed by signal 11 (SIGSEGV) while importing torch"}})
                 if x.id == "TORCH_IMPORT_FAILED")
    assert crash.title == "importing torch fails" and not any("--torch-timeout" in c for c in crash.fix)

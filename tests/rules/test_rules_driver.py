"""Driver rules: NO_DRIVER, DRIVER_LIBRARY_MISMATCH, DRIVER_TOO_OLD, TOOLKIT_NEWER_THAN_DRIVER."""

import pytest

from factsbuilder import facts, finding, ids


def test_mismatch_from_versions():
    f = facts(driver={"version": "550.107.02", "kernel_module": "550.90.07"})
    fd = finding(f, "DRIVER_LIBRARY_MISMATCH")
    assert ids(f)[0] == "DRIVER_LIBRARY_MISMATCH"
    assert "sudo reboot" in fd["fix"]
    assert any("rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia" in x for x in fd["fix"])
    assert "550.90.07" in fd["detail"] and "550.107.02" in fd["detail"]


def test_mismatch_from_nvml_error_only():
    f = facts(driver={"version": None, "kernel_module": None, "cuda": None,
                      "error": "Failed to initialize NVML: Driver/library version mismatch"})
    got = ids(f)
    assert got[0] == "DRIVER_LIBRARY_MISMATCH"
    assert "NO_DRIVER" not in got


def test_same_versions_no_mismatch():
    assert "DRIVER_LIBRARY_MISMATCH" not in ids(facts())


def test_no_driver_with_gpu_and_module_not_loaded():
    f = facts(driver={"version": None, "cuda": None, "kernel_module": None,
                      "libcuda": ["/usr/lib/x86_64-linux-gnu/libcuda.so.1"],
                      "error": "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."},
              torch={"cuda_available": False})
    fd = finding(f, "NO_DRIVER")
    assert ids(f)[0] == "NO_DRIVER"
    assert any("dkms" in x for x in fd["fix"])
    assert any("nvidia-driver-550" in x for x in fd["fix"])  # torch cu124 needs R550


def test_no_driver_not_claimed_when_driver_section_unprobed():
    f = facts(driver=None, torch={"cuda_available": False})
    assert "NO_DRIVER" not in ids(f)


def test_no_driver_not_claimed_without_gpu_evidence():
    f = facts(gpus=[], driver={"version": None, "cuda": None, "kernel_module": None, "libcuda": [],
                               "device_nodes": [], "error": "NVML Shared Library Not Found"},
              torch={"cuda_available": False})
    assert "NO_DRIVER" not in ids(f)


def test_driver_too_old_across_major():
    f = facts(driver={"version": "470.182.03", "kernel_module": "470.182.03", "cuda": "11.4"},
              torch={"version": "2.1.0+cu121", "cuda": "12.1", "cuda_available": False})
    fd = finding(f, "DRIVER_TOO_OLD")
    assert ids(f)[0] == "DRIVER_TOO_OLD"
    assert any("530.30.02" in x for x in fd["fix"])
    assert any(x.endswith("pip install torch==2.1.0 --index-url https://download.pytorch.org/whl/cu118") for x in fd["fix"])


def test_minor_version_compat_covers_same_major():
    f = facts(driver={"version": "535.183.01", "kernel_module": "535.183.01", "cuda": "12.2"},
              torch={"version": "2.5.1+cu124", "cuda": "12.4"})
    assert "DRIVER_TOO_OLD" not in ids(f)


def test_below_minor_compat_floor():
    # an R520 driver reports CUDA 11.8; a 12.x runtime needs >= 525.60.13
    f = facts(driver={"version": "520.61.05", "kernel_module": "520.61.05", "cuda": "11.8"},
              torch={"version": "2.1.2+cu121", "cuda": "12.1"})
    assert "DRIVER_TOO_OLD" in ids(f)


def test_driver_cuda_derived_from_version_when_missing():
    f = facts(driver={"version": "470.57.02", "kernel_module": "470.57.02", "cuda": None},
              torch={"version": "2.1.0+cu121", "cuda": "12.1"})
    assert "DRIVER_TOO_OLD" in ids(f)


def test_driver_too_old_from_found_version_message():
    f = facts(driver={"version": None, "kernel_module": None, "cuda": None}, gpus=None,
              torch={"version": "2.1.0+cu121", "cuda": "12.1", "cuda_available": False},
              error_text="The NVIDIA driver on your system is too old (found version 11040).")
    assert ids(f)[0] == "DRIVER_TOO_OLD"


def test_windows_driver_column():
    f = facts(host={"os": "windows"}, driver={"version": "531.14", "kernel_module": None, "cuda": None},
              torch={"version": "2.1.2+cu121", "cuda": "12.1"})
    assert "DRIVER_TOO_OLD" not in ids(f)


@pytest.mark.parametrize("nvcc,driver_cuda,hit", [("12.8.61", "12.4", True), ("12.4.131", "12.4", False),
                                                  ("V12.1.105", "12.4", False)])
def test_toolkit_newer_than_driver(nvcc, driver_cuda, hit):
    f = facts(driver={"cuda": driver_cuda}, torch={"version": "2.5.1+cu124", "cuda": "12.4"},
              toolkits=[{"root": "/usr/local/cuda", "nvcc": nvcc, "via": ["PATH"]}])
    assert ("TOOLKIT_NEWER_THAN_DRIVER" in ids(f)) is hit
    if hit:
        fd = finding(f, "TOOLKIT_NEWER_THAN_DRIVER")
        assert fd["severity"] == "warning"
        assert 'export TORCH_CUDA_ARCH_LIST="8.9"' in " ".join(fd["fix"])

"""On a machine with an NVIDIA GPU: the probes see the driver, the GPUs and a working kernel launch."""

import os

import pytest

from cudadoctor.probes import collect_facts

pytestmark = pytest.mark.gpu


def _has_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/dxg")


@pytest.mark.skipif(not _has_gpu(), reason="no NVIDIA GPU device node (/dev/nvidiactl or /dev/dxg)")
def test_gpu_machine_facts():
    facts = collect_facts()
    drv = facts["driver"]
    assert drv["version"], drv
    assert drv["cuda"] and drv["cuda"].count(".") == 1
    assert facts["gpus"], facts["driver"]
    for g in facts["gpus"]:
        assert g["name"].startswith("NVIDIA") or g["name"]
        assert g["cc"] and "." in g["cc"]
    torch = facts["torch"]
    if torch.get("import_error") == "No module named 'torch'":
        pytest.skip("torch is not installed")
    assert torch["import_error"] is None
    assert torch["probe_mode"] == "full"
    if torch["cuda"]:  # a CUDA build on a healthy GPU machine launches a kernel
        assert torch["cuda_available"] is True
        assert torch["device_error"] is None, torch["device_error"]
        assert torch["devices"][0]["kernel_ok"] is True

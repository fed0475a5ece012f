"""Arch-list and environment rules: TORCH_CUDA_ARCH_LIST, CUDA_VISIBLE_DEVICES, LD_LIBRARY_PATH, ninja."""

import pytest

from factsbuilder import facts, finding, ids

NVCC13 = [{"root": "/usr/local/cuda-13.0", "nvcc": "13.0.88", "via": ["PATH", "CUDA_HOME"]}]


def test_arch_list_names_arch_removed_from_nvcc():
    f = facts(toolkits=NVCC13, env={"TORCH_CUDA_ARCH_LIST": "7.0;8.0;8.9+PTX"},
              torch={"version": "2.14.1", "cuda": "13.0"}, driver={"cuda": "13.0", "version": "580.65.06",
                                                                   "kernel_module": "580.65.06"})
    fd = finding(f, "ARCH_LIST_UNSUPPORTED")
    assert ids(f)[0] == "ARCH_LIST_UNSUPPORTED"
    assert fd["fix"] == ['export TORCH_CUDA_ARCH_LIST="8.0;8.9+PTX"']
    assert "'7.0'" in fd["detail"]


def test_arch_list_garbage_token():
    f = facts(env={"TORCH_CUDA_ARCH_LIST": "8.9;sm_banana"})
    assert "ARCH_LIST_UNSUPPORTED" in ids(f)


@pytest.mark.parametrize("value", ["8.9", "8.6 8.9+PTX", "Ada", "native", "8.0;8.6;9.0"])
def test_arch_list_fine(value):
    f = facts(env={"TORCH_CUDA_ARCH_LIST": value})
    assert "ARCH_LIST_UNSUPPORTED" not in ids(f), value
    assert "ARCH_LIST_EXCLUDES_GPU" not in ids(f), value


def test_arch_list_excludes_gpu():
    f = facts(env={"TORCH_CUDA_ARCH_LIST": "7.5;8.0"},
              gpus=[{"index": 0, "name": "NVIDIA H100", "cc": "9.0"}])
    fd = finding(f, "ARCH_LIST_EXCLUDES_GPU")
    assert fd["fix"][0] == 'export TORCH_CUDA_ARCH_LIST="9.0"'


def test_arch_list_ptx_covers_gpu():
    f = facts(env={"TORCH_CUDA_ARCH_LIST": "8.0+PTX"}, gpus=[{"index": 0, "name": "H100", "cc": "9.0"}])
    assert "ARCH_LIST_EXCLUDES_GPU" not in ids(f)


def test_report_recommends_arch_list():
    from cudadoctor.doctor import diagnose

    f = facts(gpus=[{"index": 0, "name": "A", "cc": "8.9"}, {"index": 1, "name": "B", "cc": "8.6"}])
    assert diagnose(f)["torch_cuda_arch_list"] == "8.6;8.9"
    assert diagnose(facts(gpus=[]))["torch_cuda_arch_list"] is None


@pytest.mark.parametrize("value", ["", "-1", "2", "NoDevFiles", "GPU-deadbeef"])
def test_cuda_visible_devices_hides(value):
    f = facts(env={"CUDA_VISIBLE_DEVICES": value},
              gpus=[{"index": 0, "name": "RTX", "cc": "8.9", "uuid": "GPU-12345678-aaaa"}])
    fd = finding(f, "CUDA_VISIBLE_DEVICES_HIDES")
    assert fd["fix"][0] == "unset CUDA_VISIBLE_DEVICES"


@pytest.mark.parametrize("value", ["0", "0,1", "GPU-1234", "MIG-abc"])
def test_cuda_visible_devices_fine(value):
    f = facts(env={"CUDA_VISIBLE_DEVICES": value},
              gpus=[{"index": 0, "name": "RTX", "cc": "8.9", "uuid": "GPU-12345678-aaaa"}])
    assert "CUDA_VISIBLE_DEVICES_HIDES" not in ids(f)


def test_ld_library_path_shadow_names_entry_to_drop():
    f = facts(env={"LD_LIBRARY_PATH": "/usr/local/cuda-11.8/lib64:/opt/other/lib"})
    fd = finding(f, "LD_LIBRARY_PATH_SHADOW")
    assert fd["fix"][0] == "export LD_LIBRARY_PATH=/opt/other/lib"
    assert "/usr/local/cuda-11.8/lib64" in fd["detail"]


def test_ld_library_path_same_cuda_is_fine():
    f = facts(env={"LD_LIBRARY_PATH": "/usr/local/cuda-12.4/lib64:/usr/lib/wsl/lib"})
    assert "LD_LIBRARY_PATH_SHADOW" not in ids(f)


def test_ld_library_path_cudnn_only_entry_unsets():
    f = facts(env={"LD_LIBRARY_PATH": "/opt/cudnn/lib"})
    assert finding(f, "LD_LIBRARY_PATH_SHADOW")["fix"][0] == "unset LD_LIBRARY_PATH"


def test_ninja_missing():
    f = facts(tools={"ninja": None, "compute_sanitizer": None, "docker": "24.0.7"})
    assert finding(f, "NINJA_MISSING")["fix"][0].startswith("pip install ninja")


@pytest.mark.parametrize("tools", [None, {}, {"ninja": "1.11.1"}])
def test_ninja_not_claimed(tools):
    assert "NINJA_MISSING" not in ids(facts(tools=tools))


def test_arch_list_uses_the_nvcc_own_target_list():
    tk = [{"root": "/opt/cuda", "nvcc": "12.8.61", "via": ["PATH"],
           "targets": ["compute_75", "compute_80", "compute_86", "compute_89", "compute_90"]}]
    f = facts(toolkits=tk, env={"TORCH_CUDA_ARCH_LIST": "7.0;8.9"}, torch={"version": "2.7.1+cu128", "cuda": "12.8"},
              driver={"cuda": "12.8", "version": "570.124.06", "kernel_module": "570.124.06"})
    fd = finding(f, "ARCH_LIST_UNSUPPORTED")  # the table says 12.8 can do 7.0; this nvcc says it cannot
    assert fd["fix"] == ['export TORCH_CUDA_ARCH_LIST="8.9"']

"""Platform rules: containers without GPUs or capabilities, WSL driver layout, NO_GPU."""

from factsbuilder import facts, finding, ids

NO_GPU_CONTAINER = dict(
    host={"container": "docker"},
    driver={"version": None, "kernel_module": None, "cuda": None, "libcuda": [], "device_nodes": [],
            "error": "NVML: NVML Shared Library Not Found"},
    gpus=[],
    torch={"cuda_available": False},
)


def test_container_without_gpus_with_nvidia_image_env():
    f = facts(env={"NVIDIA_VISIBLE_DEVICES": "all"}, **NO_GPU_CONTAINER)
    got = ids(f)
    assert got[0] == "CONTAINER_NO_GPU"
    assert "NO_DRIVER" not in got and "DRIVER_TOO_OLD" not in got
    fix = finding(f, "CONTAINER_NO_GPU")["fix"]
    assert any("docker run --gpus all" in x for x in fix)


def test_visible_devices_void_is_no_gpu_even_with_devices_listed():
    f = facts(host={"container": "docker"}, env={"NVIDIA_VISIBLE_DEVICES": "void"})
    assert "CONTAINER_NO_GPU" in ids(f)


def test_cpu_only_container_without_gpu_intent_is_info_only():
    f = facts(**NO_GPU_CONTAINER)
    f["torch"]["cuda"] = None
    f["torch"]["version"] = "2.5.1+cpu"
    got = ids(f)
    assert "CONTAINER_NO_GPU" not in got
    assert "NO_GPU" in got


def test_kubernetes_fix_names_the_resource_limit():
    f = facts(env={"NVIDIA_VISIBLE_DEVICES": "all"}, **{**NO_GPU_CONTAINER, "host": {"container": "kubernetes"}})
    assert "nvidia.com/gpu" in finding(f, "CONTAINER_NO_GPU")["fix"][0]


def test_container_with_gpu_is_clean():
    assert "CONTAINER_NO_GPU" not in ids(facts(host={"container": "docker"}))


def test_capabilities_without_compute():
    f = facts(host={"container": "docker"}, env={"NVIDIA_DRIVER_CAPABILITIES": "utility"},
              driver={"version": None, "cuda": None, "libcuda": [], "kernel_module": None}, gpus=[])
    got = ids(f)
    assert got[0] == "CONTAINER_CAPABILITIES"
    assert "CONTAINER_NO_GPU" not in got
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in finding(f, "CONTAINER_CAPABILITIES")["fix"][0]


def test_capabilities_all_or_complete_are_fine():
    for caps in ("all", "compute,utility", "compute,utility,video"):
        f = facts(host={"container": "docker"}, env={"NVIDIA_DRIVER_CAPABILITIES": caps})
        assert "CONTAINER_CAPABILITIES" not in ids(f), caps


def test_capabilities_ignored_outside_containers():
    assert "CONTAINER_CAPABILITIES" not in ids(facts(env={"NVIDIA_DRIVER_CAPABILITIES": "utility"}))


WSL = {"wsl": 2, "kernel": "5.15.153.1-microsoft-standard-WSL2"}


def test_wsl_linux_driver_shadows():
    f = facts(host=WSL, driver={"kernel_module": None, "libcuda": [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1"]})
    fd = finding(f, "WSL_LINUX_DRIVER")
    assert ids(f)[0] == "WSL_LINUX_DRIVER"
    assert any("apt-get purge 'nvidia-*'" in x for x in fd["fix"])
    assert any("rm -f /usr/lib/x86_64-linux-gnu/libcuda.so.1" in x for x in fd["fix"])
    assert "WSL_LIBCUDA_MISSING" not in ids(f)


def test_wsl_healthy_layout():
    f = facts(host=WSL, driver={"kernel_module": None, "libcuda": ["/usr/lib/wsl/lib/libcuda.so.1"]})
    got = ids(f)
    assert "WSL_LINUX_DRIVER" not in got and "WSL_LIBCUDA_MISSING" not in got
    assert "DRIVER_LIBRARY_MISMATCH" not in got


def test_wsl_libcuda_missing():
    f = facts(host=WSL, driver={"version": None, "cuda": None, "kernel_module": None, "libcuda": []}, gpus=[])
    got = ids(f)
    assert got[0] == "WSL_LIBCUDA_MISSING"
    assert "NO_DRIVER" not in got


def test_wsl_unknown_libcuda_says_nothing():
    f = facts(host=WSL, driver={"libcuda": None, "kernel_module": None})
    assert "WSL_LIBCUDA_MISSING" not in ids(f)


def test_no_gpu_info_on_plain_machine():
    f = facts(gpus=[], driver={"version": None, "kernel_module": None, "cuda": None, "libcuda": [],
                               "device_nodes": [], "error": "NVML Shared Library Not Found"},
              torch={"cuda_available": False})
    fd = finding(f, "NO_GPU")
    assert fd["severity"] == "info"


def test_no_gpu_dropped_when_an_error_exists():
    f = facts(gpus=[], driver={"version": None, "kernel_module": None, "cuda": None, "libcuda": [],
                               "device_nodes": []},
              torch={"cuda_available": False}, host_compiler={"version": "14.1.0"},
              toolkits=[{"root": "/usr/local/cuda-12.0", "nvcc": "12.0.140", "via": ["PATH"]}])
    got = ids(f)
    assert "HOST_COMPILER_UNSUPPORTED" in got and "NO_GPU" not in got


def test_no_gpu_needs_probed_gpus():
    assert "NO_GPU" not in ids(facts(gpus=None, driver=None))


def test_unrelated_error_text_is_no_gpu_intent():
    f = facts(**NO_GPU_CONTAINER, error_text="error: #error -- unsupported GNU version!")
    assert "CONTAINER_NO_GPU" not in ids(f)
    g = facts(**NO_GPU_CONTAINER, error_text="bash: nvidia-smi: command not found")
    assert ids(g)[0] == "CONTAINER_NO_GPU"

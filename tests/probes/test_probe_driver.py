import os
import sys
import time

from fakes.runner import ScriptedRunner, recorded
from fakes.trees import EXE, FAKES

from cudadoctor.probes import collect_facts
from cudadoctor.probes._fs import Root
from cudadoctor.probes.driver import (
    NVML_TAG,
    find_libcuda,
    kernel_module_version,
    parse_smi_csv,
    probe_driver,
    query_nvml,
)
from cudadoctor.runner import Runner

NVML_FAIL = 'CUDADOCTOR_NVML {"driver": null, "cuda": null, "gpus": [], "error": "%s"}\n'


def test_kernel_module_proprietary(tree):
    root = tree({"/proc/driver/nvidia/version": recorded("proc-driver-nvidia-version-550.txt")})
    assert kernel_module_version(Root(str(root)))[0] == "550.54.15"


def test_kernel_module_open(tree):
    root = tree({"/proc/driver/nvidia/version": recorded("proc-driver-nvidia-version-570-open.txt")})
    assert kernel_module_version(Root(str(root)))[0] == "570.86.15"


def test_kernel_module_absent(tree):
    assert kernel_module_version(Root(str(tree({}))))[0] is None


def test_smi_csv_two_h100():
    gpus = parse_smi_csv(recorded("nvidia-smi-query-gpu-h100x2-550.txt"))
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert gpus[0]["cc"] == "9.0"
    assert gpus[0]["memory_mib"] == 81559
    assert gpus[1]["pci_bus_id"] == "00000000:2A:00.0"
    assert gpus[0]["driver_version"] == "550.54.15"


def test_smi_csv_without_compute_cap():
    (g,) = parse_smi_csv(recorded("nvidia-smi-query-gpu-rtx3090-470.txt"))
    assert g["name"] == "NVIDIA GeForce RTX 3090"
    assert "cc" not in g
    assert g["memory_mib"] == 24268
    assert g["driver_version"] == "470.223.02"


def test_smi_csv_ignores_error_text():
    assert parse_smi_csv(recorded("nvidia-smi-mismatch.txt")) == []


def test_libcuda_search_order_and_dedup(tree):
    root = tree(
        {
            "/opt/old-driver/libcuda.so.1": "",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05": "",
            "/usr/lib/i386-linux-gnu/libcuda.so.1": "",
        },
        links={
            "/lib": "usr/lib",
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1": "libcuda.so.535.104.05",
        },
    )
    runner = ScriptedRunner([(("ldconfig", "-C", str(root / "etc/ld.so.cache"), "-p"),
                              recorded("ldconfig-p-ubuntu2204-driver550.txt"))])
    env = {"LD_LIBRARY_PATH": "/opt/old-driver:/nonexistent"}
    paths, details, err = find_libcuda(runner, Root(str(root)), env, "x86_64")
    assert err is None
    # LD_LIBRARY_PATH first; /lib is /usr/lib so the cache entry and the default dir are one file;
    # the i386 copy is not loadable by a 64-bit process
    assert paths == ["/opt/old-driver/libcuda.so.1", "/lib/x86_64-linux-gnu/libcuda.so.1"]
    assert details[1]["realpath"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05"
    assert details[1]["version"] == "535.104.05"
    assert [d["via"] for d in details] == ["LD_LIBRARY_PATH", "ld.so.cache"]


def test_libcuda_wsl2(tree):
    root = tree({"/usr/lib/wsl/lib/libcuda.so.1": "", "/usr/lib/wsl/lib/libcuda.so": ""})
    runner = ScriptedRunner([(("ldconfig",), recorded("ldconfig-p-wsl2-ubuntu2204.txt"))])
    runner.add(("ldconfig", "-C", str(root / "etc/ld.so.cache"), "-p"), recorded("ldconfig-p-wsl2-ubuntu2204.txt"))
    paths, _, _ = find_libcuda(runner, Root(str(root)), {}, "x86_64")
    assert paths == ["/usr/lib/wsl/lib/libcuda.so.1"]


def test_libcuda_wsl2_with_linux_driver_inside(tree):
    root = tree({"/usr/lib/wsl/lib/libcuda.so.1": "", "/lib/x86_64-linux-gnu/libcuda.so.1": ""})
    runner = ScriptedRunner([(("ldconfig", "-C", str(root / "etc/ld.so.cache"), "-p"),
                              recorded("ldconfig-p-wsl2-linux-driver-installed.txt"))])
    paths, _, _ = find_libcuda(runner, Root(str(root)), {}, "x86_64")
    assert paths == ["/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1"]


def test_libcuda_without_ldconfig_still_checks_dirs(tree):
    root = tree({"/usr/lib/wsl/lib/libcuda.so.1": ""})
    paths, _, err = find_libcuda(ScriptedRunner(), Root(str(root)), {}, "x86_64")
    assert paths == ["/usr/lib/wsl/lib/libcuda.so.1"]
    assert "not found" in err


def test_nvml_mismatch_from_recorded_child(tree):
    root = tree({"/proc/driver/nvidia/version": recorded("proc-driver-nvidia-version-550.txt"),
                 "/usr/bin/nvidia-smi": EXE, "/dev/nvidiactl": "", "/dev/nvidia0": ""})
    runner = ScriptedRunner([
        (NVML_TAG, NVML_FAIL % "Driver/library version mismatch"),
        (("nvidia-smi", "--query-gpu=index,name,compute_cap,memory.total,uuid,pci.bus_id,driver_version",
          "--format=csv,noheader"), (18, recorded("nvidia-smi-mismatch.txt"), "")),
    ])
    driver, gpus = probe_driver(runner, Root(str(root)), {"PATH": "/usr/bin"}, arch="x86_64")
    assert driver["error"] == "NVML: Driver/library version mismatch"
    assert driver["nvml_error"] == "Driver/library version mismatch"
    assert driver["smi_error"].startswith("Failed to initialize NVML: Driver/library version mismatch")
    assert driver["kernel_module"] == "550.54.15"
    assert driver["version"] is None
    assert driver["device_nodes"] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert gpus == []


def test_smi_fallback_when_nvml_fails(tree):
    root = tree({"/usr/bin/nvidia-smi": EXE})
    smi = str(root / "usr/bin/nvidia-smi")
    runner = ScriptedRunner([
        (NVML_TAG, NVML_FAIL % "NVML Shared Library Not Found"),
        ((smi, "--query-gpu=index,name,compute_cap,memory.total,uuid,pci.bus_id,driver_version",
          "--format=csv,noheader"), recorded("nvidia-smi-query-gpu-h100x2-550.txt")),
        ((smi,), recorded("nvidia-smi-plain-h100-550.txt")),
    ])
    driver, gpus = probe_driver(runner, Root(str(root)), {"PATH": "/usr/bin"}, arch="x86_64")
    assert driver["version"] == "550.54.15"
    assert driver["cuda"] == "12.4"
    assert driver["source"] == "nvidia-smi"
    assert driver["error"] is None
    assert len(gpus) == 2 and gpus[0]["cc"] == "9.0"


def test_smi_old_driver_retries_without_compute_cap(tree):
    root = tree({"/usr/bin/nvidia-smi": EXE})
    full = "index,name,compute_cap,memory.total,uuid,pci.bus_id,driver_version"
    runner = ScriptedRunner([
        (NVML_TAG, NVML_FAIL % "Unknown Error"),
        (("nvidia-smi", f"--query-gpu={full}", "--format=csv,noheader"),
         (2, recorded("nvidia-smi-query-gpu-470-no-compute-cap.txt"), "")),
        (("nvidia-smi", f"--query-gpu={full.replace('compute_cap,', '')}", "--format=csv,noheader"),
         recorded("nvidia-smi-query-gpu-rtx3090-470.txt")),
    ])
    driver, gpus = probe_driver(runner, Root(str(root)), {"PATH": "/usr/bin"}, arch="x86_64")
    assert driver["version"] == "470.223.02"
    assert gpus[0]["name"] == "NVIDIA GeForce RTX 3090"


def _pypath(*dirs):
    return os.pathsep.join(str(d) for d in dirs)


def test_nvml_missing_real_child_no_crash():
    # this machine has no libnvidia-ml; the real pynvml child reports it and nothing raises
    out = query_nvml(Runner(), sys.executable, 10, dict(os.environ))
    assert out["driver"] is None or isinstance(out["driver"], str)
    if out["driver"] is None:
        assert out["error"]


def test_nvml_fake_mismatch_verbatim():
    env = dict(os.environ, PYTHONPATH=_pypath(FAKES / "pynvml_mismatch"))
    out = query_nvml(Runner(), sys.executable, 10, env)
    assert out["error"] == "Driver/library version mismatch"


def test_nvml_fake_h200():
    env = dict(os.environ, PYTHONPATH=_pypath(FAKES / "pynvml_h200"))
    out = query_nvml(Runner(), sys.executable, 10, env)
    assert out["error"] is None
    assert out["driver"] == "570.133.20"
    assert out["cuda"] == "12.8"
    assert out["gpus"] == [{"index": 0, "source": "nvml", "name": "NVIDIA H200", "cc": "9.0",
                            "memory_mib": 143771, "uuid": "GPU-3f1c2b7a-8e4d-4c6b-a1f2-9d0e8c7b6a54",
                            "pci_bus_id": "00000000:19:00.0"}]


def test_nvml_hang_is_bounded():
    env = dict(os.environ, PYTHONPATH=_pypath(FAKES / "pynvml_hang"))
    t0 = time.monotonic()
    out = query_nvml(Runner(), sys.executable, 2, env)
    assert time.monotonic() - t0 < 6
    assert "timed out after 2s" in out["error"]


def test_hanging_nvidia_smi_on_path_is_bounded():
    """NVML absent (or failing) and an nvidia-smi that never returns: collect_facts finishes within
    smi_timeout + a few seconds and says why in the driver section."""
    env = dict(os.environ, PATH=_pypath(FAKES / "bin_smi_hang", os.environ.get("PATH", "")),
               PYTHONPATH=_pypath(FAKES / "pynvml_mismatch"))
    t0 = time.monotonic()
    facts = collect_facts(env=env, torch_mode="skip", smi_timeout=2)
    elapsed = time.monotonic() - t0
    assert elapsed < 8, elapsed
    d = facts["driver"]
    assert d["smi_error"] == "nvidia-smi: timed out after 2s"
    assert d["error"] == "NVML: Driver/library version mismatch"
    assert facts["gpus"] == []


def test_cpu_machine_has_no_driver_error(tree):
    """No device node, module, libcuda or nvidia-smi: nothing is wrong with a driver that is absent."""
    runner = ScriptedRunner([(NVML_TAG, NVML_FAIL % "NVML Shared Library Not Found")])
    driver, gpus = probe_driver(runner, Root(str(tree({}))), {"PATH": "/usr/bin"}, arch="x86_64")
    assert driver["error"] is None
    assert driver["nvml_error"] == "NVML Shared Library Not Found"
    assert driver["smi_error"] == "nvidia-smi not found"
    assert driver["version"] is None and gpus == []


def test_device_nodes_without_driver_is_an_error(tree):
    root = tree({"/dev/nvidia0": "", "/dev/nvidiactl": ""})
    runner = ScriptedRunner([(NVML_TAG, NVML_FAIL % "NVML Shared Library Not Found")])
    driver, _ = probe_driver(runner, Root(str(root)), {"PATH": "/usr/bin"}, arch="x86_64")
    assert driver["error"] == "NVML: NVML Shared Library Not Found"

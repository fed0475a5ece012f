"""collect_facts end to end: on fake trees with recorded outputs, and on this machine for real."""

import json
import os
import shutil
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from fakes.runner import ScriptedRunner, recorded
from fakes.trees import EXE, FAKES

from cudadoctor.probes import SCHEMA, collect_facts
from cudadoctor.probes.driver import NVML_TAG
from cudadoctor.probes.torch_probe import MARK, TORCH_TAG

SPEC_KEYS = {
    None: ["schema", "collected_at", "host", "driver", "gpus", "toolkits", "host_compiler", "python",
           "torch", "env", "tools", "extensions", "error_text"],
    "host": ["os", "arch", "distro", "glibc", "kernel", "wsl", "container"],
    "driver": ["version", "kernel_module", "cuda", "libcuda", "error"],
    "host_compiler": ["name", "version", "path"],
    "python": ["version", "executable"],
    "torch": ["version", "cuda", "arch_list", "cxx11_abi", "cudnn", "cuda_available", "device_error", "import_error"],
    "env": ["TORCH_CUDA_ARCH_LIST", "CUDA_HOME", "CUDA_PATH", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "PATH",
            "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CC", "CXX", "CUDAHOSTCXX", "MAX_JOBS"],
    "tools": ["ninja", "compute_sanitizer", "docker"],
}


def assert_spec_shape(facts):
    for section, keys in SPEC_KEYS.items():
        obj = facts if section is None else facts[section]
        assert isinstance(obj, dict), section
        missing = [k for k in keys if k not in obj]
        assert not missing, (section, missing)
    assert facts["schema"] == SCHEMA
    assert facts["collected_at"].endswith("Z")
    json.dumps(facts)  # plain JSON data


WSL_TORCH = {
    "stage": "done",
    "python": {"version": "3.10.12", "executable": "/usr/bin/python3"},
    "torch": {"version": "2.3.1+cu121", "cuda": "12.1", "arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"],
              "cxx11_abi": False, "cudnn": "8.9.2", "cuda_available": True, "device_error": None, "import_error": None,
              "probe_mode": "full", "devices": [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "cc": "8.9", "kernel_ok": True}]},
    "site_dirs": ["/usr/lib/python3/dist-packages"],
}


def test_wsl2_docker_tree_from_recorded_outputs(tree):
    root = tree({
        "/etc/os-release": recorded("os-release-ubuntu2204.txt"),
        "/proc/version": recorded("proc-version-wsl2.txt"),
        "/proc/sys/kernel/osrelease": "5.15.153.1-microsoft-standard-WSL2\n",
        "/dev/dxg": "",
        "/.dockerenv": "",
        "/usr/lib/wsl/lib/libcuda.so.1": "",
        "/usr/local/cuda-12.1/bin/nvcc": EXE,
        "/usr/local/cuda-12.1/include/cuda_runtime_api.h": "",
        "/usr/bin/g++": EXE,
    }, links={"/usr/local/cuda": "cuda-12.1"})
    nvcc = str(root / "usr/local/cuda-12.1/bin/nvcc")
    runner = ScriptedRunner([
        (TORCH_TAG, MARK + json.dumps(WSL_TORCH) + "\n"),
        (NVML_TAG, 'CUDADOCTOR_NVML {"driver": null, "cuda": null, "gpus": [], "error": "NVML Shared Library Not Found"}\n'),
        (("ldconfig", "-C", str(root / "etc/ld.so.cache"), "-p"), recorded("ldconfig-p-wsl2-ubuntu2204.txt")),
        (("ldd", "--version"), recorded("ldd-version-ubuntu2204.txt")),
        ((nvcc, "--version"), recorded("nvcc-version-12.1.txt")),
        ((nvcc, "--list-gpu-arch"), recorded("nvcc-list-gpu-arch-12.1.txt")),
        (("g++", "--version"), recorded("gpp-version-ubuntu2204-gcc11.txt")),
        (("g++", "-dumpfullversion", "-dumpversion"), "11.4.0\n"),
    ])
    env = {"PATH": "/usr/local/cuda/bin:/usr/bin", "TORCH_CUDA_ARCH_LIST": "8.9"}
    facts = collect_facts(runner, root=str(root), env=env, python="/usr/bin/python3")
    assert_spec_shape(facts)
    assert facts["host"]["wsl"] == 2 and facts["host"]["container"] == "docker"
    assert facts["host"]["distro"] == "Ubuntu 22.04" and facts["host"]["glibc"] == "2.35"
    assert facts["driver"]["libcuda"] == ["/usr/lib/wsl/lib/libcuda.so.1"]
    assert facts["driver"]["kernel_module"] is None
    assert facts["driver"]["error"] == "NVML: NVML Shared Library Not Found"
    assert facts["gpus"] == [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "cc": "8.9", "kernel_ok": True, "source": "torch"}]
    assert facts["toolkits"][0]["root"] == "/usr/local/cuda" and facts["toolkits"][0]["nvcc"] == "12.1.105"
    hc = facts["host_compiler"]
    assert {k: hc[k] for k in ("name", "version", "path", "version_line", "via")} == {
        "name": "gcc", "version": "11.4.0", "path": "/usr/bin/g++",
        "version_line": "g++ (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0", "via": "PATH"}
    # -print-file-name was not scripted here: the runtime is unknown, not guessed
    assert hc["links_static_libstdcxx"] is None and "candidates" not in hc
    assert facts["python"]["version"] == "3.10.12"
    assert facts["torch"]["version"] == "2.3.1+cu121" and facts["torch"]["cuda_available"] is True
    assert facts["env"]["TORCH_CUDA_ARCH_LIST"] == "8.9" and facts["env"]["CUDA_HOME"] is None
    assert facts["tools"]["ninja"] is None and facts["tools"]["docker"] is None
    assert facts["extensions"] == [] and facts["error_text"] is None


def test_everything_fails_still_a_snapshot(tree):
    """No command answers, the tree is empty: every section is present, None or with an error."""
    facts = collect_facts(ScriptedRunner(), root=str(tree({})), env={}, python="/no/python")
    assert_spec_shape(facts)
    assert facts["torch"]["import_error"] and facts["torch"]["version"] is None
    assert facts["toolkits"] == [] and facts["gpus"] == []
    assert facts["driver"]["libcuda"] == []
    assert facts["host_compiler"]["path"] is None and facts["host_compiler"]["error"]


def test_a_probe_that_raises_becomes_an_error(tree, monkeypatch):
    import cudadoctor.probes as probes

    def boom(*a, **k):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(probes, "probe_host", boom)
    facts = collect_facts(ScriptedRunner(), root=str(tree({})), env={}, torch_mode="skip")
    assert facts["host"] == {"error": "RuntimeError: probe exploded"}
    assert facts["probe"]["errors"]["host"] == "RuntimeError: probe exploded"


REAL_NVCC = "/usr/local/cuda/bin/nvcc"


@pytest.mark.skipif(not os.path.exists(REAL_NVCC), reason="needs the CUDA toolkit at /usr/local/cuda")
def test_this_machine_for_real():
    """This CPU machine: nvcc 13.0 at /usr/local/cuda without cusparse.h/cublas_v2.h, which the torch
    wheel's nvidia/cu13 package carries in site-packages; torch installed, no GPU."""
    t0 = time.monotonic()
    facts = collect_facts()
    elapsed = time.monotonic() - t0
    assert_spec_shape(facts)
    assert elapsed < 30
    tks = {os.path.realpath(t["root"]): t for t in facts["toolkits"]}
    tk = tks[os.path.realpath("/usr/local/cuda")]
    assert tk["nvcc"].startswith("13.0")
    assert "/usr/local/cuda" in tk["via"]
    assert "cusparse.h" in tk["headers_missing"] and "cublas_v2.h" in tk["headers_missing"]
    where = tk["headers_elsewhere"]["cusparse.h"]
    assert any(p.endswith("site-packages/nvidia/cu13/include/cusparse.h") for p in where), where
    assert facts["toolkits"][0]["torch_would_use"]
    assert "cusparse.h" in facts["toolkits"][0]["headers_unresolved"]
    if shutil.which("g++"):
        assert facts["host_compiler"]["name"] == "gcc"
    torch = facts["torch"]
    if torch.get("path"):
        assert torch["import_error"] is None
        assert torch["version"].startswith("2.")
        assert isinstance(torch["arch_list"], list)
    if not facts["driver"]["device_nodes"]:
        assert facts["gpus"] == []
        assert facts["torch"]["cuda_available"] in (False, None)


def test_everything_hangs_within_the_stated_bound():
    """torch hangs on import, NVML hangs in nvmlInit, nvidia-smi never returns: the snapshot still
    comes back within max(torch_timeout + 2, nvml_timeout + 3 * smi_timeout + 7) seconds."""
    env = dict(os.environ,
               PATH=os.pathsep.join([str(FAKES / "bin_smi_hang"), os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([str(FAKES / "torch_hang"), str(FAKES / "pynvml_hang")]))
    t0 = time.monotonic()
    facts = collect_facts(env=env, torch_timeout=3, nvml_timeout=2, smi_timeout=2)
    elapsed = time.monotonic() - t0
    assert elapsed < max(3 + 2, 2 + 3 * 2 + 7), elapsed
    assert_spec_shape(facts)
    assert facts["torch"]["import_error"] == "timed out after 3s while importing torch"
    assert "timed out after 2s" in facts["driver"]["nvml_error"]
    assert facts["driver"]["smi_error"] == "nvidia-smi: timed out after 2s"


_ENV_NAMES = ["CUDA_HOME", "CUDA_PATH", "PATH", "LD_LIBRARY_PATH", "CXX", "CUDAHOSTCXX", "CC", "CPATH",
              "CONDA_PREFIX", "KUBERNETES_SERVICE_HOST", "container", "CUDA_INC_PATH", "CUDNN_HOME"]
_VALUES = st.one_of(st.sampled_from(["", "/", ":", "::/usr/bin:", "/nonexistent", "relative/dir", "/usr/local/cuda/",
                                     "g++ -std=c++17", "'unterminated", "/dev/null", "docker", "\x00x"]),
                    st.text(max_size=20))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(env=st.dictionaries(st.sampled_from(_ENV_NAMES), _VALUES, max_size=8))
def test_odd_environments_never_raise(tmp_path_factory, env):
    root = tmp_path_factory.mktemp("odd")
    (root / "usr/local/cuda-12.1/bin").mkdir(parents=True)
    (root / "usr/local/cuda").symlink_to("cuda-12.1")
    (root / "proc").mkdir()
    (root / "proc/version").write_bytes(b"\xff\xfe garbage \x00")
    facts = collect_facts(ScriptedRunner(), root=str(root), env=env, torch_mode="skip")
    assert_spec_shape({**facts, "torch": dict.fromkeys(SPEC_KEYS["torch"])})
    assert facts["probe"]["errors"] is None, facts["probe"]["errors"]


def test_extra_probes_run_alongside(tree):
    def boom():
        raise OSError("unreadable wheel")

    facts = collect_facts(ScriptedRunner(), root=str(tree({})), env={}, torch_mode="skip",
                          extra={"extensions": lambda: [{"path": "/x/_C.so", "sass": ["sm_90"], "ptx": []}],
                                 "error_text": boom})
    assert facts["extensions"] == [{"path": "/x/_C.so", "sass": ["sm_90"], "ptx": []}]
    assert facts["error_text"] is None
    assert facts["probe"]["errors"]["error_text"] == "OSError: unreadable wheel"


@pytest.mark.skipif(not os.path.exists(REAL_NVCC), reason="needs the CUDA toolkit at /usr/local/cuda")
def test_this_machine_torch_include_and_libraries():
    facts = collect_facts()
    torch = facts["torch"]
    if not torch.get("path"):
        pytest.skip("torch is not installed")
    assert torch["cuda_include_dirs"][0] == os.path.join(torch["path"], "include")
    assert torch["cuda_include_dirs"][2:] == facts["toolkits"][0]["build_include_path"]
    if torch["cuda"]:
        # the CUDA runtime torch itself maps, whatever LD_LIBRARY_PATH says
        assert any("libcudart.so" in p for p in torch["library_paths"]), torch["library_paths"]


def test_orchestration_failure_still_gives_a_snapshot(monkeypatch):
    import cudadoctor.probes as probes

    def broken_root(path):
        raise RuntimeError("cannot start")

    monkeypatch.setattr(probes, "Root", broken_root)
    facts = collect_facts(ScriptedRunner(), env={}, torch_mode="skip")
    assert facts["schema"] == SCHEMA and facts["host"] is None and facts["gpus"] == []
    assert facts["probe"]["errors"] == {"collect": "RuntimeError: cannot start"}


def test_host_reports_cpus_and_available_memory():
    from cudadoctor.probes import collect_facts
    from cudadoctor.probes.host import mem_available_gib

    host = collect_facts()["host"]
    assert host["cpus"] == len(os.sched_getaffinity(0))
    assert isinstance(host["mem_available_gib"], float) and host["mem_available_gib"] > 0
    assert mem_available_gib("MemTotal: 100 kB\nMemAvailable:   25165824 kB\n") == 24.0
    assert mem_available_gib("garbage") is None and mem_available_gib(None) is None

import copy
import socket

from cudadoctor.redact import redact

FACTS = {
    "schema": "cudadoctor.facts/1",
    "host": {"distro": "Ubuntu 22.04", "glibc": "2.35", "kernel": "5.15.153.1-microsoft-standard-WSL2", "wsl": 2},
    "driver": {"version": "550.54.15", "libcuda": ["/usr/lib/wsl/lib/libcuda.so.1"]},
    "python": {"version": "3.11.7", "executable": "/home/alice/.venvs/ml/bin/python"},
    "torch": {"version": "2.3.1+cu121", "import_error": "No module named 'torch'",
              "path": "/Users/bob/miniconda3/lib/python3.11/site-packages/torch"},
    "toolkits": [{"root": "/root/cuda-12.1", "nvcc": "12.1.105", "via": ["CUDA_HOME"]}],
    "env": {"PATH": "/home/alice/.local/bin:/usr/local/cuda/bin:/usr/bin", "CUDA_HOME": "/root/cuda-12.1",
            "MAX_JOBS": None},
    "gpus": [{"index": 0, "name": "NVIDIA GeForce RTX 4090", "cc": "8.9", "memory_mib": 24564}],
    "error_text": "alice@gpubox-07:~$ python train.py\nRuntimeError: CUDA error in /home/alice/proj/x.py",
    "extensions": [],
}


def test_home_paths_users_and_hosts_replaced():
    out = redact(FACTS, hosts=["gpubox-07"])
    assert out["python"]["executable"] == "/home/<user>/.venvs/ml/bin/python"
    assert out["torch"]["path"] == "/Users/<user>/miniconda3/lib/python3.11/site-packages/torch"
    assert out["env"]["PATH"] == "/home/<user>/.local/bin:/usr/local/cuda/bin:/usr/bin"
    # the user name seen in a home path is also removed where it appears alone
    assert out["error_text"] == "<user>@<host>:~$ python train.py\nRuntimeError: CUDA error in /home/<user>/proj/x.py"


def test_structure_versions_and_root_kept():
    out = redact(FACTS, hosts=["gpubox-07"])
    assert out["toolkits"] == FACTS["toolkits"]  # /root is not a person
    assert out["host"] == FACTS["host"] and out["driver"] == FACTS["driver"] and out["gpus"] == FACTS["gpus"]
    assert out["torch"]["version"] == "2.3.1+cu121"
    assert out["env"]["MAX_JOBS"] is None
    assert set(out) == set(FACTS)


def test_input_not_modified():
    before = copy.deepcopy(FACTS)
    redact(FACTS)
    assert FACTS == before


def test_this_hosts_name_is_removed():
    name = socket.gethostname()
    out = redact({"error_text": f"error on {name} today", "v": "12.1"})
    if len(name) > 1 and not name.startswith("localhost"):
        assert name not in out["error_text"] and "<host>" in out["error_text"]
    assert out["v"] == "12.1"


def test_name_inside_a_word_is_not_replaced():
    out = redact({"home": "/home/ann/x", "text": "channel annotations by ann"})
    assert out["home"] == "/home/<user>/x"
    assert out["text"] == "channel annotations by <user>"


def test_odd_input():
    assert redact({}) == {}
    assert redact({"a": [1, 2.5, None, True, ("x", "/home/zed/y")]}) == {"a": [1, 2.5, None, True, ["x", "/home/<user>/y"]]}


def test_redacts_a_real_snapshot(monkeypatch):
    import json

    from cudadoctor.probes import collect_facts

    monkeypatch.setenv("HOME", "/home/probeuser")
    facts = collect_facts(env={"PATH": "/home/probeuser/.local/bin:/usr/bin", "CONDA_PREFIX": "/home/probeuser/miniconda3"},
                          torch_mode="skip")
    out = redact(facts)
    text = json.dumps(out)
    assert "probeuser" not in text
    assert out["env"]["PATH"] == "/home/<user>/.local/bin:/usr/bin"
    assert out["schema"] == facts["schema"] and out["host"]["kernel"] == facts["host"]["kernel"]

import pytest
from fakes.runner import ScriptedRunner, recorded
from fakes.trees import EXE

from cudadoctor.probes._fs import Root
from cudadoctor.probes.toolkits import (
    TORCH_CUDA_HEADERS,
    parse_gpu_archs,
    parse_nvcc_version,
    probe_toolkits,
    wrapper_target,
)

SITE = "/venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    "fixture, expected",
    [("nvcc-version-11.8.txt", "11.8.89"), ("nvcc-version-12.1.txt", "12.1.105"), ("nvcc-version-13.0.txt", "13.0.88")],
)
def test_parse_nvcc_version(fixture, expected):
    assert parse_nvcc_version(recorded(fixture)) == expected


@pytest.mark.parametrize("text, expected", [("release 10.2, V10.2.89", "10.2.89"), ("Cuda compilation tools, release 9.0", "9.0"), ("garbage", None), ("", None)])
def test_parse_nvcc_version_odd(text, expected):
    assert parse_nvcc_version(text) == expected


def test_parse_gpu_archs():
    assert parse_gpu_archs(recorded("nvcc-list-gpu-arch-12.1.txt"))[-1] == "compute_90a"
    assert "compute_35" in parse_gpu_archs(recorded("nvcc-list-gpu-arch-11.8.txt"))
    assert parse_gpu_archs("nvcc fatal   : Unknown option '--list-gpu-arch'") == []


def _toolkit_files(prefix, headers=TORCH_CUDA_HEADERS):
    files = {f"{prefix}/bin/nvcc": EXE}
    for h in headers:
        files[f"{prefix}/include/{h}"] = "/* header */\n"
    return files


def _nvcc_rules(root, prefix, ver):
    exe = str(root / prefix.lstrip("/") / "bin/nvcc")
    return [((exe, "--version"), recorded(f"nvcc-version-{ver}.txt")),
            ((exe, "--list-gpu-arch"), recorded(f"nvcc-list-gpu-arch-{ver}.txt"))]


def test_cuda_home_first_then_others_merged_by_realpath(tree):
    files = {**_toolkit_files("/usr/local/cuda-11.8"), **_toolkit_files("/usr/local/cuda-12.1")}
    root = tree(files, links={"/usr/local/cuda": "/usr/local/cuda-12.1"})
    runner = ScriptedRunner(_nvcc_rules(root, "/usr/local/cuda-11.8", "11.8") + _nvcc_rules(root, "/usr/local/cuda-12.1", "12.1"))
    env = {"CUDA_HOME": "/usr/local/cuda-11.8", "PATH": "/usr/local/cuda/bin:/usr/bin"}
    tks = probe_toolkits(runner, Root(str(root)), env, [])
    assert [t["root"] for t in tks] == ["/usr/local/cuda-11.8", "/usr/local/cuda"]
    first, second = tks
    assert first["torch_would_use"] is True and second["torch_would_use"] is False
    assert first["nvcc"] == "11.8.89" and second["nvcc"] == "12.1.105"
    assert first["via"] == ["CUDA_HOME", "/usr/local/cuda-*"]
    assert second["via"] == ["PATH", "/usr/local/cuda", "/usr/local/cuda-*"]
    assert second["realpath"] == "/usr/local/cuda-12.1"
    assert "compute_90a" in second["targets"]
    assert first["headers_missing"] == [] and first["headers_unresolved"] == []


def test_nvcc_on_path_when_no_cuda_home(tree):
    root = tree({**_toolkit_files("/opt/cuda-12.1"), **_toolkit_files("/usr/local/cuda-11.8")},
                links={"/usr/local/cuda": "cuda-11.8"})
    runner = ScriptedRunner(_nvcc_rules(root, "/opt/cuda-12.1", "12.1") + _nvcc_rules(root, "/usr/local/cuda-11.8", "11.8"))
    tks = probe_toolkits(runner, Root(str(root)), {"PATH": "/opt/cuda-12.1/bin"}, [])
    assert tks[0]["root"] == "/opt/cuda-12.1" and tks[0]["via"][0] == "PATH"
    assert tks[0]["torch_would_use"]
    assert tks[1]["root"] == "/usr/local/cuda"


def test_usr_local_cuda_is_torch_fallback(tree):
    root = tree(_toolkit_files("/usr/local/cuda-13.0"), links={"/usr/local/cuda": "cuda-13.0"})
    runner = ScriptedRunner(_nvcc_rules(root, "/usr/local/cuda-13.0", "13.0"))
    (tk,) = probe_toolkits(runner, Root(str(root)), {"PATH": "/usr/bin"}, [])
    assert tk["root"] == "/usr/local/cuda" and tk["torch_would_use"]
    assert tk["nvcc"] == "13.0.88"


def test_cuda_home_that_does_not_exist(tree):
    root = tree(_toolkit_files("/usr/local/cuda-12.1"))
    runner = ScriptedRunner(_nvcc_rules(root, "/usr/local/cuda-12.1", "12.1"))
    tks = probe_toolkits(runner, Root(str(root)), {"CUDA_HOME": "/usr/local/cuda-12.4"}, [])
    assert tks[0]["root"] == "/usr/local/cuda-12.4"
    assert tks[0]["exists"] is False and tks[0]["torch_would_use"] is True
    assert tks[0]["nvcc"] is None and "does not exist" in tks[0]["error"]
    assert tks[1]["nvcc"] == "12.1.105"


def test_no_toolkit_at_all(tree):
    assert probe_toolkits(ScriptedRunner(), Root(str(tree({}))), {"PATH": "/usr/bin"}, []) == []


def test_missing_headers_found_in_pip_wheel(tree):
    """The shape of this machine: a toolkit with only the runtime headers, the library headers
    in site-packages/nvidia/cu13/include of the torch wheel's dependencies."""
    tk_headers = ["cuda_runtime_api.h"]
    files = _toolkit_files("/usr/local/cuda-13.0", tk_headers)
    for h in TORCH_CUDA_HEADERS:
        files[f"{SITE}/nvidia/cu13/include/{h}"] = ""
    root = tree(files, links={"/usr/local/cuda": "cuda-13.0"})
    runner = ScriptedRunner(_nvcc_rules(root, "/usr/local/cuda-13.0", "13.0"))
    tks = probe_toolkits(runner, Root(str(root)), {"PATH": "/usr/bin"}, [SITE])
    tk = tks[0]
    assert tk["root"] == "/usr/local/cuda"
    assert "cusparse.h" in tk["headers_missing"] and "cublas_v2.h" in tk["headers_missing"]
    assert "cuda_runtime_api.h" not in tk["headers_missing"]
    assert tk["headers_elsewhere"]["cusparse.h"] == [f"{SITE}/nvidia/cu13/include/cusparse.h"]
    assert "cusparse.h" in tk["headers_unresolved"]
    pip = [t for t in tks if t["via"] == ["pip"]]
    assert pip and pip[0]["nvcc"] is None and pip[0]["headers_missing"] == []


def test_cpath_resolves_missing_headers(tree):
    files = _toolkit_files("/usr/local/cuda-13.0", ["cuda_runtime_api.h"])
    for h in TORCH_CUDA_HEADERS:
        files[f"{SITE}/nvidia/cu13/include/{h}"] = ""
    root = tree(files, links={"/usr/local/cuda": "cuda-13.0"})
    runner = ScriptedRunner(_nvcc_rules(root, "/usr/local/cuda-13.0", "13.0"))
    env = {"PATH": "/usr/bin", "CPATH": f"{SITE}/nvidia/cu13/include"}
    tk = probe_toolkits(runner, Root(str(root)), env, [SITE])[0]
    assert "cusparse.h" in tk["headers_missing"]
    assert tk["headers_unresolved"] == []
    assert f"{SITE}/nvidia/cu13/include" in tk["build_include_path"]


def test_nvcc_wrapper_script(tree):
    """/usr/local/bin/nvcc as a two-line script: torch takes CUDA_HOME=/usr/local from it."""
    files = _toolkit_files("/usr/local/cuda-13.0", ["cuda_runtime_api.h"])
    files["/usr/local/bin/nvcc"] = ("#!/bin/sh\nexec /usr/local/cuda-13.0/bin/nvcc \"$@\"\n", 0o755)
    files["/usr/local/include/zlib.h"] = ""
    root = tree(files, links={"/usr/local/cuda": "/usr/local/cuda-13.0"})
    rules = _nvcc_rules(root, "/usr/local/cuda-13.0", "13.0") + _nvcc_rules(root, "/usr/local", "13.0")
    tks = probe_toolkits(ScriptedRunner(rules), Root(str(root)), {"PATH": "/usr/local/bin:/usr/bin"}, [])
    assert wrapper_target(Root(str(root)), "/usr/local/bin/nvcc") == "/usr/local/cuda-13.0/bin/nvcc"
    assert tks[0]["root"] == "/usr/local" and tks[0]["torch_would_use"]
    assert tks[0]["nvcc_wrapper_of"] == "/usr/local/cuda-13.0/bin/nvcc"
    # nvcc adds its own toolkit's include dir, so the runtime header resolves, the rest do not
    assert "/usr/local/cuda-13.0/include" in tks[0]["build_include_path"]
    assert "cuda_runtime_api.h" not in tks[0]["headers_unresolved"]
    assert "cusparse.h" in tks[0]["headers_unresolved"]
    assert tks[1]["root"] == "/usr/local/cuda" and tks[1]["realpath"] == "/usr/local/cuda-13.0"


def test_conda_toolkit(tree):
    files = {"/opt/conda/envs/x/bin/nvcc": EXE,
             "/opt/conda/envs/x/targets/x86_64-linux/include/cuda_runtime_api.h": ""}
    root = tree(files)
    rules = _nvcc_rules(root, "/opt/conda/envs/x", "12.1")
    tks = probe_toolkits(ScriptedRunner(rules), Root(str(root)), {"CONDA_PREFIX": "/opt/conda/envs/x"}, [])
    assert tks[0]["via"] == ["CONDA_PREFIX"]
    assert tks[0]["torch_would_use"] is False
    assert tks[0]["include_dirs"] == ["/opt/conda/envs/x/targets/x86_64-linux/include"]
    assert "cuda_runtime_api.h" not in tks[0]["headers_missing"]


def test_nvcc_that_fails(tree):
    root = tree(_toolkit_files("/usr/local/cuda-12.1"))
    exe = str(root / "usr/local/cuda-12.1/bin/nvcc")
    runner = ScriptedRunner([((exe, "--version"), (127, "", "error while loading shared libraries: libstdc++.so.6"))])
    (tk,) = probe_toolkits(runner, Root(str(root)), {"CUDA_HOME": "/usr/local/cuda-12.1"}, [])
    assert tk["nvcc"] is None
    assert "libstdc++" in tk["nvcc_error"]

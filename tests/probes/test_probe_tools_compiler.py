from fakes.runner import ScriptedRunner, recorded
from fakes.trees import EXE

from cudadoctor.probes._fs import Root
from cudadoctor.probes.compiler import probe_host_compiler
from cudadoctor.probes.tools import probe_tools

SANITIZER = """NVIDIA (R) Compute Sanitizer
Copyright (c) 2020-2024 NVIDIA Corporation
Version 2024.1.0.0 (build 33681293) (public-release)
"""


def test_tools_on_path_and_in_toolkit(tree):
    root = tree({"/usr/bin/ninja": EXE, "/usr/bin/docker": EXE,
                 "/usr/local/cuda-12.4/bin/compute-sanitizer": EXE})
    runner = ScriptedRunner([
        (("ninja", "--version"), "1.11.1\n"),
        (("docker", "--version"), "Docker version 24.0.7, build afdd53b\n"),
        (("compute-sanitizer", "--version"), SANITIZER),
    ])
    tools = probe_tools(runner, Root(str(root)), {"PATH": "/usr/bin"})
    assert tools["ninja"] == "1.11.1"
    assert tools["docker"] == "24.0.7"
    assert tools["compute_sanitizer"] == "2024.1.0.0"
    assert tools["paths"]["compute_sanitizer"] == "/usr/local/cuda-12.4/bin/compute-sanitizer"


def test_tools_absent(tree):
    tools = probe_tools(ScriptedRunner(), Root(str(tree({}))), {"PATH": "/usr/bin"})
    assert (tools["ninja"], tools["docker"], tools["compute_sanitizer"]) == (None, None, None)


def _gcc(root, name="g++", out="gpp-version-ubuntu2204-gcc11.txt", full="11.4.0\n"):
    exe = str(root / "usr/bin" / name)
    return [((exe, "--version"), recorded(out)), ((exe, "-dumpfullversion", "-dumpversion"), full)]


def test_cudahostcxx_wins(tree):
    root = tree({"/usr/bin/g++": EXE, "/usr/bin/g++-12": EXE, "/usr/bin/clang++": EXE})
    runner = ScriptedRunner(_gcc(root) + _gcc(root, "g++-12", "gpp-version-debian12.txt", "12.2.0\n"))
    cxx = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin", "CUDAHOSTCXX": "/usr/bin/g++-12", "CXX": "clang++"})
    assert (cxx["name"], cxx["version"], cxx["path"], cxx["via"]) == ("gcc", "12.2.0", "/usr/bin/g++-12", "CUDAHOSTCXX")


def test_cxx_then_gpp(tree):
    root = tree({"/usr/bin/g++": EXE, "/usr/bin/clang++": EXE})
    runner = ScriptedRunner(_gcc(root) + [((str(root / "usr/bin/clang++"), "--version"), recorded("clang-version-17.txt"))])
    cxx = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin", "CXX": "clang++"})
    assert (cxx["name"], cxx["version"], cxx["via"]) == ("clang", "17.0.6", "CXX")
    cxx = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin"})
    assert (cxx["name"], cxx["version"], cxx["via"]) == ("gcc", "11.4.0", "PATH")


def test_cxx_set_but_missing_falls_back(tree):
    root = tree({"/usr/bin/clang++": EXE})
    runner = ScriptedRunner([((str(root / "usr/bin/clang++"), "--version"), recorded("clang-version-17.txt"))])
    cxx = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin", "CXX": "g++-14"})
    assert cxx["name"] == "clang" and cxx["skipped"] == ["CXX=g++-14 not found"]


def test_cc_recorded_as_nvcc_ccbin(tree):
    root = tree({"/usr/bin/g++": EXE, "/usr/bin/gcc-10": EXE})
    runner = ScriptedRunner(_gcc(root) + [((str(root / "usr/bin/gcc-10"), "--version"), "gcc-10 (Ubuntu 10.5.0-1ubuntu1~22.04) 10.5.0\n"),
                                          ((str(root / "usr/bin/gcc-10"), "-dumpfullversion", "-dumpversion"), "10.5.0\n")])
    cxx = probe_host_compiler(runner, Root(str(root)), {"PATH": "/usr/bin", "CC": "gcc-10"})
    assert cxx["nvcc_ccbin"]["version"] == "10.5.0" and cxx["nvcc_ccbin"]["path"] == "/usr/bin/gcc-10"


def test_no_compiler(tree):
    cxx = probe_host_compiler(ScriptedRunner(), Root(str(tree({}))), {"PATH": "/usr/bin"})
    assert cxx["path"] is None and cxx["name"] is None and "no g++ or clang++" in cxx["error"]

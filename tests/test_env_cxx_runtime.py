"""`cudadoctor env` replaces a compiler that links libstdc++ statically (CXX, LDSHARED, and CC /
CUDAHOSTCXX when they name it) with one that links libstdc++.so, and says why."""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fakes.runner import ScriptedRunner, recorded  # noqa: E402
from fakes.trees import EXE, make_tree  # noqa: E402

from cudadoctor.envcmd import cxx_runtime_fix, make_env_plan, render  # noqa: E402
from cudadoctor.runner import Runner  # noqa: E402

SO, A = "-print-file-name=libstdc++.so", "-print-file-name=libstdc++.a"
OPT_VERSION = "g++-real (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0\n"
USR_VERSION = "g++ (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0\n"


def _h200(tmp_path):
    root = make_tree(tmp_path, {"/opt/gcc/bin/g++": (recorded("opt-gcc-bin-gpp-wrapper-h200.sh"), 0o755),
                                "/usr/bin/g++": EXE, "/usr/bin/gcc": EXE})
    runner = ScriptedRunner([
        (("opt/gcc/bin/g++", "--version"), OPT_VERSION),
        (("opt/gcc/bin/g++", "-dumpfullversion", "-dumpversion"), "13.3.0\n"),
        (("opt/gcc/bin/g++", SO), recorded("gpp-print-file-name-libstdcxx-so-opt-gcc-wrapper-h200.txt")),
        (("opt/gcc/bin/g++", A), recorded("gpp-print-file-name-libstdcxx-a-opt-gcc-wrapper-h200.txt")),
        (("usr/bin/g++", "--version"), USR_VERSION),
        (("usr/bin/g++", "-dumpfullversion", "-dumpversion"), "13.3.0\n"),
        (("usr/bin/g++", SO), recorded("gpp-print-file-name-libstdcxx-so-usr-bin-gpp13-h200.txt")),
        (("usr/bin/g++", A), recorded("gpp-print-file-name-libstdcxx-a-usr-bin-gpp13-h200.txt")),
    ])
    return root, runner


def test_h200_exports_cxx_ldshared_and_cudahostcxx(tmp_path):
    root, runner = _h200(tmp_path)
    env = {"PATH": "/usr/bin:/opt/gcc/bin", "CXX": "/opt/gcc/bin/g++", "CUDAHOSTCXX": "/opt/gcc/bin/g++"}
    vars_, note = cxx_runtime_fix(runner, env, str(root))
    assert note is None
    got = {v.name: v.value for v in vars_}
    assert got == {"CXX": "/usr/bin/g++", "LDSHARED": "/usr/bin/g++ -shared", "CUDAHOSTCXX": "/usr/bin/g++"}
    why = {v.name: v.why for v in vars_}
    assert "/opt/gcc/bin/g++ (CXX, CUDAHOSTCXX; a wrapper of /opt/gcc/bin/g++-real) links libstdc++ statically" in why["CXX"]
    assert "crashes the process" in why["CXX"] and "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so" in why["CXX"]


def test_rendered_plan_has_the_exports_with_comments(tmp_path):
    root, runner = _h200(tmp_path)
    runner.add(("/fake/nvcc", "--version"), "Cuda compilation tools, release 13.0, V13.0.88\n")
    env = {"PATH": "/usr/bin:/opt/gcc/bin", "CXX": "/opt/gcc/bin/g++", "MAX_JOBS": "1"}
    plan = make_env_plan(runner=runner, env=env, nvcc_path="/fake/nvcc", gpus=[], sites=[], root=str(root))
    text = render(plan, "bash")
    assert "export CXX='/usr/bin/g++'" in text and "export LDSHARED='/usr/bin/g++ -shared'" in text
    assert "# CXX: /opt/gcc/bin/g++ (CXX; a wrapper of /opt/gcc/bin/g++-real) links libstdc++ statically" in text
    assert "CUDAHOSTCXX" not in text  # it was not set
    assert 'LDSHARED="/usr/bin/g++ -shared"' in render(plan, "dotenv")


def test_no_alternative_gives_a_note_and_no_exports(tmp_path):
    root, runner = _h200(tmp_path)
    os.remove(root / "usr/bin/g++")
    vars_, note = cxx_runtime_fix(runner, {"PATH": "/opt/gcc/bin", "CXX": "/opt/gcc/bin/g++"}, str(root))
    assert vars_ == [] and "no other compiler with the shared libstdc++ was found" in note


def test_shared_runtime_compiler_needs_nothing(tmp_path):
    root, runner = _h200(tmp_path)
    assert cxx_runtime_fix(runner, {"PATH": "/usr/bin"}, str(root)) == ([], None)


@pytest.mark.skipif(not shutil.which("g++", path="/usr/bin"), reason="needs /usr/bin/g++")
def test_real_processes_with_a_compiler_that_has_only_the_static_library(tmp_path):
    """A real script standing in for the H200 wrapper, answered by real processes; /usr/bin/g++ of this
    machine is found as the replacement."""
    fake = tmp_path / "bin" / "g++"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    'case "$1" in\n'
                    "  --version) echo 'g++-real (Ubuntu 13.3.0-6ubuntu2~24.04) 13.3.0';;\n"
                    "  -dumpfullversion) echo 13.3.0;;\n"
                    "  -print-file-name=libstdc++.so) echo libstdc++.so;;\n"
                    "  -print-file-name=libstdc++.a) echo /opt/gcc/lib/gcc/x86_64-linux-gnu/13/libstdc++.a;;\n"
                    "esac\n")
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "CXX": str(fake)}
    vars_, note = cxx_runtime_fix(Runner(), env, "/")
    got = {v.name: v.value for v in vars_}
    assert note is None and got["LDSHARED"] == got["CXX"] + " -shared"
    assert os.path.dirname(got["CXX"]) in ("/usr/bin", "/usr/local/bin")

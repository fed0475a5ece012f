"""Builds and the C++ runtime: the local backend swaps a static-libstdc++ compiler for a shared one
(and says so in the build log), and verification fails a wheel whose shared objects define
__cxa_throw unless --allow-static-cxx-runtime."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fakes.wheels import make_wheel  # noqa: E402

from cudadoctor.build import cxx_runtime as R  # noqa: E402
from cudadoctor.build import local_backend as L  # noqa: E402
from cudadoctor.build import plan as P  # noqa: E402
from cudadoctor.build.execute import BuildRequest, make_plans  # noqa: E402
from cudadoctor.build.verify import verify  # noqa: E402
from cudadoctor.doctor import diagnose  # noqa: E402
from cudadoctor.errors import RefusedError  # noqa: E402

FIX = Path(__file__).resolve().parents[1] / "fixtures"
BIN = FIX / "binaries"

OPT = {"name": "gcc", "version": "13.3.0", "path": "/opt/gcc/bin/g++", "shared_libstdcxx": None,
       "static_libstdcxx": "/opt/gcc/lib/gcc/x86_64-linux-gnu/13/libstdc++.a", "links_static_libstdcxx": True,
       "wrapper_of": "/opt/gcc/bin/g++-real"}
USR = {"name": "gcc", "version": "13.3.0", "path": "/usr/bin/g++",
       "shared_libstdcxx": "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so",
       "static_libstdcxx": "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.a", "links_static_libstdcxx": False,
       "cc": "/usr/bin/gcc"}


def h200_facts(candidates=True):
    hc = dict(OPT, via="CUDAHOSTCXX", nvcc_ccbin=dict(OPT, path="/opt/gcc/bin/gcc"))
    if candidates:
        hc["candidates"] = [dict(USR)]
    return {"schema": "cudadoctor.facts/1", "host_compiler": hc,
            "env": {"CXX": "/opt/gcc/bin/g++", "CC": "/opt/gcc/bin/gcc", "CUDAHOSTCXX": "/opt/gcc/bin/g++"},
            "torch": {"version": "2.14.1+cu130", "cuda": "13.0"}, "toolkits": [{"root": "/usr/local/cuda", "nvcc": "13.0.88"}]}


# --- before the build -------------------------------------------------------------------------


def test_finding_with_a_replacement_does_not_refuse_the_local_build(tmp_path):
    rep = diagnose(h200_facts())
    assert "HOST_COMPILER_STATIC_LIBSTDCXX" in [f["id"] for f in rep["findings"]]
    assert L.blocking_findings(rep) == []
    req = BuildRequest(source=str(FIX / "ext_min"), specs=[P.TargetSpec(arch="8.6")], backend="local", out=str(tmp_path))
    assert make_plans(req, facts=h200_facts(), report=rep)


def test_finding_without_a_replacement_refuses_with_the_install_fix(tmp_path):
    rep = diagnose(h200_facts(candidates=False))
    assert [f["id"] for f in L.blocking_findings(rep)] == ["HOST_COMPILER_STATIC_LIBSTDCXX"]
    req = BuildRequest(source=str(FIX / "ext_min"), specs=[P.TargetSpec(arch="8.6")], backend="local", out=str(tmp_path))
    with pytest.raises(RefusedError) as e:
        make_plans(req, facts=h200_facts(candidates=False), report=rep)
    assert "HOST_COMPILER_STATIC_LIBSTDCXX" in str(e.value) and "apt-get install -y g++" in str(e.value)


def test_local_env_points_cc_cxx_ldshared_at_the_shared_runtime_compiler(tmp_path):
    facts = h200_facts()
    plan = make_plans(BuildRequest(source=str(FIX / "ext_min"), specs=[P.TargetSpec(arch="8.6")], backend="local",
                                   out=str(tmp_path)), facts=facts, report=diagnose(facts))[0]
    base = {"CXX": "/opt/gcc/bin/g++", "CC": "/opt/gcc/bin/gcc", "CUDAHOSTCXX": "/opt/gcc/bin/g++",
            "CUDA_HOME": "/usr/local/cuda"}
    env, notes = L.local_env(plan, facts, diagnose(facts), base)
    assert (env["CXX"], env["LDSHARED"], env["CC"], env["CUDAHOSTCXX"]) == (
        "/usr/bin/g++", "/usr/bin/g++ -shared", "/usr/bin/gcc", "/usr/bin/g++")
    assert base["CXX"] == "/opt/gcc/bin/g++"  # the caller's environment is untouched
    assert ("CXX=/usr/bin/g++ (/opt/gcc/bin/g++ and /opt/gcc/bin/gcc link libstdc++ statically: "
            "exceptions thrown in the extension would crash; /usr/bin/g++ links "
            "/usr/lib/gcc/x86_64-linux-gnu/13/libstdc++.so)") in notes
    assert 'LDSHARED="/usr/bin/g++ -shared"' in notes
    assert R.log_lines(env)[0] == ("[cudadoctor] CXX=/usr/bin/g++ (/opt/gcc/bin/g++ links libstdc++ statically: "
                                   "exceptions thrown in the extension would crash)")


def test_nothing_changes_for_a_shared_runtime_compiler():
    facts = {"host_compiler": dict(USR, via="PATH"), "env": {}}
    env = {"CXX": "g++"}
    assert R.apply(env, facts) == [] and env == {"CXX": "g++"} and R.log_lines(env) == []
    assert R.apply({}, None) == [] and R.replacement({"host_compiler": "odd"}) is None


class _Progress:
    def __init__(self):
        self.lines: list[str] = []

    def write(self, line):
        self.lines.append(line)

    def line(self, line):
        self.lines.append(line)

    def set_stage(self, stage):
        self.lines.append(f"stage: {stage}")


def test_build_log_names_the_swap_and_the_build_sees_it(tmp_path):
    """local_backend.build with a stand-in for the build script: the log says what changed, and the
    build process gets the replaced CXX / LDSHARED."""
    facts = h200_facts()
    plan = make_plans(BuildRequest(source=str(FIX / "ext_min"), specs=[P.TargetSpec(arch="8.6")], backend="local",
                                   out=str(tmp_path / "out")), facts=facts, report=diagnose(facts))[0]
    env, _ = L.local_env(plan, facts, diagnose(facts), {"PATH": "/usr/bin:/bin", "CXX": "/opt/gcc/bin/g++"})
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    'while [ $# -gt 0 ]; do [ "$1" = --out ] && out=$2; shift; done\n'
                    'echo "child CXX=$CXX LDSHARED=$LDSHARED"\n'
                    'touch "$out/demo_ops-0.1.0-cp311-cp311-linux_x86_64.whl"\n')
    fake.chmod(0o755)
    prog = _Progress()
    whl = L.build(plan, work_dir=tmp_path / "work", staging=tmp_path / "staging", progress=prog, env=env,
                  python=str(fake))
    assert whl.name.endswith(".whl")
    assert prog.lines[0] == ("[cudadoctor] CXX=/usr/bin/g++ (/opt/gcc/bin/g++ links libstdc++ statically: "
                             "exceptions thrown in the extension would crash)")
    assert "[cudadoctor] LDSHARED=/usr/bin/g++ -shared" in prog.lines
    assert "child CXX=/usr/bin/g++ LDSHARED=/usr/bin/g++ -shared" in prog.lines


# --- after the build --------------------------------------------------------------------------


def test_verify_fails_a_wheel_with_its_own_cxx_runtime(tmp_path):
    whl = make_wheel(tmp_path, {"demo_ops/_C.so": BIN / "libkern_sm86_sm89_ptx89.so",
                                "demo_ops/libhelper.so": BIN / "libstatic_rt.so"})
    with pytest.raises(RefusedError) as e:
        verify(whl, ["sm_86", "sm_89"], ["compute_89"])
    msg = str(e.value)
    assert "demo_ops/libhelper.so defines __cxa_throw, __gxx_personality_v0, __cxa_begin_catch" in msg
    assert "SIGSEGV" in msg and "CXX=/usr/bin/g++" in msg and "--allow-static-cxx-runtime" in msg
    assert e.value.exit_code == 1
    archs = verify(whl, ["sm_86", "sm_89"], ["compute_89"], allow_static_cxx_runtime=True)
    assert archs["demo_ops/_C.so"]["sass"] == ["sm_86", "sm_89"]


def test_verify_passes_a_wheel_linked_against_libstdcxx_so(tmp_path):
    whl = make_wheel(tmp_path, {"demo_ops/_C.so": BIN / "libkern_sm86_sm89_ptx89.so",
                                "demo_ops/libhelper.so": BIN / "libshared_rt.so"})
    assert verify(whl, ["sm_86"], [])
    assert R.static_runtime_objects(whl) == {}


def test_cli_flag_reaches_the_request(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import cudadoctor.cli.build_cmd  # noqa: F401 - registers `build` on the app
    from cudadoctor.build import execute as X
    from cudadoctor.cli import app

    seen = []
    monkeypatch.setattr(X, "build", lambda req, console: seen.append(req) or [])
    r = CliRunner().invoke(app, ["build", str(FIX / "ext_min"), "--arch", "8.6", "--backend", "local",
                                 "--no-pip-config", "--allow-static-cxx-runtime", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert seen and seen[0].allow_static_cxx_runtime is True
    r = CliRunner().invoke(app, ["build", str(FIX / "ext_min"), "--arch", "8.6", "--backend", "local",
                                 "--no-pip-config", "--out", str(tmp_path)])
    assert seen[1].allow_static_cxx_runtime is False


# --- end to end with real processes -----------------------------------------------------------

FAKE_GXX = """#!/bin/sh
# stands in for a g++ whose library folder holds only libstdc++.a: it says so, and links statically
for a in "$@"; do
  case "$a" in
    -print-file-name=libstdc++.so) echo libstdc++.so; exit 0;;
    -shared) exec /usr/bin/g++ -static-libstdc++ "$@";;
  esac
done
exec /usr/bin/g++ "$@"
"""
EXT_CPP = """#include <Python.h>
#include <stdexcept>
static PyObject* f(PyObject*, PyObject*) {
    try { throw std::runtime_error("x"); } catch (const std::exception&) {}
    Py_RETURN_NONE;
}
static PyMethodDef M[] = {{"f", f, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef D = {PyModuleDef_HEAD_INIT, "demo_ext", nullptr, -1, M};
PyMODINIT_FUNC PyInit_demo_ext(void) { return PyModule_Create(&D); }
"""
SETUP = ('from setuptools import setup, Extension\n'
         'setup(name="demo_ext", version="0.1", ext_modules=[Extension("demo_ext", ["ext.cpp"], language="c++")])\n')


def _python_h() -> bool:
    import sysconfig

    return (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file()


def _build_ext(src: Path, env: dict) -> Path:
    import subprocess

    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "--force"], cwd=src, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (so,) = src.glob("demo_ext*.so")
    return so


@pytest.mark.skipif(not Path("/usr/bin/g++").exists() or not _python_h(), reason="needs /usr/bin/g++ and Python.h")
def test_probe_fix_and_check_with_a_real_setuptools_build(tmp_path):
    """A compiler that links libstdc++ statically builds an extension that defines __cxa_throw (the check
    fails it); the probe finds /usr/bin/g++ instead, and with CXX/LDSHARED/CC from the fix the same
    setuptools build imports the runtime from libstdc++.so.6."""
    import os

    from cudadoctor.inspect import inspect_path
    from cudadoctor.probes._fs import Root
    from cudadoctor.probes.compiler import probe_host_compiler
    from cudadoctor.runner import Runner

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "g++"
    fake.write_text(FAKE_GXX)
    fake.chmod(0o755)
    src = tmp_path / "src"
    src.mkdir()
    (src / "ext.cpp").write_text(EXT_CPP)
    (src / "setup.py").write_text(SETUP)
    env = {k: v for k, v in os.environ.items() if k not in ("LDSHARED", "LDFLAGS", "CFLAGS", "CXXFLAGS")}
    env.update(PATH=f"{bin_dir}:/usr/bin:/bin", CXX=str(fake), CC=str(fake))

    so = _build_ext(src, env)
    (e,) = inspect_path(so)
    assert "__cxa_throw" in e["cxx_runtime_defined"] and "libstdc++.so.6" not in e["needed"]
    with pytest.raises(RefusedError, match=r"carries its own C\+\+ runtime"):
        R.check(so)

    hc = probe_host_compiler(Runner(), Root("/"), env)
    assert hc["links_static_libstdcxx"] is True and hc["path"] == str(fake)
    facts = {"host_compiler": hc, "env": {k: env[k] for k in ("CXX", "CC")}}
    notes = R.apply(env, facts)
    assert notes and env["CXX"] != str(fake) and env["LDSHARED"] == env["CXX"] + " -shared"
    assert env["CC"] != str(fake)

    so = _build_ext(src, env)
    (e,) = inspect_path(so)
    assert e["cxx_runtime_defined"] == [] and "libstdc++.so.6" in e["needed"]
    assert R.check(so) == {}

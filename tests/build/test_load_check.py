"""The build's load check (cudadoctor/build/scripts/build_wheel.py): every shared object of a built
wheel is dlopen'ed next to the build environment's torch; an undefined symbol, a missing library or a
crashing initializer refuses the wheel, the driver's absence does not."""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fakes.wheels import make_wheel  # noqa: E402

from cudadoctor.build.execute import refuse_unloadable  # noqa: E402
from cudadoctor.errors import RefusedError  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "cudadoctor" / "build" / "scripts" / "build_wheel.py"
CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler on this machine to make test shared objects")


def _script():
    spec = importlib.util.spec_from_file_location("cudadoctor_build_wheel_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _torch_imports() -> bool:
    r = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, timeout=300)
    return r.returncode == 0


def _so(tmp: Path, name: str, code: str, *args: str) -> Path:
    src = tmp / f"{name}.c"
    src.write_text(code)
    out = tmp / f"{name}.so"
    r = subprocess.run([CC, "-shared", "-fPIC", "-o", str(out), str(src), *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out


def _wheel(tmp: Path, members: dict[str, Path]) -> Path:
    return make_wheel(tmp, members, dist="pkg")


@needs_cc
def test_undefined_symbol_and_missing_library_are_errors_the_driver_is_not(tmp_path):
    if not _torch_imports():
        pytest.skip("torch does not import here: the load check only notes that")
    good = _so(tmp_path, "good", "int good(void) { return 1; }\n")
    bad = _so(tmp_path, "bad", "extern int cudadoctor_missing_symbol(void);\n"
                               "int bad(void) { return cudadoctor_missing_symbol(); }\n")
    # a library linked at build time that is gone at load time
    dep = _so(tmp_path, "libcdgone", "int gone(void) { return 2; }\n", "-Wl,-soname,libcdgone.so")
    needs_gone = _so(tmp_path, "needsgone", "extern int gone(void);\nint f(void) { return gone(); }\n",
                     f"-L{tmp_path}", "-l:libcdgone.so", "-Wl,--no-as-needed")
    # the driver library, linked against a stub with its soname (absent, or the real one, at load)
    stub = _so(tmp_path, "cudastub", "int cuInit(unsigned f) { return 0; }\n", "-Wl,-soname,libcuda.so.1")
    needs_driver = _so(tmp_path, "needsdriver", "extern int cuInit(unsigned);\nint g(void) { return cuInit(0); }\n",
                       str(stub), "-Wl,--no-as-needed")
    whl = _wheel(tmp_path, {"pkg/_good.so": good, "pkg/_bad.cpython-311-x86_64-linux-gnu.so": bad,
                            "pkg/_needs_gone.so": needs_gone, "pkg/_needs_driver.so": needs_driver})
    dep.unlink()
    stub.unlink()
    res = _script().load_check(str(whl))
    errors = {e["member"]: e["error"] for e in res["errors"]}
    assert set(errors) == {"pkg/_bad.cpython-311-x86_64-linux-gnu.so", "pkg/_needs_gone.so"}, res
    assert "undefined symbol: cudadoctor_missing_symbol" in errors["pkg/_bad.cpython-311-x86_64-linux-gnu.so"]
    assert "libcdgone.so" in errors["pkg/_needs_gone.so"] and "cannot open shared object file" in errors["pkg/_needs_gone.so"]
    assert "pkg/_good.so" in res["checked"] and "pkg/_needs_driver.so" in res["checked"]
    # no driver on the machine: a note naming it; a machine with one loads it without a note
    assert all("libcuda.so.1" in n for n in res["notes"]), res["notes"]
    assert res["torch"]
    # no path of the temporary layout leaks into the messages
    assert not any("cudadoctor-load-" in e for e in errors.values())

    with pytest.raises(RefusedError) as exc:
        refuse_unloadable(whl, res)
    msg = str(exc.value)
    assert "does not load in its build environment" in msg and "cudadoctor_missing_symbol" in msg
    assert exc.value.exit_code == 1


@needs_cc
def test_origin_run_path_to_torchs_nvidia_libraries_resolves(tmp_path):
    """A shared object that finds a CUDA library through $ORIGIN/../nvidia/<pkg>/lib (as the wheel
    will sit in site-packages next to torch's nvidia packages) loads in the check's layout."""
    if not _torch_imports():
        pytest.skip("torch does not import here")
    r = subprocess.run([sys.executable, "-c", "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))"],
                       capture_output=True, text=True, timeout=300)
    site = r.stdout.strip().splitlines()[-1]
    libs = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.[0-9]*")))
    if not libs:
        pytest.skip("torch here comes without nvidia/*/lib/libnvrtc.so.N (a CPU build or another layout)")
    lib = Path(libs[0])
    rel = os.path.relpath(lib.parent, site)
    so = _so(tmp_path, "usesnvrtc", "extern int nvrtcVersion(int*, int*);\n"
                                    "int v(void) { int a, b; return nvrtcVersion(&a, &b); }\n",
             f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,$ORIGIN/../{rel}", "-Wl,--no-as-needed")
    res = _script().load_check(str(_wheel(tmp_path, {"pkg/_nvrtc.so": so})))
    assert res["errors"] == [] and res["checked"] == ["pkg/_nvrtc.so"], res


@needs_cc
def test_a_member_needing_another_member_loads_in_a_later_pass(tmp_path):
    """pkg/_ext.so needs libpkgdep.so by soname (no run path: the package preloads it); it comes
    first in the wheel, so it loads only once the library has."""
    if not _torch_imports():
        pytest.skip("torch does not import here")
    dep = _so(tmp_path, "libpkgdep", "int dep(void) { return 3; }\n", "-Wl,-soname,libpkgdep.so")
    ext = _so(tmp_path, "ext", "extern int dep(void);\nint e(void) { return dep(); }\n",
              f"-L{tmp_path}", "-l:libpkgdep.so", "-Wl,--no-as-needed")
    res = _script().load_check(str(_wheel(tmp_path, {"pkg/_ext.so": ext, "pkg/lib/libpkgdep.so": dep})))
    assert res["errors"] == [] and res["checked"] == ["pkg/lib/libpkgdep.so", "pkg/_ext.so"], res


@needs_cc
def test_a_crashing_initializer_is_an_error(tmp_path):
    if not _torch_imports():
        pytest.skip("torch does not import here")
    boom = _so(tmp_path, "boom", "#include <stdlib.h>\n__attribute__((constructor)) static void boom(void) { abort(); }\n")
    res = _script().load_check(str(_wheel(tmp_path, {"pkg/_boom.so": boom})))
    assert len(res["errors"]) == 1 and "killed by signal 6" in res["errors"][0]["error"], res


def test_without_torch_the_check_is_a_note(tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    whl = _wheel(tmp_path, {})
    res = _script().load_check(str(whl))
    assert res["errors"] == [] and res["checked"] == []
    assert len(res["notes"]) == 1 and "torch does not import" in res["notes"][0] and "libcudart" in res["notes"][0]
    refuse_unloadable(whl, res)  # nothing to refuse
    refuse_unloadable(whl, None)

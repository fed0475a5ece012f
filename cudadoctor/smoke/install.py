"""Put a wheel where a child Python can import it, next to the running torch, without the network.

``pip install --no-deps --no-index --target DIR WHEEL`` into a temporary folder; children get
``PYTHONPATH=DIR`` so the wheel's package is found before any installed copy while torch (and
everything else) comes from the running interpreter's site-packages.
"""

from __future__ import annotations

import os
import re
import sys
import zipfile
from dataclasses import dataclass

from cudadoctor.errors import CudadoctorError, InputError
from cudadoctor.runner import Runner

_WHEEL_NAME = re.compile(r"^(?P<dist>[A-Za-z0-9_.]+)-(?P<ver>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl$")


@dataclass
class WheelInfo:
    path: str
    dist: str  # distribution name from the file name (cudadoctor_ops)
    version: str
    packages: list[str]  # top-level import names
    manifest: dict | None  # .dist-info/cudadoctor_build.json, when present


def _corrupt(path: str, why: str) -> InputError:
    return InputError(
        f"cannot smoke-test {path}: {why}.",
        hint="Rebuild the wheel (cudadoctor build, or pip wheel) and pass the .whl file it wrote; "
             "`python -m zipfile -t WHEEL` checks an archive.",
    )


def read_wheel(path: str) -> WheelInfo:
    """Check that ``path`` is a readable, complete wheel and read what smoke needs from it.

    Raises InputError (exit 2) with one paragraph when it is missing, not a wheel, or damaged.
    """
    from cudadoctor.inspect import MANIFEST_NAME

    if not os.path.exists(path):
        raise InputError(f"cannot smoke-test {path}: no such file.",
                         hint="Pass the path of a .whl file, or --installed PACKAGE to test an installed package.")
    if os.path.isdir(path):
        raise InputError(f"cannot smoke-test {path}: it is a directory, not a wheel.",
                         hint="Build a wheel first (cudadoctor build SOURCE), or use --installed PACKAGE.")
    m = _WHEEL_NAME.match(os.path.basename(path))
    if not m:
        raise _corrupt(path, "the file name is not a wheel name (dist-version-python-abi-platform.whl)")
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise _corrupt(path, f"it is not a readable zip archive ({exc})") from None
    with zf:
        try:
            bad = zf.testzip()
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as exc:
            raise _corrupt(path, f"the archive is damaged ({exc})") from None
        except Exception as exc:  # noqa: BLE001 - zlib.error and friends: still a damaged archive
            raise _corrupt(path, f"the archive is damaged ({type(exc).__name__}: {exc})") from None
        if bad is not None:
            raise _corrupt(path, f"the member {bad!r} fails its CRC check")
        names = zf.namelist()
        infos = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
        if not infos:
            raise _corrupt(path, "it has no .dist-info folder")
        info_dir = infos[0]
        for required in ("METADATA", "WHEEL"):
            if f"{info_dir}/{required}" not in names:
                raise _corrupt(path, f"{info_dir}/{required} is missing")
        manifest = None
        if f"{info_dir}/{MANIFEST_NAME}" in names:
            import json

            try:
                manifest = json.loads(zf.read(f"{info_dir}/{MANIFEST_NAME}").decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise _corrupt(path, f"its build manifest {info_dir}/{MANIFEST_NAME} is not valid JSON ({exc})") from None
            if not isinstance(manifest, dict):
                raise _corrupt(path, f"its build manifest {info_dir}/{MANIFEST_NAME} is not a JSON object")
        packages = _top_level(zf, names, info_dir)
    if not packages:
        raise _corrupt(path, "it contains no importable package or module")
    return WheelInfo(path=path, dist=m.group("dist"), version=m.group("ver"), packages=packages, manifest=manifest)


def _top_level(zf: zipfile.ZipFile, names: list[str], info_dir: str) -> list[str]:
    top = f"{info_dir}/top_level.txt"
    if top in names:
        listed = [ln.strip() for ln in zf.read(top).decode("utf-8", "replace").splitlines() if ln.strip()]
        if listed:
            return listed
    found: list[str] = []
    for n in names:
        head = n.split("/", 1)[0]
        if head.endswith((".dist-info", ".data")) or head in found:
            continue
        if "/" in n and head.isidentifier():
            found.append(head)
        elif "/" not in n and (n.endswith(".py") or ".so" in n):
            mod = n.split(".", 1)[0]
            if mod.isidentifier() and mod not in found:
                found.append(mod)
    return found


def choose_package(info: WheelInfo, wanted: str | None) -> str:
    """The import name to test: the one asked for, else the distribution's own name, else the first."""
    if wanted:
        if wanted not in info.packages:
            raise InputError(f"{info.path} does not contain a package named {wanted!r}.",
                             hint=f"It contains: {', '.join(info.packages)}.")
        return wanted
    norm = re.sub(r"[-.]+", "_", info.dist).lower()
    for p in info.packages:
        if p.lower() == norm:
            return p
    return info.packages[0]


def install_wheel(wheel: str, target: str, *, runner: Runner | None = None, python: str | None = None,
                  timeout: float = 300.0) -> None:
    """``pip install --no-deps --no-index --target`` the wheel; no network, nothing outside ``target``.

    A wheel pip refuses for this interpreter (wrong Python or platform tag) raises CudadoctorError
    with exit code 1 (the wheel is readable but does not fit here); any other pip failure exit 2.
    """
    r = (runner or Runner()).run(
        [python or sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
         "--disable-pip-version-check", "--no-warn-script-location", "--target", target, wheel],
        timeout=timeout, env={"PIP_NO_INPUT": "1"})
    if r.ok:
        return
    text = "\n".join(x for x in (r.stderr, r.stdout, r.error) if x).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    why = (errors[-1][len("ERROR:"):].strip() if errors else lines[0] if lines else f"exit status {r.returncode}")
    if "is not a supported wheel on this platform" in text:
        raise CudadoctorError(
            f"{wheel} cannot be installed for this interpreter ({python or sys.executable}): {why}",
            hint="Build it for this Python and platform (cudadoctor build --python X.Y), or run smoke with "
                 "the interpreter it was built for.", exit_code=1)
    raise CudadoctorError(f"installing {wheel} into a temporary folder failed: {why}",
                          hint="Check that pip works for this interpreter (python -m pip --version).")

"""Small wheels written on the fly for the smoke tests: a package with a smoke-case module, an
optional compiled member copied from tests/fixtures/binaries, and an optional build manifest."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

BINARIES = Path(__file__).resolve().parent.parent / "fixtures" / "binaries"


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(folder: Path, *, name: str = "fakeext", version: str = "0.1.0", files: dict[str, str | bytes],
               manifest: dict | None = None, tag: str = "py3-none-any") -> Path:
    """Write ``{name}-{version}-{tag}.whl`` holding ``files`` (paths relative to the wheel root)."""
    info = f"{name}-{version}.dist-info"
    members: dict[str, bytes] = {k: (v.encode() if isinstance(v, str) else v) for k, v in files.items()}
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: {tag}\n".encode()
    members[f"{info}/top_level.txt"] = f"{name}\n".encode()
    if manifest is not None:
        members[f"{info}/cudadoctor_build.json"] = json.dumps(manifest).encode()
    record = "".join(f"{k},{_hash(v)},{len(v)}\n" for k, v in members.items()) + f"{info}/RECORD,,\n"
    members[f"{info}/RECORD"] = record.encode()
    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in members.items():
            z.writestr(k, v)
    return path


PASSING_CASES = '''
import torch

def _inputs():
    return (torch.arange(12, dtype=torch.float32).reshape(3, 4),)

SMOKE_CASES = [
    {"name": "double/basic", "op": "double", "inputs": _inputs,
     "run": lambda x: x * 2, "reference": lambda x: x.double() * 2},
    {"name": "double/grad", "op": "double", "inputs": lambda: (torch.ones(5, requires_grad=True),),
     "run": lambda x: (x * 2).sum().backward() or x.grad, "reference": lambda x: (x * 2).sum().backward() or x.grad},
    {"name": "square/basic", "op": "square", "inputs": _inputs,
     "run": lambda x: x * x, "reference": lambda x: x.double() ** 2},
]
'''

FAILING_CASES = '''
import os, time
import torch

def _inputs():
    return (torch.arange(12, dtype=torch.float32),)

def _abort(x):
    os.abort()

def _hang(x):
    time.sleep(600)

def _raise(x):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

SMOKE_CASES = [
    {"name": "good/basic", "op": "good", "inputs": _inputs, "run": lambda x: x + 1, "reference": lambda x: x + 1},
    {"name": "wrong/off_by_one", "op": "wrong", "inputs": _inputs, "run": lambda x: x + 1, "reference": lambda x: x,
     "atol": 1e-6, "rtol": 0},
    {"name": "wrong/shape", "op": "wrong", "inputs": _inputs, "run": lambda x: x[:-1], "reference": lambda x: x},
    {"name": "raises/basic", "op": "raises", "inputs": _inputs, "run": _raise, "reference": lambda x: x},
    {"name": "crash/abort", "op": "crash", "inputs": _inputs, "run": _abort, "reference": lambda x: x},
    {"name": "hang/sleep", "op": "hang", "inputs": _inputs, "run": _hang, "reference": lambda x: x},
]
'''


def package_files(name: str = "fakeext", *, cases: str | None = PASSING_CASES, init: str = "", so: str | None = None) -> dict:
    files: dict[str, str | bytes] = {f"{name}/__init__.py": init or '"""a test package"""\n'}
    if cases is not None:
        files[f"{name}/_smoke.py"] = cases
    if so is not None:
        files[f"{name}/_C.so"] = (BINARIES / so).read_bytes()
    return files

"""Child process of `cudadoctor smoke`: runs with the interpreter whose torch is tested.

Standalone on purpose (imports nothing from cudadoctor), so it runs wherever the wheel was
installed, under compute-sanitizer, and a crash or hang here only ends this process.

    python _child.py probe --package PKG [--cases MODULE]
        One JSON object on stdout: torch (version, CUDA, C++11 ABI, devices), whether PKG imports
        (the error text when not), where it was imported from, and the smoke cases it exposes.
    python _child.py run --package PKG [--cases MODULE] [--op OP]... [--device cuda:0]
        Runs the smoke cases (of the given ops) and prints one line per case, prefixed with
        RESULT_PREFIX, holding a JSON object {case, op, status, max_abs_err, detail}.

The smoke-case protocol (a module: ``--cases MODULE``, else the ``smoke_cases`` key of the wheel's
cudadoctor_build.json manifest, else ``<PKG>._smoke``):

    SMOKE_CASES = [  # or a function smoke_cases() returning such a list
        {
            "name": "batch_norm/train_fwd",     # unique
            "op": "batch_norm",                 # the table row (default: name before "/")
            "inputs": lambda: (x, w, ...),      # CPU tensors and plain values, tiny
            "run": lambda x, w, ...: out,       # the op under test; gets the inputs on the GPU
            "reference": lambda x, w, ...: out, # pure torch; gets CPU copies of the inputs
            "atol": 1e-4, "rtol": 1e-4,         # optional
        },
    ]

``run`` and ``reference`` return a tensor, or a tuple/list of tensors (None entries are skipped),
and may call ``.backward()`` themselves (tensors keep their requires_grad flag). Both get their
own copies, so in-place updates do not leak from one into the other.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

RESULT_PREFIX = "@@cudadoctor-smoke@@ "


def _err_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[:12])


def _load_cases(package: str, module: str | None):
    """(cases, error): the package's smoke cases as a list of dicts."""
    name = module or f"{package}._smoke"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in (name, name.rsplit(".", 1)[0]) and module is None:
            return [], f"{package} has no smoke cases (no module {name})"
        return [], f"importing {name} failed: {_err_text(exc)}"
    except Exception as exc:  # noqa: BLE001 - a broken case module is a result
        return [], f"importing {name} failed: {_err_text(exc)}"
    raw = getattr(mod, "SMOKE_CASES", None)
    if raw is None and callable(getattr(mod, "smoke_cases", None)):
        try:
            raw = mod.smoke_cases()
        except Exception as exc:  # noqa: BLE001
            return [], f"{name}.smoke_cases() failed: {_err_text(exc)}"
    if raw is None:
        return [], f"{name} defines neither SMOKE_CASES nor smoke_cases()"
    cases, problems = [], []
    seen = set()
    for n, c in enumerate(list(raw)):
        if not isinstance(c, dict):
            problems.append(f"case #{n} is a {type(c).__name__}, not a dict")
            continue
        missing = [k for k in ("name", "inputs", "run", "reference") if k not in c]
        if missing:
            problems.append(f"case #{n} ({c.get('name', '?')}) lacks {', '.join(missing)}")
            continue
        if c["name"] in seen:
            problems.append(f"case name {c['name']!r} is used twice")
            continue
        seen.add(c["name"])
        c = dict(c)
        c.setdefault("op", str(c["name"]).split("/", 1)[0])
        cases.append(c)
    return cases, ("; ".join(problems) or None)


def _devices(torch) -> tuple[list[dict], str | None]:
    try:
        if not torch.cuda.is_available():
            return [], None
        out = []
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            out.append({"index": i, "name": torch.cuda.get_device_name(i), "cc": f"{major}.{minor}"})
        return out, None
    except Exception as exc:  # noqa: BLE001
        return [], _err_text(exc)


def probe(args) -> int:
    out: dict = {"python": sys.version.split()[0], "executable": sys.executable, "torch": None,
                 "package": args.package, "import_error": None, "import_traceback": None, "file": None,
                 "cases": [], "cases_error": None, "devices": [], "device_error": None}
    try:
        import torch
    except BaseException as exc:  # noqa: BLE001
        out["torch"] = {"import_error": _err_text(exc)}
        print(json.dumps(out))
        return 0
    out["torch"] = {
        "version": torch.__version__,
        "cuda": getattr(torch.version, "cuda", None),
        "cxx11_abi": bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", False)),
        "arch_list": list(torch.cuda.get_arch_list()) if getattr(torch.version, "cuda", None) else [],
    }
    out["devices"], out["device_error"] = _devices(torch)
    try:
        mod = importlib.import_module(args.package)
        out["file"] = getattr(mod, "__file__", None)
    except BaseException as exc:  # noqa: BLE001 - an import error is the result
        out["import_error"] = _err_text(exc)
        out["import_traceback"] = traceback.format_exc().splitlines()[-8:]
        print(json.dumps(out))
        return 0
    cases, err = _load_cases(args.package, args.cases)
    out["cases"] = [{"name": str(c["name"]), "op": str(c["op"])} for c in cases]
    out["cases_error"] = err
    print(json.dumps(out))
    return 0


def _flatten(v) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        out = []
        for x in v:
            out.extend(_flatten(x))
        return out
    return [v]


def _copy(v, device, torch):
    if isinstance(v, torch.Tensor):
        t = v.detach().to(device, copy=True)
        return t.requires_grad_(v.requires_grad) if (v.is_floating_point() or v.is_complex()) else t
    if isinstance(v, (list, tuple)):
        return type(v)(_copy(x, device, torch) for x in v)
    if isinstance(v, dict):
        return {k: _copy(x, device, torch) for k, x in v.items()}
    return v


def _compare(got, want, atol: float, rtol: float, torch) -> tuple[bool, float, str | None]:
    g, w = _flatten(got), _flatten(want)
    if len(g) != len(w):
        return False, float("nan"), f"returned {len(g)} tensors, the reference {len(w)}"
    worst = 0.0
    for n, (a, b) in enumerate(zip(g, w)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return False, float("nan"), f"output {n}: {a!r} != reference {b!r}"
            continue
        if tuple(a.shape) != tuple(b.shape):
            return False, float("nan"), f"output {n}: shape {tuple(a.shape)}, reference {tuple(b.shape)}"
        a64 = a.detach().to("cpu", torch.float64) if a.is_floating_point() else a.detach().cpu()
        b64 = b.detach().to("cpu", torch.float64) if b.is_floating_point() else b.detach().cpu()
        if a64.numel() == 0:
            continue
        if not a64.is_floating_point():
            if not torch.equal(a64, b64.to(a64.dtype)):
                return False, float("nan"), f"output {n}: integer values differ"
            continue
        if not torch.isfinite(a64).all() and not torch.equal(torch.isfinite(a64), torch.isfinite(b64)):
            return False, float("inf"), f"output {n}: non-finite values where the reference has none"
        diff = (a64 - b64).abs()
        diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
        err = float(diff.max())
        worst = max(worst, err)
        bad = diff > atol + rtol * b64.abs()
        if bool(bad.any()):
            idx = int(bad.flatten().nonzero()[0])
            return False, worst, (f"output {n}: {int(bad.sum())} of {a64.numel()} values differ "
                                  f"(max abs err {err:.3g}; first at flat index {idx}: "
                                  f"{float(a64.flatten()[idx]):.6g} vs {float(b64.flatten()[idx]):.6g})")
    return True, worst, None


def _emit(rec: dict) -> None:
    sys.stdout.write(RESULT_PREFIX + json.dumps(rec) + "\n")
    sys.stdout.flush()


def run(args) -> int:
    import torch

    importlib.import_module(args.package)
    cases, err = _load_cases(args.package, args.cases)
    if err:
        print(f"smoke cases: {err}", file=sys.stderr)
    if args.op:
        cases = [c for c in cases if c["op"] in args.op]
    device = torch.device(args.device)
    failed = 0
    for c in cases:
        rec = {"case": str(c["name"]), "op": str(c["op"]), "status": "pass", "max_abs_err": None,
               "detail": None, "seconds": None}
        t0 = time.monotonic()
        _emit({"begin": rec["case"]})  # lets sanitizer reports printed from here on be tied to this case
        try:
            torch.manual_seed(0)
            inputs = c["inputs"]()
            inputs = tuple(inputs) if isinstance(inputs, (list, tuple)) else (inputs,)
            gpu_in = _copy(inputs, device, torch)
            got = c["run"](*gpu_in)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            got = _copy(got, "cpu", torch)
            want = c["reference"](*_copy(inputs, "cpu", torch))
            ok, worst, why = _compare(got, want, float(c.get("atol", 1e-4)), float(c.get("rtol", 1e-4)), torch)
            rec["max_abs_err"] = worst if worst == worst else None
            if not ok:
                rec["status"], rec["detail"] = "fail", why
        except Exception as exc:  # noqa: BLE001 - a raising op is a result
            rec["status"], rec["detail"] = "error", _err_text(exc)
        rec["seconds"] = round(time.monotonic() - t0, 3)
        failed += rec["status"] != "pass"
        _emit(rec)
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - an asynchronous error surfacing at the end
            print(f"final synchronize failed: {_err_text(exc)}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cudadoctor-smoke-child")
    p.add_argument("mode", choices=("probe", "run"))
    p.add_argument("--package", required=True)
    p.add_argument("--cases", default=None, help="module with the smoke cases (default PKG._smoke)")
    p.add_argument("--op", action="append", default=[])
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args(argv)
    return probe(args) if args.mode == "probe" else run(args)


if __name__ == "__main__":
    sys.exit(main())

"""Python and torch facts, from a child process of the probed interpreter with a timeout.

The child (torch_child.py, passed with ``python -c``) prints cumulative JSON lines and a stage
name, so a crash or hang still tells whether the torch import or the kernel launch died.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Mapping

from cudadoctor.runner import Result, Runner

TORCH_TAG = "cudadoctor-torch-probe"
MARK = "CUDADOCTOR_TORCH "


def child_script() -> str:
    return Path(__file__).with_name("torch_child.py").read_text(encoding="utf-8")


def child_argv(python: str, mode: str = "auto") -> list[str]:
    return [python, "-c", child_script(), mode, TORCH_TAG]


def run_child(runner: Runner, python: str, env: Mapping[str, str] | None, timeout: float, mode: str = "auto") -> Result:
    return runner.run(child_argv(python, mode), timeout=timeout, env=dict(env) if env is not None else None)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except (ValueError, AttributeError):
        return f"signal {num}"


def interpret(res: Result, python: str, timeout: float) -> tuple[dict | None, dict]:
    """(python section or None, torch section) from the child's result; never raises."""
    data = None
    for line in reversed((res.stdout or "").splitlines()):
        if line.startswith(MARK):
            try:
                data = json.loads(line[len(MARK):])
            except ValueError:
                data = None
            if isinstance(data, dict):
                break
            data = None
    py = data.get("python") if data else None
    torch = (data.get("torch") if data else None) or {
        "version": None, "cuda": None, "arch_list": None, "cxx11_abi": None, "cudnn": None,
        "cuda_available": None, "device_error": None, "import_error": None,
    }
    stage = data.get("stage") if data else None
    if data is not None:
        torch["probe_seconds"] = data.get("torch_seconds")
        torch["site_dirs"] = data.get("site_dirs") or []
    torch["probe_stage"] = stage

    failure = None
    if res.error:
        failure = res.error
        if failure.startswith(f"{res.argv[0] if res.argv else python}: "):
            failure = failure.split(": ", 1)[1]
        if res.returncode is not None and res.returncode < 0:
            failure = f"killed by signal {-res.returncode} ({_signal_name(-res.returncode)})"
    elif stage != "done":
        tail = (res.stderr or "").strip().splitlines()
        failure = f"probe exited with status {res.returncode}" + (f": {tail[-1]}" if tail else "")

    if failure is not None:
        if data is None or stage in ("start",):
            # the interpreter itself (or site initialisation) failed before the torch part
            if py is None:
                py = {"version": None, "executable": python, "error": failure}
            torch["import_error"] = torch.get("import_error") or f"{failure} before torch was imported"
            torch["error"] = f"torch probe failed: {failure}"
        elif stage in ("core", "import"):
            what = "loading torch._C" if stage == "core" else "importing torch"
            torch["import_error"] = f"{failure} while {what}"
        elif stage == "cuda-init":
            torch["device_error"] = torch.get("device_error") or f"{failure} while initialising CUDA"
        elif stage == "launch":
            torch["device_error"] = torch.get("device_error") or f"{failure} while launching a kernel"
        else:
            torch["error"] = f"torch probe: {failure} after {stage}"
    return py, torch

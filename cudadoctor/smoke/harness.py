"""`cudadoctor smoke`: check a wheel (or an installed package) against this runtime, then run its
smoke cases on the GPU, plainly and under each compute-sanitizer tool.

Order of work:
1. install the wheel into a temporary folder next to the running torch (install.py);
2. in a child Python: import torch and the package, list its smoke cases (_child.py probe);
3. before any kernel runs: the build manifest and binaries against the runtime (torch, CUDA,
   C++11 ABI: EXT_ABI_MISMATCH) and the SASS/PTX inside against every GPU (EXT_NO_KERNEL_IMAGE),
   with the doctor's own extension rules;
4. one child per op: the cases against their torch reference; then one child per (op, tool)
   under compute-sanitizer. A crash or a hang in a child is a result, not the end of the run.

Exit codes (EXIT_* below): 0 everything ran and passed; 1 a failure was found (an import error,
a predicted no-kernel-image or ABI mismatch, a wrong result, sanitizer errors, a crash or a
timeout); 2 smoke could not run (missing or corrupt wheel, bad arguments); 3 nothing failed but
runs were skipped: no GPU is visible (the install, import, manifest and arch checks still ran),
the package has no smoke cases, or compute-sanitizer is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from cudadoctor.errors import EXIT_FINDING, EXIT_OK, EXIT_USAGE, InputError
from cudadoctor.runner import Result, Runner
from cudadoctor.smoke import sanitizer as S

SCHEMA = "cudadoctor.smoke/1"
EXIT_PASSED = EXIT_OK
EXIT_FAILED = EXIT_FINDING
EXIT_CANNOT_RUN = EXIT_USAGE
EXIT_SKIPPED = 3

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
RESULT_PREFIX = "@@cudadoctor-smoke@@ "
PLAIN = "run"  # the column of the runs without a sanitizer


@dataclass
class SmokeRequest:
    wheel: str | None = None  # a .whl to install into a temporary folder
    installed: str | None = None  # or: the import name of an installed package
    package: str | None = None  # which top-level package of the wheel (default: the wheel's own)
    cases_module: str | None = None  # default: <package>._smoke
    tools: list[str] = field(default_factory=lambda: list(S.TOOLS))
    timeout: float = 600.0  # per child process
    gpus: list[str] = field(default_factory=list)  # extra compute capabilities to judge the binaries for
    device: str = "cuda:0"
    jobs: int | None = None
    log_dir: str | None = None  # keep every child's output here
    python: str = sys.executable


Progress = Callable[[str], None]


# --- children ---------------------------------------------------------------------------------


def _child_env(pythonpath: str | None, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return env


def _child_args(mode: str, req: SmokeRequest, package: str, ops: list[str] | None = None) -> list[str]:
    argv = [req.python, CHILD, mode, "--package", package]
    if req.cases_module:
        argv += ["--cases", req.cases_module]
    if mode == "run":
        argv += ["--device", req.device]
        for op in ops or []:
            argv += ["--op", op]
    return argv


def _tail(text: str, n: int = 8) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip() and not ln.startswith(RESULT_PREFIX)]
    return "\n".join(lines[-n:])


def probe_child(runner: Runner, req: SmokeRequest, package: str, pythonpath: str | None) -> dict:
    """Import torch and the package in a child; a crash or hang comes back as ``import_error``."""
    r = runner.run(_child_args("probe", req, package), timeout=min(req.timeout, 300.0),
                   env=_child_env(pythonpath))
    for line in reversed((r.stdout or "").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                break
    why = r.error or f"exit status {r.returncode}"
    tail = _tail(r.stderr or r.stdout)
    return {"torch": None, "package": package, "devices": [], "cases": [],
            "import_error": f"the import check did not finish ({why})" + (f": {tail}" if tail else ""),
            "crashed": True}


def case_records(stdout: str) -> list[dict]:
    out = []
    for line in (stdout or "").splitlines():
        if line.startswith(RESULT_PREFIX):
            try:
                rec = json.loads(line[len(RESULT_PREFIX):])
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "case" in rec:
                out.append(rec)
    return out


def judge_run(op: str, tool: str, r: Result, expected_cases: list[str]) -> dict:
    """One table cell from a finished child: pass, fail, crash, timeout or error, with counts."""
    cases = case_records(r.stdout)
    cell: dict = {"op": op, "tool": tool, "status": "pass", "errors": None, "warnings": None,
                  "returncode": r.returncode, "detail": None, "reports": [], "cases": cases}
    text = (r.stdout or "") + "\n" + (r.stderr or "")
    verdict = S.parse_output(text, tool) if tool != PLAIN else None
    if verdict is not None:
        cell["errors"], cell["warnings"], cell["reports"] = verdict.errors, verdict.warnings, verdict.reports
        by_case = S.reports_by_case(r.stdout or "", RESULT_PREFIX)
        for c in cases:
            if by_case.get(c.get("case")):
                c["sanitizer_reports"] = by_case[c["case"]]
    seen = {c.get("case") for c in cases}
    missing = [c for c in expected_cases if c not in seen]
    bad_cases = [c for c in cases if c.get("status") != "pass"]
    if r.error and r.returncode is None:  # timed out (or could not start)
        cell["status"] = "timeout" if "timed out" in r.error else "error"
        cell["detail"] = r.error + (f"; cases not finished: {', '.join(missing)}" if missing else "")
        return cell
    if r.returncode is not None and r.returncode < 0:
        cell["status"] = "crash"
        cell["detail"] = f"killed by signal {-r.returncode}" + (f" during {missing[0]}" if missing else "") + \
            (f": {_tail(r.stderr, 3)}" if _tail(r.stderr, 3) else "")
        return cell
    if verdict is not None and verdict.errors:
        cell["status"] = "fail"
        what = "hazard" if tool == "racecheck" else "error"
        cell["detail"] = f"{verdict.errors} {what}{'s' if verdict.errors != 1 else ''}" + \
            (f": {verdict.reports[0]}" if verdict.reports else "")
        return cell
    if bad_cases:
        cell["status"] = "fail"
        first = bad_cases[0]
        cell["detail"] = f"{first.get('case')}: {first.get('status')}: {first.get('detail')}"
        if len(bad_cases) > 1:
            cell["detail"] += f" (and {len(bad_cases) - 1} more case{'s' if len(bad_cases) > 2 else ''})"
        return cell
    if missing:
        cell["status"] = "crash"
        cell["detail"] = f"exit status {r.returncode} before {missing[0]} finished" + \
            (f": {_tail(r.stderr, 3)}" if _tail(r.stderr, 3) else "")
        return cell
    if verdict is not None and verdict.tool_failure:
        cell["status"] = "error"
        cell["detail"] = f"compute-sanitizer: {verdict.tool_failure}"
        return cell
    if verdict is not None and verdict.errors is None:
        cell["status"] = "error"
        cell["detail"] = "no compute-sanitizer summary in the output" + \
            (f" (exit status {r.returncode}): {_tail(text, 3)}" if r.returncode else "")
        return cell
    if r.returncode:
        cell["status"] = "fail"
        cell["detail"] = f"exit status {r.returncode}" + (f": {_tail(r.stderr, 3)}" if _tail(r.stderr, 3) else "")
    return cell


# --- pre-run checks ---------------------------------------------------------------------------


def runtime_facts(probe: dict, entries: list[dict], *, gpus: list[dict], driver_cuda: object) -> dict:
    """A facts-v1 snapshot of just what the extension rules read."""
    t = probe.get("torch") or {}
    load_error = probe.get("import_error")
    exts = []
    for e in entries:
        e = dict(e)
        if load_error and e.get("load_error") is None:
            e["load_error"] = load_error
        exts.append(e)
    return {
        "schema": "cudadoctor.facts/1",
        "torch": {"version": t.get("version"), "cuda": t.get("cuda"), "cxx11_abi": t.get("cxx11_abi")},
        "gpus": gpus,
        "driver": {"cuda": str(driver_cuda) if driver_cuda is not None else None},
        "extensions": exts,
    }


def extension_findings(facts: dict) -> list[dict]:
    """EXT_NO_KERNEL_IMAGE and EXT_ABI_MISMATCH from the doctor's own rules."""
    from cudadoctor.rules import Facts, load_rules

    rules = load_rules()
    out: list[dict] = []
    f = Facts(facts)
    for rid in ("EXT_ABI_MISMATCH", "EXT_NO_KERNEL_IMAGE"):
        info = rules.get(rid)
        if info is None:
            continue
        res = info.fn(f) or []
        out.extend(x.to_json() for x in (res if isinstance(res, list) else [res]))
    return out


def _manifest_check(manifest: dict | None, probe: dict, abi_findings: list[dict]) -> dict:
    t = probe.get("torch") or {}
    if manifest is None:
        if abi_findings:
            return {"name": "manifest", "ok": False,
                    "detail": "no cudadoctor build manifest; the binaries (or their load error) show another "
                              "torch / CUDA / C++ ABI: see EXT_ABI_MISMATCH"}
        return {"name": "manifest", "ok": True,
                "detail": "no cudadoctor build manifest; torch/CUDA/ABI read from the binaries where they tell"}
    if manifest.get("error"):
        return {"name": "manifest", "ok": False, "detail": str(manifest["error"])}
    src = manifest.get("built_with") if isinstance(manifest.get("built_with"), dict) else manifest
    built = ", ".join(f"{k} {src.get(k)}" for k in ("torch", "cuda", "cxx11_abi", "python") if src.get(k) is not None)
    here = ", ".join(f"{k} {v}" for k, v in (("torch", t.get("version")), ("cuda", t.get("cuda")),
                                              ("cxx11_abi", t.get("cxx11_abi")), ("python", probe.get("python")))
                     if v is not None)
    py_built, py_here = str(src.get("python") or ""), str(probe.get("python") or "")
    py_bad = bool(py_built and py_here and py_built.split(".")[:2] != py_here.split(".")[:2])
    ok = not abi_findings and not py_bad
    detail = f"built with {built or 'unknown'}; running {here or 'unknown'}"
    if py_bad:
        detail += f"; built for Python {py_built}, running {py_here}"
    return {"name": "manifest", "ok": ok, "detail": detail}


# --- the whole run ----------------------------------------------------------------------------


def _present_driver(runner: Runner) -> tuple[list[dict], str | None, object]:
    from cudadoctor.archplan import driver_cuda_of, present_gpus

    try:
        gpus, driver, _err = present_gpus(runner)
    except Exception:  # noqa: BLE001 - the driver query is a hint only
        return [], None, None
    return gpus, driver, driver_cuda_of(driver)


def run_smoke(req: SmokeRequest, *, runner: Runner | None = None, progress: Progress | None = None) -> dict:
    """The smoke report (schema cudadoctor.smoke/1), with ``exit_code``. Raises InputError (exit 2)
    for a missing or corrupt wheel or a package that is not installed."""
    from cudadoctor.smoke.install import choose_package, install_wheel, read_wheel

    runner = runner or Runner(default_timeout=req.timeout)
    say = progress or (lambda _msg: None)
    if (req.wheel is None) == (req.installed is None):
        raise InputError("give either a wheel file or --installed PACKAGE.",
                         hint="For example: cudadoctor smoke dist/cudadoctor_ops-0.1.0-cp311-cp311-linux_x86_64.whl")
    report: dict = {"schema": SCHEMA, "status": None, "exit_code": None, "target": {}, "runtime": {},
                    "checks": [], "findings": [], "verdicts": [], "cases": [], "tools": list(req.tools),
                    "ops": [], "results": [], "skipped": []}
    tmp = None
    started = time.monotonic()
    try:
        if req.wheel is not None:
            info = read_wheel(req.wheel)
            package = choose_package(info, req.package)
            manifest = info.manifest
            tmp = tempfile.mkdtemp(prefix="cudadoctor-smoke-")
            say(f"installing {os.path.basename(req.wheel)} into {tmp}")
            try:
                install_wheel(req.wheel, tmp, runner=runner, python=req.python)
            except Exception as exc:
                from cudadoctor.errors import CudadoctorError

                if isinstance(exc, CudadoctorError) and exc.exit_code == EXIT_FAILED:
                    report["target"] = {"wheel": req.wheel, "package": package, "version": info.version}
                    report["checks"].append({"name": "install", "ok": False, "detail": str(exc)})
                    return _finish(report, started)
                raise
            report["target"] = {"wheel": os.path.abspath(req.wheel), "package": package, "version": info.version,
                                "installed_to": tmp}
            report["checks"].append({"name": "install", "ok": True,
                                     "detail": f"pip install --no-deps --no-index --target {tmp}"})
            from cudadoctor.inspect import inspect_path

            # a wheel with a manifest but no shared object comes back as one entry saying so: no device code
            entries = [e for e in inspect_path(req.wheel) if e.get("error") != "no shared objects inside"]
            pythonpath = tmp
        else:
            import importlib.util

            package = req.installed
            try:
                spec = importlib.util.find_spec(package)
            except (ImportError, ValueError):
                spec = None
            if spec is None:
                raise InputError(f"no installed package named {package!r} for {req.python}.",
                                 hint="Install it first (pip install WHEEL), or pass the wheel file instead of --installed.")
            from cudadoctor.inspect import _dist_manifest, installed_extension_entries

            manifest = _dist_manifest(package)
            entries = installed_extension_entries(package)
            report["target"] = {"wheel": None, "package": package, "installed_to": None}
            pythonpath = None

        if req.cases_module is None and isinstance(manifest, dict) and isinstance(manifest.get("smoke_cases"), str):
            from dataclasses import replace

            req = replace(req, cases_module=manifest["smoke_cases"])  # the build manifest names the case module
        say(f"importing torch and {package} in a child process")
        probe = probe_child(runner, req, package, pythonpath)
        t = probe.get("torch") or {}
        devices = list(probe.get("devices") or [])
        gpus = [dict(d) for d in devices]
        present, driver, driver_cuda = _present_driver(runner)
        if not gpus:  # torch sees none (CPU build, hidden devices): judge the GPUs the driver lists
            gpus = [dict(g, source="nvidia-smi") for g in present if g.get("cc")]
        judged = gpus + [{"index": None, "name": "requested target", "cc": cc} for cc in req.gpus]
        report["runtime"] = {"python": probe.get("python"), "torch": t.get("version"), "cuda": t.get("cuda"),
                             "cxx11_abi": t.get("cxx11_abi"), "gpus": gpus, "driver": driver,
                             "driver_cuda": str(driver_cuda) if driver_cuda is not None else None,
                             "device_error": probe.get("device_error")}
        if probe.get("file"):
            report["target"]["imported_from"] = probe["file"]
            if pythonpath and not os.path.abspath(probe["file"]).startswith(os.path.abspath(pythonpath)):
                report["checks"].append({"name": "isolation", "ok": False,
                                         "detail": f"{package} was imported from {probe['file']}, not from the wheel"})

        # import
        if t.get("import_error"):
            report["checks"].append({"name": "import", "ok": False, "detail": f"torch does not import: {t['import_error']}"})
        elif probe.get("import_error"):
            report["checks"].append({"name": "import", "ok": False, "detail": probe["import_error"]})
        else:
            report["checks"].append({"name": "import", "ok": True,
                                     "detail": f"{package} imports with torch {t.get('version')}"})

        # manifest and archs, before anything runs
        facts = runtime_facts(probe, entries, gpus=judged, driver_cuda=driver_cuda)
        findings = extension_findings(facts)
        report["findings"] = findings
        abi = [f for f in findings if f["id"] == "EXT_ABI_MISMATCH"]
        report["checks"].append(_manifest_check(manifest, probe, abi))
        report["manifest"] = manifest
        from cudadoctor.inspect import verdicts

        with_code = [e for e in entries if not e.get("error") and (e.get("sass") or e.get("ptx"))]
        ccs = list(dict.fromkeys(g["cc"] for g in judged if g.get("cc")))
        report["binaries"] = [{"path": e.get("path"), "sass": e.get("sass"), "ptx": e.get("ptx"),
                               "error": e.get("error")} for e in entries]
        report["verdicts"] = verdicts(with_code, ccs, driver_cuda=driver_cuda)
        unreadable = [e for e in entries if e.get("error")]
        if unreadable:
            report["checks"].append({"name": "archs", "ok": False,
                                     "detail": f"{unreadable[0]['path']}: {unreadable[0]['error']}"})
        elif not with_code:
            report["checks"].append({"name": "archs", "ok": True, "detail": "no CUDA device code in the package"})
        elif not ccs:
            archs = sorted({a for e in with_code for a in (e.get("sass") or []) + (e.get("ptx") or [])})
            report["checks"].append({"name": "archs", "ok": None,
                                     "detail": f"carries {', '.join(archs)}; no GPU to judge them against "
                                               "(--gpu CC judges for a compute capability)"})
        else:
            bad = [v for v in report["verdicts"] if not v["runs"]]
            if bad:
                report["checks"].append({"name": "archs", "ok": False,
                                         "detail": f"predicted 'no kernel image': {os.path.basename(bad[0]['path'].split('!')[-1])} "
                                                   f"on cc {bad[0]['gpu']}: {bad[0]['reason']}"})
            else:
                report["checks"].append({"name": "archs", "ok": True,
                                         "detail": "every GPU runs every shared object (" +
                                                   ", ".join(sorted({f"cc {v['gpu']} via {v['code']}" + (" PTX JIT" if v["via"] == "ptx" else "")
                                                                     for v in report['verdicts']})) + ")"})

        # cases
        cases = list(probe.get("cases") or [])
        report["cases"] = cases
        ops = list(dict.fromkeys(c["op"] for c in cases))
        report["ops"] = ops
        if not probe.get("import_error") and not t.get("import_error"):
            if probe.get("cases_error") and (req.cases_module or "no module" not in probe["cases_error"]):
                report["checks"].append({"name": "cases", "ok": False, "detail": probe["cases_error"]})
            elif not cases:
                report["checks"].append({"name": "cases", "ok": None,
                                         "detail": probe.get("cases_error") or "the case list is empty"})
                report["skipped"].append(f"no smoke cases: {probe.get('cases_error') or 'the case list is empty'}")
            else:
                report["checks"].append({"name": "cases", "ok": True,
                                         "detail": f"{len(cases)} cases for {len(ops)} ops from "
                                                   f"{req.cases_module or package + '._smoke'}"})

        # runs
        on_cpu = req.device.startswith("cpu")
        imported = not probe.get("import_error") and not t.get("import_error")
        if not imported:
            report["skipped"].append("GPU runs: the package does not import")
        elif not cases:
            pass
        elif not devices and not on_cpu:
            why = probe.get("device_error") or "torch sees no CUDA device"
            if gpus:
                why += (f", though nvidia-smi lists {', '.join(g['name'] for g in gpus)} (a CPU build of torch, "
                        "or CUDA_VISIBLE_DEVICES hiding it? `cudadoctor check` says which)")
            report["skipped"].append(f"no GPU: {why}; the install, import, manifest and arch checks above still ran")
        else:
            dev_index = 0 if on_cpu else _device_index(req.device)
            dev_cc = next((d["cc"] for d in devices if d.get("index") == dev_index), None)
            no_image = bool(dev_cc) and any(not v["runs"] and v["gpu"] == dev_cc for v in report["verdicts"])
            report["results"] = _run_all(runner, req, package, pythonpath, cases, ops, no_image, on_cpu, say,
                                         report["skipped"])
            if no_image:
                confirmed = any("no kernel image" in (c.get("detail") or "").lower()
                                for r in report["results"] if r["tool"] == PLAIN for c in r["cases"])
                report["prediction_confirmed"] = confirmed
        return _finish(report, started)
    except KeyboardInterrupt:
        _kill_children()  # the probe or pip child, when interrupted outside the run pool
        raise
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _device_index(device: str) -> int:
    try:
        return int(device.split(":", 1)[1]) if ":" in device else 0
    except ValueError:
        raise InputError(f"--device {device!r} is not a CUDA device.", hint="Write it like cuda:0.") from None


def _run_all(runner: Runner, req: SmokeRequest, package: str, pythonpath: str | None, cases: list[dict],
             ops: list[str], no_image: bool, on_cpu: bool, say: Progress, skipped: list[str]) -> list[dict]:
    by_op = {op: [c["name"] for c in cases if c["op"] == op] for op in ops}
    jobs_plain = [(op, PLAIN) for op in ops]
    tools = list(req.tools)
    sanitizer = S.find_sanitizer() if tools else None
    jobs_tool: list[tuple[str, str]] = []
    skip_cells: list[dict] = []
    if tools:
        reason = None
        if on_cpu:
            reason = "compute-sanitizer needs a CUDA device"
        elif no_image:
            reason = "no kernel image for this GPU (predicted above)"
        elif sanitizer is None:
            reason = "compute-sanitizer not found (PATH, CUDA_HOME/bin, /usr/local/cuda/bin)"
        if reason:
            skipped.append(f"{', '.join(tools)}: {reason}")
            skip_cells = [{"op": op, "tool": tool, "status": "skipped", "errors": None, "warnings": None,
                           "returncode": None, "detail": reason, "reports": [], "cases": []}
                          for op in ops for tool in tools]
        else:
            jobs_tool = [(op, tool) for op in ops for tool in tools]
    env_plain = _child_env(pythonpath)
    env_tool = S.sanitizer_env(env_plain)
    n_jobs = req.jobs or max(1, min(8, (os.cpu_count() or 2) // 2))

    def one(job: tuple[str, str]) -> dict:
        op, tool = job
        cmd = _child_args("run", req, package, [op])
        if tool != PLAIN:
            cmd = S.sanitizer_argv(sanitizer, tool, cmd, launch_timeout=req.timeout)
        say(f"{op}: {'running the cases' if tool == PLAIN else tool}")
        t0 = time.monotonic()
        r = runner.run(cmd, timeout=req.timeout, env=env_plain if tool == PLAIN else env_tool)
        cell = judge_run(op, tool, r, by_op[op])
        cell["seconds"] = round(time.monotonic() - t0, 2)
        cell["command"] = " ".join(cmd)
        if req.log_dir:
            os.makedirs(req.log_dir, exist_ok=True)
            path = os.path.join(req.log_dir, f"{op}.{tool}.log")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(f"$ {cell['command']}\n# exit {r.returncode} {r.error or ''}\n{r.stdout}\n--- stderr ---\n{r.stderr}")
            cell["log"] = path
        return cell

    pool = ThreadPoolExecutor(max_workers=n_jobs, thread_name_prefix="cudadoctor-smoke")
    try:
        cells = list(pool.map(one, jobs_plain))
        cells += list(pool.map(one, jobs_tool))
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        _kill_children()
        raise
    pool.shutdown(wait=True)
    return cells + skip_cells


def _kill_children() -> None:
    """End the child processes this process started (each leads its own session): Ctrl-C must not
    leave sanitizer runs behind. Linux /proc only; elsewhere they end at their timeout."""
    import signal

    me = os.getpid()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
                stat = fh.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass


def _finish(report: dict, started: float) -> dict:
    failed = any(c.get("ok") is False for c in report["checks"]) or \
        any(f.get("severity") == "error" for f in report["findings"]) or \
        any(r["status"] not in ("pass", "skipped") for r in report["results"])
    if failed:
        status, code = "fail", EXIT_FAILED
    elif report["skipped"]:
        status, code = "skipped", EXIT_SKIPPED
    else:
        status, code = "pass", EXIT_PASSED
    report["status"], report["exit_code"] = status, code
    report["seconds"] = round(time.monotonic() - started, 2)
    return report

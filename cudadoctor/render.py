"""Render a report: human (flutter-doctor style), JSON, GitHub workflow annotations.

Plain text only (no rich import), so ``check --from FILE`` stays fast.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

MARKS = {"ok": "✓", "info": "•", "warning": "!", "error": "✗"}
ASCII_MARKS = {"ok": "+", "info": "-", "warning": "!", "error": "x"}

# (area key, label) in display order; findings of an unknown area go under "General".
AREAS = (
    ("platform", "Platform"),
    ("driver", "Driver"),
    ("gpus", "GPUs"),
    ("torch", "PyTorch"),
    ("toolkit", "CUDA toolkit"),
    ("compiler", "Host compiler"),
    ("arch", "Arch list"),
    ("extensions", "Extensions"),
    ("tools", "Tools"),
)
_AREA_ALIASES = {"gpu": "gpus", "host_compiler": "compiler", "environment": "tools", "extension": "extensions"}


def _g(d: Any, *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict):
            return None
        d = d.get(p)
    return d


def _sec(facts: dict, name: str) -> dict:
    v = facts.get(name)
    return v if isinstance(v, dict) else {}


def _join(*parts: Any) -> str:
    return ", ".join(str(p) for p in parts if p not in (None, "", [], {}))


def _summary(area: str, facts: dict, report: dict, verbose: bool) -> tuple[str, list[str]]:
    """One-line summary of an area's facts, plus extra lines for -v."""
    extra: list[str] = []
    if area == "platform":
        h = _sec(facts, "host")
        wsl = f"WSL{h.get('wsl')}" if h.get("wsl") else None
        cont = f"in {h.get('container')} container" if h.get("container") else None
        line = _join(h.get("distro") or h.get("os"), h.get("arch"), wsl, cont)
        if verbose:
            extra += [f"kernel {h.get('kernel')}" if h.get("kernel") else "", f"glibc {h.get('glibc')}" if h.get("glibc") else ""]
            py = _sec(facts, "python")
            if py:
                extra.append(f"python {py.get('version')} ({py.get('executable') or '?'})")
        return line or "not probed", [e for e in extra if e]
    if area == "driver":
        d = _sec(facts, "driver")
        if not d:
            return "not probed", extra
        line = _join(d.get("version") and f"driver {d.get('version')}", d.get("cuda") and f"CUDA {d.get('cuda')}")
        if d.get("error") and not line:
            line = f"error: {str(d.get('error')).strip().splitlines()[0][:100]}"
        if verbose:
            if d.get("kernel_module"):
                extra.append(f"kernel module {d.get('kernel_module')}")
            for p in d.get("libcuda") or []:
                extra.append(f"libcuda {p}")
            if d.get("error") and line and not line.startswith("error"):
                extra.append(f"error: {d.get('error')}")
        return line or "not found", extra
    if area == "gpus":
        gpus = [g for g in (facts.get("gpus") or []) if isinstance(g, dict)]
        line = "; ".join(_join(g.get("name") or "GPU", g.get("cc") and f"cc {g.get('cc')}") for g in gpus)
        if verbose:
            for g in gpus:
                if g.get("memory_mib"):
                    extra.append(f"[{g.get('index')}] {g.get('memory_mib')} MiB")
            cvd = _g(facts, "env", "CUDA_VISIBLE_DEVICES")
            if cvd is not None:
                extra.append(f"CUDA_VISIBLE_DEVICES={cvd}")
        return line or ("none" if isinstance(facts.get("gpus"), list) else "not probed"), extra
    if area == "torch":
        t = _sec(facts, "torch")
        if not t:
            return "not probed", extra
        if t.get("import_error"):
            return f"import failed: {str(t.get('import_error')).strip().splitlines()[-1][:100]}", extra
        cuda = f"CUDA {t.get('cuda')}" if t.get("cuda") else "CPU build" if t.get("version") else None
        avail = {True: "CUDA available", False: "CUDA not available"}.get(t.get("cuda_available"))
        line = _join(t.get("version") and f"torch {t.get('version')}", cuda, avail)
        if verbose:
            if t.get("arch_list"):
                extra.append("arch list " + " ".join(map(str, t.get("arch_list"))))
            extra += [f"{k} {t.get(k)}" for k in ("cxx11_abi", "cudnn", "device_error") if t.get(k) is not None]
            if _g(facts, "env", "LD_LIBRARY_PATH"):
                extra.append(f"LD_LIBRARY_PATH={_g(facts, 'env', 'LD_LIBRARY_PATH')}")
        return line or "not probed", extra
    if area == "toolkit":
        tks = [t for t in (facts.get("toolkits") or []) if isinstance(t, dict)]
        if not tks:
            return ("none found" if isinstance(facts.get("toolkits"), list) else "not probed"), extra
        t = tks[0]
        via = t.get("via") if isinstance(t.get("via"), list) else []
        line = _join(t.get("nvcc") and f"nvcc {t.get('nvcc')}", t.get("root"), via and "via " + "+".join(map(str, via)))
        if verbose:
            for o in tks[1:]:
                extra.append("also " + _join(o.get("nvcc") and f"nvcc {o.get('nvcc')}", o.get("root")))
        return line, extra
    if area == "compiler":
        hc = _sec(facts, "host_compiler")
        line = " ".join(str(x) for x in (hc.get("name"), hc.get("version")) if x)
        if hc.get("path"):
            line += f" ({hc.get('path')})"
        if verbose:
            for k in ("CUDAHOSTCXX", "CXX", "CC"):
                if _g(facts, "env", k):
                    extra.append(f"{k}={_g(facts, 'env', k)}")
            if hc.get("links_static_libstdcxx") is not None:  # which C++ runtime it links into extensions
                extra.append(f"libstdc++: static only ({hc.get('static_libstdcxx')})" if hc.get("links_static_libstdcxx")
                             else f"libstdc++: {hc.get('shared_libstdcxx')}")
            has_h = _g(facts, "python", "has_python_h")
            if has_h is not None:  # what torch's extension builds include (Python.h)
                extra.append(f"Python headers: {_g(facts, 'python', 'include_dir')}"
                             + ("" if has_h else " (no Python.h)"))
        return line or "not probed", extra
    if area == "arch":
        cur = _g(facts, "env", "TORCH_CUDA_ARCH_LIST")
        rec = report.get("torch_cuda_arch_list")
        line = f"TORCH_CUDA_ARCH_LIST={cur!r}" if cur else "TORCH_CUDA_ARCH_LIST unset"
        if rec:
            line += f" (for this machine: {rec})"
        return line, extra
    if area == "extensions":
        exts = [e for e in (facts.get("extensions") or []) if isinstance(e, dict)]
        if verbose:
            for e in exts:
                extra.append(_join(e.get("path"), e.get("sass") and " ".join(e.get("sass")), e.get("ptx") and " ".join(e.get("ptx"))))
        return (f"{len(exts)} inspected" if exts else "none inspected"), extra
    if area == "tools":
        tl = _sec(facts, "tools")
        line = _join(*(f"{k.replace('_', '-')} {v}" for k, v in tl.items() if isinstance(v, (str, int, float)) and v and k != "error"))
        missing = [k.replace("_", "-") for k, v in tl.items() if v is None and k != "error"]
        if missing:
            line = _join(line, "missing: " + " ".join(missing))
        if verbose:
            paths = tl.get("paths")
            if isinstance(paths, dict):
                extra += [f"{k.replace('_', '-')}: {v}" for k, v in paths.items() if v]
        return line or "not probed", extra
    return "", extra


# Sections whose absence means the snapshot says nothing a verdict could rest on.
_PROBED_SECTIONS = ("host", "driver", "gpus", "toolkits", "torch", "host_compiler", "extensions", "error_text")


def _severity_key(findings: list[dict]) -> str:
    sev = {f.get("severity") for f in findings}
    for s in ("error", "warning", "info"):
        if s in sev:
            return s
    return "ok"


def _area_of(f: dict) -> str:
    a = str(f.get("area") or "general")
    a = _AREA_ALIASES.get(a, a)
    return a if a in dict(AREAS) else "general"


def _wrap(text: str, indent: str, width: int = 100) -> list[str]:
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=indent) or [indent]


def human(report: dict, *, verbose: bool = False, ascii_only: bool = False) -> str:
    marks = ASCII_MARKS if ascii_only else MARKS
    facts = report.get("facts") if isinstance(report.get("facts"), dict) else {}
    findings = [f for f in report.get("findings", []) if isinstance(f, dict)]
    rank = {id(f): n for n, f in enumerate(findings, 1)}
    by_area: dict[str, list[dict]] = {}
    for f in findings:
        by_area.setdefault(_area_of(f), []).append(f)
    lines = ["Doctor summary (cudadoctor check; -v for more facts):"]
    areas = list(AREAS) + ([("general", "General")] if "general" in by_area else [])
    for key, label in areas:
        fs = by_area.get(key, [])
        line, extra = _summary(key, facts, report, verbose)
        sev = _severity_key(fs)
        mark = marks["info" if sev == "ok" and line in ("not probed", "not found", "none found") else sev]
        lines.append(f"[{mark}] {label}" + (f": {line}" if line else ""))
        for e in extra:
            lines.extend(_wrap(f"{marks['info']} {e}", "    "))
        for f in fs:
            m = marks.get(f.get("severity"), marks["info"])
            lines.append(f"    {m} {f.get('title')}  [{f.get('id')}, #{rank[id(f)]}]")
            if f.get("detail"):
                lines.extend(_wrap(str(f["detail"]), "      "))
            for n, fix in enumerate(f.get("fix") or []):
                lines.append(("      fix: " if n == 0 else "           ") + str(fix))
    lines.append("")
    errors = [f for f in findings if f.get("severity") == "error"]
    warnings = [f for f in findings if f.get("severity") == "warning"]
    if report.get("error_implicates"):
        hit = [i for i in report["error_implicates"] if any(f.get("id") == i for f in findings)]
        if hit:
            lines.append("The pasted error points at: " + ", ".join(hit) + ".")
        else:
            lines.append("The pasted error usually means one of " + ", ".join(report["error_implicates"])
                         + ", but the facts show none of them.")
    if errors or warnings:
        first = (errors or warnings)[0]
        lines.append(f"Start with #{rank[id(first)]}: {first.get('id')} ({first.get('title')}).")
        areas_hit = {_area_of(f) for f in errors + warnings}
        lines.append(f"! Doctor found {len(errors)} error(s) and {len(warnings)} warning(s) "
                     f"in {len(areas_hit)} area(s).")
    elif not any(facts.get(k) for k in _PROBED_SECTIONS):
        lines.append(f"{marks['info']} The snapshot holds no facts about the driver, GPUs, torch or toolkits: "
                     "nothing could be judged. Run `cudadoctor collect` on the machine in question.")
    else:
        lines.append(f"{marks['info']} No issues found!")
    return "\n".join(lines) + "\n"


def as_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=False, default=str) + "\n"


def _esc_data(s: str) -> str:
    return s.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _esc_prop(s: str) -> str:
    return _esc_data(s).replace(":", "%3A").replace(",", "%2C")


def github(report: dict) -> str:
    """GitHub Actions workflow commands: one ::error / ::warning / ::notice per finding."""
    kind = {"error": "error", "warning": "warning", "info": "notice"}
    out = []
    for f in report.get("findings", []):
        if not isinstance(f, dict):
            continue
        title = f"{f.get('id')}: {f.get('title')}"
        body = str(f.get("detail") or "")
        if f.get("fix"):
            body += "\nFix:\n" + "\n".join(f"  {x}" for x in f["fix"])
        out.append(f"::{kind.get(f.get('severity'), 'notice')} title={_esc_prop(title)}::{_esc_data(body)}")
    status = report.get("status", "ok")
    out.append(f"cudadoctor: status {status}, {len(report.get('findings', []))} finding(s)")
    return "\n".join(out) + "\n"


def rule_list(rules: list[tuple[str, str, str]]) -> str:
    """``check --list``: id, severity, one line each."""
    width = max((len(r[0]) for r in rules), default=10)
    return "\n".join(f"{rid:<{width}}  {sev:<7}  {summary}" for rid, sev, summary in rules) + "\n"

"""Human and JSON output of a smoke report: the checks, then a table op x tool -> pass / fail."""

from __future__ import annotations

import json

from cudadoctor.smoke.harness import PLAIN

MARKS = {True: "✓", False: "✗", None: "•"}
ASCII_MARKS = {True: "+", False: "x", None: "-"}
STATUS_WORD = {"pass": "PASS", "fail": "FAIL", "skipped": "SKIPPED"}


def as_json(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=False, default=str) + "\n"


def cell_text(cell: dict | None) -> str:
    if cell is None:
        return "-"
    st = cell["status"]
    n = cell.get("errors")
    if cell["tool"] == PLAIN:
        if st == "pass":
            k = len(cell.get("cases") or [])
            return f"pass ({k} case{'s' if k != 1 else ''})"
        if st == "fail":
            bad = sum(1 for c in cell.get("cases") or [] if c.get("status") != "pass")
            return f"FAIL ({bad} case{'s' if bad != 1 else ''})" if bad else "FAIL"
        return st.upper()
    unit = "hazard" if cell["tool"] == "racecheck" else "error"
    if st == "pass":
        return f"pass (0 {unit}s)"
    if st == "fail" and n:
        return f"FAIL ({n} {unit}{'s' if n != 1 else ''})"
    if st == "fail":
        return "FAIL (wrong result)"
    if st == "skipped":
        return "skipped"
    return st.upper()


def table(report: dict) -> list[str]:
    ops = list(report.get("ops") or [])
    results = report.get("results") or []
    if not ops or not results:
        return []
    tools = [PLAIN] + [t for t in report.get("tools") or [] if any(r["tool"] == t for r in results)]
    cells = {(r["op"], r["tool"]): r for r in results}
    header = ["op"] + tools
    rows = [[op] + [cell_text(cells.get((op, t))) for t in tools] for op in ops]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def human(report: dict, *, ascii_only: bool = False, verbose: bool = False) -> str:
    marks = ASCII_MARKS if ascii_only else MARKS
    t = report.get("target") or {}
    rt = report.get("runtime") or {}
    out: list[str] = []
    what = t.get("wheel") or f"installed package {t.get('package')}"
    out.append(f"cudadoctor smoke: {t.get('package')}" + (f" {t['version']}" if t.get("version") else "") + f"  ({what})")
    gpus = ", ".join(f"{g.get('name')} (cc {g.get('cc')})" for g in rt.get("gpus") or []) or "none"
    out.append(f"runtime: torch {rt.get('torch')}, CUDA {rt.get('cuda')}, C++11 ABI "
               f"{'?' if rt.get('cxx11_abi') is None else int(bool(rt.get('cxx11_abi')))}, Python {rt.get('python')}; "
               f"GPUs: {gpus}")
    for c in report.get("checks") or []:
        out.append(f"{marks[c.get('ok')]} {c['name']:<9} {c.get('detail') or ''}")
    for f in report.get("findings") or []:
        out.append(f"  {marks[False] if f.get('severity') == 'error' else marks[None]} {f['id']}: {f['title']}")
        if verbose or f.get("severity") == "error":
            out.append(f"      {f.get('detail')}")
        for fix in f.get("fix") or []:
            out.append(f"      fix: {fix}")
    if report.get("prediction_confirmed") is not None:
        out.append(f"  prediction {'confirmed' if report['prediction_confirmed'] else 'NOT confirmed'} by the run: "
                   + ("the kernels failed with 'no kernel image is available'" if report["prediction_confirmed"]
                      else "the run did not fail with 'no kernel image is available'"))
    tab = table(report)
    if tab:
        out.append("")
        out.extend(tab)
    problems = [r for r in report.get("results") or [] if r["status"] not in ("pass", "skipped")]
    if problems:
        out.append("")
        for r in problems:
            out.append(f"{marks[False]} {r['op']} / {r['tool']}: {r.get('detail') or r['status']}")
            per_case = [(c["case"], h) for c in r.get("cases") or [] for h in c.get("sanitizer_reports") or []]
            if per_case:
                for case, head in per_case[: (20 if verbose else 3)]:
                    out.append(f"      during {case}: {head}")
            else:
                for head in (r.get("reports") or [])[: (20 if verbose else 3)]:
                    if head not in (r.get("detail") or ""):
                        out.append(f"      {head}")
            if r.get("log"):
                out.append(f"      log: {r['log']}")
    for s in report.get("skipped") or []:
        out.append(f"{marks[None]} skipped: {s}")
    out.append("")
    out.append(f"{STATUS_WORD.get(report.get('status'), str(report.get('status')).upper())} "
               f"(exit {report.get('exit_code')}): {summary_line(report)}")
    return "\n".join(out) + "\n"


def summary_line(report: dict) -> str:
    results = report.get("results") or []
    ran = [r for r in results if r["status"] != "skipped"]
    bad = [r for r in ran if r["status"] != "pass"]
    failed_checks = [c["name"] for c in report.get("checks") or [] if c.get("ok") is False]
    parts = []
    if failed_checks:
        parts.append("failed checks: " + ", ".join(failed_checks))
    if ran:
        parts.append(f"{len(ran) - len(bad)} of {len(ran)} runs passed")
    if report.get("skipped"):
        parts.append(f"{len(report['skipped'])} skipped")
    if not parts:
        parts.append("nothing ran")
    return "; ".join(parts)

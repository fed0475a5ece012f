"""compute-sanitizer: find it, build its command line, and read its verdict from the output.

Summary lines it prints (one per instrumented process with ``--target-processes all``):

    ========= ERROR SUMMARY: 3 errors                                   memcheck, initcheck, synccheck
    ========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)   racecheck

Pure apart from :func:`find_sanitizer` (which only looks at the file system).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Mapping, Sequence

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
ERROR_EXITCODE = 99
PRINT_LIMIT = 20
PREFIX = "========="

_ERROR_SUMMARY = re.compile(r"^=+\s*ERROR SUMMARY:\s*(\d+)\s+errors?", re.M)
_RACE_SUMMARY = re.compile(
    r"^=+\s*RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed(?:\s*\((\d+)\s+errors?,\s*(\d+)\s+warnings?\))?", re.M)
# The first line of each report: "========= Invalid __global__ write of size 4 bytes",
# "========= Error: Race reported between Write access at ...", "========= Uninitialized __global__ memory read".
_REPORT_HEAD = re.compile(
    r"^=+ ((?:Invalid|Uninitialized|Error:|Warning:|Barrier error|Program hit|Malloc/Free|Leaked|"
    r"Race reported|Divergent|Misaligned|Out-of-range)[^\n]*)", re.M)  # one space: sub-lines are indented
_SANITIZER_FAILURE = re.compile(
    r"^=+\s*(?:COMPUTE-SANITIZER\s*)?(?:Error|ERROR):\s*((?:No attachable process|Target application terminated|"
    r"Failed|Unable|Could not|Internal)[^\n]*)", re.M)


@dataclass
class SanitizerVerdict:
    """What one compute-sanitizer run reported."""

    tool: str
    errors: int | None  # memcheck/initcheck/synccheck: errors; racecheck: hazards; None: no summary seen
    warnings: int = 0
    summaries: int = 0  # how many summary lines (instrumented processes) were seen
    reports: list[str] = field(default_factory=list)  # first lines of the individual reports (deduplicated)
    tool_failure: str | None = None  # the sanitizer itself could not do its job

    @property
    def clean(self) -> bool:
        return self.errors == 0 and self.tool_failure is None


def parse_output(text: str, tool: str) -> SanitizerVerdict:
    """Error (or hazard) counts and report heads from compute-sanitizer's output; summed over processes."""
    text = text or ""
    if tool == "racecheck":
        races = _RACE_SUMMARY.findall(text)
        errs = _ERROR_SUMMARY.findall(text)
        if races:
            hazards = sum(int(h) for h, _e, _w in races)
            warnings = sum(int(w or 0) for _h, _e, w in races)
            v = SanitizerVerdict(tool, hazards, warnings=warnings, summaries=len(races))
        elif errs:
            v = SanitizerVerdict(tool, sum(int(n) for n in errs), summaries=len(errs))
        else:
            v = SanitizerVerdict(tool, None)
    else:
        errs = _ERROR_SUMMARY.findall(text)
        v = SanitizerVerdict(tool, sum(int(n) for n in errs) if errs else None, summaries=len(errs))
    heads: list[str] = []
    lines = text.splitlines()
    for n, line in enumerate(lines):
        head = _head(line, lines[n + 1] if n + 1 < len(lines) else "")
        if head and head not in heads:
            heads.append(head)
    v.reports = heads[:PRINT_LIMIT]
    fail = _SANITIZER_FAILURE.search(text)
    if fail:
        v.tool_failure = fail.group(1).strip()
    return v


def reports_by_case(stdout: str, prefix: str) -> dict[str, list[str]]:
    """Report heads grouped by the smoke case that was running when they were printed.

    The child prints ``<prefix>{"begin": CASE}`` before each case and synchronizes after it, so a
    report printed between two begin lines belongs to the first; reports before any case (torch's
    start-up) go under "". Best effort: the sanitizer and the child share the output pipe.
    """
    import json

    out: dict[str, list[str]] = {}
    current = ""
    lines = (stdout or "").splitlines()
    for n, line in enumerate(lines):
        if line.startswith(prefix):
            try:
                rec = json.loads(line[len(prefix):])
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("begin"), str):
                current = rec["begin"]
            continue
        head = _head(line, lines[n + 1] if n + 1 < len(lines) else "")
        if head:
            heads = out.setdefault(current, [])
            if head not in heads:
                heads.append(head)
    return out


_AT = re.compile(r"^=+\s+at\s+(.+?)(?:\s+in\s+(\S+))?\s*$")


def _head(line: str, following: str) -> str | None:
    """A report's first line, with the kernel it names on the next line ("... at kernel in file:line");
    addresses are blanked so that the same bug in many threads reads as one report."""
    m = _REPORT_HEAD.match(line)
    if not m:
        return None
    head = re.sub(r"\s+", " ", m.group(1)).strip()
    at = _AT.match(following)
    if at and " at " not in head:
        where = re.sub(r"\+0x[0-9a-fA-F]+$", "", at.group(1).strip())
        head += f" at {where}" + (f" ({at.group(2)})" if at.group(2) else "")
    return re.sub(r"0x[0-9a-fA-F]+", "0x…", head)


def find_sanitizer(env: Mapping[str, str] | None = None) -> str | None:
    """compute-sanitizer from $PATH, $CUDA_HOME / $CUDA_PATH, or /usr/local/cuda."""
    env = os.environ if env is None else env
    found = shutil.which("compute-sanitizer", path=env.get("PATH"))
    if found:
        return found
    roots = [env.get("CUDA_HOME"), env.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in [r for r in roots if r]:
        for cand in (os.path.join(root, "bin", "compute-sanitizer"),
                     os.path.join(root, "compute-sanitizer", "compute-sanitizer")):
            if os.path.isfile(cand) and os.access(cand, os.X_OK):
                return cand
    return None


def sanitizer_argv(sanitizer: str, tool: str, command: Sequence[str], *, launch_timeout: float = 600) -> list[str]:
    """The command line that runs ``command`` under ``tool``, following child processes.

    ``--launch-timeout``: how long the sanitizer waits for the target to connect (its first CUDA
    call). Its default, 10 s, is shorter than importing torch takes when several runs start at once.
    """
    if tool not in TOOLS:
        raise ValueError(f"unknown compute-sanitizer tool {tool!r}")
    argv = [sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXITCODE),
            "--target-processes", "all", "--print-limit", str(PRINT_LIMIT),
            "--launch-timeout", str(max(60, int(launch_timeout)))]
    if tool == "memcheck":
        argv += ["--leak-check", "no"]
    return argv + list(command)


def sanitizer_env(base: Mapping[str, str]) -> dict[str, str]:
    """Environment for a sanitized run: torch's caching allocator off, so every tensor is its own
    allocation and an out-of-bounds access cannot land silently inside a cached block."""
    env = dict(base)
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    return env


def parse_tools(text: str | None) -> list[str]:
    """'memcheck,racecheck' -> ['memcheck', 'racecheck']; 'all' or None -> all four; '' or 'none' -> []."""
    from cudadoctor.errors import InputError

    if text is None or text.strip().lower() == "all":
        return list(TOOLS)
    if text.strip().lower() in ("", "none"):
        return []
    out: list[str] = []
    for part in re.split(r"[,\s;]+", text.strip()):
        if not part:
            continue
        if part not in TOOLS:
            raise InputError(f"--tools: {part!r} is not a compute-sanitizer tool.",
                             hint=f"Use a comma-separated subset of {', '.join(TOOLS)}, 'all' or 'none'.")
        if part not in out:
            out.append(part)
    return out

"""Live progress for a build: a status line and the last lines of output on a terminal (rich), stage
lines only when output is not a terminal. Every line goes to the full log file."""

from __future__ import annotations

import re
import time
from collections import deque
from pathlib import Path
from typing import IO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

_NINJA = re.compile(r"^\s*\[(\d+)/(\d+)\]\s")
_ERROR = re.compile(r"(error|Error|ERROR|fatal|undefined reference|No such file)")


class BuildProgress:
    def __init__(self, console: Console, log_path: Path, title: str, *, tail: int = 10, verbose: bool = False):
        self.console = console
        self.log_path = log_path
        self.title = title
        self.tail: deque[str] = deque(maxlen=tail)
        self.verbose = verbose
        self.stage = "starting"
        self.steps = ""
        self.t0 = time.monotonic()
        self._fh: IO[str] | None = None
        self._live: Live | None = None
        self.lines = 0

    def __enter__(self) -> "BuildProgress":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.log_path, "a", encoding="utf-8", errors="replace")
        if self.console.is_terminal and not self.verbose:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def _render(self) -> Group:
        elapsed = time.monotonic() - self.t0
        head = Text.assemble((f"{self.title}", "bold"), f"  {self.stage}", f" {self.steps}" if self.steps else "",
                             (f"  {elapsed:0.0f}s", "dim"))
        body = [Text("  " + line[:200], style="dim", overflow="ellipsis", no_wrap=True) for line in self.tail]
        return Group(head, *body)

    def set_stage(self, stage: str) -> None:
        self.stage = stage
        self.steps = ""
        self.write(f"[cudadoctor] == {stage}")
        # printed above the live view on a terminal, as a plain line otherwise
        self.console.print(f"[bold]{self.title}[/bold]: {stage}", highlight=False, soft_wrap=True)
        if self._live is not None:
            self._live.update(self._render())

    def write(self, line: str) -> None:
        if self._fh:
            self._fh.write(line + "\n")
            self._fh.flush()

    def line(self, line: str) -> None:
        self.lines += 1
        self.write(line)
        self.tail.append(line)
        m = _NINJA.match(line)
        if m:
            self.steps = f"[{m.group(1)}/{m.group(2)}]"
        if self._live is not None:
            self._live.update(self._render())
        elif self.verbose:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        elif m or line.startswith("[cudadoctor"):
            self.console.print("  " + line[:160], markup=False, highlight=False, soft_wrap=True)

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
        if self._fh:
            self._fh.write(f"[cudadoctor] == finished after {time.monotonic() - self.t0:0.1f}s\n")
            self._fh.close()
            self._fh = None


def error_excerpt(log_path: Path, *, context: int = 40) -> str:
    """The compiler's error lines from a log (with a little context), else its last lines."""
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    hits = [i for i, l in enumerate(lines) if _ERROR.search(l) and not l.startswith("[cudadoctor]")]
    picked: list[str] = []
    if hits:
        seen: set[int] = set()
        for i in hits[:12]:
            for j in range(max(0, i - 1), min(len(lines), i + 2)):
                if j not in seen:
                    seen.add(j)
                    picked.append(lines[j])
        picked = picked[:context]
    else:
        picked = lines[-context:]
    return "\n".join(l[:400] for l in picked)

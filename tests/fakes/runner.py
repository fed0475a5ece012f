"""A runner that answers from recorded outputs, for probe tests on fake filesystem trees."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from cudadoctor.runner import Result, Runner

RECORDED = Path(__file__).resolve().parent.parent / "fixtures" / "recorded"


def recorded(name: str) -> str:
    return (RECORDED / name).read_text(encoding="utf-8")


class ScriptedRunner(Runner):
    """Answers ``run`` from rules ``(key, response)`` checked in order.

    ``key`` is a tuple: its first item must be a suffix of argv[0] (so "nvcc" or
    "cuda-11.8/bin/nvcc" both work against a tmp-tree path) and the rest must equal the argv that
    follows; a string key matches the last argv item (the tags of the probe child processes).
    ``response`` is a Result, a string (stdout, exit 0) or (returncode, stdout, stderr).
    Unmatched commands are "not found". Every call is kept in ``calls``.
    """

    def __init__(self, rules: Sequence[tuple] = ()):
        super().__init__()
        self.rules = list(rules)
        self.calls: list[tuple[str, ...]] = []

    def add(self, key, response) -> "ScriptedRunner":
        self.rules.append((key, response))
        return self

    def run(self, argv, *, timeout=None, env=None, input=None) -> Result:  # type: ignore[override]
        argv = tuple(str(a) for a in argv)
        self.calls.append(argv)
        for key, resp in self.rules:
            if isinstance(key, str):
                if argv[-1] != key:
                    continue
            else:
                head, rest = key[0], tuple(key[1:])
                if not (argv[0] == head or argv[0].endswith("/" + head.lstrip("/")) or os.path.basename(argv[0]) == head):
                    continue
                if tuple(argv[1:]) != rest:
                    continue
            if isinstance(resp, Result):
                return Result(argv, resp.returncode, resp.stdout, resp.stderr, resp.error)
            if isinstance(resp, str):
                return Result(argv, 0, resp, "")
            rc, out, err = (tuple(resp) + ("", ""))[:3]
            return Result(argv, rc, out, err)
        return Result(argv, None, error=f"{argv[0]}: command not found")

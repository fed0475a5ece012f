"""Rules: pure functions facts -> findings, one module per family, registered for `check --list`.

A rule is ``fn(facts: Facts) -> Finding | list[Finding] | None`` decorated with ``@rule``.
Rules import neither subprocess nor torch, and never raise on odd facts: ``evaluate`` turns an
exception inside a rule into an internal finding instead of a traceback.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from cudadoctor.findings import SEVERITY_ORDER, Finding

RULE_MODULES = ("driver", "platform", "torch", "toolkit", "arch", "extensions", "environment", "cxx_runtime",
                "messages")


@dataclass(frozen=True)
class RuleInfo:
    id: str
    severity: str
    area: str
    summary: str
    priority: int  # lower = more likely root cause; orders findings of equal severity
    fn: Callable[["Facts"], Any]


REGISTRY: dict[str, RuleInfo] = {}


def rule(id: str, *, severity: str, area: str, summary: str, priority: int = 50):
    """Register a rule. ``priority`` orders findings: root causes (driver, container) low numbers."""

    def deco(fn):
        if id in REGISTRY:
            raise ValueError(f"rule {id} registered twice")
        REGISTRY[id] = RuleInfo(id, severity, area, summary, priority, fn)
        return fn

    return deco


class Facts:
    """Null-safe read access to a facts dict: ``facts.get("torch.version")``, ``facts.list("gpus")``."""

    def __init__(self, data: dict | None):
        self.data = data if isinstance(data, dict) else {}

    def get(self, path: str, default: Any = None) -> Any:
        cur: Any = self.data
        for part in path.split("."):
            if isinstance(cur, dict):
                cur = cur.get(part)
            elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
                cur = cur[int(part)]
            else:
                return default
            if cur is None:
                return default
        return cur

    def section(self, name: str) -> dict:
        v = self.data.get(name)
        return v if isinstance(v, dict) else {}

    def list(self, path: str) -> list:
        v = self.get(path)
        return [x for x in v if x is not None] if isinstance(v, list) else []

    def env(self, name: str) -> str | None:
        v = self.section("env").get(name)
        return v if isinstance(v, str) else None


def load_rules() -> dict[str, RuleInfo]:
    for name in RULE_MODULES:
        try:
            importlib.import_module(f"cudadoctor.rules.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"cudadoctor.rules.{name}":
                raise
    return REGISTRY


def _as_list(out: Any) -> Iterable[Finding]:
    if out is None:
        return []
    if isinstance(out, Finding):
        return [out]
    return [f for f in out if isinstance(f, Finding)]


def evaluate(facts: dict | None) -> list[Finding]:
    """All findings for ``facts``, ordered: errors first, then by rule priority (root cause first)."""
    load_rules()
    f = Facts(facts)
    found: list[tuple[int, int, int, Finding]] = []
    for n, info in enumerate(REGISTRY.values()):
        try:
            results = list(_as_list(info.fn(f)))
        except Exception as exc:  # noqa: BLE001 - a crashing rule becomes a finding, never a traceback
            results = [
                Finding(
                    id="INTERNAL_RULE_ERROR",
                    severity="warning",
                    title=f"rule {info.id} could not evaluate these facts",
                    detail=f"{type(exc).__name__}: {exc}",
                    area="general",
                )
            ]
        for r in results:
            found.append((SEVERITY_ORDER.get(r.severity, 9), info.priority, n, r))
    found.sort(key=lambda t: t[:3])
    return [t[3] for t in found]

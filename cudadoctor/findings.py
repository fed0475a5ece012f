"""Findings and the report of facts-v1 (../shared/spec/facts-v1.md, mirrored in docs/facts-v1.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

REPORT_SCHEMA = "cudadoctor.report/1"
FACTS_SCHEMA = "cudadoctor.facts/1"

SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


@dataclass
class Finding:
    id: str
    severity: str  # error | warning | info
    title: str
    detail: str = ""
    fix: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)
    area: str = "general"  # which line of the human report it belongs under

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        return d


def report_status(findings: list[Finding]) -> str:
    if any(f.severity == "error" for f in findings):
        return "fail"
    if any(f.severity == "warning" for f in findings):
        return "warn"
    return "ok"

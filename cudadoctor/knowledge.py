"""Knowledge tables: compatibility facts as data, one TOML file per table in cudadoctor/data/.

Each file holds ``[[row]]`` entries and every row names its ``source``. A new CUDA release,
GPU or torch wheel is a data change. Loading is cached; a missing or broken table raises
KnowledgeError (a packaging bug, not user input).
"""

from __future__ import annotations

import tomllib
from functools import lru_cache
from importlib import resources
from typing import Any


class KnowledgeError(RuntimeError):
    pass


@lru_cache(maxsize=None)
def load_table(name: str) -> tuple[dict[str, Any], ...]:
    """Rows of cudadoctor/data/<name>.toml, each a dict with at least a ``source`` key."""
    try:
        text = resources.files("cudadoctor.data").joinpath(f"{name}.toml").read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as exc:
        raise KnowledgeError(f"knowledge table {name!r} is missing: {exc}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KnowledgeError(f"knowledge table {name!r} is not valid TOML: {exc}") from exc
    rows = data.get("row", [])
    for i, row in enumerate(rows):
        if not row.get("source"):
            raise KnowledgeError(f"knowledge table {name!r} row {i} has no source")
    return tuple(rows)


def table_names() -> list[str]:
    return sorted(
        p.name[: -len(".toml")]
        for p in resources.files("cudadoctor.data").iterdir()
        if p.name.endswith(".toml")
    )

"""Probe tests import their helpers from tests/fakes (``fakes.runner``, ``fakes.trees``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from fakes.trees import make_tree  # noqa: E402


@pytest.fixture
def tree(tmp_path):
    def _make(files=None, links=None, dirs=()):
        return make_tree(tmp_path, files, links, dirs)

    return _make

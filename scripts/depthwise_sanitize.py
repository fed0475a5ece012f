"""Runs every depthwise_conv2d kernel variant once (for compute-sanitizer); exit 1 on a mismatch.

    compute-sanitizer --tool memcheck python scripts/depthwise_sanitize.py

Same as `python -m cudadoctor_ops.sanitize depthwise`.
"""

from __future__ import annotations

import sys

import cudadoctor_ops
from cudadoctor_ops.depthwise import sanitize_exercise


def main() -> int:
    try:
        n = sanitize_exercise()
    except AssertionError as exc:
        print(f"depthwise_sanitize: {exc}")
        return 1
    print(f"depthwise_sanitize: {n} runs ok ({cudadoctor_ops.__name__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

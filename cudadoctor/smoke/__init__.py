"""`cudadoctor smoke`: install a wheel next to the running torch (or take an installed package),
check it against this runtime before anything runs, then run its smoke cases on the GPU, plainly
and under compute-sanitizer (memcheck, racecheck, initcheck, synccheck).

harness.py   the run (run_smoke) and the exit codes
install.py   wheel checks and the isolated install
sanitizer.py compute-sanitizer command line and output parsing
render.py    table and JSON output
_child.py    the child process (standalone) and the smoke-case protocol a package implements
"""

from cudadoctor.smoke.harness import (
    EXIT_CANNOT_RUN,
    EXIT_FAILED,
    EXIT_PASSED,
    EXIT_SKIPPED,
    SCHEMA,
    SmokeRequest,
    run_smoke,
)

__all__ = ["run_smoke", "SmokeRequest", "SCHEMA", "EXIT_PASSED", "EXIT_FAILED", "EXIT_CANNOT_RUN", "EXIT_SKIPPED"]

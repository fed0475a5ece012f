"""The one subprocess chokepoint. Every external command goes through a Runner with a timeout.

Probes take a Runner as a parameter, so tests pass a FakeRunner with recorded outputs.
A Runner never raises: failures come back as a Result with ``error`` set.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Result:
    argv: tuple[str, ...]
    returncode: int | None  # None: did not run to completion (missing, timeout)
    stdout: str = ""
    stderr: str = ""
    error: str | None = None  # "not found", "timed out after 5s", OSError text, "killed by signal 11"

    @property
    def ok(self) -> bool:
        return self.error is None and self.returncode == 0


class Runner:
    """Runs commands with a timeout; never raises."""

    def __init__(self, default_timeout: float = 10.0, env: Mapping[str, str] | None = None):
        self.default_timeout = default_timeout
        self.env = dict(env) if env is not None else None

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        input: str | None = None,
    ) -> Result:
        argv = tuple(str(a) for a in argv)
        t = self.default_timeout if timeout is None else timeout
        run_env = dict(os.environ if self.env is None else self.env)
        if env:
            run_env.update(env)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=run_env,
                text=True,
                errors="replace",
                start_new_session=True,
            )
        except FileNotFoundError:
            return Result(argv, None, error=f"{argv[0]}: command not found")
        except OSError as exc:
            return Result(argv, None, error=f"{argv[0]}: {exc.strerror or exc}")
        try:
            out, err = proc.communicate(input=input, timeout=t)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = _drain(proc)
            return Result(argv, None, out, err, error=f"{argv[0]}: timed out after {t:g}s")
        rc = proc.returncode
        if rc < 0:
            return Result(argv, rc, out, err, error=f"{argv[0]}: killed by signal {-rc}")
        return Result(argv, rc, out, err)


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass


def _drain(proc: subprocess.Popen) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=2)
        return out or "", err or ""
    except Exception:  # noqa: BLE001 - a hung pipe must not hang the doctor
        return "", ""


@dataclass
class FakeRunner(Runner):
    """For tests: maps a command (tuple or its first word) to a Result or (rc, stdout, stderr)."""

    responses: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)

    def __post_init__(self) -> None:
        Runner.__init__(self)

    def run(self, argv, *, timeout=None, env=None, input=None) -> Result:  # type: ignore[override]
        argv = tuple(str(a) for a in argv)
        self.calls.append(argv)
        for key in (argv, argv[0], os.path.basename(argv[0])):
            if key in self.responses:
                r = self.responses[key]
                if isinstance(r, Result):
                    return Result(argv, r.returncode, r.stdout, r.stderr, r.error)
                rc, out, err = (tuple(r) + ("", ""))[:3]
                return Result(argv, rc, out, err)
        return Result(argv, None, error=f"{argv[0]}: command not found")

"""Docker through the docker SDK (imported lazily: machines without it can still plan and build
locally). One context manager per container; it always removes what it created, on success, on
failure and on Ctrl-C, unless asked to keep it (``--keep-container`` / CUDADOCTOR_KEEP_CONTAINER=1).
"""

from __future__ import annotations

import os
import signal
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from cudadoctor.build.plan import LABEL
from cudadoctor.errors import CudadoctorError

RUN_LABEL = "org.cudadoctor.run"


def _docker():
    try:
        import docker  # noqa: PLC0415 - optional dependency, imported on use
    except ImportError as exc:
        raise CudadoctorError(
            "the Docker backend needs the `docker` Python package, which is not installed here "
            f"({exc}).",
            hint="Install it with `python3 -m pip install docker`, or build with --backend local.",
        ) from exc
    return docker


def daemon_address(env: dict | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def client(env: dict | None = None):
    """A connected docker client; a daemon that does not answer is a one-paragraph error (exit 2)."""
    docker = _docker()
    where = daemon_address(env)
    try:
        c = docker.from_env(environment=env, timeout=600)
        c.ping()
    except Exception as exc:  # noqa: BLE001 - DockerException, requests errors, socket errors alike
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CudadoctorError(
            f"no Docker daemon answered at {where} ({reason}).",
            hint=(
                "Start one (`sudo systemctl start docker`, or `sudo dockerd &` where there is no systemd), "
                "check that your user may use it (`docker info`), or point DOCKER_HOST at a daemon that runs "
                "(DOCKER_HOST=ssh://user@buildhost or tcp://host:2376); or build on this machine with "
                "--backend local."
            ),
        ) from None
    return c


def extra_labels(env: dict | None = None) -> dict[str, str]:
    """CUDADOCTOR_CONTAINER_LABELS="ci.job=123,team=ops": more labels on every container (to find
    a CI job's containers)."""
    text = (os.environ if env is None else env).get("CUDADOCTOR_CONTAINER_LABELS") or ""
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if key and sep:
            out[key] = value
    return out


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Treat SIGTERM like Ctrl-C while a container runs, so cleanup happens either way."""
    def _raise(signum, frame):  # noqa: ARG001
        raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run_pending() -> None:
    """A Python call: the interpreter runs the handlers of signals already delivered on entry."""


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the duration, then hand the first one that came to the
    handler that was installed (a Ctrl-C that lands while the daemon creates a container must not
    leave the container created and its id unknown). Python runs signal handlers in the main
    thread whichever thread the signal reached, so this replaces the handlers there; elsewhere it
    does nothing."""
    got: list[int] = []

    def hold(signum, frame):  # noqa: ARG001
        got.append(signum)

    try:
        old = {s: signal.signal(s, hold) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: handlers cannot be set here
        yield
        return
    try:
        yield
    finally:
        _run_pending()
        for s, h in old.items():
            signal.signal(s, h)
        if got:
            h = old[got[0]]
            if callable(h):
                h(got[0], None)  # default_int_handler, sigterm_as_interrupt's: KeyboardInterrupt
            elif h == signal.SIG_DFL:
                raise KeyboardInterrupt


class Container:
    """A created (not yet started) container that is removed on exit from the ``with`` block."""

    def __init__(self, docker_client, image: str, command: list[str], *, run_id: str, role: str,
                 keep: bool = False, **kwargs: Any):
        self.client = docker_client
        self.image = image
        self.command = command
        self.run_id = run_id
        self.role = role
        self.keep = keep or os.environ.get("CUDADOCTOR_KEEP_CONTAINER") == "1"
        self.kwargs = kwargs
        self.container = None
        self.name = f"cudadoctor-{role}-{run_id}"

    def __enter__(self) -> "Container":
        labels = {LABEL: self.role, RUN_LABEL: self.run_id, **extra_labels(), **self.kwargs.pop("labels", {})}
        try:
            # A Ctrl-C held back until the container's id is known is raised on leaving this block
            # (or just after); here, __exit__ is not called for an exception from __enter__.
            with signals_deferred():
                self.container = self.client.containers.create(
                    self.image, self.command, name=self.name, labels=labels, detach=True, **self.kwargs
                )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start(self) -> None:
        self.container.start()

    def stream(self, on_line: Callable[[str], None]) -> int:
        """Follow the output line by line until the container exits; returns its exit status."""
        buf = b""
        for chunk in self.container.logs(stream=True, follow=True, stdout=True, stderr=True):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                on_line(line.decode("utf-8", "replace").rstrip("\r"))
        if buf:
            on_line(buf.decode("utf-8", "replace"))
        status = self.container.wait()
        return int(status.get("StatusCode", 1))

    def commit(self, tag: str, changes: list[str]) -> str:
        repo, _, t = tag.rpartition(":")
        img = self.container.commit(repository=repo, tag=t, changes=changes,
                                    message="cudadoctor build toolchain")
        return img.id

    def __exit__(self, *exc) -> None:
        if self.container is None:
            return
        if self.keep:
            return
        # A second Ctrl-C during removal must not leave the container behind.
        for _ in range(3):
            try:
                self.container.remove(force=True)
                return
            except KeyboardInterrupt:
                continue
            except Exception as err:  # noqa: BLE001
                if "No such container" in str(err) or getattr(err, "status_code", None) == 404:
                    return
                if "already in progress" in str(err):
                    return
                raise


def labelled_containers(docker_client, run_id: str | None = None) -> list:
    """Containers (running or not) this tool created; only one run's when ``run_id`` is given."""
    filters = {"label": [f"{RUN_LABEL}={run_id}"] if run_id else [LABEL]}
    return docker_client.containers.list(all=True, filters=filters)

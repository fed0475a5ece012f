"""The build container's lifetime (cudadoctor/build/container.py) against a fake Docker client: a
Ctrl-C that lands while the daemon creates the container still removes it."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from cudadoctor.build import container as dk


class FakeContainer:
    def __init__(self, registry: dict, name: str):
        self.registry, self.name = registry, name
        registry[name] = self

    def remove(self, force: bool = False) -> None:
        self.registry.pop(self.name, None)


class FakeContainers:
    """containers.create as the daemon sees it: the container exists once the request is made,
    whether or not its id reaches the caller. ``interrupt``: a SIGINT then arrives before the id
    is returned, sent to the process ("process") or to another thread of it ("thread": in a
    process with threads the kernel may hand the signal to any of them)."""

    def __init__(self, interrupt: str | None):
        self.registry: dict = {}
        self.interrupt = interrupt

    def create(self, image, command, name, labels, detach, **kwargs):
        c = FakeContainer(self.registry, name)
        if self.interrupt == "process":
            os.kill(os.getpid(), signal.SIGINT)
        elif self.interrupt == "thread":
            stop = threading.Event()
            t = threading.Thread(target=stop.wait, daemon=True)
            t.start()
            signal.pthread_kill(t.ident, signal.SIGINT)
            stop.set()
            t.join()
        for _ in range(10000):  # bytecodes at which Python would raise a delivered SIGINT
            pass
        return c


class FakeClient:
    def __init__(self, interrupt: str | None = None):
        self.containers = FakeContainers(interrupt)


@pytest.fixture
def default_sigint():
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("to", ["process", "thread"])
def test_ctrl_c_while_the_container_is_created_leaves_none(default_sigint, to):
    client = FakeClient(interrupt=to)
    with pytest.raises(KeyboardInterrupt):
        with dk.Container(client, "img", ["true"], run_id="r1", role="build"):
            for _ in range(10000):  # the held-back Ctrl-C may surface here too: __exit__ removes then
                pass
    assert client.containers.registry == {}


def test_container_is_removed_after_the_block_unless_kept(monkeypatch):
    monkeypatch.delenv("CUDADOCTOR_KEEP_CONTAINER", raising=False)
    client = FakeClient()
    with dk.Container(client, "img", ["true"], run_id="r2", role="build") as c:
        assert list(client.containers.registry) == [c.name] == ["cudadoctor-build-r2"]
    assert client.containers.registry == {}
    with dk.Container(client, "img", ["true"], run_id="r3", role="build", keep=True):
        pass
    assert list(client.containers.registry) == ["cudadoctor-build-r3"]


def test_signals_deferred_delivers_the_signal_when_it_ends(default_sigint):
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with dk.signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10000):
                pass
            reached.append("end of block")  # not interrupted inside the block
    assert reached == ["end of block"]

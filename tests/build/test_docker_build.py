"""Real builds in Docker (CI starts dockerd, so these run there).

Base image: a Debian bookworm made with debootstrap + docker import (docker/scripts/make-base-image.sh,
cached by tag). CUDA 13.0 nvcc comes from pip wheels (--toolkit pip), torch 2.14.1 from this machine's
pip configuration (local wheel folders / PyPI) with its CA bundle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures"
LABEL = "org.cudadoctor.build"


def _docker_ok() -> str | None:
    try:
        import docker

        docker.from_env(timeout=10).ping()
    except Exception as exc:  # noqa: BLE001
        return f"no Docker daemon: {exc}"
    if subprocess.run(["which", "debootstrap"], capture_output=True).returncode != 0 and not os.environ.get(
        "CUDADOCTOR_BASE_IMAGE"
    ):
        return "debootstrap is not installed and CUDADOCTOR_BASE_IMAGE is not set"
    return None


_why = _docker_ok()
if _why:
    pytestmark = [pytest.mark.docker, pytest.mark.skip(reason=_why)]


@pytest.fixture(scope="session")
def base_image() -> str:
    tag = os.environ.get("CUDADOCTOR_BASE_IMAGE")
    if tag:
        return tag
    r = subprocess.run([str(ROOT / "docker" / "scripts" / "make-base-image.sh")], capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def client():
    import docker

    return docker.from_env(timeout=60)


# Every container a test's builds create carries this label, so the checks below see only this
# session's containers, not those of other builds on the same daemon.
SESSION = f"pytest-{os.getpid()}-{int(time.time())}"


def labelled(client) -> list:
    """This session's containers. The SDK lists, then inspects each one: a container removed (or
    not yet inspectable) in between answers 404, so the listing is retried."""
    import docker

    filters = {"label": [LABEL, f"org.cudadoctor.test={SESSION}"]}
    for _ in range(20):
        try:
            return client.containers.list(all=True, filters=filters)
        except docker.errors.NotFound:
            time.sleep(0.25)
    return client.containers.list(all=True, filters=filters)


def session_env() -> dict:
    env = dict(os.environ)
    env.pop("CUDADOCTOR_KEEP_CONTAINER", None)
    env["CUDADOCTOR_CONTAINER_LABELS"] = f"org.cudadoctor.test={SESSION}"
    return env


def cli(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    env = session_env()
    return subprocess.run([sys.executable, "-m", "cudadoctor", "build", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def test_fat_wheel_in_docker(base_image, client, tmp_path):
    out = tmp_path / "dist"
    r = cli(str(FIX / "ext_min"), "--arch", "8.6,8.9", "--torch", "2.14.1", "--cuda", "13.0", "--toolkit", "pip",
            "--base-image", base_image, "--out", str(out), "--work-dir", str(tmp_path / "work"))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    wheels = list(out.glob("*.whl"))
    assert [w.name for w in wheels] == ["ext_min-0.1.0+cu130torch2.14-cp311-cp311-linux_x86_64.whl"]
    wheel = wheels[0]
    log = wheel.with_name(wheel.name[:-4] + ".build.log")
    assert log.is_file() and "TORCH_CUDA_ARCH_LIST=8.6;8.9" in log.read_text()
    assert wheel.stat().st_uid == os.getuid()
    assert labelled(client) == []

    # the wheel installs, and inspect sees sm_86 and sm_89 SASS in every shared object
    site = tmp_path / "site"
    pi = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site),
                         str(wheel)], capture_output=True, text=True, timeout=300)
    assert pi.returncode == 0, pi.stderr
    ins = subprocess.run([sys.executable, "-m", "cudadoctor", "inspect", "--json", str(site / "ext_min")],
                         capture_output=True, text=True, timeout=120)
    assert ins.returncode == 0, ins.stderr
    entries = json.loads(ins.stdout)["files"]
    sos = [e for e in entries if ".so" in e["path"]]
    assert sos, entries
    for e in sos:
        assert {"sm_86", "sm_89"} <= set(e["sass"]), e
    manifest = json.loads(next((site).glob("ext_min-*.dist-info")).joinpath("cudadoctor_build.json").read_text())
    assert manifest["torch"].startswith("2.14.1") and manifest["cuda"] == "13.0"
    assert manifest["nvcc"].startswith("13.0") and manifest["glibc"] and manifest["cxx11_abi"] is True
    assert manifest["python"].startswith("3.11") and manifest["source_hash"].startswith("sha256:")

    # the loaded extension registers its op (no GPU needed to load)
    load = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import ext_min, torch; "
         "print(torch.ops.ext_min.scale)", str(site)], capture_output=True, text=True, timeout=300)
    assert load.returncode == 0, load.stderr

    # a rebuild with nothing changed reuses the image and the work folder, and is quick
    t0 = time.monotonic()
    r2 = cli(str(FIX / "ext_min"), "--arch", "8.6,8.9", "--torch", "2.14.1", "--cuda", "13.0", "--toolkit", "pip",
             "--base-image", base_image, "--out", str(out), "--work-dir", str(tmp_path / "work"))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "up to date" in r2.stderr and "up to date" in r2.stdout
    assert time.monotonic() - t0 < 30
    # --force builds again, in the same work folder: the image is reused and no source file is copied
    r3 = cli(str(FIX / "ext_min"), "--arch", "8.6,8.9", "--torch", "2.14.1", "--cuda", "13.0", "--toolkit", "pip",
             "--base-image", base_image, "--out", str(out), "--work-dir", str(tmp_path / "work"), "--force")
    assert r3.returncode == 0, r3.stderr[-3000:]
    assert "reusing image" in r3.stderr and "0 file(s) changed" in r3.stderr
    assert labelled(client) == []


def test_uncompilable_source_shows_compiler_error_and_keeps_log(base_image, client, tmp_path):
    out = tmp_path / "dist"
    r = cli(str(FIX / "ext_broken"), "--arch", "8.6", "--torch", "2.14.1", "--toolkit", "pip",
            "--base-image", base_image, "--out", str(out), "--work-dir", str(tmp_path / "work"))
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert "undeclared_value_cudadoctor_test" in r.stderr and "undefined" in r.stderr
    log = out / "torch2.14-cu130-py3.11.build.log"
    assert f"The full log is kept at {log}" in r.stderr.replace("\n", " ") or str(log) in r.stderr
    assert log.is_file() and "undeclared_value_cudadoctor_test" in log.read_text()
    assert list(out.glob("*.whl")) == []
    assert labelled(client) == []


def stop_build(proc, client, grace: float) -> None:
    """A Ctrl-C to the build if it still runs, `grace` seconds for it to end, then kill; and no
    container of this session left to the tests that follow."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
    for c in labelled(client):
        c.remove(force=True)


def test_ctrl_c_removes_the_build_container(base_image, client, tmp_path):
    env = session_env()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cudadoctor", "build", str(FIX / "ext_slow"), "--arch", "8.6", "--toolkit", "pip",
         "--base-image", base_image, "--out", str(tmp_path / "dist"), "--work-dir", str(tmp_path / "work")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
        # A shell that starts this suite in the background leaves SIGINT ignored, and Python keeps an
        # ignored SIGINT ignored: give the build the default disposition, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # ext_slow waits ten minutes before it compiles, so the build is still running when Ctrl-C comes
    # (a fast compile, or a ccache hit, must not let the build finish first).
    try:
        seen = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            seen = [c for c in labelled(client) if c.labels.get(LABEL) == "build" and c.status == "running"]
            if seen:
                break
            time.sleep(0.5)
        assert seen, "the build container never ran: " + (proc.stderr.read() if proc.poll() is not None else "")
        # how the build container runs: the invoking uid:gid, unprivileged, no network, source read-only
        attrs = client.api.inspect_container(seen[0].id)
        hc = attrs["HostConfig"]
        assert attrs["Config"]["User"] == f"{os.getuid()}:{os.getgid()}"
        assert hc["Privileged"] is False and hc["NetworkMode"] == "none"
        mounts = {m["Target"]: m for m in hc["Mounts"]}
        assert mounts["/src"].get("ReadOnly") is True and mounts["/src"]["Source"] == str(FIX / "ext_slow")
        assert not mounts["/build"].get("ReadOnly", False)
        time.sleep(3)  # let the build start inside the container
    except BaseException:
        stop_build(proc, client, grace=120)
        raise
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        stop_build(proc, client, grace=0)
        raise
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err and "Traceback" not in err
    assert labelled(client) == []
    assert list((tmp_path / "dist").glob("*.whl")) == []


def test_copy_transfer_for_remote_daemons(base_image, client, tmp_path):
    """With a remote daemon (DOCKER_HOST tcp:// or ssh://) nothing is bind-mounted: the source goes in
    and the wheel comes out as tar archives. Forced here against the local daemon."""
    env = dict(session_env(), CUDADOCTOR_DOCKER_TRANSFER="copy")
    out = tmp_path / "dist"
    r = subprocess.run(
        [sys.executable, "-m", "cudadoctor", "build", str(FIX / "ext_min"), "--arch", "8.9", "--toolkit", "pip",
         "--base-image", base_image, "--out", str(out), "--work-dir", str(tmp_path / "work")],
        capture_output=True, text=True, env=env, timeout=1800, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(out.glob("*.whl"))
    log = wheel.with_name(wheel.name[:-4] + ".build.log").read_text()
    assert "copying the source into the container" in log
    # no work folder was mounted: the only file there is the up-to-date stamp written on this side
    assert [p.name for p in (tmp_path / "work").rglob("*") if p.is_file()] == ["cudadoctor-stamp.json"]
    from cudadoctor.build.manifest import read_manifest

    m = read_manifest(wheel)
    assert m["shared_objects"]["ext_min/_C.cpython-311-x86_64-linux-gnu.so"]["sass"] == ["sm_89"]
    # the extension was loaded in the container next to its torch (no GPU or driver there: torch
    # still imports, and this extension needs no driver library)
    assert m["load_check"] == {"checked": ["ext_min/_C.cpython-311-x86_64-linux-gnu.so"], "notes": []}, m["load_check"]
    assert "load check: 1 shared object(s) load next to torch 2.14.1" in log
    assert labelled(client) == []


@pytest.mark.compile
def test_opsrc_fat_wheel_in_docker(base_image, client, tmp_path):
    """The operator package itself (several .cu files; about 4 minutes on 2 cores for two archs)."""
    if not (ROOT / "opsrc" / "setup.py").is_file():
        pytest.skip("opsrc/ is not in this checkout")
    out = tmp_path / "dist"
    r = cli("opsrc", "--arch", "8.6,8.9", "--torch", "2.14.1", "--toolkit", "pip", "--base-image", base_image,
            "--out", str(out), "--work-dir", str(tmp_path / "work"))
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    wheel = next(out.glob("cudadoctor_ops-*+cu130torch2.14-*.whl"))
    site = tmp_path / "site"
    pi = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site),
                         str(wheel)], capture_output=True, text=True, timeout=300)
    assert pi.returncode == 0, pi.stderr
    ins = subprocess.run([sys.executable, "-m", "cudadoctor", "inspect", "--json", str(site / "cudadoctor_ops")],
                         capture_output=True, text=True, timeout=120)
    sos = [e for e in json.loads(ins.stdout)["files"] if ".so" in e["path"]]
    assert sos
    for e in sos:
        assert {"sm_86", "sm_89"} <= set(e["sass"]), e
    imp = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import cudadoctor_ops; "
                          "print(cudadoctor_ops.__file__)", str(site)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert imp.returncode == 0 and str(site) in imp.stdout, imp.stderr
    assert labelled(client) == []


def test_ci_image_runs_check(base_image, client, tmp_path):
    """docker/ci/Dockerfile on the offline base: pip gets the host's CA bundle through docker/ci/ca-bundle.crt;
    the image's entry point is `cudadoctor check --format github`."""
    import shutil

    ctx = tmp_path / "ctx"
    ctx.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, ctx / name)
    shutil.copytree(ROOT / "cudadoctor", ctx / "cudadoctor", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "docker" / "ci", ctx / "docker" / "ci")
    ca = next((os.environ.get(k) for k in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE") if os.environ.get(k)), None)
    if ca and os.path.isfile(ca):
        shutil.copy(ca, ctx / "docker" / "ci" / "ca-bundle.crt")
    tag = "cudadoctor/ci-test:latest"
    try:
        client.images.build(path=str(ctx), dockerfile="docker/ci/Dockerfile", tag=tag, network_mode="host",
                            buildargs={"BASE": base_image}, rm=True, forcerm=True, labels={LABEL: "test"})
    except Exception as exc:  # noqa: BLE001 - show the build log
        log = "".join(str(x.get("stream", x)) for x in getattr(exc, "build_log", []) or [])
        pytest.fail(f"CI image build failed: {exc}\n{log[-3000:]}")
    try:
        out = client.containers.run(tag, remove=True, stdout=True, stderr=True,
                                    labels={LABEL: "test", "org.cudadoctor.test": SESSION})
    except Exception as exc:  # noqa: BLE001 - exit 1 (an error finding: no GPU here) is expected
        out = getattr(exc, "stderr", b"") or str(exc).encode()
        assert getattr(exc, "exit_status", None) == 1, exc
    text = out.decode("utf-8", "replace") if isinstance(out, bytes) else str(out)
    assert "Traceback" not in text
    assert "::" in text  # GitHub workflow annotations
    assert labelled(client) == []
    client.images.remove(tag, force=True)

"""The Docker backend: make (or reuse) the toolchain image, then build the wheel in a fresh container.

- The image tag is a hash of the recipe (base image, requirements, pip indexes, setup script), so an
  image is made once and reused; it is made by running the setup script in a container from the base
  image (pip folders and the CA bundle mounted read-only, host network) and committing it.
- The build container runs as the invoking uid:gid, without --privileged and without network; the
  source is mounted read-only and copied into a persistent work folder (incremental rebuilds).
- Every container is removed on success, failure and Ctrl-C (container.Container).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cudadoctor.build import container as dk
from cudadoctor.build.plan import LABEL, PIP_CUDA_HOME, VENV, BuildPlan
from cudadoctor.build.progress import BuildProgress
from cudadoctor.errors import CudadoctorError, RefusedError

SCRIPTS = Path(__file__).with_name("scripts")
CA_IN_CONTAINER = "/etc/cudadoctor/ca-bundle.crt"
SCRIPTS_IN_CONTAINER = "/opt/cudadoctor-scripts"


def scripts_digest() -> str:
    h = hashlib.sha256()
    for name in ("setup_toolchain.sh",):
        h.update((SCRIPTS / name).read_bytes())
    return h.hexdigest()[:16]


def _mount(source: str, target: str | None = None, *, read_only: bool = True):
    """A bind mount (HostConfig only: `volumes=` would also declare image volumes that a commit keeps)."""
    docker = dk._docker()
    src = os.path.abspath(source)
    return docker.types.Mount(target or src, src, type="bind", read_only=read_only)


def transfer_mode(env: dict | None = None) -> str:
    """"mount" for a daemon on this machine (bind mounts), "copy" for a remote one (DOCKER_HOST tcp://
    or ssh://): files then travel as tar archives, since the daemon cannot see this machine's folders.
    CUDADOCTOR_DOCKER_TRANSFER=copy|mount overrides."""
    env = os.environ if env is None else env
    forced = env.get("CUDADOCTOR_DOCKER_TRANSFER")
    if forced in ("copy", "mount"):
        return forced
    host = env.get("DOCKER_HOST") or ""
    return "mount" if not host or host.startswith("unix://") or host.startswith("npipe://") else "copy"


def tar_tree(members: list[tuple[str, str]], *, dirs: tuple[str, ...] = (), skip=None) -> bytes:
    """A tar of (host path, path in the container) pairs, folders recursively (``skip``: a callable
    on a relative path that drops build outputs), plus empty world-writable ``dirs``."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in dirs:
            ti = tarfile.TarInfo(d.lstrip("/"))
            ti.type = tarfile.DIRTYPE
            ti.mode = 0o1777
            tar.addfile(ti)
        for host, inside in members:
            def _filter(ti, _root=host, _inside=inside):
                rel = os.path.relpath(ti.name, _inside.lstrip("/")) if ti.name != _inside.lstrip("/") else "."
                if skip is not None and rel != "." and skip(rel):
                    return None
                ti.uid = ti.gid = 0
                ti.uname = ti.gname = "root"
                ti.mode |= 0o444 | (0o111 if ti.isdir() else 0)
                return ti
            tar.add(host, arcname=inside.lstrip("/"), recursive=True, filter=_filter)
    return buf.getvalue()


def _skip_build_outputs(rel: str) -> bool:
    from cudadoctor.build.plan import SKIP_DIRS

    parts = rel.split(os.sep)
    return any(p in SKIP_DIRS or p.endswith(".egg-info") for p in parts) or rel.endswith((".pyc", ".so", ".o"))


def fetch_dir(ct, path: str, dest: Path) -> None:
    """Copy a folder out of a (stopped) container into ``dest``."""
    import io
    import tarfile

    stream, _ = ct.container.get_archive(path)
    data = b"".join(stream)
    base = os.path.basename(path.rstrip("/"))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for m in tar.getmembers():
            if not m.isfile():
                continue
            rel = os.path.relpath(m.name, base)
            if rel.startswith("..") or os.path.isabs(rel):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(m) as src, open(target, "wb") as fh:
                fh.write(src.read())


def _image_exists(client, tag: str) -> bool:
    docker = dk._docker()
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def ensure_image(client, plan: BuildPlan, progress: BuildProgress, run_id: str) -> str:
    recipe = plan.image
    assert recipe is not None
    if _image_exists(client, recipe.tag):
        progress.set_stage(f"reusing image {recipe.tag}")
        return recipe.tag
    docker = dk._docker()
    if not _image_exists(client, recipe.base):
        progress.set_stage(f"pulling {recipe.base}")
        try:
            client.images.pull(recipe.base)
        except docker.errors.APIError as exc:
            raise CudadoctorError(
                f"the base image {recipe.base} is not on this Docker host and could not be pulled "
                f"({exc.explanation or exc}).",
                hint="Pull it where the registry is reachable, pass an image that exists with --base-image, or "
                "make an offline Debian base with docker/scripts/make-base-image.sh and use --toolkit pip.",
            ) from None
    progress.set_stage(f"making image {recipe.tag} from {recipe.base}")
    env = dict(recipe.setup_env)
    mode = transfer_mode()
    if plan.pip.ca_bundle and not os.path.isfile(plan.pip.ca_bundle):
        raise CudadoctorError(
            f"the CA bundle {plan.pip.ca_bundle} does not exist.",
            hint="Pass an existing PEM file with --ca-bundle, or unset PIP_CERT/SSL_CERT_FILE/REQUESTS_CA_BUNDLE.",
        )
    mounts = []
    copies = [(str(SCRIPTS), SCRIPTS_IN_CONTAINER)]
    if plan.pip.ca_bundle:
        copies.append((plan.pip.ca_bundle, CA_IN_CONTAINER))
    if mode == "mount":
        mounts = [_mount(h, c) for h, c in copies]
        copies = []
        for p in plan.pip.local_paths():
            if os.path.exists(p):
                mounts.append(_mount(p))
    elif plan.pip.local_paths():
        progress.write("[cudadoctor] remote daemon: local pip folders "
                       + ", ".join(plan.pip.local_paths()) + " are not visible to it")
    with dk.sigterm_as_interrupt(), dk.Container(
        client, recipe.base, ["sh", f"{SCRIPTS_IN_CONTAINER}/{recipe.setup_script}"], run_id=run_id,
        role="setup", keep=plan.keep_container, environment=env, mounts=mounts, network_mode="host",
        user="0:0",
    ) as ct:
        if copies:
            ct.container.put_archive("/", tar_tree(copies))
        ct.start()
        rc = ct.stream(progress.line)
        if rc != 0:
            raise RefusedError(
                f"making the build image from {recipe.base} failed (setup exit status {rc}); the full log is "
                f"{progress.log_path}.",
                hint="Fix: read the pip or apt-get error at the end of the log; behind a TLS-intercepting proxy "
                "pass its CA bundle with --ca-bundle; behind a mirror pass --index-url/--extra-index-url/--find-links.",
            )
        path = f"{VENV}/bin:{recipe.cuda_home}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        ct.commit(recipe.tag, [
            f"ENV CUDA_HOME={recipe.cuda_home}",
            f"ENV PATH={path}",
            f'LABEL {LABEL}="image"',
        ])
    progress.set_stage(f"image {recipe.tag} ready")
    return recipe.tag


def build(plan: BuildPlan, *, work_dir: Path, staging: Path, progress: BuildProgress) -> Path:
    """Run the build; returns the raw wheel in ``staging`` (build-info.json next to it)."""
    docker = dk._docker()
    try:
        return _build(plan, work_dir=work_dir, staging=staging, progress=progress)
    except (docker.errors.DockerException, _requests_errors()) as exc:
        raise CudadoctorError(
            f"the Docker daemon refused a request: {getattr(exc, 'explanation', None) or exc}.",
            hint=f"The log so far is {progress.log_path}; `docker info` shows the daemon's state.",
        ) from None


def _requests_errors() -> type[BaseException]:
    """The connection errors of the HTTP library under the docker SDK (a daemon that went away)."""
    try:
        import requests

        return requests.exceptions.RequestException
    except ImportError:  # pragma: no cover - the docker SDK depends on requests
        return OSError


def _build(plan: BuildPlan, *, work_dir: Path, staging: Path, progress: BuildProgress) -> Path:
    client = dk.client()
    run_id = dk.new_run_id()
    tag = ensure_image(client, plan, progress, run_id)
    staging.mkdir(parents=True, exist_ok=True)
    env = dict(plan.env)
    env.update({
        "HOME": "/tmp",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "CCACHE_DIR": "/build/ccache",
        "PYTHONUNBUFFERED": "1",
    })
    mode = transfer_mode()
    if mode == "mount":
        work_dir.mkdir(parents=True, exist_ok=True)
        mounts = [
            _mount(plan.source, "/src"),
            _mount(str(SCRIPTS), SCRIPTS_IN_CONTAINER),
            _mount(str(work_dir.resolve()), "/build", read_only=False),
            _mount(str(staging.resolve()), "/out", read_only=False),
        ]
    else:
        mounts = []
        env["CCACHE_DIR"] = "/build/ccache"
    cmd = ["python", f"{SCRIPTS_IN_CONTAINER}/build_wheel.py", "--src", "/src", "--work", "/build",
           "--out", "/out", "--info", "/out/build-info.json"]
    progress.set_stage(f"building in {tag} (TORCH_CUDA_ARCH_LIST={plan.target.arch_list}, {plan.jobs} job(s))")
    with dk.sigterm_as_interrupt(), dk.Container(
        client, tag, cmd, run_id=run_id, role="build", keep=plan.keep_container, environment=env,
        mounts=mounts, network_mode="none", user=f"{os.getuid()}:{os.getgid()}", working_dir="/build",
        labels={"org.cudadoctor.target": plan.target.name},
    ) as ct:
        if mode == "copy":
            progress.write(f"[cudadoctor] copying the source into the container (daemon at {dk.daemon_address()})")
            ct.container.put_archive("/", tar_tree([(plan.source, "/src"), (str(SCRIPTS), SCRIPTS_IN_CONTAINER)],
                                                   dirs=("/build", "/out"), skip=_skip_build_outputs))
        ct.start()
        rc = ct.stream(progress.line)
        if mode == "copy" and rc == 0:
            fetch_dir(ct, "/out", staging)
    return built_wheel(rc, staging)


class BuildFailed(Exception):
    """The build step exited non-zero; the caller turns it into a message with the log's errors."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


def built_wheel(status: int, staging: Path) -> Path:
    """The wheel a build step left in ``staging``; BuildFailed for a non-zero status (3: no wheel)."""
    if status != 0:
        raise BuildFailed(status)
    wheels = sorted(staging.glob("*.whl"))
    if not wheels:
        raise BuildFailed(3)
    return wheels[0]


__all__ = ["build", "ensure_image", "BuildFailed", "built_wheel", "PIP_CUDA_HOME"]

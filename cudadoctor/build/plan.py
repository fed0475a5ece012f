"""The build plan: targets (torch x CUDA x python x archs) -> image recipe, environment, nvcc flags and
wheel label. Pure: no Docker, no subprocess, no torch. Everything a build needs is decided here, so
impossible requests are refused before any container or compiler starts.

Matching rules
- The target torch decides the CUDA version: without ``--cuda`` the CUDA of the variant PyPI ships
  (``pypi_default`` in data/torch_wheels.toml); with ``--cuda`` the pair must have been published.
- Every requested architecture must be one the target CUDA's nvcc can compile (data/nvcc_targets.toml).
- The host compiler of the image (or of the host, local backend) must be one that nvcc accepts
  (data/host_compilers.toml).
- The default image is ``nvidia/cuda:<cuda>-devel-ubuntu24.04`` with torch from its
  download.pytorch.org/whl/cuXYZ index; ``--toolkit pip`` assembles CUDA from nvidia-* wheels instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from cudadoctor import archs as _archs
from cudadoctor.errors import InputError, RefusedError
from cudadoctor.versions import CudaVersion, parse as parse_version

PLAN_VERSION = 1
DEFAULT_DISTRO = "ubuntu24.04"
IMAGE_PREFIX = "cudadoctor/build"
LABEL = "org.cudadoctor.build"  # every container and image the builder makes carries it

# What a distro ships: its python3 and its default g++ major. Used to refuse a --python the image
# cannot provide and a host compiler nvcc rejects, before any container starts.
DISTROS: dict[str, dict[str, Any]] = {
    "ubuntu20.04": {"python": "3.8", "gcc": 9},
    "ubuntu22.04": {"python": "3.10", "gcc": 11},
    "ubuntu24.04": {"python": "3.12", "gcc": 13},
    "rockylinux8": {"python": "3.6", "gcc": 8},
    "rockylinux9": {"python": "3.9", "gcc": 11},
    "bullseye": {"python": "3.9", "gcc": 10},
    "bookworm": {"python": "3.11", "gcc": 12},
    "trixie": {"python": "3.13", "gcc": 14},
}

BACKENDS = ("docker", "local")
TOOLKITS = ("image", "pip")


# --------------------------------------------------------------------------------------------------
# knowledge lookups


def _load(name: str) -> tuple[dict, ...]:
    from cudadoctor.knowledge import load_table

    return load_table(name)


def torch_variants(torch: str | None = None) -> list[dict]:
    """Rows of data/torch_wheels.toml, optionally only those of the torch minor series of ``torch``."""
    rows = list(_load("torch_wheels"))
    if torch is None:
        return rows
    want = _minor(torch)
    return [r for r in rows if _minor(str(r.get("torch"))) == want]


def _minor(version: str) -> tuple[int, int] | None:
    v = parse_version(version)
    if v is None or len(v.release) < 2:
        return None
    return v.release[0], v.release[1]


def gcc_max_for(cuda: str) -> int | None:
    """Newest g++ major the nvcc of ``cuda`` accepts (None when the table does not know that CUDA)."""
    want = CudaVersion.parse(cuda)
    for row in _load("host_compilers"):
        if CudaVersion.parse(str(row.get("cuda"))) == want and row.get("gcc_max") is not None:
            return int(row["gcc_max"])
    return None


# --------------------------------------------------------------------------------------------------
# pip settings


@dataclass(frozen=True)
class PipSettings:
    """Where pip finds packages, and the CA bundle it trusts. Paths are host paths."""

    index_url: str | None = None
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()
    constraints: tuple[str, ...] = ()
    ca_bundle: str | None = None
    trusted_hosts: tuple[str, ...] = ()

    def env(self, *, ca_path: str | None = None) -> dict[str, str]:
        """PIP_* environment for these settings; ``ca_path`` is where the CA bundle is seen."""
        out: dict[str, str] = {}
        if self.index_url:
            out["PIP_INDEX_URL"] = self.index_url
        if self.extra_index_urls:
            out["PIP_EXTRA_INDEX_URL"] = " ".join(self.extra_index_urls)
        if self.find_links:
            out["PIP_FIND_LINKS"] = " ".join(self.find_links)
        if self.constraints:
            out["PIP_CONSTRAINT"] = " ".join(self.constraints)
        if self.trusted_hosts:
            out["PIP_TRUSTED_HOST"] = " ".join(self.trusted_hosts)
        ca = ca_path or self.ca_bundle
        if ca:
            out["PIP_CERT"] = ca
            out["SSL_CERT_FILE"] = ca
            out["REQUESTS_CA_BUNDLE"] = ca
        return out

    def local_paths(self) -> list[str]:
        """Host folders and files these settings read (file:// indexes, find-links folders, constraint
        files): a container needs them mounted read-only at the same path."""
        paths: list[str] = []
        for url in (self.index_url, *self.extra_index_urls, *self.find_links):
            if not url:
                continue
            if url.startswith("file://"):
                paths.append(url[len("file://"):])
            elif "://" not in url:
                paths.append(url)
        paths.extend(c for c in self.constraints if "://" not in c)
        out: list[str] = []
        for p in paths:
            p = os.path.normpath(p)
            # file:///opt/pypi/simple links to ../../files: mount the parent of a "simple" index
            if os.path.basename(p) == "simple":
                p = os.path.dirname(p)
            if p not in out:
                out.append(p)
        return out

    def with_extra_index(self, url: str) -> "PipSettings":
        if url == self.index_url or url in self.extra_index_urls:
            return self
        return replace(self, extra_index_urls=(*self.extra_index_urls, url))


_PIP_KEYS = {
    "index-url": "index_url",
    "extra-index-url": "extra_index_urls",
    "find-links": "find_links",
    "constraint": "constraints",
    "cert": "ca_bundle",
    "trusted-host": "trusted_hosts",
}


def pip_settings_from_config(config_list: str, env: Mapping[str, str]) -> PipSettings:
    """PipSettings from ``pip config list`` output plus PIP_* / CA environment variables.

    ``global.extra-index-url='file:///a file:///b'`` lines; the environment wins over config files.
    The CA bundle defaults to PIP_CERT, then SSL_CERT_FILE, then REQUESTS_CA_BUNDLE.
    """
    found: dict[str, str] = {}
    for line in config_list.splitlines():
        m = re.match(r"^\s*(?:[\w:.-]*?)\.?([\w-]+)\s*=\s*'?(.*?)'?\s*$", line)
        if not m or m.group(1) not in _PIP_KEYS:
            continue
        found[m.group(1)] = m.group(2)
    for key in _PIP_KEYS:
        v = env.get("PIP_" + key.upper().replace("-", "_"))
        if v:
            found[key] = v
    ca = env.get("PIP_CERT") or env.get("SSL_CERT_FILE") or env.get("REQUESTS_CA_BUNDLE") or found.get("cert")
    split = lambda k: tuple(x for x in (found.get(k) or "").split() if x)  # noqa: E731
    return PipSettings(
        index_url=found.get("index-url") or None,
        extra_index_urls=split("extra-index-url"),
        find_links=split("find-links"),
        constraints=split("constraint"),
        ca_bundle=ca or None,
        trusted_hosts=split("trusted-host"),
    )


# --------------------------------------------------------------------------------------------------
# targets


@dataclass(frozen=True)
class TargetSpec:
    """One target as the user asked for it (CLI options or one [[target]] of a matrix file)."""

    arch: str
    torch: str | None = None
    cuda: str | None = None
    python: str | None = None
    base_image: str | None = None
    toolkit: str = "image"
    name: str | None = None


@dataclass(frozen=True)
class Target:
    """A resolved target: every version fixed, every arch checked."""

    torch: str  # as requested: "2.14.1" or "2.14"
    cuda: str  # "13.0"
    python: str | None  # "3.11"; None: whatever python3 the image has
    archs: tuple[_archs.ArchItem, ...]
    toolkit: str
    base_image: str | None
    index_url: str | None  # the torch variant's index
    pypi_default: bool
    name: str

    @property
    def arch_list(self) -> str:
        """TORCH_CUDA_ARCH_LIST value ("8.6;8.9+PTX")."""
        return _archs.torch_arch_list(list(self.archs))

    @property
    def torch_requirement(self) -> str:
        v = parse_version(self.torch)
        if v is not None and len(v.release) >= 3:
            return f"torch=={'.'.join(map(str, v.release[:3]))}"
        return f"torch=={self.torch}.*"

    @property
    def local_label(self) -> str:
        """PEP 440 local version label: cu130torch2.14."""
        mm = _minor(self.torch)
        return f"{CudaVersion.parse(self.cuda).tag}torch{mm[0]}.{mm[1]}"

    @property
    def sass(self) -> list[str]:
        return [i.arch.sm for i in self.archs if i.sass]

    @property
    def ptx(self) -> list[str]:
        return [i.arch.compute for i in self.archs if i.ptx]


def _refuse(message: str, fix: str) -> RefusedError:
    return RefusedError(message, hint=f"Fix: {fix}")


def _suggest_cuda_for(items: list[_archs.ArchItem], torch: str | None) -> str:
    """A torch/CUDA pair whose nvcc can target every item, newest first."""
    rows = torch_variants(torch) if torch else list(_load("torch_wheels"))
    ok = [
        r for r in rows
        if all(_archs.nvcc_can_target(i.arch, str(r["cuda"])) for i in items)
    ]
    ok.sort(key=lambda r: (parse_version(str(r["torch"])), CudaVersion.parse(str(r["cuda"]))), reverse=True)
    if not ok:
        return ""
    r = ok[0]
    return f"--torch {r['torch']} --cuda {r['cuda']}"


def resolve_target(spec: TargetSpec, *, default_torch: str | None = None, host_gcc: int | None = None,
                   backend: str = "docker") -> Target:
    """Fix torch/CUDA/python and check every arch; refuse impossible combinations (RefusedError, exit 1)."""
    if spec.toolkit not in TOOLKITS:
        raise InputError(f"unknown toolkit {spec.toolkit!r}.", hint=f"Use one of: {', '.join(TOOLKITS)}.")
    torch = spec.torch or default_torch
    if torch is None:
        rows = [r for r in _load("torch_wheels") if r.get("pypi_default")]
        rows.sort(key=lambda r: parse_version(str(r["torch"])))
        if not rows:
            raise InputError("no torch version given and the torch wheel table is empty.", hint="Pass --torch.")
        torch = str(rows[-1]["torch"])
    if _minor(torch) is None:
        raise InputError(f"cannot read torch version {torch!r}.", hint="Use a release such as 2.14.1 or 2.14.")
    if spec.cuda is not None and CudaVersion.parse(spec.cuda) is None:
        raise InputError(f"cannot read CUDA version {spec.cuda!r}.", hint="Use a release such as 13.0.")

    variants = torch_variants(torch)
    row: dict | None = None
    if variants:
        published = ", ".join(sorted({str(r["cuda"]) for r in variants}, key=CudaVersion.parse))
        if spec.cuda is None:
            defaults = [r for r in variants if r.get("pypi_default")] or variants
            row = defaults[-1]
        else:
            want = CudaVersion.parse(spec.cuda)
            match = [r for r in variants if CudaVersion.parse(str(r["cuda"])) == want]
            if not match:
                raise _refuse(
                    f"torch {torch} was never published for CUDA {spec.cuda}: its wheels exist for CUDA {published}.",
                    f"pick one of those with --cuda, or another torch release (`cudadoctor build --torch X.Y --cuda {spec.cuda}`).",
                )
            row = match[0]
        cuda = str(row["cuda"])
    else:
        if spec.cuda is None:
            raise _refuse(
                f"torch {torch} is not in cudadoctor's table of published torch wheels, so its CUDA version is unknown.",
                "pass --cuda X.Y to say which CUDA build of torch to use.",
            )
        cuda = str(CudaVersion.parse(spec.cuda))

    # architectures
    items = _archs.parse_spec(spec.arch, nvcc_version=cuda)
    if not items:
        raise InputError(f"architecture list {spec.arch!r} names no architecture.", hint="Example: --arch 8.6,8.9.")
    bad = [i for i in items if not _archs.nvcc_can_target(i.arch, cuda)]
    if bad:
        reasons = "; ".join(_archs.describe_nvcc_range(i.arch) for i in bad)
        names = ", ".join(i.arch.sm for i in bad)
        alt = _suggest_cuda_for(bad, None)
        fix = f"drop {', '.join(i.cc for i in bad)} from --arch"
        if alt:
            fix += f", or build those for an older/newer toolkit ({alt})"
        raise _refuse(
            f"nvcc from CUDA {cuda} (the CUDA of torch {torch}) cannot compile for {names}: {reasons}.",
            fix + ".",
        )

    # host compiler
    gcc = host_gcc
    distro = None
    if backend == "docker":
        distro = image_distro(spec.base_image, spec.toolkit)
        if gcc is None and distro in DISTROS:
            gcc = DISTROS[distro]["gcc"]
    gmax = gcc_max_for(cuda)
    if gcc is not None and gmax is not None and gcc > gmax:
        where = f"the image's g++ ({distro})" if backend == "docker" else "the host's g++"
        raise _refuse(
            f"nvcc from CUDA {cuda} rejects g++ {gcc} (newest accepted: g++ {gmax}); {where} would fail with "
            "'unsupported GNU version'.",
            f"install g++-{gmax} and `export CUDAHOSTCXX=/usr/bin/g++-{gmax}`, or use a base image whose g++ is <= {gmax}."
            if backend == "local" else f"use a base image whose g++ is <= {gmax} (--base-image).",
        )

    # python
    python = spec.python
    if python is not None:
        if not re.fullmatch(r"3\.\d+", python):
            raise InputError(f"cannot read python version {python!r}.", hint="Use major.minor, such as 3.11.")
        if backend == "docker" and distro in DISTROS and DISTROS[distro]["python"] != python:
            raise _refuse(
                f"the image {base_image_for(spec.base_image, spec.toolkit, cuda)} ships python {DISTROS[distro]['python']}, "
                f"not {python}.",
                f"leave out --python, or pass a --base-image with python {python}.",
            )
    elif backend == "docker" and distro in DISTROS:
        python = DISTROS[distro]["python"]

    name = spec.name or f"torch{'.'.join(map(str, _minor(torch)))}-{CudaVersion.parse(cuda).tag}" + (
        f"-py{python}" if python else ""
    )
    return Target(
        torch=torch,
        cuda=cuda,
        python=python,
        archs=tuple(items),
        toolkit=spec.toolkit,
        base_image=spec.base_image,
        index_url=(row or {}).get("index_url") or f"https://download.pytorch.org/whl/{CudaVersion.parse(cuda).tag}",
        pypi_default=bool((row or {}).get("pypi_default")),
        name=re.sub(r"[^A-Za-z0-9_.-]", "_", name),
    )


def base_image_for(base_image: str | None, toolkit: str, cuda: str) -> str:
    if base_image:
        return base_image
    if toolkit == "pip":
        return f"debian:{'bookworm'}"
    v = CudaVersion.parse(cuda)
    return f"nvidia/cuda:{v.major}.{v.minor}.0-devel-{DEFAULT_DISTRO}"


def image_distro(base_image: str | None, toolkit: str) -> str | None:
    """The distro of a base image, when its name says it (nvidia/cuda:13.0.0-devel-ubuntu24.04,
    debian:bookworm, cudadoctor/base:bookworm-...)."""
    if base_image is None:
        return "bookworm" if toolkit == "pip" else DEFAULT_DISTRO
    low = base_image.lower()
    for d in DISTROS:
        if d in low:
            return d
    m = re.search(r"ubuntu:?(\d\d\.\d\d)", low)
    if m and f"ubuntu{m.group(1)}" in DISTROS:
        return f"ubuntu{m.group(1)}"
    return None


# --------------------------------------------------------------------------------------------------
# toolkit from pip


def toolkit_requirements(cuda: str) -> list[str]:
    """pip requirements that make up an nvcc toolchain for ``cuda`` (CUDA 12: -cu12 names)."""
    v = CudaVersion.parse(cuda)
    pin = f"=={v.major}.{v.minor}.*"
    if v.major >= 13:
        names = ["nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-nvvm"]
    else:
        sfx = f"-cu{v.major}"
        names = [f"nvidia-cuda-nvcc{sfx}", f"nvidia-cuda-runtime{sfx}", f"nvidia-cuda-cccl{sfx}"]
    return [n + pin for n in names]


# --------------------------------------------------------------------------------------------------
# fast-build settings


def parallelism(cores: int, mem_gib: float | None, jobs: int | None = None, n_targets: int = 4) -> tuple[int, int]:
    """(ninja jobs, nvcc --threads) for this many cores, GiB of free memory and device targets.

    nvcc compiles the targets of one file one after another unless given --threads; a file's host
    front end is serial, so jobs x threads may exceed the cores by 2x without slowing down. An nvcc
    job of a torch extension peaks at roughly 2 GiB plus 0.5 GiB per extra device thread; the job
    count stays within free memory.
    """
    cores = max(1, int(cores))
    n_targets = max(1, int(n_targets))
    cap = 4 if cores >= 16 else 2 if cores >= 4 else 1
    threads = max(1, min(n_targets, cap))
    if jobs is not None:
        if jobs < 1:
            raise InputError(f"--jobs must be at least 1, not {jobs}.")
        return jobs, threads
    njobs = cores if threads == 1 else max(1, (2 * cores) // threads)
    if mem_gib is not None and mem_gib > 0:
        per_job = 2.0 + 0.5 * (threads - 1)
        njobs = min(njobs, max(1, int(mem_gib // per_job)))
    return njobs, threads


def build_env(target: Target, *, jobs: int, threads: int, compress: bool = True,
              extra_nvcc: Iterable[str] = ()) -> dict[str, str]:
    """Environment for the build step: arch list, job count, nvcc flags appended to every nvcc call."""
    nvcc = [f"--threads={threads}"]
    # appended after the project's own flags, so --no-compress also undoes a project's -compress-all
    nvcc += ["-Xfatbin", "-compress-all"] if compress else ["--no-compress"]
    nvcc += list(extra_nvcc)
    return {
        "TORCH_CUDA_ARCH_LIST": target.arch_list,
        "MAX_JOBS": str(jobs),
        "NVCC_APPEND_FLAGS": " ".join(nvcc),
        "FORCE_CUDA": "1",
        "CUDADOCTOR_LOCAL_LABEL": target.local_label,
    }


def nvcc_flags(target: Target, *, threads: int, compress: bool = True) -> list[str]:
    """The device-code flags the build adds (gencode flags come from TORCH_CUDA_ARCH_LIST through torch)."""
    flags = _archs.gencode_flags(list(target.archs)) + [f"--threads={threads}"]
    flags += ["-Xfatbin", "-compress-all"] if compress else ["--no-compress"]
    return flags


# --------------------------------------------------------------------------------------------------
# image recipe


@dataclass(frozen=True)
class ImageRecipe:
    base: str
    toolkit: str
    requirements: tuple[str, ...]
    cuda_home: str
    setup_script: str  # name of the script in cudadoctor/build/scripts
    setup_env: tuple[tuple[str, str], ...]
    tag: str

    def dockerfile(self) -> str:
        """A Dockerfile equivalent of this recipe (for users who build images in their own pipeline;
        build context: the cudadoctor/build/scripts folder)."""
        envs = "".join(f"ENV {k}={json.dumps(v)}\n" for k, v in self.setup_env if not k.startswith("PIP_"))
        return (
            f"FROM {self.base}\n"
            f"{envs}"
            f"COPY {self.setup_script} /opt/cudadoctor/{self.setup_script}\n"
            f"RUN sh /opt/cudadoctor/{self.setup_script}\n"
            f"ENV CUDA_HOME={self.cuda_home} PATH=/opt/cudadoctor/venv/bin:{self.cuda_home}/bin:$PATH\n"
            f'LABEL {LABEL}="image"\n'
        )


VENV = "/opt/cudadoctor/venv"
PIP_CUDA_HOME = "/opt/cudadoctor/cuda"


def image_recipe(target: Target, pip: PipSettings, *, script_digest: str = "") -> ImageRecipe:
    base = base_image_for(target.base_image, target.toolkit, target.cuda)
    reqs = [target.torch_requirement, "setuptools>=68", "wheel", "ninja"]
    if target.toolkit == "pip":
        reqs += toolkit_requirements(target.cuda)
        cuda_home = PIP_CUDA_HOME
    else:
        cuda_home = "/usr/local/cuda"
    # PyPI's torch is the pypi_default variant; any other variant comes from its cuXYZ index.
    torch_pip = pip if target.pypi_default or not target.index_url else pip.with_extra_index(target.index_url)
    env = {
        "CUDADOCTOR_REQUIREMENTS": " ".join(reqs),
        "CUDADOCTOR_TOOLKIT": target.toolkit,
        "CUDADOCTOR_CUDA_HOME": cuda_home,
        "CUDADOCTOR_PYTHON": target.python or "",
        **torch_pip.env(ca_path="/etc/cudadoctor/ca-bundle.crt" if torch_pip.ca_bundle else None),
    }
    key = json.dumps(
        {"v": PLAN_VERSION, "base": base, "env": sorted((k, v) for k, v in env.items() if k != "PIP_CERT"),
         "script": script_digest},
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    tag = f"{IMAGE_PREFIX}:{CudaVersion.parse(target.cuda).tag}-torch{target.torch}-{target.toolkit}-{digest}"
    return ImageRecipe(
        base=base,
        toolkit=target.toolkit,
        requirements=tuple(reqs),
        cuda_home=cuda_home,
        setup_script="setup_toolchain.sh",
        setup_env=tuple(sorted(env.items())),
        tag=tag,
    )


# --------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class BuildPlan:
    source: str
    out: str
    backend: str
    target: Target
    jobs: int
    threads: int
    env: tuple[tuple[str, str], ...]
    nvcc_flags: tuple[str, ...]
    image: ImageRecipe | None
    pip: PipSettings
    keep_container: bool = False
    compress: bool = True

    @property
    def label(self) -> str:
        return self.target.local_label

    def wheel_name(self, dist: str, version: str, tags: str = "cp311-cp311-linux_x86_64") -> str:
        """The final wheel file name for a project ``dist`` of ``version`` (local label replaced)."""
        return f"{normalize_dist(dist)}-{relabel_version(version, self.label)}-{tags}.whl"

    def to_dict(self) -> dict:
        t = self.target
        return {
            "source": self.source,
            "out": self.out,
            "backend": self.backend,
            "target": {
                "name": t.name, "torch": t.torch, "cuda": t.cuda, "python": t.python,
                "arch_list": t.arch_list, "sass": t.sass, "ptx": t.ptx, "toolkit": t.toolkit,
                "local_label": t.local_label, "torch_requirement": t.torch_requirement,
            },
            "jobs": self.jobs,
            "nvcc_threads": self.threads,
            "env": dict(self.env),
            "nvcc_flags": list(self.nvcc_flags),
            "image": None if self.image is None else {
                "base": self.image.base, "tag": self.image.tag, "requirements": list(self.image.requirements),
                "cuda_home": self.image.cuda_home,
            },
        }


def normalize_dist(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name)


def relabel_version(version: str, label: str) -> str:
    """'0.1.0' -> '0.1.0+cu130torch2.14'; an existing local label is replaced."""
    return version.split("+", 1)[0] + "+" + label


def make_plan(
    spec: TargetSpec,
    *,
    source: str,
    out: str,
    backend: str = "docker",
    pip: PipSettings | None = None,
    cores: int = 2,
    mem_gib: float | None = None,
    jobs: int | None = None,
    default_torch: str | None = None,
    host_gcc: int | None = None,
    keep_container: bool = False,
    compress: bool = True,
    script_digest: str = "",
) -> BuildPlan:
    if backend not in BACKENDS:
        raise InputError(f"unknown backend {backend!r}.", hint=f"Use one of: {', '.join(BACKENDS)}.")
    target = resolve_target(spec, default_torch=default_torch, host_gcc=host_gcc, backend=backend)
    pip = pip or PipSettings()
    njobs, threads = parallelism(cores, mem_gib, jobs, len(target.sass) + len(target.ptx))
    env = build_env(target, jobs=njobs, threads=threads, compress=compress)
    image = image_recipe(target, pip, script_digest=script_digest) if backend == "docker" else None
    return BuildPlan(
        source=source,
        out=out,
        backend=backend,
        target=target,
        jobs=njobs,
        threads=threads,
        env=tuple(sorted(env.items())),
        nvcc_flags=tuple(nvcc_flags(target, threads=threads, compress=compress)),
        image=image,
        pip=pip,
        keep_container=keep_container,
        compress=compress,
    )


# --------------------------------------------------------------------------------------------------
# matrix files


_SPEC_KEYS = {"arch", "torch", "cuda", "python", "base_image", "toolkit", "name"}


def read_matrix(text: str, *, defaults: TargetSpec | None = None, where: str = "matrix") -> list[TargetSpec]:
    """Targets of a matrix TOML file::

        [defaults]            # optional, applies to every target
        arch = "8.0,8.6,8.9,9.0"
        [[target]]
        torch = "2.14.1"
        cuda = "13.0"
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{where} is not valid TOML: {exc}.") from exc
    base = dict(data.get("defaults") or {})
    rows = data.get("target")
    if not isinstance(rows, list) or not rows:
        raise InputError(f"{where} has no [[target]] entries.", hint='Example: [[target]]\\ntorch = "2.14.1"\\narch = "8.6,8.9"')
    out = []
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise InputError(f"{where}: target {n} is not a table.")
        merged = {**base, **row}
        unknown = sorted(set(merged) - _SPEC_KEYS)
        if unknown:
            raise InputError(f"{where}: target {n} has unknown key(s) {', '.join(unknown)}.",
                             hint=f"Known keys: {', '.join(sorted(_SPEC_KEYS))}.")
        if defaults is not None:
            for k in _SPEC_KEYS:
                if k not in merged and getattr(defaults, k) is not None:
                    merged[k] = getattr(defaults, k)
        if not merged.get("arch"):
            raise InputError(f"{where}: target {n} has no arch.", hint='Add arch = "8.6,8.9" to it or to [defaults].')
        merged = {k: (str(v) if k != "toolkit" else v) for k, v in merged.items()}
        out.append(TargetSpec(**merged))
    return out


def _arch_token(item: _archs.ArchItem) -> str:
    """One --arch token that means exactly this item (families such as Ampere are expanded)."""
    if not item.sass:
        return item.arch.compute
    return item.cc + ("+PTX" if item.ptx else "")


def github_matrix(targets: list[Target]) -> dict:
    """The `strategy.matrix` JSON for GitHub Actions: one include entry per target."""
    return {
        "include": [
            {
                "name": t.name,
                "torch": t.torch,
                "cuda": t.cuda,
                "python": t.python or "",
                "arch": ",".join(_arch_token(i) for i in t.archs),
                "toolkit": t.toolkit,
                "base_image": t.base_image or "",
                "label": t.local_label,
            }
            for t in targets
        ]
    }


# Folders a source tree's hash and the copy into the work folder leave out (build outputs, VCS).
SKIP_DIRS = frozenset({".git", "build", "dist", "__pycache__", ".eggs", ".cudadoctor", ".tox", ".venv", ".pytest_cache"})

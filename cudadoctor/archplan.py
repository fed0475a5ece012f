"""Arch plans: an arch spec + the nvcc that will build + the GPUs present -> TORCH_CUDA_ARCH_LIST,
-gencode flags and, per GPU, whether the result runs natively or through PTX JIT.

Everything that touches the system goes through a Runner (nvcc --version / --list-gpu-code,
nvidia-smi), so tests use a FakeRunner. The decisions themselves live in cudadoctor.archs.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import Mapping

from cudadoctor.archs import (
    Arch,
    ArchItem,
    cc_from_name,
    describe_nvcc_range,
    gencode_flags,
    nvcc_can_target,
    parse_spec,
    torch_arch_list,
)
from cudadoctor.errors import RefusedError
from cudadoctor.runner import Runner
from cudadoctor.versions import CudaVersion

# What to suggest when there is no GPU and no spec: the SASS set of torch's own wheels,
# reduced to what the nvcc can target, with PTX for the newest.
SUGGESTED = ("5.0", "6.0", "7.0", "7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0")

_NVCC_RELEASE = re.compile(r"release\s+(\d+\.\d+)(?:,\s*V(\d+\.\d+\.\d+))?")
_WRAPPER = re.compile(r"""exec\s+["']?(/[^"'\s]+/nvcc)\b""")


@dataclass
class Nvcc:
    path: str | None
    version: str | None = None  # "13.0.88"
    codes: list[str] | None = None  # nvcc --list-gpu-code, when it answers
    real_path: str | None = None  # the nvcc a wrapper script execs
    error: str | None = None

    @property
    def cuda(self) -> CudaVersion | None:
        return CudaVersion.parse(self.version)

    @property
    def root(self) -> str | None:
        p = self.real_path or self.path
        return os.path.dirname(os.path.dirname(p)) if p else None


def find_nvcc_path(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str | None:
    """The nvcc a torch extension build uses: --nvcc, else $CUDA_HOME/bin/nvcc, else nvcc on PATH,
    else /usr/local/cuda/bin/nvcc (torch.utils.cpp_extension's order)."""
    env = os.environ if env is None else env
    if explicit:
        return explicit
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            cand = os.path.join(env[var], "bin", "nvcc")
            if os.path.exists(cand):
                return cand
    found = shutil.which("nvcc", path=env.get("PATH"))
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def wrapper_target(path: str) -> str | None:
    """The real nvcc behind a small shell wrapper (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``)."""
    try:
        if os.path.getsize(path) > 4096:
            return None
        with open(path, "r", encoding="utf-8", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    if not text.startswith("#!"):
        return None
    m = _WRAPPER.search(text)
    return m.group(1) if m else None


def probe_nvcc(runner: Runner, explicit: str | None = None, env: Mapping[str, str] | None = None) -> Nvcc:
    path = find_nvcc_path(explicit, env)
    if path is None:
        return Nvcc(None, error="no nvcc found (CUDA_HOME, PATH, /usr/local/cuda)")
    n = Nvcc(path)
    if os.path.exists(path):
        n.real_path = wrapper_target(path) or os.path.realpath(path)
    r = runner.run([path, "--version"], timeout=20)
    if not r.ok:
        n.error = r.error or (r.stderr.strip() or r.stdout.strip() or f"exit status {r.returncode}")
        if explicit:
            from cudadoctor.errors import InputError

            raise InputError(f"cannot run the nvcc given with --nvcc ({path}): {n.error}.")
        return n
    m = _NVCC_RELEASE.search(r.stdout)
    n.version = (m.group(2) or m.group(1)) if m else None
    codes = runner.run([path, "--list-gpu-code"], timeout=20)
    if codes.ok:
        found = [t for t in codes.stdout.split() if re.fullmatch(r"sm_\d+[af]?", t)]
        n.codes = found or None
    return n


def present_gpus(runner: Runner) -> tuple[list[dict], str | None, str | None]:
    """(gpus [{index, name, cc}], driver version, error) from one light nvidia-smi query."""
    r = runner.run(
        ["nvidia-smi", "--query-gpu=index,name,compute_cap,driver_version", "--format=csv,noheader"], timeout=15
    )
    if not r.ok and not r.error and "compute_cap" in (r.stdout + r.stderr):
        r = runner.run(["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"], timeout=15)
    if not r.ok:
        return [], None, r.error or (r.stdout.strip() or r.stderr.strip())
    gpus: list[dict] = []
    driver = None
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        cc = cells[2] if len(cells) >= 4 and re.fullmatch(r"\d+\.\d+", cells[2]) else cc_from_name(cells[1])
        driver = cells[-1] if re.fullmatch(r"\d+\.\d+(\.\d+)?", cells[-1]) else driver
        gpus.append({"index": int(cells[0]), "name": cells[1], "cc": cc})
    return gpus, driver, None


def driver_cuda_of(driver: str | None) -> CudaVersion | None:
    """Newest CUDA a Linux driver version supports (data/driver_cuda.toml)."""
    from cudadoctor.knowledge import KnowledgeError, load_table
    from cudadoctor.versions import parse

    v = parse(driver)
    if v is None:
        return None
    try:
        rows = load_table("driver_cuda")
    except KnowledgeError:
        return None
    best = None
    for row in rows:
        if row.get("kind") != "release" or not row.get("linux"):
            continue
        need = parse(row["linux"])
        c = CudaVersion.parse(row.get("cuda"))
        if need is not None and c is not None and v >= need and (best is None or c > best):
            best = c
    return best


@dataclass
class ArchPlan:
    items: list[ArchItem]
    nvcc: Nvcc
    gpus: list[dict] = field(default_factory=list)
    spec: str | None = None
    suggested: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def torch_cuda_arch_list(self) -> str:
        return torch_arch_list(self.items)

    @property
    def gencode(self) -> list[str]:
        return gencode_flags(self.items)

    def to_json(self) -> dict:
        return {
            "torch_cuda_arch_list": self.torch_cuda_arch_list or None,
            "gencode": self.gencode,
            "gpus": self.gpus,
            "spec": self.spec,
            "suggested": self.suggested,
            "nvcc": {"path": self.nvcc.path, "version": self.nvcc.version, "checked_with": self._checked_with()},
            "notes": self.notes,
        }

    def _checked_with(self) -> str:
        if self.nvcc.codes:
            return "nvcc --list-gpu-code"
        return "knowledge table" if self.nvcc.version else "nothing (no nvcc)"


def _nvcc_accepts(item: ArchItem, nvcc: Nvcc) -> bool:
    a = item.arch
    if nvcc.codes:
        listed = {Arch.parse(c) for c in nvcc.codes}
        if a in listed:
            return True
        if a.suffix and a.base in listed:
            return nvcc_can_target(a, nvcc.version)
        return False
    return nvcc_can_target(a, nvcc.version)


def check_against_nvcc(items: list[ArchItem], nvcc: Nvcc) -> None:
    """RefusedError (exit 1) naming every arch this nvcc cannot target and the nvcc range that can."""
    if nvcc.version is None and not nvcc.codes:
        return
    bad = [i for i in items if not _nvcc_accepts(i, nvcc)]
    if not bad:
        return
    where = f"nvcc {nvcc.version or '?'} ({nvcc.path})"
    why = "; ".join(describe_nvcc_range(i.arch) for i in bad)
    ok = [i for i in items if i not in bad]
    hint = "Use an nvcc in that range (--nvcc PATH or CUDA_HOME), or drop " + ", ".join(i.arch.cc for i in bad)
    hint += f" (keeps {torch_arch_list(ok)})." if ok else "."
    raise RefusedError(f"{where} cannot target {', '.join(i.arch.sm for i in bad)}: {why}.", hint=hint)


def suggested_items(nvcc: Nvcc) -> list[ArchItem]:
    archs = [Arch.parse(a) for a in SUGGESTED]
    keep = [a for a in archs if nvcc.version is None or _nvcc_accepts(ArchItem(a), nvcc)]
    return [ArchItem(a, True, n == len(keep) - 1, "suggested") for n, a in enumerate(keep)]


def gpu_verdicts(items: list[ArchItem], gpus: list[dict], nvcc: Nvcc, driver: str | None) -> list[dict]:
    from cudadoctor.archs import ptx_runs_on, sass_runs_on
    from cudadoctor.inspect import driver_for_cuda

    out = []
    sass = [i.arch.sm for i in items if i.sass]
    ptx = [i.arch.compute for i in items if i.ptx]
    drv_cuda = driver_cuda_of(driver)
    for g in gpus:
        d = dict(g)
        cc = g.get("cc")
        if not cc:
            d.update(runs=None, via=None, needs_driver=None, note="compute capability unknown")
            out.append(d)
            continue
        if any(sass_runs_on(s, cc) for s in sass):
            d.update(runs=True, via="sass", needs_driver=None)
        elif any(ptx_runs_on(p, cc) for p in ptx):
            need_cuda = nvcc.cuda
            need = driver_for_cuda(str(need_cuda)) if need_cuda else None
            d.update(runs=True, via="ptx", needs_driver=need, needs_driver_cuda=str(need_cuda) if need_cuda else None)
            if need_cuda and drv_cuda is not None and drv_cuda < need_cuda:
                d.update(runs=False, note=f"PTX from nvcc {need_cuda} needs a driver for CUDA >= {need_cuda}; "
                                          f"driver {driver} supports CUDA {drv_cuda}")
        else:
            d.update(runs=False, via=None, needs_driver=None,
                     note=f"no SASS that runs on {cc} and no PTX at or below it")
        out.append(d)
    return out


def make_plan(spec: str | None, *, nvcc: Nvcc, gpus: list[dict], driver: str | None = None) -> ArchPlan:
    """Parse ``spec`` (None: the GPUs present), check it against ``nvcc``, judge each GPU."""
    ccs = [g["cc"] for g in gpus if g.get("cc")]
    notes: list[str] = []
    suggested = False
    if spec is None or not spec.strip():
        if ccs:
            items = parse_spec("native", gpus=ccs, nvcc_version=nvcc.version)
            spec = None
        else:
            items = suggested_items(nvcc)
            suggested = True
            notes.append(
                "No GPU found and no arch spec given, so nothing says which GPUs the build is for. "
                f"Suggested: {torch_arch_list(items)} (torch's own wheel set this nvcc can target); "
                "pass a spec, e.g. `cudadoctor arch 8.6,8.9`."
            )
    else:
        items = parse_spec(spec, gpus=ccs, nvcc_version=nvcc.version)
        if not items and spec.strip().lower() == "native":
            items = suggested_items(nvcc)
            suggested = True
            notes.append(f"'native' but no GPU is present. Suggested: {torch_arch_list(items)}.")
    check_against_nvcc(items, nvcc)
    ptx_only = [i for i in items if i.ptx and not i.sass]
    if ptx_only:
        notes.append("TORCH_CUDA_ARCH_LIST cannot say PTX-only: it gets " + ", ".join(f"{i.cc}+PTX" for i in ptx_only)
                     + " (SASS too); the -gencode flags below are exact.")
    if nvcc.path is None:
        notes.append("No nvcc found: the list was not checked against a compiler.")
    plan = ArchPlan(items, nvcc, [], spec, suggested, notes)
    plan.gpus = gpu_verdicts(items, gpus, nvcc, driver)
    return plan

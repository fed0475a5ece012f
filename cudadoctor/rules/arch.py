"""Arch-list rules: TORCH_CUDA_ARCH_LIST must be something nvcc can target and must cover the GPUs."""

from __future__ import annotations

import re

from cudadoctor import archs
from cudadoctor.findings import Finding
from cudadoctor.rules import Facts, rule
from cudadoctor.rules._kb import build_toolkit, gpu_ccs

_SPLIT = re.compile(r"[,;\s]+")


def _nvcc(f: Facts) -> str | None:
    tk = build_toolkit(f)
    v = tk.get("nvcc") if tk else None
    return str(v) if v else None


def _can_target(f: Facts, arch: archs.Arch, nvcc: str | None) -> bool:
    """Can the build toolkit's nvcc target ``arch``? Its own `--list-gpu-arch` answer (toolkits[0].targets)
    when the probe recorded one, else the nvcc target table."""
    tk = build_toolkit(f)
    targets = tk.get("targets") if tk else None
    if isinstance(targets, list) and targets and not arch.suffix:
        listed = {str(t).strip().lower() for t in targets}
        return arch.compute in listed or arch.sm in listed
    return nvcc is None or archs.nvcc_can_target(arch, nvcc)


def recommended_arch_list(f: Facts) -> str | None:
    """TORCH_CUDA_ARCH_LIST for the GPUs present ("8.6;8.9"), limited to what the nvcc can target."""
    nvcc = _nvcc(f)
    ccs = sorted({c for _, _, c in gpu_ccs(f)}, key=lambda c: archs.Arch.parse(c))
    keep = [c for c in ccs if _can_target(f, archs.Arch.parse(c), nvcc)]
    return ";".join(keep) or None


def _items(text: str, ccs: list[str]):
    """(token, items or None) per token of an arch list; None marks a token that is no architecture."""
    out = []
    for tok in _SPLIT.split(text.strip()):
        if tok:
            got = archs.parse_arch_list(tok, gpus=ccs)
            out.append((tok, got or None))
    return out


@rule("ARCH_LIST_UNSUPPORTED", severity="error", area="arch", priority=38,
      summary="TORCH_CUDA_ARCH_LIST names an arch this nvcc cannot target")
def arch_list_unsupported(f: Facts):
    text = f.env("TORCH_CUDA_ARCH_LIST")
    if not text or not text.strip():
        return None
    nvcc = _nvcc(f)
    ccs = [c for _, _, c in gpu_ccs(f)]
    bad, good = [], []
    for tok, items in _items(text, ccs):
        if items is None:
            bad.append((tok, "is not a CUDA architecture"))
            continue
        for it in items:
            if not _can_target(f, it.arch, nvcc):
                bad.append((tok, f"cannot be targeted by nvcc {nvcc or ''} ({archs.describe_nvcc_range(it.arch)})"
                            .replace("nvcc  (", "nvcc (")))
            else:
                good.append(it)
    if not bad:
        return None
    value = archs.torch_arch_list(good) if good else (recommended_arch_list(f) or "")
    fix = [f'export TORCH_CUDA_ARCH_LIST="{value}"'] if value else [
        "unset TORCH_CUDA_ARCH_LIST   (torch then builds for the GPUs present)"]
    return Finding(
        id="ARCH_LIST_UNSUPPORTED",
        severity="error",
        title="TORCH_CUDA_ARCH_LIST names architectures this nvcc cannot build: "
        + ", ".join(sorted({t for t, _ in bad})),
        detail=f"env.TORCH_CUDA_ARCH_LIST is {text!r}; " + "; ".join(f"{t!r} {why}" for t, why in bad)
        + ". nvcc stops with 'Unsupported gpu architecture' (or torch with 'Unknown CUDA arch').",
        fix=fix,
        facts=["env.TORCH_CUDA_ARCH_LIST", "toolkits[0].nvcc"],
        area="arch",
    )


@rule("ARCH_LIST_EXCLUDES_GPU", severity="warning", area="arch", priority=55,
      summary="TORCH_CUDA_ARCH_LIST is set and covers no present GPU")
def arch_list_excludes_gpu(f: Facts):
    text = f.env("TORCH_CUDA_ARCH_LIST")
    gpus = gpu_ccs(f)
    if not text or not text.strip() or not gpus:
        return None
    items = archs.parse_arch_list(text, gpus=[c for _, _, c in gpus])
    if not items:
        return None  # nothing readable: ARCH_LIST_UNSUPPORTED reports it
    sass = [i.arch.sm for i in items if i.sass]
    ptx = [i.arch.compute for i in items if i.ptx]
    if any(archs.runs_on(sass, ptx, c)[0] for _, _, c in gpus):
        return None
    rec = recommended_arch_list(f) or ";".join(sorted({c for _, _, c in gpus}))
    names = ", ".join(f"{n or 'GPU'} (cc {c})" for _, n, c in gpus)
    return Finding(
        id="ARCH_LIST_EXCLUDES_GPU",
        severity="warning",
        title=f"TORCH_CUDA_ARCH_LIST={text!r} builds nothing that runs on this machine's GPU",
        detail=f"env.TORCH_CUDA_ARCH_LIST is {text!r} and the GPUs are {names}; extensions built here "
        "would fail with 'no kernel image is available for execution on the device'.",
        fix=[f'export TORCH_CUDA_ARCH_LIST="{rec}"',
             f'or keep the other targets and add this GPU: export TORCH_CUDA_ARCH_LIST="{text.strip()};{rec}"'],
        facts=["env.TORCH_CUDA_ARCH_LIST"] + [f"gpus[{i}].cc" for i, _, _ in gpus],
        area="arch",
    )

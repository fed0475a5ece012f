"""Extension rules: inspected CUDA extensions (facts ``extensions[]``) against the GPUs and torch here.

Each entry: {path, sass: ["sm_86"], ptx: ["compute_89"], ptx_isa: {"compute_89": "9.0"},
built_with: {torch, cuda, cxx11_abi}, load_error, manifest?}. Pure: reads facts only.
"""

from __future__ import annotations

import os
import re

from cudadoctor.archs import Arch, cc_from_name
from cudadoctor.findings import Finding
from cudadoctor.inspect import verdict
from cudadoctor.rules import Facts, rule
from cudadoctor.versions import CudaVersion, torch_release

_UNDEFINED = re.compile(r"undefined symbol:?\s*(\S+)")
REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall --no-cache-dir <the extension's source or sdist>"


def _extensions(f: Facts) -> list[dict]:
    return [e for e in f.list("extensions") if isinstance(e, dict) and isinstance(e.get("path"), str)]


def _gpus(f: Facts) -> list[tuple[str, str]]:
    out = []
    for g in f.list("gpus"):
        if not isinstance(g, dict):
            continue
        name = g.get("name") if isinstance(g.get("name"), str) else "GPU"
        cc = g.get("cc") if isinstance(g.get("cc"), str) else cc_from_name(name)
        a = Arch.parse(cc) if cc else None
        if a is not None:
            out.append((name, a.base.cc))
    return out


def _name(e: dict) -> str:
    return os.path.basename(e["path"].split("!")[-1]) or e["path"]


@rule("EXT_NO_KERNEL_IMAGE", severity="error", area="extensions",
      summary="an inspected extension has no SASS/PTX that a present GPU can run", priority=60)
def ext_no_kernel_image(f: Facts):
    gpus = _gpus(f)
    if not gpus:
        return []
    out = []
    driver_cuda = f.get("driver.cuda")
    for n, e in enumerate(f.list("extensions")):
        if not isinstance(e, dict) or not isinstance(e.get("path"), str) or e.get("error"):
            continue
        sass = [s for s in (e.get("sass") or []) if isinstance(s, str)] if isinstance(e.get("sass"), list) else []
        ptx = [p for p in (e.get("ptx") or []) if isinstance(p, str)] if isinstance(e.get("ptx"), list) else []
        if not sass and not ptx:
            continue
        bad = []
        for name, cc in gpus:
            v = verdict({**e, "sass": sass, "ptx": ptx}, cc, driver_cuda=driver_cuda)
            if not v["runs"]:
                bad.append((name, cc, v))
        if not bad:
            continue
        ccs = sorted({cc for _, cc, _ in bad}, key=lambda c: Arch.parse(c))
        jit_driver = [v for _, _, v in bad if v["via"] == "ptx"]
        who = ", ".join(f"{name} (cc {cc})" for name, cc, _ in bad)
        have = ", ".join(sass + ptx)
        if jit_driver and len(jit_driver) == len(bad):
            v = jit_driver[0]
            title = f"{_name(e)} can only run on {who} through PTX that this driver is too old to compile"
            detail = (f"{e['path']} carries {have}; {v['reason']}. The CUDA launch fails with "
                      "CUDA_ERROR_UNSUPPORTED_PTX_VERSION / 'no kernel image is available'.")
            fix = [f"upgrade the NVIDIA driver to >= {v['needs_driver'] or 'the one for CUDA ' + str(v['needs_driver_cuda'])}",
                   f"or rebuild with SASS for the GPU: export TORCH_CUDA_ARCH_LIST=\"{';'.join(ccs)}\"; {REBUILD}"]
        else:
            title = f"{_name(e)} has no kernel image for {who}"
            detail = (f"{e['path']} carries {have or 'no device code'}: no SASS for the GPU's family (SASS runs "
                      f"only on the same major with an equal or higher minor; Jetson and 'a' targets only on that "
                      f"exact GPU) and no PTX at or below its compute capability. Launching its kernels fails with "
                      f"'no kernel image is available for execution on the device'.")
            fix = [f"export TORCH_CUDA_ARCH_LIST=\"{';'.join(ccs)}+PTX\"   (cudadoctor arch prints the list for this machine)",
                   REBUILD]
        out.append(Finding(id="EXT_NO_KERNEL_IMAGE", severity="error", title=title, detail=detail, fix=fix,
                           facts=[f"extensions[{n}].sass", f"extensions[{n}].ptx", "gpus"], area="extensions"))
    return out


def _cxx11(v) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("0", "1", "true", "false"):
        return v.strip().lower() in ("1", "true")
    return None


@rule("EXT_ABI_MISMATCH", severity="error", area="extensions",
      summary="an extension was built against another torch / CUDA / C++ ABI, or fails with an undefined symbol",
      priority=55)
def ext_abi_mismatch(f: Facts):
    out = []
    torch_v = torch_release(f.get("torch.version"))
    torch_cuda = CudaVersion.parse(f.get("torch.cuda"))
    torch_abi = _cxx11(f.get("torch.cxx11_abi"))
    for n, e in enumerate(f.list("extensions")):
        if not isinstance(e, dict) or not isinstance(e.get("path"), str):
            continue
        bw = e.get("built_with") if isinstance(e.get("built_with"), dict) else {}
        reasons: list[str] = []
        refs: list[str] = []
        built_torch = torch_release(bw.get("torch"))
        if built_torch is not None and torch_v is not None and built_torch.release[:2] != torch_v.release[:2]:
            reasons.append(f"built against torch {bw.get('torch')}, running torch {f.get('torch.version')}")
            refs += [f"extensions[{n}].built_with.torch", "torch.version"]
        built_cuda = CudaVersion.parse(bw.get("cuda"))
        if built_cuda is not None and torch_cuda is not None and built_cuda.major != torch_cuda.major:
            reasons.append(f"built with CUDA {bw.get('cuda')}, torch uses CUDA {f.get('torch.cuda')}")
            refs += [f"extensions[{n}].built_with.cuda", "torch.cuda"]
        built_abi = _cxx11(bw.get("cxx11_abi"))
        if built_abi is not None and torch_abi is not None and built_abi != torch_abi:
            reasons.append(f"built with _GLIBCXX_USE_CXX11_ABI={int(built_abi)}, torch uses {int(torch_abi)}")
            refs += [f"extensions[{n}].built_with.cxx11_abi", "torch.cxx11_abi"]
        err = e.get("load_error") if isinstance(e.get("load_error"), str) else None
        m = _UNDEFINED.search(err or "")
        if m:
            sym = m.group(1)
            kind = ("a C++11-ABI (std::__cxx11) symbol" if "__cxx11" in sym else
                    "a torch/c10 symbol" if re.search(r"c10|at\d|torch", sym) else "a symbol")
            reasons.append(f"loading it fails: undefined symbol {sym} ({kind} the running torch does not export)")
            refs.append(f"extensions[{n}].load_error")
        if not reasons:
            continue
        out.append(Finding(
            id="EXT_ABI_MISMATCH", severity="error",
            title=f"{_name(e)} does not match the installed torch",
            detail=f"{e['path']}: " + "; ".join(reasons) + ". A compiled extension only loads into the torch "
                   "(major.minor), CUDA major and C++ ABI it was built against.",
            fix=[f"rebuild it against this torch: {REBUILD}",
                 f"or install the torch it was built for (torch=={bw.get('torch')})" if bw.get("torch") else
                 "or install the torch version it was built for"],
            facts=refs, area="extensions"))
    return out

"""Rules read off a pasted error message (``check --error``) where the machine's facts alone cannot
show the cause: an extension imported before torch, and a compiler killed for memory."""

from __future__ import annotations

import re

from cudadoctor.findings import Finding
from cudadoctor.rules import Facts, rule
from cudadoctor.versions import parse

# torch's own libraries, which `import torch` loads and an extension links by name (no RPATH to them)
_TORCH_LIB = re.compile(
    r"(lib(?:c10(?:_cuda)?|torch(?:_cpu|_cuda(?:_cu|_cpp)?|_python|_global_deps)?|shm))\.so(?:\.[\d.]+)?: "
    r"cannot open shared object file", re.IGNORECASE)
_SPLIT_CUDA = ("libtorch_cuda_cu", "libtorch_cuda_cpp")  # torch 1.10-1.12 only
_CUDA_LIBS = ("libc10_cuda", "libtorch_cuda")


def _text(f: Facts) -> str:
    t = f.get("error_text")
    return t if isinstance(t, str) else ""


def _torch_lib_dir(f: Facts) -> str:
    d = f.get("torch.lib_dir")
    if isinstance(d, str) and d:
        return d
    return "$(python -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), \"lib\"))')"


@rule("EXT_LOADED_BEFORE_TORCH", severity="error", area="extensions", priority=41,
      summary="an extension cannot find libc10.so / libtorch*.so: loaded before torch, or built against another torch")
def ext_loaded_before_torch(f: Facts):
    m = _TORCH_LIB.search(_text(f))
    if m is None:
        return None
    err = f.get("torch.import_error")
    if isinstance(err, str) and err.strip():
        return None  # torch itself does not import: TORCH_IMPORT_FAILED / LD_LIBRARY_PATH_SHADOW say why
    lib = m.group(1).lower()
    tv = parse(f.get("torch.version"))
    version = f.get("torch.version") if isinstance(f.get("torch.version"), str) else None
    cpu_build = version is not None and f.get("torch.cuda") is None and f.get("torch.hip") is None
    rebuild = ("rebuild it against the torch installed now: pip install --no-build-isolation --no-cache-dir "
               "--force-reinstall --no-deps <the extension's package or folder>")
    if lib in _SPLIT_CUDA and (tv is None or tv.release[:2] >= (1, 13)):
        title = f"the extension was built against torch 1.10-1.12, whose CUDA half was {lib}.so"
        detail = (f"the error names {m.group(0)!r}. torch 1.10 to 1.12 split libtorch_cuda.so into "
                  "libtorch_cuda_cu.so and libtorch_cuda_cpp.so; later releases have neither, so an extension "
                  f"linked against them cannot load next to torch {version or '1.13 or newer'}.")
        fix = [rebuild]
    elif lib in _CUDA_LIBS and cpu_build:
        title = f"the extension was built for a CUDA torch, but torch {version} is a CPU build"
        detail = (f"the error names {m.group(0)!r}: torch's CUDA libraries, which a CPU build of torch does not "
                  "ship. The extension was compiled against a CUDA build of torch.")
        fix = ["install the CUDA build of torch the extension was built with (pip install torch==<version> "
               "--index-url https://download.pytorch.org/whl/cu<XY>)", "or " + rebuild + " (CPU only)"]
    else:
        title = f"an extension was loaded before torch, so {lib}.so was not found"
        detail = (f"the error names {m.group(0)!r}. Extensions built with torch's BuildExtension link "
                  "libc10.so and libtorch*.so by name without a path to them; `import torch` loads them into "
                  "the process first. Importing the compiled module before torch (or loading it from a "
                  "program that never imports torch) leaves the dynamic loader looking in the default "
                  "folders only." + (f" torch {version} itself imports." if version else ""))
        fix = ["import torch before the extension: `import torch` then `import my_ext` (in a package, put "
               "`import torch` at the top of its __init__.py, before `from . import _C`)",
               f"a program that does not import torch (C++, ctypes): export LD_LIBRARY_PATH={_torch_lib_dir(f)}"
               ":$LD_LIBRARY_PATH"]
    return Finding(id="EXT_LOADED_BEFORE_TORCH", severity="error", area="extensions", title=title,
                   detail=detail, fix=fix, facts=["error_text", "torch.version", "torch.cuda"])


_KILLED = re.compile(
    r"'(cicc|cudafe\+\+|ptxas|nvlink|fatbinary)' died due to signal 9"
    r"|killed signal terminated program (cc1plus|cc1)", re.IGNORECASE)
_GIB_PER_JOB = 2.5  # an nvcc job of a torch extension: about 2 GiB plus the host compiler's share


def _int(v) -> int | None:
    try:
        return int(str(v).strip())
    except (TypeError, ValueError):
        return None


@rule("BUILD_OUT_OF_MEMORY", severity="error", area="compiler", priority=39,
      summary="a compiler process was killed (signal 9) during an extension build: too many parallel jobs for the memory")
def build_out_of_memory(f: Facts):
    m = _KILLED.search(_text(f))
    if m is None:
        return None
    prog = m.group(1) or m.group(2)
    cpus = _int(f.get("host.cpus"))
    mem = f.get("host.mem_available_gib")
    mem = float(mem) if isinstance(mem, (int, float)) and mem > 0 else None
    set_jobs = _int(f.env("MAX_JOBS"))
    if set_jobs is not None and set_jobs > 1:
        jobs = max(1, set_jobs // 2)
        why = f"MAX_JOBS={set_jobs} was still too many"
    elif mem is not None:
        jobs = max(1, int(mem // _GIB_PER_JOB))
        if cpus:
            jobs = min(jobs, cpus)
        why = f"{mem:g} GiB available now, about {_GIB_PER_JOB:g} GiB per job"
    else:
        jobs = 2
        why = "memory not probed; each job can take several GiB"
    ninja = (f"With MAX_JOBS unset, ninja runs as many jobs as there are CPUs plus two ({cpus + 2} here)"
             if set_jobs is None and cpus else "Each parallel compile job holds its own memory")
    return Finding(
        id="BUILD_OUT_OF_MEMORY", severity="error", area="compiler",
        title=f"the build's {prog} was killed for memory: run fewer compile jobs",
        detail=(f"the error says {m.group(0)!r}: the kernel's out-of-memory killer stopped the compiler. "
                f"{ninja}, and one nvcc job of a torch extension peaks at 2 GiB or more (large templated "
                "kernels, many architectures per file: much more). Nothing is wrong with the sources."),
        fix=[f"export MAX_JOBS={jobs}   ({why}), then build again",
             f"or build with cudadoctor build, which sizes its jobs to the free memory (--jobs {jobs} sets them)",
             "or keep NVCC_APPEND_FLAGS free of --threads N>1 and add swap where memory is small"],
        facts=["error_text", "host.mem_available_gib", "host.cpus", "env.MAX_JOBS"],
    )


_LIBSTDCXX = re.compile(
    r"(?P<lib>/\S*libstdc\+\+\.so\.6):? version [`'‘](?P<tag>GLIBCXX|CXXABI)_(?P<ver>[\d.]+)['’] not found"
    r"(?: \(required by (?P<by>[^)\s]+)\))?")
_CONDA_MARKS = ("/envs/", "conda", "miniforge", "mambaforge", "micromamba")


def _gcc_for(glibcxx: str) -> str | None:
    """The first GCC whose libstdc++ defines GLIBCXX_<glibcxx> (data/libstdcxx.toml)."""
    from cudadoctor.knowledge import load_table

    want = parse(glibcxx)
    best = None
    for row in load_table("libstdcxx"):
        v = parse(row.get("glibcxx"))
        if v is not None and want is not None and v <= want:
            best = row.get("gcc")
    return best


def libstdcxx_match(text: str):
    return _LIBSTDCXX.search(text or "")


@rule("LIBSTDCXX_TOO_OLD", severity="error", area="compiler", priority=38,
      summary="version `GLIBCXX_...' not found: the process loaded a libstdc++.so.6 older than a library needs")
def libstdcxx_too_old(f: Facts):
    texts = [t for t in (f.get("error_text"), f.get("torch.import_error")) if isinstance(t, str)]
    m = next((x for x in map(libstdcxx_match, texts) if x), None)
    if m is None:
        return _libstdcxx_older_than_compilers(f)
    lib, tag, ver, by = m.group("lib"), m.group("tag"), m.group("ver"), m.group("by")
    gcc = _gcc_for(ver) if tag == "GLIBCXX" else None
    conda_prefix = f.env("CONDA_PREFIX")
    exe = str(f.get("python.executable") or "")
    in_conda = bool(conda_prefix) or any(s in exe or s in (by or "") for s in _CONDA_MARKS)
    lib_is_conda = any(s in lib for s in _CONDA_MARKS) or bool(conda_prefix and lib.startswith(conda_prefix))
    by_torch = bool(by) and "/torch/lib/" in by
    needs = f"{tag}_{ver}" + (f" (GCC {gcc} or newer)" if gcc else "")
    newer = str(gcc).split(".")[0] if gcc else None
    compiler_lib = f.get("host_compiler.shared_libstdcxx")
    fix: list[str] = []
    if lib_is_conda:
        where = "the conda environment's libstdc++, older than the compiler the library was built with"
        fix.append(f"conda install -c conda-forge 'libstdcxx-ng>={newer}'   (the environment's libstdc++ from GCC "
                   f"{newer} or newer)" if newer else "conda install -c conda-forge libstdcxx-ng   (a newer libstdc++ "
                   "in the environment)")
        if isinstance(compiler_lib, str) and compiler_lib.startswith("/"):
            fix.append(f"or export LD_PRELOAD={compiler_lib}   (the libstdc++ of the compiler that built it)")
    elif in_conda:
        where = "the system's libstdc++, found before the conda environment's own"
        prefix = conda_prefix or "$CONDA_PREFIX"
        fix.append(f"ls -l {prefix}/lib/libstdc++.so.6*   (the environment needs the libstdc++.so.6 link; "
                   f"recreate it with ln -s libstdc++.so.6.0.<N> libstdc++.so.6, or conda install -c conda-forge "
                   "libstdcxx-ng)")
        fix.append(f"export LD_LIBRARY_PATH={prefix}/lib:$LD_LIBRARY_PATH")
    elif by_torch:
        where = "the system's libstdc++, older than the one this torch release was built against"
        fix.append("run this torch where a newer libstdc++ is found first: a conda environment (conda install -c "
                   f"conda-forge {'libstdcxx-ng>=' + newer if newer else 'libstdcxx-ng'}) or a container of a newer "
                   "distribution; or install an older torch release built for this distribution")
    else:
        where = "the system's libstdc++, older than the compiler the library was built with"
        fix.append("build it on (or in a container of) the oldest distribution it must run on, e.g. "
                   "cudadoctor build --backend docker with the target's image, so it needs no newer libstdc++"
                   + (f"; or install a GCC {newer} runtime here" if newer else ""))
    what = ("torch itself" if by_torch else f"{by}" if by else "a library")
    detail = (f"{what} needs {needs}, which {lib} does not define: {where}. The dynamic loader takes the first "
              "libstdc++.so.6 it finds and never a second one, so every C++ library in the process must be "
              "satisfied by that one.")
    if by_torch:
        detail += " torch's own libraries need it, so `import torch` fails before any extension loads."
    return Finding(id="LIBSTDCXX_TOO_OLD", severity="error", area="compiler",
                   title=f"the loaded libstdc++ lacks {tag}_{ver}" + (f" (needs GCC {gcc}'s or newer)" if gcc else ""),
                   detail=detail, fix=fix,
                   facts=["error_text", "torch.import_error", "env.CONDA_PREFIX", "host_compiler.shared_libstdcxx"])


_CXX_STD = re.compile(r"c\+\+(?P<std>\d\d) or later compatible compiler is required to use (?P<what>pytorch|aten)"
                      r"|you need c\+\+(?P<std2>\d\d) to compile pytorch", re.IGNORECASE)
_GCC_FOR_STD = {17: 9, 20: 10}  # torch's own floor for C++17 (gcc 9); -std=c++20 spelled so from gcc 10


@rule("CXX_STANDARD_TOO_OLD", severity="error", area="compiler", priority=40,
      summary="torch's headers stop with '#error C++NN or later ... is required': the build asks for an older C++ standard")
def cxx_standard_too_old(f: Facts):
    m = _CXX_STD.search(_text(f))
    if m is None:
        return None
    std = int(m.group("std") or m.group("std2"))
    version = f.get("torch.version") if isinstance(f.get("torch.version"), str) else None
    hc = f.section("host_compiler")
    name = str(hc.get("name") or "").lower()
    v = parse(hc.get("version"))
    fix = [f"setup.py: remove any '-std=c++NN' from extra_compile_args (both 'cxx' and 'nvcc'): BuildExtension "
           f"then passes the standard this torch needs; or set '-std=c++{std}' in both",
           f"CMake: set(CMAKE_CXX_STANDARD {std}) and set(CMAKE_CUDA_STANDARD {std})"]
    floor = _GCC_FOR_STD.get(std)
    if v is not None and floor is not None and "clang" not in name and v.release[0] < floor:
        fix.append(f"and a g++ that compiles C++{std}: g++ {hc.get('version')} is too old; g++ {floor} or newer "
                   f"(e.g. sudo apt-get install -y g++-{max(floor, 11)} && export CXX=g++-{max(floor, 11)} "
                   f"CUDAHOSTCXX=g++-{max(floor, 11)})")
    if std >= 20:
        fix.append("nvcc needs CUDA 12.0 or newer for -std=c++20 (every CUDA build of a torch that requires C++20 is)")
    return Finding(
        id="CXX_STANDARD_TOO_OLD", severity="error", area="compiler",
        title=f"the build compiles torch's headers as older than C++{std}, which {'torch ' + version if version else 'this torch'} requires",
        detail=(f"the error says {m.group(0)!r}: torch's headers check __cplusplus and stop. torch 2.1 made C++17 "
                "the minimum and recent releases C++20 (torch 2.14's torch/all.h and ATen/ATen.h check for it); "
                "a setup.py or CMakeLists.txt that pins "
                "an older -std / CMAKE_CXX_STANDARD overrides the standard torch's BuildExtension would pass."),
        fix=fix, facts=["error_text", "torch.version", "host_compiler.version"],
    )


def _libstdcxx_older_than_compilers(f: Facts):
    """Before any message: the libstdc++.so.6 Python maps (with torch loaded) defines older GLIBCXX
    labels than the one the host compiler links extensions against, so an extension built here that
    uses a newer libstdc++ symbol will not import."""
    loaded, lv = f.get("python.libstdcxx"), parse(f.get("python.libstdcxx_glibcxx"))
    comp, cv = f.get("host_compiler.shared_libstdcxx"), parse(f.get("host_compiler.shared_libstdcxx_glibcxx"))
    if lv is None or cv is None or cv <= lv or not isinstance(loaded, str):
        return None
    label = f"3.4.{cv.release[-1]}"
    gcc = _gcc_for(label)
    major = str(gcc).split(".")[0] if gcc else None
    name = " ".join(str(x) for x in (f.get("host_compiler.name"), f.get("host_compiler.version")) if x) or "the compiler"
    conda = any(s in loaded for s in _CONDA_MARKS)
    fix = []
    if conda:
        fix.append(f"conda install -c conda-forge 'libstdcxx-ng>={major}'   (the environment's libstdc++ as new as "
                   f"the compiler's)" if major else "conda install -c conda-forge libstdcxx-ng")
    if isinstance(comp, str) and comp.startswith("/"):
        fix.append(f"{'or ' if fix else ''}export LD_PRELOAD={comp}   (load the compiler's libstdc++ first)")
    fix.append("or build with the compiler that matches the runtime (conda install -c conda-forge gxx, "
               "or CXX / CUDAHOSTCXX set to an older g++)")
    return Finding(
        id="LIBSTDCXX_TOO_OLD", severity="warning", area="compiler",
        title=f"extensions built here can need GLIBCXX_{label}, newer than the libstdc++ Python loads",
        detail=(f"{name} links extensions against a libstdc++ that defines up to GLIBCXX_{label}"
                + (f" (GCC {gcc})" if gcc else "") + f"; the interpreter, with torch loaded, maps {loaded}, "
                f"which stops at GLIBCXX_{f.get('python.libstdcxx_glibcxx')}. An extension that uses a newer "
                f"libstdc++ symbol fails to import with \"version `GLIBCXX_...' not found\"."
                + (" The loaded copy is a conda environment's." if conda else "")),
        fix=fix,
        facts=["python.libstdcxx", "python.libstdcxx_glibcxx", "host_compiler.shared_libstdcxx",
               "host_compiler.shared_libstdcxx_glibcxx"],
    )

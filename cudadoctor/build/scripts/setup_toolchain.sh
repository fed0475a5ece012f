#!/bin/sh
# Prepares a `cudadoctor build` image: a venv at /opt/cudadoctor/venv with torch, ninja and setuptools,
# and (CUDADOCTOR_TOOLKIT=pip) a CUDA toolkit assembled from nvidia-* pip wheels at
# CUDADOCTOR_CUDA_HOME. Runs once per image as root; pip settings come in as PIP_* variables.
set -eu
: "${CUDADOCTOR_REQUIREMENTS:?}" "${CUDADOCTOR_TOOLKIT:=image}" "${CUDADOCTOR_CUDA_HOME:=/usr/local/cuda}"
VENV=/opt/cudadoctor/venv
say() { echo "[cudadoctor setup] $*"; }

if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1 \
   || ! command -v g++ >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    say "installing python3, g++ with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3 python3-venv python3-dev g++ make ca-certificates ccache >/dev/null
  elif command -v dnf >/dev/null 2>&1; then
    dnf install -y -q python3 python3-devel gcc-c++ make
  else
    say "the base image has no python3/g++ and no apt-get or dnf to install them"; exit 3
  fi
fi
PYV=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ -n "${CUDADOCTOR_PYTHON:-}" ] && [ "$PYV" != "$CUDADOCTOR_PYTHON" ]; then
  say "the image's python3 is $PYV, the target asks for $CUDADOCTOR_PYTHON"; exit 3
fi
say "python $PYV, $(g++ --version | head -n1)"

python3 -m venv "$VENV"
say "pip install $CUDADOCTOR_REQUIREMENTS"
# shellcheck disable=SC2086
"$VENV/bin/python" -m pip install --no-input --progress-bar off $CUDADOCTOR_REQUIREMENTS

if [ "$CUDADOCTOR_TOOLKIT" = pip ]; then
  say "assembling CUDA at $CUDADOCTOR_CUDA_HOME from nvidia-* wheels"
  "$VENV/bin/python" - "$CUDADOCTOR_CUDA_HOME" <<'PY'
import os, sys, sysconfig
home = sys.argv[1]
nv = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
os.makedirs(home, exist_ok=True)
# CUDA 13 wheels share nvidia/cu13/{bin,include,lib,nvvm}; CUDA 12 wheels have one folder per
# component (nvidia/cuda_nvcc/bin, nvidia/cublas/include, ...). Merge them all into one tree.
for comp in sorted(os.listdir(nv)):
    cdir = os.path.join(nv, comp)
    for sub in ("bin", "include", "lib", "nvvm"):
        src = os.path.join(cdir, sub)
        if not os.path.isdir(src):
            continue
        dst = os.path.join(home, sub)
        os.makedirs(dst, exist_ok=True)
        for entry in os.listdir(src):
            link = os.path.join(dst, entry)
            if not os.path.lexists(link):
                os.symlink(os.path.join(src, entry), link)
lib = os.path.join(home, "lib")
os.makedirs(lib, exist_ok=True)
# The runtime wheel ships libcudart.so.13 but no libcudart.so, so `-lcudart` fails to link.
made = []
for entry in sorted(os.listdir(lib)):
    if ".so." in entry:
        plain = os.path.join(lib, entry.split(".so.", 1)[0] + ".so")
        if not os.path.lexists(plain):
            os.symlink(entry, plain)
            made.append(os.path.basename(plain))
if not os.path.lexists(os.path.join(home, "lib64")):
    os.symlink("lib", os.path.join(home, "lib64"))
print("[cudadoctor setup] linked", ", ".join(made) or "nothing", "; nvcc:", os.path.realpath(os.path.join(home, "bin", "nvcc")))
PY
fi
"$CUDADOCTOR_CUDA_HOME/bin/nvcc" --version | tail -n 2
"$VENV/bin/python" -c 'import torch; print("[cudadoctor setup] torch", torch.__version__, "cuda", torch.version.cuda)'
command -v ninja >/dev/null 2>&1 || ln -s "$VENV/bin/ninja" /usr/local/bin/ninja
rm -rf /root/.cache/pip
say "done"

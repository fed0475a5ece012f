#!/usr/bin/env bash
# Depthwise conv2d on a GPU machine: build opsrc for the local GPU's arch, benchmark, run the
# depthwise tests and compute-sanitizer (memcheck, racecheck, initcheck, synccheck).
# Logs go to $OUT (default ./gpu-logs). Usage: bash scripts/depthwise-gpu.sh [bench|tests|sanitize|all]...
set -u
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-logs}"
mkdir -p "$OUT"
STEPS="${*:-all}"
want() { [[ " $STEPS " == *" all "* || " $STEPS " == *" $1 "* ]]; }
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
cd "$ROOT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt" 2>&1
$PY -c "import torch,sys;print(sys.version);print(torch.__version__, torch.version.cuda)" >> "$OUT/env.txt" 2>&1

t0=$(date +%s)
( cd opsrc && timeout 200 $PY setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1
rc=$?
PKG="$ROOT/opsrc"
if [ $rc -ne 0 ]; then
  # The full package did not build: build the depthwise kernels alone (schemas are all in ops.cpp).
  echo "full build failed (rc=$rc); building depthwise sources alone" | tee -a "$OUT/build.log"
  rm -rf /tmp/opsrc_dw && cp -r opsrc /tmp/opsrc_dw && rm -f /tmp/opsrc_dw/csrc/batch_norm*.cu
  rm -f /tmp/opsrc_dw/cudadoctor_ops/batch_norm*.py
  ( cd /tmp/opsrc_dw && timeout 150 $PY setup.py build_ext --inplace ) >> "$OUT/build.log" 2>&1
  rc=$?
  PKG=/tmp/opsrc_dw
fi
echo "build rc=$rc in $(( $(date +%s) - t0 ))s (package at $PKG)" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || { tail -50 "$OUT/build.log"; exit 1; }
export PYTHONPATH="$PKG:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if want bench; then
  timeout 90 $PY -m cudadoctor_ops.bench_depthwise --json "$OUT/bench.json" > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?" | tee -a "$OUT/summary.txt"
  tail -8 "$OUT/bench.txt"
fi
if want tests; then
  timeout 120 $PY -m pytest -q -p no:cacheprovider tests/ops/test_depthwise.py > "$OUT/tests.txt" 2>&1
  echo "tests rc=$?: $(tail -1 "$OUT/tests.txt")" | tee -a "$OUT/summary.txt"
fi
if want sanitize; then
  for tool in memcheck racecheck initcheck synccheck; do
    extra=""; [ "$tool" = "racecheck" ] && extra="--small"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool "$tool" \
      $PY scripts/depthwise_sanitize.py $extra > "$OUT/sanitize-$tool.txt" 2>&1
    echo "sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.txt" | tail -1)" | tee -a "$OUT/summary.txt"
  done
fi
cat "$OUT/summary.txt"

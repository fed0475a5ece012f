#!/usr/bin/env bash
# Depthwise conv2d on a GPU machine when the whole operator package does not build: builds the
# depthwise kernels alone (ops.cpp keeps every schema) in a scratch copy of opsrc, then runs the
# depthwise benchmark, tests and compute-sanitizer like `scripts/gpu-check.sh build depthwise`.
# Logs go to $OUT (default ./gpu-logs).
set -u
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-logs}"
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-16}"
cd "$ROOT"
SCRATCH="${SCRATCH:-/tmp/opsrc_depthwise}"
rm -rf "$SCRATCH" && cp -r opsrc "$SCRATCH"
find "$SCRATCH/csrc" -name '*.cu' ! -name 'depthwise*.cu' -delete
find "$SCRATCH/cudadoctor_ops" -maxdepth 1 -name '*.py' ! -name '__init__.py' ! -name 'depthwise.py' \
  ! -name 'bench*.py' ! -name 'sanitize.py' -delete
rm -rf "$SCRATCH/build" "$SCRATCH"/cudadoctor_ops/_C*.so
t0=$(date +%s)
( cd "$SCRATCH" && timeout 200 "$PY" setup.py build_ext --inplace ) > "$OUT/depthwise-build.log" 2>&1
rc=$?
echo "depthwise-only build rc=$rc in $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
[ $rc -eq 0 ] || { tail -30 "$OUT/depthwise-build.log"; exit 1; }
export PYTHONPATH="$SCRATCH:$ROOT${PYTHONPATH:+:$PYTHONPATH}"

timeout 120 "$PY" -m cudadoctor_ops.bench depthwise --json-out "$OUT/depthwise-bench.json" \
  > "$OUT/depthwise-bench.log" 2>&1
echo "bench rc=$? $(grep -E 'rows meet their target' "$OUT/depthwise-bench.log" | tail -1)" | tee -a "$OUT/summary.txt"
: > "$OUT/depthwise-tests.log"
for group in "not opcheck and not compile" "opcheck" "compile"; do
  echo "==== -k '$group' ====" >> "$OUT/depthwise-tests.log"
  timeout 120 "$PY" -X faulthandler -m pytest tests/ops/test_depthwise.py -k "$group" -q -rs \
    -p no:cacheprovider >> "$OUT/depthwise-tests.log" 2>&1
  echo "tests[$group] rc=$?: $(tail -1 "$OUT/depthwise-tests.log")" | tee -a "$OUT/summary.txt"
done
: > "$OUT/depthwise-sanitizer.log"
for tool in memcheck racecheck initcheck synccheck; do
  echo "==== $tool ====" >> "$OUT/depthwise-sanitizer.log"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 60 compute-sanitizer --tool "$tool" --error-exitcode 17 \
    "$PY" -m cudadoctor_ops.sanitize depthwise >> "$OUT/depthwise-sanitizer.log" 2>&1
  echo "sanitizer $tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/depthwise-sanitizer.log" | tail -1)" | tee -a "$OUT/summary.txt"
done

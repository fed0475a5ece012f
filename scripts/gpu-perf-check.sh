#!/usr/bin/env bash
# One-call check of the operators after kernel changes, on a CUDA machine (no network, no Docker):
#   1. cudadoctor build --backend local --arch $ARCHS (default 9.0) of opsrc, install the wheel
#   2. in parallel: pytest tests/ops, cudadoctor smoke --installed (all four sanitizers)
#   3. alone on the GPU: the benchmarks (batch_norm, depthwise, conv_bn_relu headline), then the
#      same CBR and depthwise cases on the previous kernel variants for an old-vs-new comparison
#   4. scripts/gpu_profile.py (kernel-level breakdown)
# Writes at most 8 files to $OUT: summary.txt build.log tests.log smoke.log bench.txt cbr.txt
# variants.txt profile.txt. Environment: OUT, PYTHON (python3), ARCHS, T_* time limits (seconds).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gpu-perf-out}"
ARCHS="${ARCHS:-9.0}"
L="$(mktemp -d /tmp/gpu-perf.XXXX)"
mkdir -p "$OUT" "$L/dist"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
T0=$SECONDS
S="$OUT/summary.txt"
say() { echo "[$((SECONDS - T0))s] $*" | tee -a "$S"; }
lim() { timeout --kill-after=10 "$@"; }

say "GPU: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1)"
lim "${T_BUILD:-240}" "$PY" -m cudadoctor build opsrc --backend local --arch "$ARCHS" --out "$L/dist" \
  --work-dir "$REPO/build/gpu-perf-work" >"$OUT/build.log" 2>&1
say "build: exit $? ($(grep -E 'MiB|error' "$OUT/build.log" | head -n 2 | tr '\n' ' '))"
whl=$(ls "$L"/dist/cudadoctor_ops-*.whl 2>/dev/null | head -n 1)
if [ -z "$whl" ] || ! "$PY" -m pip install -q --no-deps --force-reinstall "$whl" >>"$OUT/build.log" 2>&1; then
  say "no installable wheel: stopping"
  exit 1
fi

xdist=""; "$PY" -c "import xdist" 2>/dev/null && xdist="-n 8"
( lim "${T_TESTS:-260}" "$PY" -m pytest -q -p no:cacheprovider $xdist tests/ops -m "not compile" \
    >"$OUT/tests.log" 2>&1; echo "[exit $?]" >>"$OUT/tests.log" ) &
p1=$!
( lim "${T_SMOKE:-260}" "$PY" -m cudadoctor smoke --installed -j 4 >"$OUT/smoke.log" 2>&1; echo "[exit $?]" >>"$OUT/smoke.log" ) &
p2=$!
wait $p1 $p2
say "tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1) $(tail -n 1 "$OUT/tests.log")"
say "smoke: $(grep -E '^(PASS|FAIL)' "$OUT/smoke.log" | tail -n 1) $(tail -n 1 "$OUT/smoke.log")"

cd "$L"
lim "${T_BENCH:-150}" "$PY" -m cudadoctor_ops.bench batch_norm depthwise >"$OUT/bench.txt" 2>"$L/bench.err"
say "bench batch_norm+depthwise: exit $? ($(grep -E 'rows meet' "$OUT/bench.txt" | tail -n 1))"
lim "${T_CBR:-150}" "$PY" -m cudadoctor_ops.bench_cbr --cases headline >"$OUT/cbr.txt" 2>&1
say "bench cbr: exit $?"
{
  # previous kernel variants, same process kind, same shapes (old vs new in one run)
  for v in ${VARIANTS:-}; do
    echo "== $v"
    env $v lim 120 "$PY" -m cudadoctor_ops.bench_cbr --cases headline 2>&1 | tail -n 12
  done
} >"$OUT/variants.txt" 2>&1
lim "${T_PROFILE:-120}" "$PY" "$REPO/scripts/gpu_profile.py" bn cbr dw >"$OUT/profile.txt" 2>&1
say "profile: exit $?"
say "total $((SECONDS - T0))s"

#!/usr/bin/env bash
# The channels-last depthwise backward on a CUDA machine, in one call: build and install the wheel
# (gpu-perf-check.sh build), the kernel-level profile of the rows below cuDNN (gpu_profile.py
# dwmiss), the shared-memory weight gradient's settings side by side (gpu_variants.py dwv3), the
# backward tests of tests/ops/test_depthwise.py (-k bwd2, the switch children included), then
# optionally the depthwise bench. Logs in $OUT: summary.txt build.log profile.txt variants.txt
# tests.log bench.txt.
#
#   scripts/gpu-dw-wgrad.sh [build] [profile] [variants] [tests] [bench]   (default: all but bench)
#
# Environment: OUT, PYTHON, T_PROFILE / T_VARIANTS / T_TESTS / T_BENCH (seconds), TEST_K (pytest -k,
# default bwd2), VARIANT_PARTS (default dwv3).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gpu-dw-wgrad-out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
S="$OUT/summary.txt"
T0=$SECONDS
say() { echo "[$((SECONDS - T0))s] $*" | tee -a "$S"; }
lim() { timeout --kill-after=10 "$@"; }

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(build profile variants tests)
for sec in "${sections[@]}"; do
  case "$sec" in
    build)
      bash scripts/gpu-perf-check.sh build || { say "build failed"; exit 1; } ;;
    profile)
      lim "${T_PROFILE:-60}" "$PY" scripts/gpu_profile.py dwmiss >"$OUT/profile.txt" 2>&1
      say "profile dwmiss: exit $?" ;;
    variants)
      lim "${T_VARIANTS:-200}" "$PY" scripts/gpu_variants.py ${VARIANT_PARTS:-dwv3} >"$OUT/variants.txt" 2>&1
      say "variants ${VARIANT_PARTS:-dwv3}: exit $?" ;;
    tests)
      xdist=""
      "$PY" -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-14}"
      lim "${T_TESTS:-150}" "$PY" -m pytest -q -rf -p no:cacheprovider $xdist tests/ops/test_depthwise.py \
        -k "${TEST_K:-bwd2}" -m "not compile" >"$OUT/tests.log" 2>&1
      say "tests -k ${TEST_K:-bwd2}: exit $? ($(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1))" ;;
    bench)
      (cd /tmp && lim "${T_BENCH:-150}" "$PY" -m cudadoctor_ops.bench depthwise >"$OUT/bench.txt" 2>/dev/null)
      say "bench depthwise: exit $? ($(grep -E 'rows meet' "$OUT/bench.txt" | tail -n 1))" ;;
    *)
      echo "unknown section: $sec" >&2
      exit 2 ;;
  esac
done

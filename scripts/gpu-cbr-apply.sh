#!/usr/bin/env bash
# One device call for the Conv+BN+ReLU apply-from-sums kernels (cbr_apply_sums_nhwc_v3, the
# default, against CUDADOCTOR_OPS_CBR_APPLY_V5=1 and the older settings), on a CUDA machine:
#
#   bash scripts/gpu-cbr-apply.sh            (SKIP_BUILD=1: install .gpuwheel/ instead of building)
#
# 1. build the wheel (its parts come back under $OUT/wheel: copy them into .gpuwheel/ and carry
#    that folder to skip the build in a later call), 2. test_apply_sums_one_launch_matches_two_kernels
#    and the wgmma training forward tests, 3. gpu_variants.py cbra (default / V5 / APPLY_ROUNDS=0 /
#    V4=4, default and V5 twice), 4. gpu_profile.py cbrapply and cbrfp16 under the default and
#    V5, 5. the four sanitizers over `cudadoctor_ops.sanitize conv_bn_relu` with V5,
#    6. bench_cbr --cases headline with V5 (with --no-compile), if time is left.
# Writes $OUT/summary.txt and $OUT/logs.tgz (every log), within the device tool's limit on files.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DEST="${OUT:-/tmp/gpu-cbr-apply-out}"
S="$(mktemp -d /tmp/gpu-cbr-apply.XXXX)"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
T0=$SECONDS
run() { OUT="$S" "$@"; }
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  run bash scripts/gpu-perf-check.sh install || { cp "$S/summary.txt" "$DEST/" 2>/dev/null; exit 1; }
else
  OUT="$S" WHEEL_BACK=1 bash scripts/gpu-perf-check.sh build || { cp "$S/summary.txt" "$DEST/"; exit 1; }
  [ -d "$S/wheel" ] && mv "$S/wheel" "$DEST/wheel"
fi
SMOKE=0 TEST_PATHS=tests/ops/test_conv_bn_relu.py TEST_K="apply_sums or wgmma" T_TESTS=150 run bash scripts/gpu-perf-check.sh tests
KV_PARTS=cbra T_KVARIANTS=150 run bash scripts/gpu-perf-check.sh kvariants
PROFILE_PARTS="cbrapply cbrfp16" T_PROFILE=40 run bash scripts/gpu-perf-check.sh profile
CUDADOCTOR_OPS_CBR_APPLY_V5=1 PROFILE_PARTS="cbrapply cbrfp16" T_PROFILE=40 run bash scripts/gpu-perf-check.sh profile
CUDADOCTOR_OPS_CBR_APPLY_V5=1 T_SANITIZE=150 run bash scripts/gpu-perf-check.sh sanitize
if [ $((SECONDS - T0)) -lt 420 ]; then
  (cd /tmp && CUDADOCTOR_OPS_CBR_APPLY_V5=1 timeout 90 python3 -m cudadoctor_ops.bench_cbr --cases headline --no-compile \
     >"$S/cbr-v5.txt" 2>&1; echo "[exit $?]" >>"$S/cbr-v5.txt")
  echo "[$((SECONDS - T0))s] bench_cbr headline with V5: $(tail -n 1 "$S/cbr-v5.txt")" >>"$S/summary.txt"
fi
cp "$S/summary.txt" "$DEST/summary.txt"
tar czf "$DEST/logs.tgz" -C "$S" --exclude=wheel --exclude=dist .
cat "$DEST/summary.txt"

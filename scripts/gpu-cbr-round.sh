#!/usr/bin/env bash
# One device call for a round of Conv+BN+ReLU kernel work on a CUDA machine: build, the tests of
# the kernels changed, their switch settings side by side, a kernel-level profile, the four
# sanitizers and the headline bench, within the device tool's 600 s:
#
#   bash scripts/gpu-cbr-round.sh            (SKIP_BUILD=1: install .gpuwheel/ instead of building)
#
# First the build (its wheel's parts come back under $OUT/wheel: copy them into .gpuwheel/ and
# carry that folder to skip the build in a later call), or with SKIP_BUILD=1 the install of
# .gpuwheel/. Then the steps in the order of ROUND_STEPS (default "tests kvariants profile
# sanitize bench"; each a section of scripts/gpu-perf-check.sh, the variables choose what they
# cover):
#   tests: pytest $ROUND_TESTS (paths) -k "$ROUND_K" (T_TESTS, default 150 s)
#   kvariants: scripts/gpu_variants.py $ROUND_KV (default cbra: the apply from sums and the
#      masked backward's group partials against their switches)
#   profile: scripts/gpu_profile.py $ROUND_PROFILE (default cbrfp16)
#   sanitize: the four tools over `cudadoctor_ops.sanitize $SAN_PARTS` with $ROUND_SAN_ENV set
#      (default CUDADOCTOR_OPS_BN_BWD_GROUPS=1: the backward's group partials on the sanitizer's
#      small tensors too)
#   bench: bench_cbr --cases headline $ROUND_BENCH (default --no-compile --no-resnet) if fewer than
#      ROUND_BENCH_BY (default 440) seconds have passed
# Writes $OUT/summary.txt and $OUT/logs.tgz (every log) after each step, so that a call cut off by
# the device tool's limit still brings back what ran.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
DEST="${OUT:-/tmp/gpu-cbr-round-out}"
S="$(mktemp -d /tmp/gpu-cbr-round.XXXX)"
mkdir -p "$DEST"
export PYTHONUNBUFFERED=1
T0=$SECONDS
save() { cp "$S/summary.txt" "$DEST/summary.txt" 2>/dev/null; tar czf "$DEST/logs.tgz" -C "$S" --exclude=wheel --exclude=dist . 2>/dev/null; }
run() { OUT="$S" "$@"; local rc=$?; save; return $rc; }
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  run bash scripts/gpu-perf-check.sh install || exit 1
else
  WHEEL_BACK=1 run bash scripts/gpu-perf-check.sh build || exit 1
  [ -d "$S/wheel" ] && mv "$S/wheel" "$DEST/wheel"
fi
step_tests() {
  local tests="${ROUND_TESTS:-tests/ops/test_conv_bn_relu.py tests/ops/test_batch_norm_bwd_fused.py}"
  SMOKE=0 TEST_PATHS="$tests" TEST_K="${ROUND_K:-apply_sums or shared_memory or streamed or tile_backward}" \
    T_TESTS="${T_TESTS:-150}" run bash scripts/gpu-perf-check.sh tests
}
step_kvariants() { KV_PARTS="${ROUND_KV:-cbra}" T_KVARIANTS="${T_KVARIANTS:-150}" run bash scripts/gpu-perf-check.sh kvariants; }
step_profile() { PROFILE_PARTS="${ROUND_PROFILE:-cbrfp16}" T_PROFILE=40 run bash scripts/gpu-perf-check.sh profile; }
step_sanitize() {
  T_SANITIZE="${T_SANITIZE:-120}" run env ${ROUND_SAN_ENV:-CUDADOCTOR_OPS_BN_BWD_GROUPS=1} bash scripts/gpu-perf-check.sh sanitize
}
step_bench() {
  [ $((SECONDS - T0)) -lt "${ROUND_BENCH_BY:-440}" ] || { echo "bench: left out (time)" >>"$S/summary.txt"; return 0; }
  (cd /tmp && timeout "${T_CBR:-100}" python3 -m cudadoctor_ops.bench_cbr --cases headline ${ROUND_BENCH:---no-compile --no-resnet} \
     >"$S/cbr.txt" 2>&1; echo "[exit $?]" >>"$S/cbr.txt")
  echo "[$((SECONDS - T0))s] bench_cbr headline ${ROUND_BENCH:---no-compile --no-resnet}: $(tail -n 1 "$S/cbr.txt")" >>"$S/summary.txt"
  save
}
for step in ${ROUND_STEPS:-tests kvariants profile sanitize bench}; do
  declare -F "step_$step" >/dev/null || { echo "unknown step: $step" >&2; exit 2; }
  "step_$step"
done
save
cat "$DEST/summary.txt"

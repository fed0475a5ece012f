#!/usr/bin/env bash
# Checks of the operators after kernel changes, on a CUDA machine (no network, no Docker):
#
#   scripts/gpu-perf-check.sh [SECTION...]      default: build tests bench
#
#   build     cudadoctor build --backend local --arch $ARCHS (default 9.0) of opsrc; install it
#             (WHEEL_BACK=1: also in parts under $OUT/wheel, so that a later call on a fresh
#             machine can carry it instead of building again: copy the parts and name.txt that
#             came back into .gpuwheel/, ignored by .git/info/exclude, and carry it)
#   install   instead of build: install the wheel in $WHEEL_DIR (default .gpuwheel: a
#             cudadoctor_ops-*.whl, or an earlier call's wheel.part.* and name.txt)
#   sanitize  compute-sanitizer's four tools at once, each over
#             python -m cudadoctor_ops.sanitize $SAN_PARTS (default conv_bn_relu); logs
#             sanitize-TOOL.log, the ERROR SUMMARY lines in summary.txt
#   tests     in parallel: pytest tests/ops and cudadoctor smoke --installed (all four sanitizers;
#             SMOKE=0: pytest alone)
#   smoke     cudadoctor smoke --installed alone
#   bench     alone on the GPU: python -m cudadoctor_ops.bench batch_norm depthwise, then
#             python -m cudadoctor_ops.bench_cbr --cases headline (with torch.compile and ResNet-50)
#   variants  the previous kernel variants in the same kind of run: `bench batch_norm` once per
#             setting in $BN_VARIANTS (default: CUDADOCTOR_OPS_BN_FUSED=0, the channels_last
#             training forward without the one-launch kernel; CUDADOCTOR_OPS_BN_SINGLEREAD=0, the
#             contiguous one without the single-read kernel; CUDADOCTOR_OPS_BN_FUSED_BWD=0, the
#             backward without its one-launch kernels), and with
#             CBR_VARIANTS=1 CBR's v1 NHWC kernels (CUDADOCTOR_OPS_CBR_V1=1); the depthwise bench
#             times its previous kernels itself
#   profile   scripts/gpu_profile.py $PROFILE_PARTS (default bn cbr dw; kernel-level breakdown)
#   kvariants scripts/gpu_variants.py $KV_PARTS (default bn cbr dw dwb; also dww): kernel choices (switch
#             settings) side by side against torch, one child process per setting
#   ncu       Nsight Compute sections of scripts/gpu_ncu.py $NCU_PARTS (default dw bn; also bnh, bnbig, bwdtile, hmma,
#             bnstats, tile, dws, dwk5), plus $NCU_SECTIONS, appended to profile.txt; once per VAR=VALUE setting in
#             $NCU_ENVS when given (e.g. "CUDADOCTOR_OPS_BN_STATS_PIPE=0 CUDADOCTOR_OPS_BN_STATS_PIPE=4";
#             a comma joins the settings of one run)
# The sections after `build` use the installed wheel, so on a machine still warm from an earlier
# call they can run alone. Writes to $OUT: summary.txt build.log tests.log smoke.log bench.txt
# cbr.txt variants.txt kvariants.txt profile.txt sanitize-*.log (and wheel/ with WHEEL_BACK=1). Environment: OUT, PYTHON, ARCHS, T_*, GPU_WHEELS,
# TEST_PATHS (pytest paths of `tests`, default tests/ops), TEST_K (pytest -k of `tests`), TEST_WORKERS (pytest-xdist workers, default 14: tests/ops took about 210 s that way on the H200
# machine, then over 250 s once the switch tests of the depthwise weight gradient, bn_tile_nhwc's
# merge batch and Conv+BN+ReLU's contiguous forward were added; T_TESTS defaults to 490: 361 s on 2026-11-30 with
# smoke alongside, then past 420 s (97% done) once the graph bench test passed, 350 s again later that day;
# the build took 77-104 s, so build + tests fit one 600 s call only with T_TESTS <= 480; on 2026-12-01
# tests/ops took 441 s, then, with the two hoist children added, had 2592 of its results in at 450 s,
# after a 130 s build: run `tests` in a call of its own on a warm machine, or split TEST_PATHS;
# on the next stop every file but test_depthwise.py took 428 s alone after a 113 s build, so the
# split that fits is: call 1 `build tests` with TEST_PATHS set to the other files of tests/ops and
# T_TESTS=430, call 2 on the still-warm machine `tests` with TEST_PATHS=tests/ops/test_depthwise.py;
# on 2026-12-02 that first split, run on a fresh machine from a carried wheel without `build`, had
# 97% of its results in at 440 s with smoke beside it, and smoke itself, slowed by the 14 workers,
# ran past its 300 s; test_conv_bn_relu.py alone took 153 s). SMOKE=0 leaves smoke out of `tests`
# (run it in a call of its own, or beside a short TEST_PATHS / TEST_K selection).
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

section_build() {
  say "GPU: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1)"
  # GPU_WHEELS: a folder of wheels to install first (no index), e.g. nvidia-cudnn-frontend, whose
  # headers give the wheel the cudnn_conv_stats kernel
  if [ -n "${GPU_WHEELS:-}" ]; then
    local rc=0
    "$PY" -m pip install -q --no-deps "$GPU_WHEELS"/*.whl >"$L/gpu-wheels.log" 2>&1 || rc=$?
    say "wheels from $GPU_WHEELS: exit $rc ($(cd "$GPU_WHEELS" && ls *.whl | tr '\n' ' '))"
    [ "$rc" = 0 ] || say "$(tail -n 3 "$L/gpu-wheels.log")"
  fi
  lim "${T_BUILD:-220}" "$PY" -m cudadoctor build opsrc --backend local --arch "$ARCHS" --out "$L/dist" \
    --work-dir "$REPO/build/gpu-perf-work" >"$OUT/build.log" 2>&1
  say "build: exit $? ($(grep -E 'MiB|error' "$OUT/build.log" | head -n 2 | tr '\n' ' '))"
  local whl
  whl=$(ls "$L"/dist/cudadoctor_ops-*.whl 2>/dev/null | head -n 1)
  if [ -z "$whl" ] || ! "$PY" -m pip install -q --no-deps --force-reinstall "$whl" >>"$OUT/build.log" 2>&1; then
    say "no installable wheel"
    return 1
  fi
  # WHEEL_BACK=1: the wheel also under $OUT/wheel as parts of 15 MB (wheel.part.aa, ...) and
  # name.txt: files come back from the device machine only under plain names (a wheel's has a +),
  # at most 16 MiB each and 8 in all (the wheel is about 18 MiB)
  if [ "${WHEEL_BACK:-0}" = 1 ]; then
    mkdir -p "$OUT/wheel" && split -b 15000000 "$whl" "$OUT/wheel/wheel.part." &&
      basename "$whl" >"$OUT/wheel/name.txt"
  fi
  check_import
}

# the package imports (its ops register) here, not in every test; `cudadoctor build` has already
# refused a shared object that does not load (its load check)
check_import() {
  if ! (cd "$L" && "$PY" -c "import cudadoctor_ops" >>"$OUT/build.log" 2>&1); then
    say "the installed wheel does not import: $(tail -n 1 "$OUT/build.log" | cut -c1-300)"
    return 1
  fi
  say "import: ok; cudnn_conv_stats kernel: $(cd "$L" && "$PY" -c "from cudadoctor_ops import cudnn_stats as c; print(c._CPP)" 2>&1 | tail -n 1)"
}

section_install() {
  say "GPU: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>&1)"
  local whl d="${WHEEL_DIR:-.gpuwheel}"
  whl=$(ls "$d"/cudadoctor_ops-*.whl 2>/dev/null | head -n 1)
  if [ -z "$whl" ] && [ -f "$d/name.txt" ] && ls "$d"/wheel.part.* >/dev/null 2>&1; then
    whl="$L/dist/$(cat "$d/name.txt")"
    cat "$d"/wheel.part.* >"$whl"
  fi
  if [ -z "$whl" ] || ! "$PY" -m pip install -q --no-deps --force-reinstall "$whl" >"$OUT/build.log" 2>&1; then
    say "no installable wheel in ${WHEEL_DIR:-.gpuwheel}"
    return 1
  fi
  say "installed $(basename "$whl")"
  check_import
}

section_sanitize() {
  local cs tool pids=()
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  [ -z "$cs" ] && { say "sanitize: compute-sanitizer not found"; return 0; }
  for tool in memcheck racecheck initcheck synccheck; do
    ( cd "$L" && PYTORCH_NO_CUDA_MEMORY_CACHING=1 lim "${T_SANITIZE:-300}" "$cs" --tool "$tool" \
        --error-exitcode 9 "$PY" -m cudadoctor_ops.sanitize ${SAN_PARTS:-conv_bn_relu} \
        >"$OUT/sanitize-$tool.log" 2>&1; echo "[exit $?]" >>"$OUT/sanitize-$tool.log" ) &
    pids+=($!)
  done
  wait "${pids[@]}"
  for tool in memcheck racecheck initcheck synccheck; do
    say "sanitize $tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize-$tool.log" | tail -n 1) $(grep -vE '^\[exit|^=' "$OUT/sanitize-$tool.log" | tail -n 1 | cut -c1-200) $(tail -n 1 "$OUT/sanitize-$tool.log")"
  done
}

section_tests() {
  local xdist="" p1 p2
  "$PY" -c "import xdist" 2>/dev/null && xdist="-n ${TEST_WORKERS:-14}"
  # TEST_K: a pytest -k expression (default: every test of TEST_PATHS)
  ( lim "${T_TESTS:-490}" "$PY" -m pytest -q -rf -p no:cacheprovider --durations=25 $xdist ${TEST_PATHS:-tests/ops} -m "not compile" \
      ${TEST_K:+-k "$TEST_K"} >"$OUT/tests.log" 2>&1; echo "[exit $?]" >>"$OUT/tests.log" ) &
  p1=$!
  if [ "${SMOKE:-1}" = 0 ]; then
    wait $p1
    say "tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1) $(tail -n 1 "$OUT/tests.log")"
    say "smoke: left out (SMOKE=0)"
    return 0
  fi
  ( lim "${T_SMOKE:-300}" "$PY" -m cudadoctor smoke --installed -j 2 >"$OUT/smoke.log" 2>&1
    echo "[exit $?]" >>"$OUT/smoke.log" ) &
  p2=$!
  wait $p1 $p2
  say "tests: $(grep -E '(passed|failed|error)' "$OUT/tests.log" | tail -n 1) $(tail -n 1 "$OUT/tests.log")"
  say "smoke: $(grep -E '^(PASS|FAIL)' "$OUT/smoke.log" | tail -n 1) $(tail -n 1 "$OUT/smoke.log")"
}

# smoke alone (for a call of its own: see SMOKE=0 above)
section_smoke() {
  lim "${T_SMOKE:-300}" "$PY" -m cudadoctor smoke --installed -j 2 >"$OUT/smoke.log" 2>&1
  echo "[exit $?]" >>"$OUT/smoke.log"
  say "smoke: $(grep -E '^(PASS|FAIL)' "$OUT/smoke.log" | tail -n 1) $(tail -n 1 "$OUT/smoke.log")"
}

section_bench() {
  # BENCH_OPS: the sections of `cudadoctor_ops.bench` (default batch_norm depthwise); BENCH_ARGS:
  # extra arguments (e.g. --graph); BENCH_CBR=0 skips the Conv+BN+ReLU bench
  ( cd "$L" && lim "${T_BENCH:-180}" "$PY" -m cudadoctor_ops.bench ${BENCH_OPS:-batch_norm depthwise} ${BENCH_ARGS:-} >"$OUT/bench.txt" 2>"$L/bench.err" )
  say "bench ${BENCH_OPS:-batch_norm depthwise}: exit $? ($(grep -E 'rows meet' "$OUT/bench.txt" | tail -n 1))"
  [ "${BENCH_CBR:-1}" = 0 ] && return 0
  ( cd "$L" && lim "${T_CBR:-130}" "$PY" -m cudadoctor_ops.bench_cbr --cases headline >"$OUT/cbr.txt" 2>&1 )
  say "bench cbr: exit $?"
}

section_variants() {
  # BN_VARIANTS: space-separated VAR=VALUE settings, each a full `bench batch_norm` run
  local v
  {
    for v in ${BN_VARIANTS:-CUDADOCTOR_OPS_BN_FUSED=0 CUDADOCTOR_OPS_BN_SINGLEREAD=0 CUDADOCTOR_OPS_BN_FUSED_BWD=0}; do
      echo "== $v"
      env "$v" timeout 90 "$PY" -m cudadoctor_ops.bench batch_norm 2>/dev/null | grep -E "batch_norm|copy"
    done
    if [ -n "${CBR_VARIANTS:-}" ]; then
      echo "== CUDADOCTOR_OPS_CBR_V1=1 (previous CBR NHWC kernels)"
      CUDADOCTOR_OPS_CBR_V1=1 lim 90 "$PY" -m cudadoctor_ops.bench_cbr --cases headline --no-compile --no-resnet 2>/dev/null
      echo "== default (v2 CBR NHWC kernels), same call"
      lim 90 "$PY" -m cudadoctor_ops.bench_cbr --cases headline --no-compile --no-resnet 2>/dev/null
    fi
  } >"$OUT/variants.txt" 2>&1
  say "variants: done"
}

# kernel choices side by side, one child per switch setting (scripts/gpu_variants.py $KV_PARTS)
section_kvariants() {
  lim "${T_KVARIANTS:-240}" "$PY" "$REPO/scripts/gpu_variants.py" ${KV_PARTS:-bn cbr dw dwb} >"$OUT/kvariants.txt" 2>&1
  say "kvariants: exit $?"
}

section_profile() {
  # appends, as the ncu section does: either may run first
  { echo "== gpu_profile.py ${PROFILE_PARTS:-bn cbr dw}"
    lim "${T_PROFILE:-120}" "$PY" "$REPO/scripts/gpu_profile.py" ${PROFILE_PARTS:-bn cbr dw}
  } >>"$OUT/profile.txt" 2>&1
  say "profile: exit $?"
}

# Nsight Compute on a few kernels (scripts/gpu_ncu.py), appended to profile.txt
section_ncu() {
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null)
  [ -z "$ncu" ] && { say "ncu: not found"; return 0; }
  local extra=() sec setting
  # NCU_SECTIONS: more --section names (e.g. WarpStateStats)
  for sec in ${NCU_SECTIONS:-}; do extra+=(--section "$sec"); done
  for setting in ${NCU_ENVS:--}; do
    { echo "== ncu ${NCU_PARTS:-dw bn} (${setting/#-/default settings})"
      [ "$setting" = - ] && setting=NCU_SETTING=default
      env ${setting//,/ } timeout --kill-after=10 "${T_NCU:-150}" "$ncu" --profile-from-start off --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis "${extra[@]}" \
        "$PY" "$REPO/scripts/gpu_ncu.py" ${NCU_PARTS:-dw bn}
    } >>"$OUT/profile.txt" 2>&1
  done
  say "ncu: exit $?"
}

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(build tests bench)
for s in "${sections[@]}"; do
  declare -F "section_$s" >/dev/null || { echo "unknown section: $s" >&2; exit 2; }
  "section_$s" || { [ "$s" = build ] || [ "$s" = install ] && exit 1; }
done
say "total $((SECONDS - T0))s"

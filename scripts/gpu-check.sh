#!/usr/bin/env bash
# GPU checks of the operator package (opsrc/) on a CUDA machine: build, tests, compute-sanitizer,
# benchmarks. Logs go to $OUT (default: a new /tmp/gpu-check.* dir) as flat files; a closing table goes to
# stdout.
#
#   scripts/gpu-check.sh [SECTION...]      default: build tests sanitizer bench
#
# Sections (each a function section_<name> below; add yours the same way):
#   build      build_ext --inplace for the GPU's arch (TORCH_CUDA_ARCH_LIST, default: the GPU's)
#              -> build.log
#   tests      pytest tests/ops -m "not compile" -> tests.log
#   sanitizer  compute-sanitizer memcheck/racecheck/initcheck/synccheck over
#              `python -m cudadoctor_ops.sanitize $SANITIZE_OPS` -> sanitizer.log
#   bench      python -m cudadoctor_ops.bench $BENCH_OPS -> bench.log (+ bench.json)
#   cbr        Conv+BN+ReLU: its tests, sanitizer tools, python -m cudadoctor_ops.bench_cbr
#              -> cbr.log, cbr-bench.log (not in the default list)
#   depthwise  depthwise conv2d: bench, tests, sanitizer -> depthwise-{bench,tests,sanitizer}.log
# Environment: PYTHON (python3), OUT, MAX_JOBS (nproc), TORCH_CUDA_ARCH_LIST,
#   TESTS (pytest targets, default tests/ops), SANITIZE_OPS / BENCH_OPS (default batch_norm),
#   SANITIZE_TOOLS (default: memcheck racecheck initcheck synccheck), BENCH_ARGS (e.g. --quick),
#   SECTION_TIMEOUT_<name> (seconds; sanitizer: per tool).
# Exit status: 0 when every section passed, 1 otherwise, 2 for an unknown section.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}"
mkdir -p "$OUT"
export PYTHONPATH="$REPO/opsrc${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
declare -a ROWS=()
START_ALL=$SECONDS

note() { echo "[gpu-check $(date -u +%H:%M:%S)] $*"; }

# run_logged NAME TIMEOUT LOG CMD... : runs CMD with a timeout, appending to LOG.
run_logged() {
  local name="$1" limit="$2" log="$3"
  shift 3
  echo "\$ $*" >>"$log"
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "[timed out after ${limit}s]" >>"$log"
  return $rc
}

limit_for() {  # limit_for NAME DEFAULT
  local var="SECTION_TIMEOUT_$1"
  echo "${!var:-$2}"
}

section_build() {
  local log="$OUT/build.log"
  : >"$log"
  if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
    TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)"
    export TORCH_CUDA_ARCH_LIST
  fi
  {
    echo "torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1)"
    echo "nvcc: $("${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>&1 | tail -n 2 | head -n 1)"
    echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME:-}"
  } >>"$log"
  local t0=$SECONDS
  (cd opsrc && run_logged build "$(limit_for build 300)" "$log" "$PY" setup.py build_ext --inplace)
  local rc=$?
  local so
  so="$(ls opsrc/cudadoctor_ops/_C*.so 2>/dev/null | head -n 1)"
  if [ $rc -eq 0 ] && [ -n "$so" ]; then
    ROWS+=("build|ok|$((SECONDS - t0))s|$(basename "$so") for $TORCH_CUDA_ARCH_LIST")
    return 0
  fi
  ROWS+=("build|FAIL|$((SECONDS - t0))s|rc=$rc, see build.log: $(grep -m1 -i 'error' "$log" | cut -c1-120)")
  return 1
}

section_tests() {
  local log="$OUT/tests.log"
  : >"$log"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  run_logged tests "$(limit_for tests 240)" "$log" "$PY" -m pytest ${TESTS:-tests/ops} -m "not compile" -q -rs --durations=12 -p no:cacheprovider
  local rc=$?
  local line
  line="$(grep -E '(passed|failed|error|skipped)' "$log" | tail -n 1 | sed 's/=//g' | cut -c1-140)"
  if [ $rc -eq 0 ]; then
    ROWS+=("tests|ok|$((SECONDS - t0))s|$line")
    return 0
  fi
  ROWS+=("tests|FAIL|$((SECONDS - t0))s|rc=$rc ${line}")
  return 1
}

section_sanitizer() {
  local log="$OUT/sanitizer.log"
  : >"$log"
  local san
  san="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  if [ ! -x "$san" ]; then
    ROWS+=("sanitizer|FAIL|0s|compute-sanitizer not found")
    return 1
  fi
  local ok=0 tool rc t0 errs details=""
  # shellcheck disable=SC2086
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    t0=$SECONDS
    echo "==== $tool ====" >>"$log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_logged "sanitizer-$tool" "$(limit_for sanitizer 100)" "$log" \
      "$san" --tool "$tool" --error-exitcode 17 --target-processes all \
      "$PY" -m cudadoctor_ops.sanitize ${SANITIZE_OPS:-batch_norm}
    rc=$?
    errs="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1 | sed 's/^========= //')"
    details+="$tool: rc=$rc ${errs:-no summary} ($((SECONDS - t0))s); "
    [ $rc -ne 0 ] && ok=1
  done
  ROWS+=("sanitizer|$([ $ok -eq 0 ] && echo ok || echo FAIL)|-|${details}")
  return $ok
}

section_bench() {
  local log="$OUT/bench.log"
  : >"$log"
  local t0=$SECONDS
  # shellcheck disable=SC2086
  run_logged bench "$(limit_for bench 200)" "$log" "$PY" -m cudadoctor_ops.bench ${BENCH_OPS:-batch_norm} --json-out "$OUT/bench.json" ${BENCH_ARGS:-}
  local rc=$?
  local met
  met="$(grep -E 'rows meet their target' "$log" | tail -n 1)"
  ROWS+=("bench|$([ $rc -eq 0 ] && echo ok || echo FAIL)|$((SECONDS - t0))s|rc=$rc ${met}")
  return $rc
}

section_depthwise() {
  # Depthwise conv2d: benchmark -> depthwise-bench.log (+ .json); tests in three pytest runs (a
  # crash in one group keeps the others' results; faulthandler prints where) ->
  # depthwise-tests.log; compute-sanitizer, four tools -> depthwise-sanitizer.log.
  local t0=$SECONDS rc=0 r log group tool san details=""
  log="$OUT/depthwise-bench.log"
  : >"$log"
  # shellcheck disable=SC2086
  run_logged depthwise-bench "$(limit_for depthwise_bench 120)" "$log" \
    "$PY" -m cudadoctor_ops.bench depthwise --json-out "$OUT/depthwise-bench.json" ${BENCH_ARGS:-}
  r=$?
  [ $r -ne 0 ] && rc=1
  details+="bench rc=$r $(grep -E 'rows meet their target' "$log" | tail -n 1); "
  log="$OUT/depthwise-tests.log"
  : >"$log"
  for group in "not opcheck and not compile" "opcheck" "compile"; do
    echo "==== -k '$group' ====" >>"$log"
    run_logged depthwise-tests "$(limit_for depthwise_tests 120)" "$log" "$PY" -X faulthandler \
      -m pytest tests/ops/test_depthwise.py -k "$group" -q -rs -p no:cacheprovider
    r=$?
    [ $r -ne 0 ] && rc=1
    details+="tests[$group] rc=$r $(grep -E '(passed|failed|error)' "$log" | tail -n 1 | sed 's/=//g'); "
  done
  log="$OUT/depthwise-sanitizer.log"
  : >"$log"
  san="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    echo "==== $tool ====" >>"$log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_logged "depthwise-$tool" "$(limit_for depthwise_sanitizer 60)" \
      "$log" "$san" --tool "$tool" --error-exitcode 17 "$PY" -m cudadoctor_ops.sanitize depthwise
    r=$?
    [ $r -ne 0 ] && rc=1
    details+="$tool rc=$r $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1 | sed 's/^========= //'); "
  done
  ROWS+=("depthwise|$([ $rc -eq 0 ] && echo ok || echo FAIL)|$((SECONDS - t0))s|${details}")
  return $rc
}

# cbr: fused Conv+BN+ReLU -- its tests, the four sanitizer tools over its kernel paths, and its
# benchmark with torch.compile and the ResNet-50 step -> cbr.log, cbr-bench.log (+ cbr-bench.json)
section_cbr() {
  local log="$OUT/cbr.log" t0=$SECONDS ok=0 rc tool details=""
  : >"$log"
  run_logged cbr-tests "$(limit_for cbr_tests 240)" "$log" "$PY" -m pytest tests/ops/test_conv_bn_relu.py -q -rs -p no:cacheprovider
  rc=$?
  details+="tests rc=$rc $(grep -E '(passed|failed)' "$log" | tail -n 1 | sed 's/=//g' | cut -c1-80); "
  [ $rc -ne 0 ] && ok=1
  local san
  san="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
    echo "==== $tool ====" >>"$log"
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 run_logged "cbr-$tool" "$(limit_for sanitizer 100)" "$log" \
      "$san" --tool "$tool" --error-exitcode 17 --target-processes all "$PY" -m cudadoctor_ops.sanitize conv_bn_relu
    rc=$?
    details+="$tool rc=$rc; "
    [ $rc -ne 0 ] && ok=1
  done
  run_logged cbr-bench "$(limit_for bench 300)" "$OUT/cbr-bench.log" "$PY" -m cudadoctor_ops.bench_cbr ${BENCH_ARGS:-}
  rc=$?
  details+="bench rc=$rc"
  [ $rc -ne 0 ] && ok=1
  ROWS+=("cbr|$([ $ok -eq 0 ] && echo ok || echo FAIL)|$((SECONDS - t0))s|${details}")
  return $ok
}

SECTIONS=("$@")
[ ${#SECTIONS[@]} -eq 0 ] && SECTIONS=(build tests sanitizer bench)
for s in "${SECTIONS[@]}"; do
  if ! declare -F "section_$s" >/dev/null; then
    echo "gpu-check: unknown section '$s'; known: $(declare -F | awk '{print $3}' | grep '^section_' | sed 's/^section_//' | tr '\n' ' ')" >&2
    exit 2
  fi
done

note "repo $REPO, out $OUT, sections: ${SECTIONS[*]}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >>"$SUMMARY" 2>&1 || true
FAILED=0
for s in "${SECTIONS[@]}"; do
  note "section $s"
  if ! "section_$s"; then
    FAILED=1
    if [ "$s" = build ]; then
      note "build failed; later sections would use a stale or missing extension, stopping"
      break
    fi
  fi
done

{
  printf '%-10s %-5s %-6s %s\n' section status time details
  for r in "${ROWS[@]}"; do
    IFS='|' read -r a b c d <<<"$r"
    printf '%-10s %-5s %-6s %s\n' "$a" "$b" "$c" "$d"
  done
  echo "total $((SECONDS - START_ALL))s; logs in $OUT"
} | tee -a "$SUMMARY"
if [ -f "$OUT/bench.log" ]; then
  echo
  sed -n '/^op /,/rows meet their target/p' "$OUT/bench.log"
fi
exit $FAILED

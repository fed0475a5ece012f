#!/usr/bin/env bash
# One-call GPU validation of the whole project on a CUDA machine (no network, no Docker needed):
#   1. cudadoctor build --backend local --arch 8.0,9.0 of opsrc (falls back to pip wheel), install it
#   2. in parallel: cudadoctor check/collect/inspect; pytest tests/ops; cudadoctor smoke --installed
#      (every op under memcheck, racecheck, initcheck, synccheck)
#   3. benchmarks (batch_norm, depthwise, conv_bn_relu), alone on the GPU
# Writes at most 8 flat files to $OUT and prints a closing table.
# Environment: OUT, PYTHON (python3), ARCHS (8.0,9.0), T_BUILD/T_TESTS/T_SMOKE/T_BENCH (seconds).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-/tmp/gpu-final-out}"
L="$(mktemp -d /tmp/gpu-final.XXXX)"
mkdir -p "$OUT" "$L/dist"
ARCHS="${ARCHS:-8.0,9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
declare -a ROWS=()
T0=$SECONDS
row() { ROWS+=("$(printf '%-10s %-5s %5ss  %s' "$1" "$2" "$3" "$4")"); }
lim() { timeout --kill-after=10 "$@"; }

nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader >"$L/gpu.txt" 2>&1

# A C++ compiler that links its own copy of the C++ runtime into shared objects makes every
# exception thrown inside an extension (TORCH_CHECK) kill the process. Probe the compiler torch
# will link with; prefer the system g++ when the default one does that.
leaks_runtime() {  # leaks_runtime CXX -> 0 when a tiny shared object defines __cxa_throw itself
  printf 'void f(){throw 1;}\n' >"$L/rt.cpp"
  "$1" -shared -fPIC "$L/rt.cpp" -o "$L/rt.so" 2>/dev/null || return 2
  # (no grep -q: with pipefail, nm's SIGPIPE would turn a match into a failure)
  nm -D --defined-only "$L/rt.so" 2>/dev/null | grep '__cxa_throw' >/dev/null
}
cxx_default="${CXX:-$(command -v g++ || command -v c++)}"
{
  echo "CXX=${CXX:-} CUDAHOSTCXX=${CUDAHOSTCXX:-} default=$cxx_default"
  for c in "$cxx_default" /usr/bin/g++; do
    [ -x "$c" ] || continue
    if leaks_runtime "$c"; then echo "$c: links its own C++ runtime (defines __cxa_throw)"; else echo "$c: uses the shared libstdc++"; fi
  done
} >"$L/cxx.txt" 2>&1
if leaks_runtime "$cxx_default" && [ -x /usr/bin/g++ ] && ! leaks_runtime /usr/bin/g++; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared"
  echo "using CC/CXX/LDSHARED from /usr/bin for the extension's host code and link" >>"$L/cxx.txt"
fi
row cxx info 0 "$(tail -n1 "$L/cxx.txt")"
"$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$L/install.log" 2>&1 || row install FAIL 0 "pip install -e . failed"

# 1. build
s=$SECONDS
if lim "${T_BUILD:-260}" "$PY" -m cudadoctor build opsrc --backend local --arch "$ARCHS" --out "$L/dist" \
     >"$L/build.log" 2>&1; then
  how="cudadoctor build --backend local"
else
  rc=$?
  echo "[cudadoctor build exited $rc; falling back to pip wheel]" >>"$L/build.log"
  how="pip wheel (cudadoctor build exited $rc)"
  TORCH_CUDA_ARCH_LIST="${ARCHS//,/;}" lim "${T_BUILD:-260}" "$PY" -m pip wheel --no-build-isolation --no-deps \
    ./opsrc -w "$L/dist" >>"$L/build.log" 2>&1
fi
whl=$(ls "$L"/dist/cudadoctor_ops-*.whl 2>/dev/null | head -n1)
if [ -n "$whl" ] && "$PY" -m pip install -q --no-deps --force-reinstall "$whl" >>"$L/build.log" 2>&1; then
  row build ok $((SECONDS - s)) "$how: $(basename "$whl") ($(du -k "$whl" | cut -f1) KiB)"
else
  row build FAIL $((SECONDS - s)) "$how: no installable wheel (see build.log)"
fi

# 2. doctor + tests + smoke, in parallel
s=$SECONDS
(
  "$PY" -m cudadoctor check -v >"$L/check.txt" 2>&1; echo "[exit $?]" >>"$L/check.txt"
  "$PY" -m cudadoctor check --json >"$L/check.json" 2>&1
  "$PY" -m cudadoctor collect >"$L/collect.json" 2>"$L/collect.err"
  { [ -n "$whl" ] && "$PY" -m cudadoctor inspect "$whl"; echo "[exit $?]"; } >"$L/inspect.txt" 2>&1
  "$PY" -m cudadoctor arch >>"$L/inspect.txt" 2>&1
) &
pid_doc=$!
xdist=""; "$PY" -c "import xdist" 2>/dev/null && xdist="-n 6"
( cd "$REPO" && lim "${T_TESTS:-240}" "$PY" -m pytest -q -p no:cacheprovider $xdist tests/ops -m "not compile" \
    >"$L/tests.log" 2>&1; echo "[exit $?]" >>"$L/tests.log" ) &
pid_tests=$!
( lim "${T_SMOKE:-260}" "$PY" -m cudadoctor smoke --installed -j 6 --log-dir "$L/smoke-logs" \
    --json-out "$L/smoke.json" >"$L/smoke.txt" 2>&1; echo "[exit $?]" >>"$L/smoke.txt" ) &
pid_smoke=$!
wait $pid_doc; wait $pid_tests; wait $pid_smoke
t=$((SECONDS - s))
row check "$(grep -q '^\[exit [01]\]' "$L/check.txt" && echo ok || echo FAIL)" "$t" "$(grep -E 'Doctor found|No issues|error\(s\)' "$L/check.txt" | tail -n1)"
row tests "$(grep -q '^\[exit 0\]' "$L/tests.log" && echo ok || echo FAIL)" "$t" "$(grep -E '(passed|failed|error)' "$L/tests.log" | tail -n1)"
row smoke "$(grep -q '^\[exit 0\]' "$L/smoke.txt" && echo ok || echo FAIL)" "$t" "$(tail -n 3 "$L/smoke.txt" | head -n 2 | tr '\n' ' ')"

# 3. benchmarks, alone on the GPU
s=$SECONDS
lim "${T_BENCH:-150}" "$PY" -m cudadoctor_ops.bench batch_norm depthwise --json-out "$L/bench.json" >"$L/bench.txt" 2>&1
echo "[exit $?]" >>"$L/bench.txt"
lim "${T_BENCH_CBR:-120}" "$PY" -m cudadoctor_ops.bench_cbr --cases headline --json-out "$L/cbr.json" >"$L/cbr.txt" 2>&1
echo "[exit $?]" >>"$L/cbr.txt"
row bench "$(grep -q '^\[exit 0\]' "$L/bench.txt" && echo ok || echo FAIL)" $((SECONDS - s)) "batch_norm+depthwise; cbr: $(tail -n1 "$L/cbr.txt")"

{
  echo "GPU: $(cat "$L/gpu.txt")"
  printf '%s\n' "${ROWS[@]}"
  echo "total $((SECONDS - T0))s"
} | tee "$L/summary.txt"
{ whl_so=$(ls "$("$PY" -c 'import cudadoctor_ops,os;print(os.path.dirname(cudadoctor_ops.__file__))' 2>/dev/null)"/_C*.so 2>/dev/null | head -n1)
  echo "extension: $whl_so"; nm -D --defined-only "$whl_so" 2>/dev/null | grep -E '__cxa_throw|__gxx_personality' || echo "no C++ runtime symbols defined"
  ldd "$whl_so" 2>/dev/null | grep -E 'stdc|gcc_s'; } >>"$L/cxx.txt" 2>&1
cat "$L/cxx.txt" >>"$L/summary.txt"
cp "$L/summary.txt" "$L/check.txt" "$L/collect.json" "$L/tests.log" "$L/smoke.txt" "$OUT/" 2>/dev/null
cat "$L/bench.txt" "$L/cbr.txt" >"$OUT/bench.txt" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$L" . 2>/dev/null

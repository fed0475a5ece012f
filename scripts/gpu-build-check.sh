#!/usr/bin/env bash
# `cudadoctor build --backend local` on a GPU machine (no Docker, no network), measured against a
# plain `pip wheel ./opsrc` with only TORCH_CUDA_ARCH_LIST set.
#
#   scripts/gpu-build-check.sh [SECTION...]     default: local rebuild baseline nocompress tests
#
# Sections (each fits in a few minutes on 16 cores; run them in several calls if needed — the
# work folders and timings persist under build/gpu-build-check/<source>-<archs>/, which git ignores):
#   local       cold `cudadoctor build opsrc --backend local --arch $ARCHS` (compiler cache off)
#   rebuild     the same command again, nothing changed (up to date: no compiler), then with --force
#               (the doctor and pip run again in the same work folder) (needs `local` first)
#   baseline    cold `pip wheel --no-build-isolation --no-deps ./opsrc` (a fresh copy of opsrc),
#               only TORCH_CUDA_ARCH_LIST set
#   nocompress  cold `cudadoctor build ... --no-compress` (wheel size without compression)
#   tests       install the `local` wheel into a fresh folder, `cudadoctor inspect` it, run tests/ops,
#               `cudadoctor smoke --installed` (all four sanitizers) and `cudadoctor check` with it
# Environment: PYTHON (python3), OUT (./gpu-build-out), ARCHS (8.0,8.6,8.9,9.0), SOURCE (opsrc; the
#   tests section needs opsrc).
# Logs: $OUT/<section>.log; times and sizes: $OUT/summary.txt (also printed at the end).
# Exit status: 0 when every section passed, 1 otherwise, 2 for an unknown section.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-$REPO/gpu-build-out}"
ARCHS="${ARCHS:-8.0,8.6,8.9,9.0}"
SOURCE="${SOURCE:-opsrc}"
ARCH_LIST="${ARCHS//,/;}"
ARCH_KEY="${ARCHS//[^0-9A-Za-z]/_}"
STATE="$REPO/build/gpu-build-check/$(basename "$SOURCE")-$ARCH_KEY"
mkdir -p "$OUT" "$STATE"
SUMMARY="$OUT/summary.txt"
touch "$SUMMARY"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CCACHE_DISABLE=1          # cold builds are cold; the rebuild relies on the work folder only
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
FAILED=0

note() { echo "[gpu-build-check $(date -u +%H:%M:%S)] $*"; }
record() { echo "$*" | tee -a "$SUMMARY"; }
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }
wheel_in() { ls -1 "$1"/*.whl 2>/dev/null | head -n 1; }
size_of() { stat -c %s "$1" 2>/dev/null || echo 0; }
so_bytes() {  # total uncompressed size of the shared objects inside a wheel
  "$PY" -c 'import sys, zipfile; print(sum(i.file_size for i in zipfile.ZipFile(sys.argv[1]).infolist() if ".so" in i.filename))' "$1" 2>/dev/null || echo 0
}

cd_build() {  # cd_build NAME OUTDIR [extra args]: one timed `cudadoctor build --backend local`
  local name="$1" dist="$2"
  shift 2
  local log="$OUT/$name.log"
  rm -rf "$dist"
  local t0 t1 rc
  t0=$(now)
  "$PY" -m cudadoctor build "$SOURCE" --backend local --arch "$ARCHS" --out "$dist" \
    --work-dir "$STATE/work-$name" "$@" >"$log" 2>&1
  rc=$?
  t1=$(now)
  local w
  w=$(wheel_in "$dist")
  record "$name: exit $rc, wall $(secs "$t0" "$t1") s, wheel ${w:+$(basename "$w")} $(size_of "${w:-/nonexistent}") bytes"
  echo "$(secs "$t0" "$t1")" >"$STATE/$name.seconds"
  return $rc
}

section_local() {
  rm -rf "$STATE/work-local"
  cd_build local "$STATE/dist-local"
}

section_rebuild() {
  [ -d "$STATE/work-local" ] || { record "rebuild: needs the local section first"; return 1; }
  local log="$OUT/rebuild.log" t0 t1 rc w
  t0=$(now)
  "$PY" -m cudadoctor build "$SOURCE" --backend local --arch "$ARCHS" --out "$STATE/dist-local" \
    --work-dir "$STATE/work-local" >"$log" 2>&1
  rc=$?
  t1=$(now)
  record "rebuild (nothing changed): exit $rc, wall $(secs "$t0" "$t1") s"
  echo "$(secs "$t0" "$t1")" >"$STATE/rebuild.seconds"
  # --force: no up-to-date shortcut; the doctor runs, pip builds in the same work folder, ninja finds
  # every object current
  local t2 t3 rc2
  t2=$(now)
  "$PY" -m cudadoctor build "$SOURCE" --backend local --arch "$ARCHS" --out "$STATE/dist-local" \
    --work-dir "$STATE/work-local" --force >"$OUT/rebuild-force.log" 2>&1
  rc2=$?
  t3=$(now)
  record "rebuild --force (nothing changed, incremental): exit $rc2, wall $(secs "$t2" "$t3") s"
  echo "$(secs "$t2" "$t3")" >"$STATE/rebuild-force.seconds"
  [ $rc -eq 0 ] && [ $rc2 -eq 0 ]
}

section_baseline() {
  local log="$OUT/baseline.log" src="$STATE/baseline-src" dist="$STATE/dist-baseline" t0 t1 rc w
  rm -rf "$src" "$dist"
  cp -r "$SOURCE" "$src" && rm -rf "$src/build" "$src"/*.egg-info
  t0=$(now)
  env -u MAX_JOBS -u NVCC_APPEND_FLAGS TORCH_CUDA_ARCH_LIST="$ARCH_LIST" \
    "$PY" -m pip wheel --no-build-isolation --no-deps -w "$dist" "$src" >"$log" 2>&1
  rc=$?
  t1=$(now)
  w=$(wheel_in "$dist")
  record "baseline pip wheel ./$SOURCE (TORCH_CUDA_ARCH_LIST=$ARCH_LIST only): exit $rc, wall $(secs "$t0" "$t1") s, wheel $(size_of "${w:-/nonexistent}") bytes"
  echo "$(secs "$t0" "$t1")" >"$STATE/baseline.seconds"
  return $rc
}

section_nocompress() {
  rm -rf "$STATE/work-nocompress"
  cd_build nocompress "$STATE/dist-nocompress" --no-compress
}

section_tests() {
  local log="$OUT/tests.log" site="$STATE/site" w rc=0
  w=$(wheel_in "$STATE/dist-local")
  [ -n "$w" ] || { record "tests: no wheel from the local section"; return 1; }
  rm -rf "$site"
  {
    echo "\$ pip install --no-deps --target $site $w"
    "$PY" -m pip install --no-deps --no-index --target "$site" "$w" || rc=1
    echo "\$ cudadoctor inspect $site/cudadoctor_ops --target $ARCHS"
    "$PY" -m cudadoctor inspect "$site/cudadoctor_ops" --target "$ARCHS" || rc=1
    echo "\$ manifest"
    cat "$site"/cudadoctor_ops-*.dist-info/cudadoctor_build.json || rc=1
    echo "\$ pytest tests/ops (cudadoctor_ops from the installed wheel)"
    PYTHONPATH="$site:$PYTHONPATH" "$PY" -c 'import cudadoctor_ops, sys; print("cudadoctor_ops from", cudadoctor_ops.__file__)' || rc=1
    local xdist=""; "$PY" -c "import xdist" 2>/dev/null && xdist="-n 6"
    PYTHONPATH="$site:$PYTHONPATH" timeout 900 "$PY" -m pytest -q $xdist tests/ops -m "not compile" -p no:cacheprovider || rc=1
  } >"$log" 2>&1
  record "tests: wheel $(basename "$w") install+inspect+tests/ops exit $rc ($(grep -Eo '[0-9]+ (passed|failed)[^=]*' "$log" | tail -n 1))"
  # the doctor and the sanitizers on the same installed wheel
  local rs=0
  PYTHONPATH="$site:$PYTHONPATH" timeout 600 "$PY" -m cudadoctor smoke --installed -j 6 >"$OUT/smoke.log" 2>&1 || rs=$?
  record "smoke --installed: exit $rs ($(grep -E 'PASS|FAIL' "$OUT/smoke.log" | tail -n 1))"
  PYTHONPATH="$site:$PYTHONPATH" "$PY" -m cudadoctor check -v >"$OUT/check.log" 2>&1
  record "check: exit $? ($(grep -E 'Doctor found|No issues' "$OUT/check.log" | tail -n 1))"
  [ $rc -eq 0 ] && [ $rs -eq 0 ]
}

ratios() {
  local l r b
  l=$(cat "$STATE/local.seconds" 2>/dev/null || true)
  r=$(cat "$STATE/rebuild.seconds" 2>/dev/null || true)
  b=$(cat "$STATE/baseline.seconds" 2>/dev/null || true)
  [ -n "$l" ] && [ -n "$b" ] && record "ratio local/baseline: $(awk -v a="$l" -v b="$b" 'BEGIN { printf "%.2f", a / b }') (target <= 0.5)"
  [ -n "$l" ] && [ -n "$r" ] && record "ratio rebuild/local: $(awk -v a="$r" -v b="$l" 'BEGIN { printf "%.2f", a / b }') (target <= 0.2)"
  local f
  f=$(cat "$STATE/rebuild-force.seconds" 2>/dev/null || true)
  [ -n "$l" ] && [ -n "$f" ] && record "ratio rebuild --force/local: $(awk -v a="$f" -v b="$l" 'BEGIN { printf "%.2f", a / b }')"
  local wl wn
  wl=$(wheel_in "$STATE/dist-local"); wn=$(wheel_in "$STATE/dist-nocompress")
  [ -n "$wl" ] && [ -n "$wn" ] && record "with -compress-all: wheel $(size_of "$wl") bytes, shared objects $(so_bytes "$wl") bytes; --no-compress: wheel $(size_of "$wn") bytes, shared objects $(so_bytes "$wn") bytes"
  return 0
}

sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(local rebuild baseline nocompress tests)
note "machine: $(nproc) cores, $("$PY" -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -n 1), $(${CUDA_HOME:-/usr/local/cuda}/bin/nvcc --version 2>/dev/null | grep release)"
for s in "${sections[@]}"; do
  if ! declare -F "section_$s" >/dev/null; then echo "unknown section: $s" >&2; exit 2; fi
  note "section $s"
  "section_$s" || FAILED=1
done
ratios
cp -f "$STATE"/dist-local/*.build.log "$OUT/" 2>/dev/null || true
note "summary ($SUMMARY):"
cat "$SUMMARY"
exit $FAILED

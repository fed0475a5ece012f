#!/usr/bin/env bash
# Live proof of `cudadoctor smoke` and the extension rules on a GPU machine (no Docker, no network):
#
#   scripts/gpu-smoke-proof.sh [SECTION...]     default: sm80 fat planted abi
#
# Sections (each fits in one 10-minute call on 16 cores; wheels persist under
# build/gpu-smoke-proof/, which git ignores, so sections can run in separate calls):
#   sm80     build cudadoctor-ops for 8.0 only (no PTX): `cudadoctor inspect` must predict it cannot
#            run on this GPU, `cudadoctor smoke` must report EXT_NO_KERNEL_IMAGE (and the run must
#            confirm it), `cudadoctor check` with the wheel installed must report
#            EXT_NO_KERNEL_IMAGE with its fix
#   fat      rebuild for 8.0,9.0: inspect runs natively, smoke passes under all four tools
#   planted  the planted-bug extension (tests/fixtures/planted_bugs) built for this GPU: smoke
#            must flag the out-of-bounds write under memcheck and the race under racecheck
#   abi      the planted-bug extension built with the other C++11 ABI, and the fat wheel with a
#            manifest claiming another torch: smoke and `cudadoctor check` must report
#            EXT_ABI_MISMATCH
# Builds use `cudadoctor build --backend local`; when that fails, `pip wheel --no-build-isolation`
# with TORCH_CUDA_ARCH_LIST (said so in the log and the table).
# Environment: PYTHON (python3), OUT (build/gpu-smoke-proof/out), SMOKE_TIMEOUT (per child, 300).
# Logs: $OUT/<section>.log, $OUT/smoke-fat.json, $OUT/summary.txt (the closing table, also on stdout).
# Exit status: 0 when every expectation held, 1 otherwise, 2 for an unknown section.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-python3}"
OUT="${OUT:-$REPO/build/gpu-smoke-proof/out}"
STATE="$REPO/build/gpu-smoke-proof"
SMOKE_TIMEOUT="${SMOKE_TIMEOUT:-300}"
mkdir -p "$OUT" "$STATE"
SUMMARY="$OUT/summary.txt"
touch "$SUMMARY"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
FAILED=0
CD=("$PY" -m cudadoctor)

note() { echo "[gpu-smoke-proof $(date -u +%H:%M:%S)] $*"; }
# expect SECTION WHAT OK(0|1) DETAIL : one row of the closing table
expect() {
  local mark="ok"
  if [ "$3" != 0 ]; then mark="FAIL"; FAILED=1; fi
  printf '%-8s | %-58s | %-4s | %s\n' "$1" "$2" "$mark" "$4" | tee -a "$SUMMARY"
}
# run_log LOG CMD... : echo the command into LOG, run it, append its output; returns its status
run_log() {
  local log="$1"
  shift
  echo "\$ $*" >>"$log"
  "$@" >>"$log" 2>&1
  local rc=$?
  echo "[exit $rc]" >>"$log"
  return $rc
}
gpu_cc() { "$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))' 2>/dev/null || echo 9.0; }

# build_ops ARCHS DEST LOG : a cudadoctor-ops wheel for ARCHS (e.g. 8.0 or 8.0,9.0) in DEST
build_ops() {
  local archs="$1" dest="$2" log="$3"
  rm -rf "$dest"
  mkdir -p "$dest"
  if run_log "$log" timeout 540 "${CD[@]}" build opsrc --backend local --arch "$archs" --out "$dest" \
      --work-dir "$STATE/work"; then
    BUILT_WITH="cudadoctor build --backend local"
  else
    note "cudadoctor build failed; falling back to pip wheel (see the log)"
    echo "# cudadoctor build failed: falling back to pip wheel with TORCH_CUDA_ARCH_LIST" >>"$log"
    rm -rf "$dest" "$STATE/opsrc-copy"
    mkdir -p "$dest"
    cp -r opsrc "$STATE/opsrc-copy"
    rm -rf "$STATE/opsrc-copy/build"
    run_log "$log" env TORCH_CUDA_ARCH_LIST="${archs//,/;}" timeout 540 \
      "$PY" -m pip wheel --no-build-isolation --no-deps -w "$dest" "$STATE/opsrc-copy" || return 1
    BUILT_WITH="pip wheel (fallback)"
  fi
  ls "$dest"/cudadoctor_ops-*.whl >/dev/null 2>&1
}

# build_planted ARCH DEST LOG [ABI0] : the planted-bug extension wheel in DEST
build_planted() {
  local arch="$1" dest="$2" log="$3" abi="${4:-}"
  rm -rf "$dest" "$STATE/planted-src"
  mkdir -p "$dest"
  cp -r tests/fixtures/planted_bugs "$STATE/planted-src"
  local extra=()
  [ "$abi" = ABI0 ] && extra=(PLANTED_BUGS_CXX11_ABI=0)
  run_log "$log" env TORCH_CUDA_ARCH_LIST="$arch" "${extra[@]}" timeout 400 \
    "$PY" -m pip wheel --no-build-isolation --no-deps -w "$dest" "$STATE/planted-src" || return 1
  ls "$dest"/planted_bugs-*.whl >/dev/null 2>&1
}

# install_to WHEEL DIR : pip install --no-deps --target DIR (what `check` then sees via PYTHONPATH)
install_to() {
  rm -rf "$2"
  "$PY" -m pip install -q --no-deps --no-index --target "$2" "$1"
}

# has_finding JSON ID [FIX_SUBSTRING] : the check/smoke JSON report holds finding ID (with such a fix)
has_finding() {
  "$PY" - "$@" <<'PYEOF'
import json, sys
path, fid = sys.argv[1], sys.argv[2]
want_fix = sys.argv[3] if len(sys.argv) > 3 else None
try:
    rep = json.load(open(path))
except (OSError, ValueError):
    sys.exit(1)
for f in rep.get("findings", []):
    if f.get("id") == fid and (want_fix is None or any(want_fix in x for x in f.get("fix") or [])):
        print(f"{fid}: {f.get('title')}" + (f" | fix: {next(x for x in f['fix'] if want_fix in x)}" if want_fix else ""))
        sys.exit(0)
sys.exit(1)
PYEOF
}

check_ext_supported() { "${CD[@]}" check --help 2>/dev/null | grep -q -- '--ext'; }

section_sm80() {
  local log="$OUT/sm80.log" dest="$STATE/sm80" cc
  : >"$log"
  cc="$(gpu_cc)"
  note "sm80: building cudadoctor-ops for 8.0 only"
  if ! build_ops 8.0 "$dest" "$log"; then
    expect sm80 "build cudadoctor-ops --arch 8.0" 1 "see sm80.log"
    return
  fi
  local whl
  whl="$(ls "$dest"/cudadoctor_ops-*.whl | head -n 1)"
  expect sm80 "build cudadoctor-ops --arch 8.0" 0 "$BUILT_WITH: $(basename "$whl")"

  run_log "$log" "${CD[@]}" inspect "$whl"
  local rc=$? said=1
  grep -q "cannot run" "$log" && said=0
  expect sm80 "inspect predicts it cannot run on cc $cc" $(( rc == 1 && said == 0 ? 0 : 1 )) "inspect exit $rc"

  run_log "$log" "${CD[@]}" smoke "$whl" --timeout "$SMOKE_TIMEOUT"
  rc=$?
  local nki=1 confirmed=1
  tail -n 60 "$log" | grep -q "EXT_NO_KERNEL_IMAGE" && nki=0
  tail -n 60 "$log" | grep -q "prediction confirmed" && confirmed=0
  expect sm80 "smoke reports EXT_NO_KERNEL_IMAGE (exit 1)" $(( rc == 1 && nki == 0 ? 0 : 1 )) "smoke exit $rc"
  expect sm80 "the run confirms 'no kernel image is available'" $confirmed \
    "$(tail -n 60 "$log" | grep -m1 -o 'prediction [a-zA-Z ]*' || echo 'no prediction line')"

  install_to "$whl" "$STATE/site-sm80" >>"$log" 2>&1
  echo "# check with the 8.0 wheel on PYTHONPATH" >>"$log"
  PYTHONPATH="$STATE/site-sm80:$PYTHONPATH" run_log "$log" "${CD[@]}" check
  rc=$?
  PYTHONPATH="$STATE/site-sm80:$PYTHONPATH" "${CD[@]}" check --json >"$STATE/check-sm80.json" 2>>"$log"
  local got
  got="$(has_finding "$STATE/check-sm80.json" EXT_NO_KERNEL_IMAGE TORCH_CUDA_ARCH_LIST)"
  local found=$?
  if [ $found -ne 0 ] && check_ext_supported; then
    run_log "$log" "${CD[@]}" check --ext "$whl"
    rc=$?
    "${CD[@]}" check --ext "$whl" --json >"$STATE/check-sm80.json" 2>>"$log"
    got="$(has_finding "$STATE/check-sm80.json" EXT_NO_KERNEL_IMAGE TORCH_CUDA_ARCH_LIST)"
    found=$?
  fi
  echo "# $got" >>"$log"
  expect sm80 "check (wheel installed) reports EXT_NO_KERNEL_IMAGE + fix" $found "check exit $rc; ${got:0:150}"
}

section_fat() {
  local log="$OUT/fat.log" dest="$STATE/fat" cc
  : >"$log"
  cc="$(gpu_cc)"
  note "fat: building cudadoctor-ops for 8.0,9.0"
  if ! build_ops 8.0,9.0 "$dest" "$log"; then
    expect fat "build cudadoctor-ops --arch 8.0,9.0" 1 "see fat.log"
    return
  fi
  local whl
  whl="$(ls "$dest"/cudadoctor_ops-*.whl | head -n 1)"
  expect fat "build cudadoctor-ops --arch 8.0,9.0" 0 "$BUILT_WITH: $(basename "$whl")"
  run_log "$log" "${CD[@]}" inspect "$whl"
  local rc=$?
  expect fat "inspect: runs natively on cc $cc" $(( rc == 0 ? 0 : 1 )) "inspect exit $rc"
  note "fat: smoke under memcheck, racecheck, initcheck, synccheck"
  rm -rf "$STATE/fat-logs"
  run_log "$log" "${CD[@]}" smoke "$whl" --timeout "$SMOKE_TIMEOUT" --log-dir "$STATE/fat-logs" \
    --json-out "$OUT/smoke-fat.json"
  rc=$?
  # the table of the run, for the summary
  sed -n '/^op /,/^$/p' "$log" | tee -a "$SUMMARY"
  expect fat "smoke: every op passes all four tools (exit 0)" $(( rc == 0 ? 0 : 1 )) "smoke exit $rc"
  # the children's own logs, folded into one file
  for f in "$STATE"/fat-logs/*.log; do
    [ -f "$f" ] || continue
    { echo "=== $(basename "$f")"; tail -n 40 "$f"; } >>"$log"
  done
}

section_planted() {
  local log="$OUT/planted.log" dest="$STATE/planted" cc
  : >"$log"
  cc="$(gpu_cc)"
  note "planted: building the planted-bug extension for $cc"
  if ! build_planted "$cc" "$dest" "$log"; then
    expect planted "build planted_bugs for $cc" 1 "see planted.log"
    return
  fi
  local whl
  whl="$(ls "$dest"/planted_bugs-*.whl | head -n 1)"
  expect planted "build planted_bugs for $cc" 0 "$(basename "$whl")"
  run_log "$log" "${CD[@]}" smoke "$whl" --tools memcheck,racecheck --timeout "$SMOKE_TIMEOUT" \
    --json-out "$STATE/planted.json"
  local rc=$?
  sed -n '/^op /,/^$/p' "$log" | tee -a "$SUMMARY"
  local flags
  flags=$("$PY" - "$STATE/planted.json" <<'PYEOF'
import json, sys
try:
    rep = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    rep = {}
cells = {(r["op"], r["tool"]): r for r in rep.get("results", [])}
def flagged(op, tool):
    r = cells.get((op, tool)) or {}
    return int(r.get("status") == "fail" and (r.get("errors") or 0) > 0)
print(flagged("oob_write", "memcheck"), flagged("smem_race", "racecheck"))
PYEOF
)
  local oob race
  read -r oob race <<<"${flags:-0 0}"
  expect planted "memcheck flags the out-of-bounds write" $(( ${oob:-0} == 1 ? 0 : 1 )) "smoke exit $rc"
  expect planted "racecheck flags the shared-memory race" $(( ${race:-0} == 1 ? 0 : 1 )) "smoke exit $rc"
}

section_abi() {
  local log="$OUT/abi.log" dest="$STATE/abi" cc
  : >"$log"
  cc="$(gpu_cc)"
  note "abi: planted-bug extension built with _GLIBCXX_USE_CXX11_ABI=0"
  if build_planted "$cc" "$dest" "$log" ABI0; then
    local whl
    whl="$(ls "$dest"/planted_bugs-*.whl | head -n 1)"
    run_log "$log" "${CD[@]}" smoke "$whl" --tools none
    local rc=$? said=1 sym
    tail -n 40 "$log" | grep -q "EXT_ABI_MISMATCH" && said=0
    sym="$(tail -n 40 "$log" | grep -m1 -o 'undefined symbol: [^ ]*' || echo "no undefined symbol")"
    expect abi "smoke: C++11 ABI 0 build -> EXT_ABI_MISMATCH" $(( rc == 1 && said == 0 ? 0 : 1 )) \
      "smoke exit $rc; $sym"
    if check_ext_supported; then
      install_to "$whl" "$STATE/site-abi" >>"$log" 2>&1
      PYTHONPATH="$STATE/site-abi:$PYTHONPATH" run_log "$log" "${CD[@]}" check --ext-package planted_bugs
      rc=$?
      PYTHONPATH="$STATE/site-abi:$PYTHONPATH" "${CD[@]}" check --ext-package planted_bugs --json \
        >"$STATE/check-abi.json" 2>>"$log"
      local got seen
      got="$(has_finding "$STATE/check-abi.json" EXT_ABI_MISMATCH)"
      seen=$?
      expect abi "check --ext-package: ABI 0 build -> EXT_ABI_MISMATCH" $seen "check exit $rc; ${got:0:120}"
    fi
  else
    expect abi "build planted_bugs with C++11 ABI 0" 1 "see abi.log"
  fi

  # a cudadoctor-ops wheel whose manifest says it was built for another torch and the old ABI
  local fat
  fat="$(ls "$STATE"/fat/cudadoctor_ops-*.whl 2>/dev/null | head -n 1)"
  if [ -z "$fat" ]; then
    expect abi "check: manifest claiming torch 2.9 -> EXT_ABI_MISMATCH" 1 "needs the fat section's wheel first"
    return
  fi
  note "abi: the fat wheel with a manifest claiming torch 2.9.0 / ABI 0"
  local claimed="$STATE/claimed"
  rm -rf "$claimed"
  mkdir -p "$claimed"
  "$PY" - "$fat" "$claimed" <<'PYEOF' >>"$log" 2>&1
import base64, hashlib, json, os, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
out = os.path.join(dest, os.path.basename(src))
claim = {"torch": "2.9.0", "cxx11_abi": False}
members = []
with zipfile.ZipFile(src) as zin:
    names = zin.namelist()
    info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    for n in names:
        if n.endswith("/RECORD"):
            continue
        data = zin.read(n)
        if n == f"{info}/cudadoctor_build.json":
            data = json.dumps(dict(json.loads(data), **claim), indent=2).encode()
        members.append((n, data))
if f"{info}/cudadoctor_build.json" not in names:
    members.append((f"{info}/cudadoctor_build.json", json.dumps(claim).encode()))
digest = lambda d: "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
record = "".join(f"{n},{digest(d)},{len(d)}\n" for n, d in members) + f"{info}/RECORD,,\n"
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
    for n, d in members + [(f"{info}/RECORD", record.encode())]:
        zout.writestr(n, d)
print("wrote", out)
PYEOF
  local claimed_whl
  claimed_whl="$(ls "$claimed"/*.whl | head -n 1)"
  install_to "$claimed_whl" "$STATE/site-claimed" >>"$log" 2>&1
  echo "# check with the re-labelled wheel on PYTHONPATH" >>"$log"
  PYTHONPATH="$STATE/site-claimed:$PYTHONPATH" run_log "$log" "${CD[@]}" check
  local rc=$?
  PYTHONPATH="$STATE/site-claimed:$PYTHONPATH" "${CD[@]}" check --json >"$STATE/check-claimed.json" 2>>"$log"
  local got found
  got="$(has_finding "$STATE/check-claimed.json" EXT_ABI_MISMATCH)"
  found=$?
  if [ $found -ne 0 ] && check_ext_supported; then
    run_log "$log" "${CD[@]}" check --ext "$claimed_whl"
    rc=$?
    "${CD[@]}" check --ext "$claimed_whl" --json >"$STATE/check-claimed.json" 2>>"$log"
    got="$(has_finding "$STATE/check-claimed.json" EXT_ABI_MISMATCH)"
    found=$?
  fi
  echo "# $got" >>"$log"
  expect abi "check: manifest claiming torch 2.9.0 -> EXT_ABI_MISMATCH" $found "check exit $rc; ${got:0:120}"
  run_log "$log" "${CD[@]}" smoke "$claimed_whl" --tools none
  rc=$?
  local said=1
  tail -n 40 "$log" | grep -q "EXT_ABI_MISMATCH" && said=0
  expect abi "smoke: manifest claiming torch 2.9.0 -> EXT_ABI_MISMATCH" $(( rc == 1 && said == 0 ? 0 : 1 )) "smoke exit $rc"
}

SECTIONS=("$@")
[ ${#SECTIONS[@]} -eq 0 ] && SECTIONS=(sm80 fat planted abi)
for s in "${SECTIONS[@]}"; do
  if ! declare -F "section_$s" >/dev/null; then
    echo "unknown section: $s (sections: sm80 fat planted abi)" >&2
    exit 2
  fi
done
{
  echo "gpu-smoke-proof $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader 2>/dev/null | head -n 1)"
  echo "torch: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda, "cxx11_abi", torch._C._GLIBCXX_USE_CXX11_ABI)' 2>&1)"
  echo "nvcc: $("${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version 2>&1 | grep -m1 release)"
  echo "compute-sanitizer: $(compute-sanitizer --version 2>/dev/null | grep -m1 -i version || "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" --version 2>&1 | grep -m1 -i version)"
} | tee -a "$SUMMARY"
for s in "${SECTIONS[@]}"; do
  t0=$SECONDS
  "section_$s"
  note "$s done in $((SECONDS - t0))s"
done
echo
echo "== closing table ($(date -u +%H:%M:%S)) =="
cat "$SUMMARY"
exit $FAILED

#!/usr/bin/env bash
# Cross-checks cudadoctor's pure-Python fat binary reader against cuobjdump on real binaries:
# torch's libtorch_cuda.so (and any extra files given as arguments, plus the test fixtures).
# For each file it prints the SASS/PTX per-arch image counts from both tools, whether they agree,
# and the wall time of `cudadoctor inspect --json` vs `cuobjdump --list-elf` on the same file.
# Usage (on a machine with a CUDA toolkit and torch): scripts/crosscheck-inspect.sh [FILE...]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CUOBJDUMP=${CUOBJDUMP:-}
for c in "$CUOBJDUMP" "${CUDA_HOME:-/nonexistent}/bin/cuobjdump" "$(command -v cuobjdump 2>/dev/null)" /usr/local/cuda/bin/cuobjdump; do
  if [ -n "$c" ] && [ -x "$c" ]; then CUOBJDUMP=$c; break; fi
done
if [ -z "$CUOBJDUMP" ] || [ ! -x "$CUOBJDUMP" ]; then echo "cuobjdump not found (set CUOBJDUMP=)" >&2; exit 2; fi
echo "cuobjdump: $CUOBJDUMP ($("$CUOBJDUMP" --version | tail -1))"
TORCH_LIB=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so"))' 2>/dev/null)
FILES=("$@")
[ -n "$TORCH_LIB" ] && [ -f "$TORCH_LIB" ] && FILES+=("$TORCH_LIB")
for f in tests/fixtures/binaries/*.so tests/fixtures/binaries/*.o tests/fixtures/binaries/*.fatbin; do FILES+=("$f"); done
[ ${#FILES[@]} -gt 0 ] || { echo "nothing to check" >&2; exit 2; }
fail=0
for f in "${FILES[@]}"; do
  echo "== $f ($(du -h "$f" | cut -f1))"
  t0=$(date +%s.%N); "$CUOBJDUMP" --list-elf "$f" > /tmp/cc_elf.txt 2>/tmp/cc_elf.err; t1=$(date +%s.%N)
  "$CUOBJDUMP" --list-ptx "$f" > /tmp/cc_ptx.txt 2>/tmp/cc_ptx.err; t2=$(date +%s.%N)
  "$PY" -m cudadoctor inspect --json --gpu 9.0 "$f" > /tmp/cc_ours.json 2>/tmp/cc_ours.err; t3=$(date +%s.%N)
  "$PY" - "$f" <<'PYEOF'
import collections, json, re, sys, time
from cudadoctor.binary import read_binary
def counts(path, pat):
    c = collections.Counter()
    for line in open(path, errors="replace"):
        m = re.search(pat, line)
        if m:
            c[m.group(1)] += 1
    return c
elf = counts("/tmp/cc_elf.txt", r"ELF file\s+\d+:.*\.(sm_\d+[af]?)\.cubin")
ptx = counts("/tmp/cc_ptx.txt", r"PTX file\s+\d+:.*\.(sm_\d+[af]?)\.ptx")
t = time.perf_counter(); info = read_binary(sys.argv[1]); dt = time.perf_counter() - t
# cuobjdump --list-elf names family SASS (sm_103f) without its suffix; `cuobjdump -elf` shows
# "arch = sm_103f". The images run on the same devices either way, so compare without it.
fam = sorted({e.arch for e in info.entries if e.kind == "sass" and e.arch.endswith("f")})
o_sass = collections.Counter(re.sub(r"f$", "", e.arch) for e in info.entries if e.kind == "sass")
o_ptx = collections.Counter(e.arch.replace("compute_", "sm_") for e in info.entries if e.kind == "ptx")
ok = (o_sass == elf) and (o_ptx == ptx)
print(f"  cuobjdump SASS {dict(sorted(elf.items()))}")
print(f"  ours      SASS {dict(sorted(o_sass.items()))}")
print(f"  cuobjdump PTX  {dict(sorted(ptx.items()))}")
print(f"  ours      PTX  {dict(sorted(o_ptx.items()))}")
if fam:
    print(f"  family SASS compared without the f suffix: {fam}")
print(f"  compression: {collections.Counter(e.compression for e in info.entries)}; in-process read {dt:.3f}s")
print("  AGREE" if ok else "  DISAGREE")
sys.exit(0 if ok else 1)
PYEOF
  rc=$?; [ $rc -eq 0 ] || fail=1
  awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" 'BEGIN { printf "  time: cuobjdump --list-elf %.2fs, --list-ptx %.2fs, cudadoctor inspect --json (CLI, incl. startup) %.2fs, ratio ours/list-elf %.2f\n", b-a, c-b, d-c, (d-c)/((b-a)>0?(b-a):1e-9) }'
  if [ -s /tmp/cc_ours.err ]; then echo "  cudadoctor stderr: $(head -c 300 /tmp/cc_ours.err)"; fi
done
[ $fail -eq 0 ] && echo "ALL AGREE" || echo "SOME DISAGREE"
exit $fail

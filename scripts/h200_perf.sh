#!/usr/bin/env bash
# Performance on one GPU machine, in one command: the paper and b2b suites against Inductor
# (default and max-autotune) and the bare GEMM, timed as CUDA-graph replays in interleaved
# rounds; then the GPU tests (log: $OUT/gpu-tests.txt); optionally the models suite. Each part
# logs to $OUT/<part>.log; results land in $OUT/<suite>/, comfuse's tuning decisions in
# $OUT/tuning/; the tables are printed last and everything under $OUT is packed into
# $OUT/all.tgz.
#
# Time limits in seconds (0 skips a part): PAPER_S (400), B2B_S (150), GPU_TESTS_S (300),
# MODELS_S (240, with MODELS=1). Other knobs: PAPER_SHAPES ("suite": each workload at its own
# shapes; or "M,K,N;M,K,N"), PAPER_ONLY and B2B_ONLY (workloads), REPEAT (rounds, 3),
# CANDIDATES, GPU_TESTS_K (pytest -k), MODELS_ONLY, MODELS_CANDIDATES and MODELS_LAYERS (the
# models suite's --only, --candidates and --layers).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/comfuse-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export COMFUSE_CACHE_DIR=${COMFUSE_CACHE_DIR:-/tmp/comfuse-cache}  # kernels stay on the machine
CANDIDATES=${CANDIDATES:-comfuse,inductor,inductor-max-autotune,gemm}

# some machines return only a few files: the tuning decisions and everything else under $OUT
# go back in one archive, however the script ends
trap 'mkdir -p "$OUT/tuning"; cp "$COMFUSE_CACHE_DIR"/tuning/*.json "$OUT/tuning/" 2>/dev/null;
      tgz=$(mktemp); (cd "$OUT" && tar czf "$tgz" . && find . -mindepth 1 -delete && chmod 644 "$tgz" && mv "$tgz" all.tgz)' EXIT
failed=0

part() {  # part NAME LIMIT COMMAND...: run COMMAND under LIMIT seconds (0: skip), log to $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  [ "$limit" = 0 ] && return
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  [ "$rc" = 0 ] || failed=1
  echo "$name rc=$rc in $(( $(date +%s) - start )) s"
}

part paper "${PAPER_S:-400}" python3 -m comfuse.cli bench --suite paper --shapes "${PAPER_SHAPES:-suite}" \
  ${PAPER_ONLY:+--only "$PAPER_ONLY"} --graph --repeat "${REPEAT:-3}" --candidates "$CANDIDATES" --out "$OUT/paper"
part b2b "${B2B_S:-150}" python3 -m comfuse.cli bench --suite b2b \
  ${B2B_ONLY:+--only "$B2B_ONLY"} --graph --repeat "${REPEAT:-3}" --candidates "$CANDIDATES" --out "$OUT/b2b"
part gpu-tests "${GPU_TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout=150 \
  ${GPU_TESTS_K:+-k "$GPU_TESTS_K"}
mv "$OUT/gpu-tests.log" "$OUT/gpu-tests.txt" 2>/dev/null && tail -n 8 "$OUT/gpu-tests.txt"
[ -n "${MODELS:-}" ] && part models "${MODELS_S:-240}" python3 -m comfuse.cli bench --suite models \
  ${MODELS_ONLY:+--only "$MODELS_ONLY"} ${MODELS_CANDIDATES:+--candidates "$MODELS_CANDIDATES"} \
  ${MODELS_LAYERS:+--layers "$MODELS_LAYERS"} --out "$OUT/models"

for f in "$OUT"/*/results.md; do
  [ -f "$f" ] && { echo; echo "== $f"; grep -E '^\|' "$f"; }
done
exit $failed

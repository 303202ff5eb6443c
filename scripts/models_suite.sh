#!/usr/bin/env bash
# The models suite (`comfuse bench --suite models`) on one GPU machine in one command, within
# a total time limit: optional GPU tests first, then each model with its forms, each (model,
# form) a fresh process with cold caches; rows accumulate in one results.json (--resume), so
# a second command on the same machine adds to the first's. Everything lands under
# $OUT/suite-run/ and goes back packed in $OUT/all.tgz; each model's table is printed.
#
#   SPECS="bert:inductor,comfuse llama8b:inductor,comfuse:300" PROFILE_MODELS="llama8b" \
#   TESTS="tests/test_gpu.py" TESTK="reduce_overhead" bash scripts/models_suite.sh
#
# Knobs: SPECS (model:forms[:seconds a form may run], space-separated), PROFILE_MODELS (the
# models profiled kernel by kernel), TOTAL_S (the whole command's limit, 570 s), ROW_S (a
# form's default limit, 250 s), ROUNDS (5), TESTS / TESTK / TESTS_S (pytest's files, -k and
# limit), WHEELS (a folder of wheels installed first, e.g. Liger-Kernel's; .whl), SUITE_DIR
# (where results.json accumulates, out/suite), COMMIT (recorded in env.txt; pass it: a copy of
# the working tree may carry a .git whose HEAD is older than the files), WARM (1: each
# compiled form's first calls again in a new process with the caches the first left).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/comfuse-out}
RUN=$OUT/suite-run
SUITE=${SUITE_DIR:-out/suite}
mkdir -p "$RUN"
began=$(date +%s)
trap 'mkdir -p "$RUN/suite"; cp -r "$SUITE"/. "$RUN/suite/" 2>/dev/null; rm -rf "$RUN"/suite/cache*; (cd "$OUT" && tar czf all.tgz suite-run && rm -rf suite-run)' EXIT
if compgen -G "${WHEELS:-.whl}/*.whl" > /dev/null; then
  pip install -q --no-deps --target /tmp/suite-site "${WHEELS:-.whl}"/*.whl > "$RUN/pip.txt" 2>&1
  export PYTHONPATH=/tmp/suite-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null) (from git HEAD: COMMIT not given)}"
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
} > "$RUN/env.txt" 2>&1
cat "$RUN/env.txt"
if [ -n "${TESTS:-}" ]; then
  timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider -rP $TESTS -k "${TESTK:-}" > "$RUN/gpu-tests.txt" 2>&1
  echo "tests rc=$?: $(grep -E 'passed|failed|skipped|error' "$RUN/gpu-tests.txt" | tail -1)"
fi
for spec in ${SPECS:-}; do
  model=${spec%%:*}; rest=${spec#*:}; forms=${rest%%:*}; row_s=${ROW_S:-250}
  [ "$rest" != "$forms" ] && row_s=${rest#*:}
  left=$(( ${TOTAL_S:-570} - ($(date +%s) - began) ))
  if [ "$left" -lt 60 ]; then echo "$spec: skipped, $left s left"; continue; fi
  [ "$row_s" -gt $(( left - 20 )) ] && row_s=$(( left - 20 ))
  profile=""; [[ " ${PROFILE_MODELS:-} " == *" $model "* ]] && profile=--profile
  timeout $(( left - 10 )) python3 -c 'from comfuse.cli import main; main()' bench --suite models --only "$model" \
    --candidates "$forms" --rounds "${ROUNDS:-5}" $([ "${WARM:-0}" = 1 ] || echo --no-warm) $profile --resume --row-limit "$row_s" --out "$SUITE" \
    > "$RUN/suite-$model.txt" 2>&1
  echo "$spec rc=$? ($(( $(date +%s) - began )) s so far)"
done
[ -f "$SUITE/results.md" ] && cat "$SUITE/results.md"

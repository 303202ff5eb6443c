#!/usr/bin/env bash
# First calls by phase (scripts/first_call_phases.py) for several models and forms on one GPU
# machine in one command: each (model, form) in a fresh process with empty caches (comfuse's,
# Inductor's, Triton's), then, for the forms in WARM_FORMS, once more in a new process with
# the caches the first left (the warm first calls). Logs and JSON under $OUT/phases/, packed
# into $OUT/phases.tgz; a table last.
#
#   SPECS="gpt2:inductor,comfuse llama8b:inductor,comfuse" WARM_FORMS="comfuse" \
#   EXTRA="gpt2:comfuse:COMFUSE_GRAPH_CHECK=1" bash scripts/first_calls.sh
#
# EXTRA: model:form:VAR=value rows run last (a setting's effect, e.g. the check forced);
# ROW_S: a process's limit (160 s); TOTAL_S: the command's (560 s).
set -uo pipefail
cd "$(dirname "$0")/.."
R=$PWD
OUT=${OUT:-/tmp/comfuse-out}
P=$OUT/phases
mkdir -p "$P"
began=$(date +%s)
trap '(cd "$OUT" && tar czf phases.tgz --exclude="phases/cache-*" phases)' EXIT
export PYTHONUNBUFFERED=1 COMFUSE_LOG=${COMFUSE_LOG:-info}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton, transformers, sys; print(torch.__version__, triton.__version__, transformers.__version__, sys.version.split()[0])'
  git -C "$R" log -1 --format=%h 2>/dev/null; date -u; } > "$P/env.txt" 2>&1

row() {  # model form tag cache [VAR=value ...]
  local model=$1 form=$2 tag=$3 cache=$4; shift 4
  local left=$(( ${TOTAL_S:-560} - ($(date +%s) - began) ))
  if [ "$left" -lt 40 ]; then echo "$tag: skipped, $left s left"; return; fi
  local limit=${ROW_S:-160}; [ "$limit" -gt $(( left - 10 )) ] && limit=$(( left - 10 ))
  env "$@" COMFUSE_CACHE_DIR="$cache/c" TRITON_CACHE_DIR="$cache/t" TORCHINDUCTOR_CACHE_DIR="$cache/i" OUT="$P" \
    timeout "$limit" python3 "$R/scripts/first_call_phases.py" "$model" "$form" > "$P/$tag.txt" 2> "$P/$tag.log"
  echo "$tag rc=$? ($(( $(date +%s) - began )) s so far)"
  cp "$P/phases-$model-${form/@/-}.json" "$P/$tag.json" 2>/dev/null
}

for spec in ${SPECS:-}; do
  model=${spec%%:*}; forms=${spec#*:}
  for form in ${forms//,/ }; do
    cache=$P/cache-$model-$form; rm -rf "$cache"
    row "$model" "$form" "$model-$form" "$cache" X=1
    if [[ " ${WARM_FORMS:-} " == *" $form "* ]]; then row "$model" "$form" "$model-$form-warm" "$cache" X=1; fi
    rm -rf "$cache"
  done
done
for spec in ${EXTRA:-}; do
  IFS=: read -r model form setting <<< "$spec"
  cache=$P/cache-extra; rm -rf "$cache"
  row "$model" "$form" "$model-$form-${setting%%=*}" "$cache" "$setting"
  rm -rf "$cache"
done
cat "$P/env.txt"
for f in "$P"/*.txt; do
  [ "$(basename "$f")" = env.txt ] && continue
  echo "== $(basename "$f" .txt)"; grep -A3 -E "^[a-z0-9]+ [a-z@-]+: first step" "$f" | head -4
  grep -E "kept without|is timed against|Inductor's alone|compilation of the graph without" "${f%.txt}.log" | cut -c1-220
done

#!/usr/bin/env bash
# Whole models against Inductor on one GPU machine, in one command: the GPU tests in three parts
# (each under its own limit), then scripts/models_check.py for each model (Inductor and the
# comfuse backend compiled in one process, the first call, forward and training step timed,
# gradients against eager, profiles). Everything lands under $OUT/models-run/ and goes back
# packed in $OUT/all.tgz; a short table is printed last.
#
# Knobs: MODELS (gpt2,llama,bert,llama8b; empty runs none), LAYERS (2; llama8b runs 1), ROUNDS (5), FORMS
# (inductor,comfuse), MODEL_S (limit a model, 200 s), TESTS ("heads,kernels,rest": the LM head's
# tests, the generated kernels' and the template's, the others; empty skips them),
# TESTS_S (limit a part, 300 s), COMMIT (the commit to record, where the tree carries no git
# history of its own). Each model starts with empty caches (comfuse's, Inductor's, Triton's),
# so its first calls are cold on a machine that ran something before; autotuning's decisions
# (each candidate's plan and time) and this GPU's record by class of plan (measured.json) are
# kept beside its log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/comfuse-out}
RUN=$OUT/models-run
mkdir -p "$RUN"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
trap 'rm -rf "$RUN"/*/cache "$RUN"/*/caches; tgz=$(mktemp); (cd "$OUT" && tar czf "$tgz" models-run && rm -rf models-run && chmod 644 "$tgz" && mv "$tgz" all.tgz)' EXIT
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  echo "commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
  date -u
} > "$RUN/env.txt" 2>&1
cat "$RUN/env.txt"
HEADS="ws_split or lse or head or cross" KERNELS="generated or template"
IFS=, read -ra parts <<< "${TESTS-heads,kernels,rest}"
for part in "${parts[@]}"; do
  case $part in
    heads) k="$HEADS" ;;
    kernels) k="($KERNELS) and not ($HEADS)" ;;  # (the kernels' own tests, each form and shape)
    *) k="not ($HEADS) and not ($KERNELS)" ;;
  esac
  mkdir -p "$RUN/tests-$part"; s=$(date +%s)
  COMFUSE_CACHE_DIR=$RUN/tests-$part/cache timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_gpu.py -k "$k" > "$RUN/tests-$part/pytest.txt" 2>&1
  echo "tests ($part) rc=$? in $(( $(date +%s) - s )) s: $(grep -E 'passed|failed|skipped|error' "$RUN/tests-$part/pytest.txt" | tail -1)"
done
IFS=, read -ra models <<< "${MODELS-gpt2,llama,bert,llama8b}"
for m in "${models[@]}"; do
  layers=${LAYERS:-2}; [ "$m" = llama8b ] && layers=1
  mkdir -p "$RUN/$m"; s=$(date +%s); c=$RUN/$m/caches
  COMFUSE_CACHE_DIR=$c/comfuse TORCHINDUCTOR_CACHE_DIR=$c/inductor TRITON_CACHE_DIR=$c/triton OUT=$RUN/$m timeout "${MODEL_S:-200}" python3 scripts/models_check.py --models "$m" \
    --layers "$layers" --forms "${FORMS:-inductor,comfuse}" --rounds "${ROUNDS:-5}" --log > "$RUN/$m/log.txt" 2>&1
  echo "$m rc=$? in $(( $(date +%s) - s )) s"
  [ -d "$c/comfuse/tuning" ] && cp -r "$c/comfuse/tuning" "$RUN/$m/decisions"
  [ -f "$c/comfuse/measured/record.json" ] && cp "$c/comfuse/measured/record.json" "$RUN/$m/measured.json"
done
echo
for m in "${models[@]}"; do
  grep -E "backend: the graph" "$RUN/$m/log.txt" 2>/dev/null | sed 's/^ *//' | cut -c1-220
  grep -E "^\| $m " "$RUN/$m/log.txt" 2>/dev/null | cut -d'|' -f2-9
done

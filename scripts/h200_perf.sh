#!/usr/bin/env bash
# One device call for the GPU schedules: the suites (one shape per workload) against cuBLAS,
# eager and torch.compile, comfuse autotuned (its tuning decisions, with every candidate
# plan's time, land in $OUT/cache/tuning); the mainloop alone against cuBLAS; then the
# GPU-only tests (cooperative-strip stress, cross-entropy memory at vocabulary 32k and 128k,
# autotuning, DDP where two GPUs are present). Logs and results go to $OUT; a short table
# is printed last. Knobs: SUITE, ONLY (workloads), CANDIDATES, BENCH_S, MAINLOOP_S, GPU_TESTS_S, GPU_TESTS_K,
# REPEAT (interleaved timing rounds), SHAPES (paper suite at these M,K,N;... instead of --quick), CUTE=1 (scripts/cute_cluster_probe.py run; carry build/cute), BENCH_GRAPH=1 (suite candidates timed as CUDA-graph replays), MODELS=1, MODEL_CANDIDATES, CE_MEMORY=1, HOST=1, ANATOMY=1,
# MATRIX=1 (the tests not marked gpu, run on the GPU: -v, so a timeout still shows each result; MATRIX_S, MATRIX_K, MATRIX_N workers),
# CE_SPLIT=1 (linear + CE forward variants; CE_SPLIT_SHAPES, CE_SPLIT_QUICK=1, CE_SPLIT_S)
# TRAIN=1 (training steps of the Hugging Face blocks; TRAIN_S, TRAIN_MODELS), POWER=1 (rested vs sustained timing; POWER_S)
# (ANATOMY_ONLY, ANATOMY_FORMS), MAINLOOP_GRAPH (1: time the mainloop as CUDA-graph replays)
# (a *_S of 0 skips that part).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/comfuse-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export COMFUSE_CACHE_DIR=${COMFUSE_CACHE_DIR:-/tmp/comfuse-cache}  # kernels stay on the machine
# the device tool returns only a few files: everything goes back in one archive
trap 'mkdir -p "$OUT/tuning"; cp "$COMFUSE_CACHE_DIR"/tuning/*.json "$OUT/tuning/" 2>/dev/null;
      (cd "$OUT" && tar czf all.tgz --exclude=all.tgz . && find . -mindepth 1 ! -name all.tgz -delete)' EXIT

start=$(date +%s)
[ "${BENCH_S:-270}" = 0 ] || timeout "${BENCH_S:-270}" python3 -m comfuse.cli bench --suite "${SUITE:-all}" \
  ${SHAPES:+--shapes "$SHAPES"} $([ -z "${SHAPES:-}" ] && echo --quick) --repeat "${REPEAT:-1}" --out "$OUT/bench" \
  --candidates "${CANDIDATES:-comfuse,eager,inductor,gemm,sdpa}" ${ONLY:+--only "$ONLY"} ${BENCH_GRAPH:+--graph} \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$? in $(( $(date +%s) - start )) s"
[ "${BENCH_S:-270}" = 0 ] || python3 -m comfuse.cli bench --report-only --out "$OUT/bench" > /dev/null 2>&1
start=$(date +%s)
[ "${MAINLOOP_S:-120}" = 0 ] || GRAPH="${MAINLOOP_GRAPH:-1}" timeout "${MAINLOOP_S:-120}" python3 scripts/mainloop_bench.py --out "$OUT" > "$OUT/mainloop.log" 2>&1
echo "mainloop rc=$? in $(( $(date +%s) - start )) s"

start=$(date +%s)
if [ "${GPU_TESTS_S:-170}" != 0 ]; then  # (timeout 0 would mean no limit)
  timeout "${GPU_TESTS_S:-170}" python3 -m pytest -q -p no:cacheprovider -m gpu --timeout=150 ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
    > "$OUT/gpu-tests.txt" 2>&1
  echo "gpu tests rc=$? in $(( $(date +%s) - start )) s"; tail -n 8 "$OUT/gpu-tests.txt"
fi

if [ -n "${MATRIX:-}" ]; then  # the whole CPU test matrix (tests not marked gpu), on the GPU
  start=$(date +%s)
  # (xdist, on the GPU machine: the matrix is bound by Triton's compiles; serial it took ~600 s)
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${MATRIX_N:-6}")
  COMFUSE_TEST_DEVICE=cuda COMFUSE_PROPERTY_EXAMPLES=${COMFUSE_PROPERTY_EXAMPLES:-40} timeout "${MATRIX_S:-300}" \
    python3 -m pytest -v -p no:cacheprovider -m "not gpu" -rf $workers \
    --timeout=220 ${MATRIX_K:+-k "$MATRIX_K"} > "$OUT/matrix.txt" 2>&1
  echo "matrix rc=$? in $(( $(date +%s) - start )) s"; grep -E "FAILED|ERROR" "$OUT/matrix.txt" | sort -u | head -30
  grep -cE " PASSED" "$OUT/matrix.txt" | sed 's/^/passed: /'
fi
if [ -n "${CE_MEMORY:-}" ]; then  # linear + cross-entropy training step, vocabulary 128256
  timeout "${CE_MEMORY_S:-150}" python3 scripts/ce_memory.py > "$OUT/ce_memory.log" 2>&1
  echo "ce memory rc=$?"; grep -E "^\|" "$OUT/ce_memory.log"
fi
if [ -n "${CE_SPLIT:-}" ]; then  # linear + CE forward: split kernel variants, comfuse.compile's pick (scripts/ce_split_bench.py)
  for shape in ${CE_SPLIT_SHAPES:-8192x4096x32768}; do
    COMFUSE_LOG=info timeout "${CE_SPLIT_S:-200}" python3 scripts/ce_split_bench.py --shape "$shape" ${CE_SPLIT_QUICK:+--quick} \
      --out "$OUT/ce_split_$shape" > "$OUT/ce_split_$shape.log" 2>&1
    echo "ce split $shape rc=$?"; grep -E "^\||autotuning: chose" "$OUT/ce_split_$shape.log" | cut -c1-160
  done
fi
if [ -n "${ANATOMY:-}" ]; then  # cooperative strips taken apart as CUDA-graph replays (scripts/coop_anatomy.py)
  GRAPH=1 ONLY="${ANATOMY_ONLY:-rmsnorm,softmax,ln_postnorm}" FORMS="${ANATOMY_FORMS:-as is,overlapped,mainloop only}" \
    timeout "${ANATOMY_S:-200}" python3 scripts/coop_anatomy.py > "$OUT/anatomy.log" 2>&1
  echo "anatomy rc=$?"; grep -E "^\|" "$OUT/anatomy.log" | cut -c1-160
fi
if [ -n "${HOST:-}" ]; then  # Python time of a fused call against its GPU time (scripts/host_overhead.py)
  timeout "${HOST_S:-150}" python3 scripts/host_overhead.py > "$OUT/host.log" 2>&1
  echo "host rc=$?"; grep -E "^\||^whole" "$OUT/host.log" | cut -c1-160
fi
if [ -n "${MODELS:-}" ]; then  # Hugging Face blocks: comfuse's backend against Inductor
  timeout "${MODELS_S:-240}" python3 -m comfuse.cli bench --suite models --out "$OUT/models" \
    --candidates "${MODEL_CANDIDATES:-comfuse-backend,eager,inductor,inductor-max-autotune}" > "$OUT/models.log" 2>&1
  echo "models rc=$?"; grep -E "^\| (bert_layer|llama_mlp) " "$OUT/models/results.md" | cut -c1-220
fi
if [ -n "${CUTE:-}" ]; then  # the CuTe DSL cluster-exchange probe (cubins built on the CPU into build/cute; carry it)
  timeout "${CUTE_S:-120}" python3 scripts/cute_cluster_probe.py run --dir "${CUTE_DIR:-build/cute}" > "$OUT/cute.log" 2>&1
  echo "cute rc=$?"; grep -E "^\||cluster" "$OUT/cute.log" | head -12
fi
if [ -n "${TRAIN:-}" ]; then  # training steps of the Hugging Face blocks against Inductor (issue 6)
  timeout "${TRAIN_S:-450}" python3 scripts/model_train_bench.py --models "${TRAIN_MODELS:-llama_mlp,bert_layer}" \
    --out "$OUT/train" > "$OUT/train.log" 2>&1
  echo "train rc=$?"; grep -E "^\|" "$OUT/train.log"
fi
if [ -n "${POWER:-}" ]; then  # long GEMMs rested and under sustained load (the H200's power limit)
  timeout "${POWER_S:-200}" python3 scripts/power_check.py --out "$OUT/power" > "$OUT/power.log" 2>&1
  echo "power rc=$?"; grep -E "^\|" "$OUT/power.log"
fi
grep -sE "^\| (ln_postnorm|rmsnorm|softmax|mblr|multi_stage|linear_ce|dlrm_bottom_mlp|target_attention|transformer_mlp|self_attention) " "$OUT/bench/results.md" | cut -c1-220
grep -E "^\|" "$OUT/mainloop.log" 2>/dev/null

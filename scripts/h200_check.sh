#!/usr/bin/env bash
# Checks on one GPU machine, in one command: the environment, the whole test suite on CUDA,
# the demo with timings. Logs go to $OUT (env.txt, pytest.txt, demo.txt); a short summary is
# printed last. PYTEST_ARGS: extra pytest arguments.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/comfuse-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export COMFUSE_CACHE_DIR=$OUT/cache
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
  python3 -c 'import torch, triton, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
  date -u
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

start=$(date +%s)
timeout 450 python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/pytest.txt" 2>&1
pytest_rc=$?
echo "pytest rc=$pytest_rc in $(( $(date +%s) - start )) s"
tail -n 15 "$OUT/pytest.txt"

start=$(date +%s)
python3 -m comfuse.cli demo --device cuda > "$OUT/demo.txt" 2>&1
demo_rc=$?
echo "demo rc=$demo_rc in $(( $(date +%s) - start )) s"
tail -n 12 "$OUT/demo.txt"
exit $(( pytest_rc || demo_rc ))

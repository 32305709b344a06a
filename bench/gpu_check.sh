#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py's doc says what it measures): one run, at most 8 minutes,
# writing OUT/gpu_check.md and OUT/gpu_check.json (OUT: $OUT on the device machine, else
# bench-work/gpu_check). Run where a CUDA GPU is: `bash bench/gpu_check.sh`.
# On a CPU, `bash bench/gpu_check.sh --device cpu --smoke` runs every section at toy sizes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=${OUT:-bench-work}/gpu_check
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout ${GPU_CHECK_TIMEOUT:-470} "$PY" bench/gpu_check.py --out "$DEST" "$@"
rc=$?
[ -f "$DEST/gpu_check.md" ] && cat "$DEST/gpu_check.md"
exit $rc

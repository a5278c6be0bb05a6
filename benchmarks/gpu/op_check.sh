#!/usr/bin/env bash
# Times GEMM (bf16, fp8), grouped GEMM and decode attention at context on a lent H100/H200 and prints them
# beside aiconfigurator-core's rows for the same shapes (benchmarks/gpu/op_check.py; under 5 minutes).
# The database's rows travel with the tree (benchmarks/gpu/op_check_db_rows.json, written here by
# `op_check.py --write-db-rows`): the GPU machine has no internet. Needs a CUDA torch there: the machine's
# own python3 if it has one, else the one named by PYTHON.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -c "import torch; assert torch.cuda.is_available()" 2>/dev/null \
  || { echo "error: $PYTHON has no CUDA torch; set PYTHON to one that has" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
timeout 290 "$PYTHON" benchmarks/gpu/op_check.py "$@"

#!/usr/bin/env bash
# The serving benchmark on a GPU machine (issue 29 item 9): the same benchmarks/serving.py, with the
# ranks on the GPUs (the runtime picks nccl when it sees CUDA), figures written under $OUT.
# Never run in CI. Run from the repository root on a machine whose Python has moeplan installed with a
# CUDA torch (the device tool's machines: `pip install -e .[hf,test,bench]` in a venv over its torch):
#   OUT=/some/dir bash benchmarks/gpu/serve_check.sh [extra benchmarks/serving.py flags]
# Writes $OUT/serve_check.json (rows, ratios, targets), $OUT/serve_check.txt (the printed table),
# $OUT/environment.txt (GPUs, torch, CUDA, nccl), $OUT/rank_memory.txt (each rank's peak host memory with
# CUDA beside the Kubernetes pods' memory requests). Ranks above the GPU count are skipped.
set -euo pipefail
OUT="${OUT:?set OUT to the folder for the figures}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
gpus="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$gpus" -lt 1 ]; then
  echo "error: no CUDA device visible to $PY; this check is for a GPU machine" >&2
  exit 2
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} > "$OUT/environment.txt"
# The decode step on this GPU beside the cost model's prediction (eager and captured), CUDA graphs off and on: the
# service's own step eager and as it now serves on a GPU alone (CUDA graphs over KV pools), a StaticCache step
# captured by hand, and the service's step compiled as a CPU rank alone runs it (inductor, no CUDA graphs; its
# compile adds a minute or two) (issue 39 item 5; benchmarks/gpu/decode_step.py: Qwen3-30B-A3B's config cut to 16
# layers, batch 1/16/64 at 1024 tokens of context). benchmarks/serving.py below serves with graphs on; add
# --eager-peer to serve each bundle again with them off.
"$PY" benchmarks/gpu/decode_step.py --out "$OUT" 2>&1 | tee "$OUT/decode_step.txt" || true
ranks=()
for r in 1 2 4; do [ "$r" -le "$gpus" ] && ranks+=("$r"); done
"$PY" benchmarks/serving.py --models tiny_moe qwen3_moe --ranks "${ranks[@]}" --concurrency 1 4 16 64 \
  --peers static transformers --threads 1 --keep "$OUT/work" --json "$@" 2>&1 | tee "$OUT/serve_check.txt"
tail -n 1 "$OUT/serve_check.txt" > "$OUT/serve_check.json"
# Host memory of each rank with CUDA (its context and libraries), beside what the Kubernetes pods request
# (backends/kubernetes/pod_memory.py; measured so far on CPU only).
"$PY" benchmarks/rank_memory.py --ranks "${ranks[@]:0:2}" --concurrency 8 --requests 16 --prompt-tokens 32 \
  --new-tokens 32 --json 2>&1 | tee "$OUT/rank_memory.txt"
rm -rf "$OUT/work"
echo "figures in $OUT"

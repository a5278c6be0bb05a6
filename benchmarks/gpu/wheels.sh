#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has no internet; its image has torch, numpy, scipy, onnx, click, rich,
# jinja2, pyyaml, safetensors, tokenizers, huggingface-hub, but transformers 5.17 and no server or ILP packages),
# downloaded here into .whl/ (git-ignored) at the versions this checkout's .venv runs, for CPython 3.12 x86-64.
# benchmarks/gpu/device_checks.sh installs them there. Run from the repository root:  bash benchmarks/gpu/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
NAMES="transformers starlette uvicorn h11 highspy openai jiter pydantic pydantic_core annotated-types typing-inspection
sniffio httpx2 httpcore2 truststore anyio idna certifi typing_extensions"
pins=()
for name in $NAMES; do
  version="$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')"
  [ -n "$version" ] || { echo "error: $name is not installed in $PY's venv; run make venv first" >&2; exit 2; }
  pins+=("$name==$version")
done
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/.whl/" >> .git/info/exclude; }
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 "${platforms[@]}" -d .whl "${pins[@]}"
du -sh .whl

#!/usr/bin/env bash
# Every GPU check in one call, for a lent GPU machine with a short lease (the device tool: 15 minutes in all, no
# internet there). Never run in CI. From the repository root on that machine:
#     OUT=/some/dir bash benchmarks/gpu/device_checks.sh          (about 9 minutes on one H200)
#     OUT=/some/dir PARTS="op_check decode_step" bash benchmarks/gpu/device_checks.sh      (some parts only)
# Parts, each under its own time limit so that one stuck part leaves the others' figures:
#   1. decode_step.py: the runtime's decode step beside the cost model's prediction, CUDA graphs off and on (the
#      service's own step as a GPU rank alone serves it, captured over KV pools, first: not yet run on a GPU);
#   2. op_check.sh: GEMM / grouped GEMM / attention kernels beside aiconfigurator-core's rows;
#   3. offload_check.py: the CUDA copy path of the offloading runtime (the wide model only: its copies take real
#      PCIe time), verified, measured beside the modelled seconds;
#   4. serving.py through serve_check.sh's steps: qwen3_moe at 1 rank on the GPU, concurrency 1/16/64, beside the
#      static batch (the transformers peer needs packages the machine lacks);
#   5. fp8_experts_check.py: one Qwen3-30B-A3B MoE layer's experts held bf16 and FP8 (weight-only), timed;
#   6. decode_fused (not in the default PARTS: a second call, `PARTS=decode_fused`, as triton compiles for minutes):
#      decode_step.py's inductor parts at batch 16, the fused kernels captured as CUDA graphs (MOEPLAN_GRAPH_INDUCTOR)
#      and compiled uncaptured, with the kernels one captured step launches: whether fusion can bring the runtime's
#      step within 2x of AIConfigurator (docs/cost_model.md).
# Python packages the machine lacks travel as wheels in .whl/ (built here with `bash benchmarks/gpu/wheels.sh`)
# and install into the machine's Python; moeplan is imported from this checkout. $OUT gets one .txt per part and
# figures.tgz with every JSON (the device tool brings back at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?set OUT to the folder for the figures}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
# Into the machine's own Python, not a --target folder on PYTHONPATH: a bundle's launcher drops PYTHONPATH so that
# its ranks run the bundle's runtime/ (planner/launch/torchrun_launch.py), and the ranks need transformers 5.24
# (the bundle's requirements.txt) where the image has 5.17. The machine is lent bare and given back afterwards.
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl \
    > "$OUT/install.txt" 2>&1 || echo "wheel install failed (see install.txt)" >> "$OUT/install.txt"
fi
PKG="$(mktemp -d)"
ln -s "$PWD" "$PKG/moeplan"                       # `import moeplan` -> this checkout
export PYTHONPATH="$PKG"
WORK="$(mktemp -d)"
{
  date -u; nvidia-smi; uptime
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__)'
} >> "$OUT/install.txt" 2>&1

PARTS="${PARTS:-decode_step op_check offload_check serving fp8_experts}"
part() {  # part NAME SECONDS COMMAND...: run under a limit, output to $OUT/NAME.txt, never stop the script
  local name="$1" limit="$2"
  shift 2
  case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
  echo "== $name (limit ${limit}s, load $(cut -d' ' -f1 /proc/loadavg)) $(date -u +%T)" | tee -a "$OUT/parts.txt"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "   rc $? in $((SECONDS - start)) s" | tee -a "$OUT/parts.txt"
}

part decode_step 140 "$PY" benchmarks/gpu/decode_step.py --out "$WORK/decode_step" \
  --parts runtime "service graph" static predicted
part op_check 60 bash benchmarks/gpu/op_check.sh
part offload_check 190 "$PY" benchmarks/gpu/offload_check.py --out "$WORK/offload_check" --models wide
part serving 160 "$PY" benchmarks/serving.py --models qwen3_moe --ranks 1 --concurrency 1 16 64 --peers static \
  --threads 1 --keep "$WORK/serving" --json
part fp8_experts 60 "$PY" benchmarks/gpu/fp8_experts_check.py --out "$WORK/fp8_experts"
part decode_fused 420 "$PY" benchmarks/gpu/decode_step.py --out "$WORK/decode_fused" --batches 16 \
  --parts runtime "service graph" predicted "fused graph" compiled
[ -f "$OUT/serving.txt" ] && tail -n 1 "$OUT/serving.txt" > "$WORK/serving.json"
rm -rf "$WORK/serving"
tar czf "$OUT/figures.tgz" -C "$WORK" . 2>/dev/null
echo "figures in $OUT" | tee -a "$OUT/parts.txt"

"""Weight precision on this CPU: the runtime's real step with bfloat16 weights beside float32, in one run.

runtime/precision.py holds a checkpoint's weights at bfloat16 on a CPU only where that is as fast as
float32 (docs/models.md, "Weight precision"). This measures it: for each model (benchmarks/serving.py's
`qwen3_moe_hd32` and examples/tiny_moe), a bfloat16 copy of the checkpoint is compiled into a 1-rank
torchrun bundle, then `moeplan run` (one static batch, tokens/s measured inside the rank: no start-up)
runs it with MOEPLAN_WEIGHT_PRECISION=fp32 (held as float32) and =bf16 (held as bfloat16), interleaved,
`--repeats` times per batch size; the median tokens/s of each and the ratio bf16 / fp32 are printed
with the load average (`os.getloadavg()`) and the CPU's flags (avx512_bf16, amx_bf16) beside them.

    python benchmarks/weight_precision.py [--models qwen3_moe_hd32 tiny_moe] [--batches 1 16 64]
                                          [--new-tokens 16] [--repeats 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import CLI, CORPUS, REPO, _run, model_dir, prompts_for

PRECISIONS = ("fp32", "bf16")


def bf16_copy(source: Path, out: Path) -> Path:
    """`source` with every floating tensor stored as bfloat16 and the config saying so."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    state = load_file(str(source / "model.safetensors"))
    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def cpu_flags() -> list:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = set(next((l.split(":", 1)[1].split() for l in text.splitlines() if l.startswith("flags")), []))
    return sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})


def run_once(bundle: Path, prompts: Path, new_tokens: int, precision: str) -> tuple:
    env_before = os.environ.get("MOEPLAN_WEIGHT_PRECISION")
    os.environ["MOEPLAN_WEIGHT_PRECISION"] = precision
    try:
        report = json.loads(_run(CLI + ["run", str(bundle), "--prompts", str(prompts), "--new-tokens", str(new_tokens),
                                        "--json"]).strip().splitlines()[-1])
    finally:
        if env_before is None:
            os.environ.pop("MOEPLAN_WEIGHT_PRECISION")
        else:
            os.environ["MOEPLAN_WEIGHT_PRECISION"] = env_before
    return report["tokens_per_second"], report["weight_dtype"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen3_moe_hd32", "tiny_moe"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    print(f"cpu flags {' '.join(cpu_flags())}; torch threads {os.cpu_count()} cores", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        for name in args.models:
            model = bf16_copy(model_dir(name, scratch), scratch / f"{name}-bf16")
            trace, bundle = scratch / f"{name}.npz", scratch / f"bundle-{name}"
            _run(CLI + ["trace", str(model), "--data", str(CORPUS / "corpus_train.txt"), "--out", str(trace),
                        "--max-tokens", "2000"])
            _run(CLI + ["compile", str(model), "--trace", str(trace), "--gpus-per-node", "1", "--out", str(bundle)])
            for batch in args.batches:
                prompts = scratch / f"prompts-{name}-{batch}.txt"
                prompts.write_text("\n".join(p.replace("\n", " ") for p in prompts_for(model, batch, args.prompt_tokens)) + "\n")
                measured = {p: [] for p in PRECISIONS}
                held = {}
                for _ in range(args.repeats):
                    for p in PRECISIONS:  # interleaved: both see the same load
                        tps, held[p] = run_once(bundle, prompts, args.new_tokens, p)
                        measured[p].append(tps)
                load = os.getloadavg()[0]
                row = {"model": name, "batch": batch, "load_average": round(load, 2),
                       **{f"{p}_tokens_per_s": round(statistics.median(measured[p]), 1) for p in PRECISIONS},
                       "held": held, "runs": measured}
                row["bf16_over_fp32"] = round(row["bf16_tokens_per_s"] / row["fp32_tokens_per_s"], 3)
                rows.append(row)
                print(f"{name:16s} batch {batch:3d}: fp32 {row['fp32_tokens_per_s']:8.1f} tok/s, bf16 "
                      f"{row['bf16_tokens_per_s']:8.1f} tok/s, bf16/fp32 {row['bf16_over_fp32']:.2f}x "
                      f"(load average {load:.2f})", flush=True)
    if args.json:
        print(json.dumps({"cpu_flags": cpu_flags(), "rows": rows}, sort_keys=True))
    return 0


if __name__ == "__main__":
    assert REPO.is_dir()
    sys.exit(main())

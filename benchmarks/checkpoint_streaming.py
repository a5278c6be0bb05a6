"""Peak memory of `moeplan compile` on a multi-GB checkpoint: streamed (copy and reference) vs materialised.

Builds a random-weight Qwen3-MoE checkpoint of at least --gb GB from its transformers config
(float32, seeded, written shard by shard with an index json, in the per-expert layout
transformers saves: `mlp.experts.N.{gate,up,down}_proj.weight`), so building it never holds more
than one shard. Then, each as a real CLI subprocess whose peak RSS is
`resource.getrusage(RUSAGE_CHILDREN).ru_maxrss` of a wrapper process that runs only it:

* `compile --weights copy` and `compile --weights reference` (this branch: streamed);
* the baseline measured in the same run: the import compile used before streaming
  (`moeplan.passes.importers.load_model` on the directory: transformers' `from_pretrained`,
  which is what the previous compile held in memory while writing shards);
* the floor: a process that only imports moeplan's CLI, torch and transformers;
* `moeplan run` of each bundle at 2 ranks (no --verify, whose single-process reference holds the
  whole model by design): the peak of the largest process (a rank: dense weights + its experts;
  for the reference bundle, also `run`'s own sha256 check of the checkpoint), vs the full model's bytes.

    .venv/bin/python benchmarks/checkpoint_streaming.py [--gb 2.2] [--work build/checkpoint_streaming] [--keep] [--json]

The checkpoint lives under build/ (ignored by git) and is deleted at the end unless --keep.
Ratios are to the checkpoint's bytes on disk; the machine may be loaded (timings are not the point).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARD_BYTES = 256 << 20
WRAPPER = ("import json, resource, subprocess, sys\n"
           "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
           "print(json.dumps([p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,"
           " (p.stdout + p.stderr)[-1500:]]))\n")


def config_for(gb: float):
    """A Qwen3-MoE config whose float32 checkpoint is at least `gb` GB (64 experts, hidden 1024)."""
    import transformers

    hidden, inter, experts, vocab = 1024, 512, 64, 32000
    per_layer = experts * 3 * hidden * inter * 4 + 4 * hidden * hidden * 4
    layers = max(1, math.ceil((gb * 1e9 - 2 * vocab * hidden * 4) / per_layer))
    return transformers.Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2048,
                                       moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=4,
                                       num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                       head_dim=128, max_position_embeddings=256, tie_word_embeddings=False,
                                       norm_topk_prob=True, dtype="float32")


def checkpoint_tensors(config):
    """(checkpoint name, shape) in the layout transformers saves, from the library model's shapes on meta."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, D] -> per expert gate [I, D], up [I, D]
            base, (e_count, two_i, d) = name[: -len("gate_up_proj")], t.shape
            for e in range(e_count):
                yield f"{base}{e}.gate_proj.weight", (two_i // 2, d)
                yield f"{base}{e}.up_proj.weight", (two_i // 2, d)
        elif name.endswith("mlp.experts.down_proj"):  # [E, D, I] -> per expert [D, I]
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                yield f"{base}{e}.down_proj.weight", tuple(t.shape[1:])
        else:
            yield name, tuple(t.shape)


def write_checkpoint(directory: Path, config, seed: int = 0) -> int:
    """Seeded random weights, <= 256 MB per shard, with model.safetensors.index.json; returns bytes written."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    gen = torch.Generator().manual_seed(seed)
    names = list(checkpoint_tensors(config))
    shards, current, size = [], {}, 0
    weight_map = {}

    def flush():
        nonlocal current, size
        if current:
            file = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(current, file))
            shards.append(file)
            current, size = {}, 0

    for name, shape in names:
        t = torch.randn(shape, generator=gen) * 0.02 if not name.endswith("norm.weight") else torch.ones(shape)
        if size + t.numel() * 4 > SHARD_BYTES:
            flush()
        current[name] = t
        size += t.numel() * 4
    flush()
    total = sum((directory / f).stat().st_size for f in shards)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    return total


def write_trace(path: Path, layers: int, experts: int, top_k: int) -> None:
    import numpy as np

    from moeplan.passes.analysis.trace.format import make_trace, save_trace

    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)]) for _ in range(256)])
    weights = np.sort(rng.random(ids.shape).astype(np.float32), axis=2)[:, :, ::-1]
    save_trace(make_trace(ids, np.ascontiguousarray(weights), num_experts=experts), path)


def peak(cmd: list) -> dict:
    """Peak RSS (bytes) of one command, run alone under a wrapper process."""
    proc = subprocess.run([sys.executable, "-c", WRAPPER, *map(str, cmd)], capture_output=True, text=True)
    code, rss, tail = json.loads(proc.stdout.strip().splitlines()[-1])
    if code != 0:
        raise SystemExit(f"command failed ({code}): {' '.join(map(str, cmd))}\n{tail}")
    return {"peak_rss_bytes": rss}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.2, help="checkpoint size to build, GB (at least 2 for the issue's figure)")
    ap.add_argument("--work", default=str(REPO / "build" / "checkpoint_streaming"))
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and bundles")
    ap.add_argument("--no-ranks", action="store_true", help="skip the 2-rank run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    exe = Path(sys.executable).parent / "moeplan"
    try:
        config = config_for(args.gb)
        model_dir = work / "qwen3_moe"
        ckpt_bytes = write_checkpoint(model_dir, config)
        trace = work / "trace.npz"
        write_trace(trace, config.num_hidden_layers, config.num_experts, config.num_experts_per_tok)
        compile_args = ["compile", model_dir, "--trace", trace, "--nodes", "1", "--gpus-per-node", "2", "--policy",
                        "contiguous", "--mode", "coherent", "--quiet"]
        results = {"checkpoint_bytes": ckpt_bytes, "checkpoint_files": len(list(model_dir.glob("*.safetensors"))),
                   "config": {"layers": config.num_hidden_layers, "experts": config.num_experts, "hidden": config.hidden_size}}
        results["import_floor"] = peak([sys.executable, "-c", "import moeplan.planner.cli, torch, transformers"])
        results["materialised_import_baseline"] = peak(
            [sys.executable, "-c", f"from moeplan.passes.importers import load_model; load_model({str(model_dir)!r})"])
        results["compile_copy"] = peak([exe, *compile_args, "--out", work / "copy"])
        results["compile_reference"] = peak([exe, *compile_args, "--out", work / "reference", "--weights", "reference"])
        results["bundle_bytes"] = {form: sum(p.stat().st_size for p in (work / form).rglob("*") if p.is_file())
                                   for form in ("copy", "reference")}
        for key in ("import_floor", "materialised_import_baseline", "compile_copy", "compile_reference"):
            results[key]["ratio_to_checkpoint"] = round(results[key]["peak_rss_bytes"] / ckpt_bytes, 4)
        if not args.no_ranks:
            prompts = work / "prompts.txt"
            prompts.write_text("ids: 5 9 11 3 40 2\n")
            shard = max((work / "copy" / "shards").glob("*.safetensors"), key=lambda p: p.stat().st_size).stat().st_size
            for form in ("copy", "reference"):
                ranks = peak([exe, "run", work / form, "--nproc", "2", "--new-tokens", "2", "--mode", "coherent",
                              "--prompts", prompts, "--json"])
                ranks.update(largest_rank_shard_bytes=shard,
                             ratio_to_checkpoint=round(ranks["peak_rss_bytes"] / ckpt_bytes, 4))
                results[f"run_2_ranks_{form}_largest_process"] = ranks
        copy, base = results["compile_copy"]["peak_rss_bytes"], results["materialised_import_baseline"]["peak_rss_bytes"]
        results["copy_vs_materialised"] = round(copy / base, 4)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    if not args.json:
        gb = lambda b: f"{b / 1e9:.2f} GB"
        print(f"checkpoint: {gb(ckpt_bytes)} in {results['checkpoint_files']} files ({results['config']})")
        for key in ("import_floor", "materialised_import_baseline", "compile_copy", "compile_reference",
                    "run_2_ranks_copy_largest_process", "run_2_ranks_reference_largest_process"):
            if key in results:
                r = results[key]
                print(f"{key:32s} peak RSS {gb(r['peak_rss_bytes']):>9s}  = {r['ratio_to_checkpoint']:.3f} x checkpoint")
    print(json.dumps(results, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

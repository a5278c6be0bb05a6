"""Every tiny transformers architecture (examples/hf_tiny/architectures.py) through the serving
engine: continuous batching of concurrent greedy requests, token for token against the model's own
forward over the whole sequence (what `moeplan run --verify` checks), in both modes, at 1 rank.

Per architecture: build the seeded tiny model, write a 1-rank bundle, serve it in this process
(`serving.ranks.serve_bundle`, world of one) and submit `--requests` requests of 2..31 prompt
tokens and 6..18 new tokens, arriving while others run; then recompute each response with the
model alone. A row is `exact` (all responses equal), `N mismatches`, or the one-line reason the
engine refused the model (linear attention: Qwen3-Next; chunked attention: Llama-4). The 2-rank
exchange paths are tests/test_serving_engine.py's (TinyMoE, Qwen2-MoE, gpt-oss).

    python benchmarks/serving_architectures.py [--arch mixtral gpt_oss ...] [--modes standard coherent]
        [--requests 8] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # runtime_fixtures: bundles written by the codegen alone


def serve_and_check(arch: str, mode: str, requests: int, scratch: Path) -> str:
    import transformers

    from moeplan.runtime.model.library_model import decoder_layers
    from moeplan.runtime.model.moe_adapter import find_containers
    from moeplan.runtime.serving.contract import GenerationRequest, SamplingParams
    from moeplan.runtime.serving.ranks import serve_bundle
    from moeplan.passes.importers.resolve import import_file
    from runtime_fixtures import contiguous_placement, write_hf_bundle

    model_dir = import_file(REPO / "examples" / "hf_tiny" / "architectures.py").build(arch, scratch / mode)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = len(find_containers(*reversed(decoder_layers(model))))
    experts = find_containers(*reversed(decoder_layers(model)))[0].num_experts
    bundle = write_hf_bundle(scratch / mode / "bundle", model_dir, model, contiguous_placement(layers, experts, 1, 1))
    vocab = model.config.get_text_config().vocab_size
    prompts = [[(7 * i + 3 * j + 1) % (vocab - 3) + 3 for j in range(2 + (i * 11) % 30)] for i in range(requests)]
    lengths = [6 + (i * 5) % 13 for i in range(requests)]
    events = {i: [] for i in range(requests)}

    def front(client, plan, codec):
        done = threading.Semaphore(0)
        for i, p in enumerate(prompts):
            def sink(event, i=i):
                events[i].append(event)
                if event.finish_reason:
                    done.release()
            client.submit(GenerationRequest(f"r{i}", tuple(p), lengths[i], SamplingParams(temperature=0.0), (), True), sink)
            if i >= requests // 2:
                time.sleep(0.01)
        for _ in prompts:
            done.acquire()
        return 0

    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        code = serve_bundle(bundle, front, mode=mode)
    if code != 0:
        return errors.getvalue().strip().splitlines()[-1]
    mismatches = 0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = list(p)
            for _ in range(lengths[i]):
                ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
            mismatches += [e.token_id for e in events[i] if e.token_id >= 0] != ids[len(p):]
    return "exact" if not mismatches else f"{mismatches} mismatches"


def main(argv=None) -> int:
    from moeplan.passes.importers.resolve import import_file

    names = import_file(REPO / "examples" / "hf_tiny" / "architectures.py").ARCHITECTURES
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=list(names), choices=names)
    ap.add_argument("--modes", nargs="+", default=["standard", "coherent"], choices=("standard", "coherent"))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    rows = []
    with tempfile.TemporaryDirectory(prefix="moeplan-serving-archs-") as scratch:
        for arch in args.arch:
            row = {"arch": arch}
            for mode in args.modes:
                row[mode] = serve_and_check(arch, mode, args.requests, Path(scratch) / arch)
            rows.append(row)
            print(f"{arch:16s} " + "  ".join(f"{m}: {row[m]}" for m in args.modes), flush=True)
    exact = sum(all(r[m] == "exact" for m in args.modes) for r in rows)
    print(f"{exact} of {len(rows)} architectures serve exactly in {', '.join(args.modes)} mode")
    if args.json:
        print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speculative routing recall: how well the routers of MoE layers l+1 .. l+D, run on a hidden state
of layer l, name the experts those layers really use (issue 33, item 1).

Models (trained, none tuned on here):
* `tiny`: examples/tiny_moe (the committed checkpoint; 6 MoE layers x 16 experts, top-2);
* `qwen3`: examples/qwen3_moe (transformers' Qwen3-MoE, 4 x 8, top-2, its own BPE tokenizer);
* `olmoe64`: transformers' OLMoE, 8 MoE layers x 64 experts, top-8, hidden 96, trained here by
  benchmarks/placement_corpus.py's recipe with its own seed (150 steps, LM + router balance loss)
  into build/speculation/olmoe64/model if missing (~3-6 CPU min);
* `olmoe_like`: benchmarks/offload.py's TinyMoE-code 4 x 64, top-8 model (trained there if missing).

Every model is traced by `moeplan trace --speculate D --speculate-from SRC` (the library's router
modules, `passes/analysis/trace/speculate.py`) on the held-out corpus
(examples/tiny_moe/corpus_heldout.txt), once per stand-in hidden state. The stand-in was chosen on
TinyMoE's *training* corpus only (`--choose-on`, printed first); the held-out figures of the other
models were not looked at to choose it.

Baselines in the same run, from the planning trace (the training corpus) for the same models:
* `previous token`: the experts the previous token of the sequence used at layer l+d (temporal locality);
* `affinity`: the k most frequent layer-(l+d) experts of tokens that used the same top-1 expert at
  layer l (transition counts fitted on the planning trace);
* `popular`: layer l+d's k most loaded experts on the planning trace.

    .venv/bin/python benchmarks/speculation.py [--models tiny qwen3 olmoe64 olmoe_like] [--depth 3]
        [--tokens 8192] [--json]

`--json`: the last line is {"choice": {...}, "cases": [{"model", "source", "recall": {"1": .., ...},
"baselines": {name: {"1": ..}}}], "published": {...}}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "build" / "speculation"
sys.path.insert(0, str(Path(__file__).resolve().parent))

SOURCES = ("block-output", "residual", "router-input")
OLMOE64 = dict(arch="olmoe", layers=8, experts=64, top_k=8, hidden=96, expert_hidden=32, seed=7, steps=150)
PUBLISHED = {
    "mixtral-offloading": "Eliseev & Mazur 2023 (Mixtral-8x7B, top-2 of 8): next layer's gate on the current hidden "
                          "state; speculative loads correct in more than 80% of cases",
    "fate": "Fate, arXiv 2502.12224 (Qwen1.5-MoE, DeepSeek-MoE): previous layer's gate input; ~97% prefetch accuracy",
}
SETTING = ("published: production models (32-60 expert layers, hidden 2048-4096, trained on trillions of tokens); here: "
           "small models trained briefly on pydoc text (hidden 64-128, 4-8 MoE layers), so each layer moves the "
           "residual stream relatively more and speculation is harder")


def olmoe64_model() -> Path:
    """transformers' OLMoE 64 x top-8 trained by placement_corpus's recipe (cached)."""
    from placement_corpus import TrainedModel, train_hf_model

    out = BUILD / "olmoe64" / "model"
    if not (out / "model.safetensors").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        model = train_hf_model(TrainedModel(**OLMOE64), log=lambda m: print(m, file=sys.stderr, flush=True))
        model.config.output_router_logits = False
        model.save_pretrained(out)
    return out


def model_dir(name: str) -> Path:
    if name == "tiny":
        return REPO / "examples" / "tiny_moe"
    if name == "qwen3":
        return REPO / "examples" / "qwen3_moe"
    if name == "olmoe64":
        return olmoe64_model()
    from offload import olmoe_model

    return olmoe_model()


def traced(name: str, corpus: str, source: str, depth: int, tokens: int) -> Path:
    """`moeplan trace MODEL --data corpus --speculate depth --speculate-from source` (cached)."""
    out = BUILD / f"{name}_{corpus}_{source}_d{depth}_{tokens}.npz"
    if not out.is_file():
        BUILD.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "moeplan.planner.cli", "trace", str(model_dir(name)), "--data",
                        str(REPO / "examples" / "tiny_moe" / f"corpus_{corpus}.txt"), "--max-tokens", str(tokens),
                        "--speculate", str(depth), "--speculate-from", source, "--out", str(out), "--quiet"], check=True)
    return out


def baselines(plan, held, depth: int) -> dict:
    """Recall of the non-speculative guesses (module doc) at distances 1..depth."""
    from moeplan.passes.analysis.trace.speculate import named_share

    E, K = held.num_experts, held.top_k
    ex = held.experts.astype(np.int64)
    T, L, _ = ex.shape
    depth = min(depth, L - 1)
    seq = held.sequence if held.sequence is not None else np.arange(T) // 128
    prev = np.r_[False, seq[1:] == seq[:-1]]
    loads = plan.expert_loads()  # [L, E]
    popular = np.argsort(-loads, axis=1, kind="stable")[:, :K]  # [L, K]
    pe = plan.experts.astype(np.int64)

    def previous(d):
        g = np.full((T, L - d, K), -1, dtype=np.int64)
        g[1:][prev[1:]] = ex[:-1][prev[1:], d:, :]
        return g

    def affinity(d):
        g = np.empty((T, L - d, K), dtype=np.int64)
        for l in range(L - d):
            counts = np.zeros((E, E))
            ok = pe[:, l, 0] >= 0
            for k in range(pe.shape[2]):
                nxt = pe[ok, l + d, k]
                np.add.at(counts, (pe[ok, l, 0][nxt >= 0], nxt[nxt >= 0]), 1)
            counts += loads[l + d][None, :] * 1e-9  # rows never seen: popularity
            best = np.argsort(-counts, axis=1, kind="stable")[:, :K]  # [E, K]
            g[:, l] = best[np.maximum(ex[:, l, 0], 0)]
        return g

    guesses = {"previous token": previous, "affinity": affinity,
               "popular": lambda d: np.broadcast_to(popular[None, d:], (T, L - d, K)).copy()}
    return {name: {str(d): named_share(ex[:, d:], fn(d)) for d in range(1, depth + 1)} for name, fn in guesses.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "qwen3", "olmoe64", "olmoe_like"],
                    choices=["tiny", "qwen3", "olmoe64", "olmoe_like"])
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per trace (held-out corpus: ~48k bytes)")
    ap.add_argument("--choose-on", default="tiny", help="the model whose training-corpus trace chooses the stand-in")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.analysis.trace.speculate import speculation_recall

    log = sys.stderr if args.json else sys.stdout
    choice = {}
    for source in SOURCES:
        t = load_trace(traced(args.choose_on, "train", source, args.depth, args.tokens))
        choice[source] = speculation_recall(t.experts, t.speculation)
    chosen = max(SOURCES, key=lambda s: (choice[s]["1"], -SOURCES.index(s)))
    print(f"stand-in chosen on {args.choose_on}'s training corpus: {chosen} "
          + "  ".join(f"{s}: d1 {choice[s]['1']:.3f}" for s in SOURCES), file=log, flush=True)
    cases = []
    for name in args.models:
        plan = load_trace(traced(name, "train", chosen, args.depth, args.tokens))
        base = None
        for source in SOURCES:
            held = load_trace(traced(name, "heldout", source, args.depth, args.tokens))
            recall = speculation_recall(held.experts, held.speculation)
            if base is None:
                base = baselines(plan, held, args.depth)
            best = {d: max(b[d] for b in base.values()) for d in recall if d in base["popular"]}
            case = {"model": name, "source": source, "chosen": source == chosen, "tokens": held.num_tokens,
                    "layers": held.num_layers, "experts": held.num_experts, "top_k": held.top_k,
                    "recall": {d: round(v, 4) for d, v in recall.items()},
                    "over_best_baseline": {d: round(recall[d] / best[d], 3) for d in best if best[d] > 0},
                    "baselines": {n: {d: round(v, 4) for d, v in b.items()} for n, b in base.items()}}
            cases.append(case)
            print(f"{name:<10} {held.num_layers}x{held.num_experts} top-{held.top_k} {source:<12}"
                  + "".join(f"  d{d} {v:.3f}" for d, v in case["recall"].items())
                  + "  | best baseline " + " ".join(f"d{d} {best[d]:.3f}" for d in best)
                  + ("  (chosen)" if source == chosen else ""), file=log, flush=True)
        print("           baselines: " + "; ".join(f"{n} " + " ".join(f"d{d} {v:.3f}" for d, v in b.items())
                                                  for n, b in base.items()), file=log, flush=True)
    chosen_cases = [c for c in cases if c["chosen"]]
    summary = {"chosen_source": chosen, "min_recall_d1": min(c["recall"]["1"] for c in chosen_cases),
               "target_d1": 0.80, "models_at_target": sum(c["recall"]["1"] >= 0.80 for c in chosen_cases),
               "models": len(chosen_cases)}
    out = {"choice": {"model": args.choose_on, "corpus": "train", "recall": choice, "chosen": chosen},
           "cases": cases, "summary": summary, "published": dict(PUBLISHED, setting_difference=SETTING),
           "olmoe64": OLMOE64}
    emit(out, args.json, PUBLISHED, SETTING)
    return 0


def emit(out: dict, as_json: bool, published: dict, setting: str) -> None:
    """The report's last lines: one JSON object, or the summary, the published figures and how the settings differ."""
    if as_json:
        print(json.dumps(out, sort_keys=True))
        return
    print("summary: " + json.dumps(out["summary"], sort_keys=True))
    for v in published.values():
        print("published: " + v)
    print("setting difference: " + setting)


if __name__ == "__main__":
    sys.exit(main())

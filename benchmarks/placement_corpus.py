"""A placement benchmark corpus that is not the project's own planted generator.

Why: the placement ILP was tuned on `synth_planted` traces; a method that only wins there has
learned the generator, not the problem. The corpus has three kinds of traces:

* trained: small Hugging Face MoE models built from transformers' own model classes (Mixtral,
  Qwen3-MoE, OLMoE) at different sizes, top-1, top-2 and top-8, each trained briefly with its own
  seed on examples/tiny_moe/corpus_train.txt (bytes as tokens, LM loss + the model's own router
  balance loss) and traced on examples/tiny_moe/corpus_heldout.txt by moeplan's recorder (the
  real HF router hooks, not a re-implementation);
* drift: a second synthetic generator with another affinity model (`latent_drift_trace`): no
  planted clusters; a token's latent vector drifts from layer to layer and each layer routes it
  by a dot product with its own random expert embeddings, so affinity is graded and overlapping;
* the DeepSeek-V3 shape (58 layers x 256 experts, top-8) from both generators.

Traces are cached under build/placement_corpus/ (keyed by the generator's parameters), so the
training runs once. Plan on one half of a trace (first half of its sequences) and score on the
other (`benchmarks/placement.py`).

    python benchmarks/placement_corpus.py            # build (or reuse) every trace, print a summary
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # shared 2-core machine: idle threads must sleep

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / "build" / "placement_corpus"
TRAIN_TEXT = REPO / "examples" / "tiny_moe" / "corpus_train.txt"
TRACE_TEXT = REPO / "examples" / "tiny_moe" / "corpus_heldout.txt"


@dataclass(frozen=True)
class TrainedModel:
    """A small HF MoE model: architecture, size, routing, seed and training length."""

    arch: str  # "mixtral", "qwen3_moe", "olmoe"
    layers: int
    experts: int
    top_k: int
    hidden: int = 64
    expert_hidden: int = 32
    seed: int = 0
    steps: int = 150
    batch: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    trace_tokens: int = 32_768


@dataclass(frozen=True)
class CorpusCase:
    """One trace and the topology it is planned for."""

    name: str
    nodes: int
    gpus_per_node: int
    redundant: int
    source: dict = field(default_factory=dict)  # {"trained": TrainedModel fields} | {"drift": ...} | {"planted": ...}
    expert_groups: int = 0  # eplb's hierarchical policy (DeepSeek-V3: 8 groups)

    @property
    def deepseek_shaped(self) -> bool:
        return self.expert_groups > 0


DEEPSEEK_DRIFT = dict(layers=58, experts=256, top_k=8, tokens=20_000, dim=24, drift=0.85, temperature=2.5, zipf=0.8,
                      seed=3)
DEEPSEEK_PLANTED = dict(layers=58, experts=256, top_k=8, tokens=20_000, affinity=0.6, zipf=0.8, seed=1)

CORPUS = [
    CorpusCase("mixtral-16x2-s0 4gpu", 1, 4, 4, {"trained": asdict(TrainedModel("mixtral", 6, 16, 2, seed=0))}),
    CorpusCase("mixtral-16x2-s1 8gpu", 2, 4, 8, {"trained": asdict(TrainedModel("mixtral", 6, 16, 2, seed=1))}),
    CorpusCase("mixtral-64x1 8gpu", 2, 4, 8, {"trained": asdict(TrainedModel("mixtral", 8, 64, 1, seed=2))}),
    CorpusCase("qwen3moe-64x8 8gpu", 2, 4, 8, {"trained": asdict(TrainedModel("qwen3_moe", 6, 64, 8, seed=3))}),
    CorpusCase("olmoe-32x8 8gpu", 2, 4, 8, {"trained": asdict(TrainedModel("olmoe", 8, 32, 8, hidden=96, seed=4))}),
    CorpusCase("drift-64x1 8gpu", 2, 4, 8, {"drift": dict(layers=12, experts=64, top_k=1, tokens=20_000, dim=16,
                                                          drift=0.8, temperature=3.0, zipf=0.8, seed=0)}),
    CorpusCase("drift-64x2 8gpu", 2, 4, 8, {"drift": dict(layers=12, experts=64, top_k=2, tokens=20_000, dim=16,
                                                          drift=0.7, temperature=2.0, zipf=1.0, seed=1)}),
    CorpusCase("deepseek-v3 drift", 8, 8, 64, {"drift": DEEPSEEK_DRIFT}, expert_groups=8),
    CorpusCase("deepseek-v3 planted", 8, 8, 64, {"planted": DEEPSEEK_PLANTED}, expert_groups=8),
]


# --------------------------------------------------------------------------------------------
# Generator 2: latent drift


def latent_drift_trace(*, layers: int, experts: int, top_k: int, tokens: int, dim: int, drift: float,
                       temperature: float, zipf: float, seed: int, sequence_length: int = 128):
    """A `Trace` whose inter-layer affinity comes from a drifting latent state, not planted clusters.

    Per token a latent z_0 ~ N(0, I_dim); z_{l+1} = drift * z_l + sqrt(1 - drift^2) * noise. Layer
    l has expert embeddings W_l [E, dim] (unit rows, random) and a popularity bias
    b_l[e] = zipf * log(rank^-1) over a random ranking; a token's logits are
    temperature * W_l z_l + b_l + Gumbel noise, its experts the top-k (heaviest first, softmax
    weights over the chosen logits). Experts of consecutive layers are affine to the degree that
    their embeddings point the same way, so every expert has many partly-affine successors of
    graded strength (the planted generator's are all-or-nothing clusters). Deterministic for a seed.
    """
    from moeplan.passes.analysis.trace.format import make_trace

    rng = np.random.default_rng(seed)
    z = rng.standard_normal((tokens, dim))
    chosen = np.empty((tokens, layers, top_k), dtype=np.int32)
    weights = np.empty((tokens, layers, top_k), dtype=np.float32)
    for layer in range(layers):
        if layer:
            z = drift * z + np.sqrt(1.0 - drift ** 2) * rng.standard_normal((tokens, dim))
        embed = rng.standard_normal((experts, dim))
        embed /= np.linalg.norm(embed, axis=1, keepdims=True)
        ranks = np.empty(experts)
        ranks[rng.permutation(experts)] = np.arange(1, experts + 1)
        logits = temperature * (z @ embed.T) - zipf * np.log(ranks)[None, :]  # z @ embed.T ~ N(0, 1) per entry
        logits = logits + rng.gumbel(size=logits.shape)
        top = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
        chosen[:, layer] = top
        picked = np.take_along_axis(logits, top, axis=1)
        w = np.exp(picked - picked[:, :1])
        weights[:, layer] = w / w.sum(axis=1, keepdims=True)
    index = np.arange(tokens)
    return make_trace(chosen, weights, num_experts=experts, sequence=index // sequence_length,
                      positions=index % sequence_length)


# --------------------------------------------------------------------------------------------
# Generator 1: briefly trained Hugging Face MoE models


def build_hf_model(spec: TrainedModel):
    """An untrained transformers model of the spec's architecture (its own classes, small config)."""
    import torch
    import transformers

    torch.manual_seed(spec.seed)
    common = dict(vocab_size=256, hidden_size=spec.hidden, num_hidden_layers=spec.layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=spec.top_k, max_position_embeddings=spec.seq_len,
                  tie_word_embeddings=False, output_router_logits=True, router_aux_loss_coef=0.01)
    if spec.arch == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=spec.expert_hidden, num_local_experts=spec.experts, **common)
        return transformers.MixtralForCausalLM(config)
    if spec.arch == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=2 * spec.expert_hidden, moe_intermediate_size=spec.expert_hidden,
                                             num_experts=spec.experts, norm_topk_prob=True, decoder_sparse_step=1,
                                             head_dim=spec.hidden // 4, **common)
        return transformers.Qwen3MoeForCausalLM(config)
    if spec.arch == "olmoe":
        config = transformers.OlmoeConfig(intermediate_size=spec.expert_hidden, num_experts=spec.experts,
                                          norm_topk_prob=False, **common)
        return transformers.OlmoeForCausalLM(config)
    raise ValueError(f"unknown architecture {spec.arch!r}")


def train_hf_model(spec: TrainedModel, log=print):
    """Train briefly (LM loss + the model's router balance loss), deterministic for the spec."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)
    model = build_hf_model(spec)
    data = torch.frombuffer(bytearray(TRAIN_TEXT.read_bytes()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    model.train()
    for step in range(spec.steps):
        lr = spec.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + np.cos(np.pi * step / spec.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch,), generator=gen)
        window = torch.stack([data[s: s + spec.seq_len] for s in starts.tolist()])
        out = model(input_ids=window, labels=window)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == spec.steps - 1:
            log(f"    {spec.arch} {spec.experts}x{spec.top_k} seed {spec.seed} step {step}: loss {float(out.loss):.3f}")
    return model.eval()


def trained_trace(spec: TrainedModel, directory: Path, log=print):
    """Train, save_pretrained into `directory`, and record the held-out text's routing with moeplan."""
    from moeplan.passes.analysis.trace.record import record_trace
    from moeplan.passes.importers import load_model

    model = train_hf_model(spec, log)
    model.config.output_router_logits = False
    model.save_pretrained(directory / "model")
    loaded = load_model(str(directory / "model"))
    return record_trace(loaded, TRACE_TEXT.read_text(encoding="utf-8"), max_tokens=spec.trace_tokens,
                        seq_len=spec.seq_len)


# --------------------------------------------------------------------------------------------


def case_key(case: CorpusCase) -> str:
    return hashlib.sha256(json.dumps(case.source, sort_keys=True).encode()).hexdigest()[:12]


def load_case_trace(case: CorpusCase, log=print):
    """The case's trace, from the cache under build/placement_corpus/ or generated (and cached)."""
    from moeplan.passes.analysis.trace.format import load_trace, save_trace
    from moeplan.passes.analysis.trace.synth_planted import synthesize_trace

    kind, params = next(iter(case.source.items()))
    directory = CACHE / f"{kind}-{case_key(case)}"
    path = directory / "trace.npz"
    if path.is_file():
        return load_trace(path)
    directory.mkdir(parents=True, exist_ok=True)
    log(f"  generating {case.name} ({kind}) into {directory}")
    if kind == "trained":
        trace = trained_trace(TrainedModel(**params), directory, log)
    elif kind == "drift":
        trace = latent_drift_trace(**params)
    elif kind == "planted":
        trace = synthesize_trace(**params)
    else:
        raise ValueError(kind)
    save_trace(trace, path)
    (directory / "source.json").write_text(json.dumps(case.source, sort_keys=True, indent=1) + "\n")
    return trace


def main() -> int:
    from moeplan.passes.analysis.affinity import transition_counts

    for case in CORPUS:
        trace = load_case_trace(case)
        counts = transition_counts(trace, "current")
        rows = counts.sum(axis=2, keepdims=True)
        top1 = float(counts.max(axis=2).sum() / counts.sum()) if counts.size else 0.0
        load = np.stack([np.bincount(trace.experts[:, l][trace.experts[:, l] >= 0], minlength=trace.num_experts)
                         for l in range(trace.num_layers)])
        print(f"{case.name:24s} {trace.num_tokens:6d} tokens x {trace.num_layers:2d} layers, top-{trace.top_k} of "
              f"{trace.num_experts:3d}; P(argmax successor) {top1:.3f}; hottest/mean load {float((load.max(1) / load.mean(1)).mean()):.2f}")
        del rows
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Shared builders for the runtime, bundle and compile tests: a small TinyMoE and its bundle.

The model is examples/tiny_moe/model.py at a reduced size (fast to shard, run and verify) with
seeded weights saved beside it, so every build of it is byte-identical.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_moe"
SMALL = {"moeplan_loader": "model.py:load", "model_type": "tiny_moe", "vocab_size": 256, "hidden_size": 32,
         "num_layers": 3, "num_heads": 2, "num_experts": 8, "top_k": 2, "expert_hidden": 32, "shared_experts": 0,
         "max_positions": 64, "norm_eps": 1e-5}
PROMPTS = ["hello world", "abc", "moe!"]


def example_module():
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    import model  # examples/tiny_moe/model.py

    return model


def small_model_dir(root: Path, seed: int = 0, **overrides) -> Path:
    """A model directory (config.json, model.py, model.safetensors) for a small seeded TinyMoE."""
    from safetensors.torch import save_file

    directory = root / "small_moe"
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(SMALL, **overrides)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(EXAMPLE / "model.py", directory / "model.py")
    m = example_module()
    torch.manual_seed(seed)
    net = m.TinyMoE(m.TinyMoEConfig.from_dict(config))
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


def load_small(directory: Path):
    m = example_module()
    return m.load(directory)


def contiguous_placement(num_layers: int, num_experts: int, nodes: int, gpus_per_node: int, replicate=()) -> dict:
    """placement.json dict: expert e on device e * devices // E; `replicate` experts on every device too."""
    devices = nodes * gpus_per_node
    layers = []
    for layer in range(num_layers):
        per = [[e for e in range(num_experts) if e * devices // num_experts == d] for d in range(devices)]
        for d in range(devices):
            per[d] = sorted(set(per[d]) | set(replicate))
        layers.append({"layer": layer, "devices": per})
    return {"version": 1, "policy": "contiguous", "topology": {"nodes": nodes, "gpus_per_node": gpus_per_node},
            "num_experts": num_experts, "layers": layers, "metrics": {}}


def write_small_bundle(out: Path, model_dir: Path, placement: dict, mode: str = "coherent") -> Path:
    """A bundle via the codegen directly (no planner passes): the backend's contract alone."""
    from moeplan.backends.common.shards import shard_name
    from moeplan.backends.torchrun.codegen import write_bundle
    from moeplan.backends.common.model_source import model_files
    from moeplan.backends.common.shards import state_dict_sha256
    from moeplan.core.plan import Plan

    state = load_small(model_dir).state_dict()
    arch, files = model_files(str(model_dir))
    topo = placement["topology"]
    plan = Plan(target="torchrun",
                model={"name": "small_moe", "architecture": arch, "config": "model/config.json",
                       "source": "model/model.py", "weights_sha256": state_dict_sha256(state)},
                topology=dict(topo), placement=placement,
                communication={"mode": mode, "gating": "dynamic"}, predicted={},
                shards=[shard_name(r) for r in range(topo["nodes"] * topo["gpus_per_node"])])
    write_bundle(out, plan, state, {"architecture": arch, "files": files})
    return out


def random_trace(num_tokens: int, num_layers: int, num_experts: int, top_k: int = 2, seed: int = 0):
    from moeplan.passes.analysis.trace.format import make_trace

    rng = np.random.default_rng(seed)
    experts = np.stack([[rng.permutation(num_experts)[:top_k] for _ in range(num_layers)] for _ in range(num_tokens)])
    weights = np.sort(rng.random((num_tokens, num_layers, top_k)).astype(np.float32), axis=2)[:, :, ::-1]
    return make_trace(experts, np.ascontiguousarray(weights), num_experts=num_experts)


def hf_model_dir(root: Path, kind: str, seed: int = 0) -> tuple:
    """A tiny random-weight Hugging Face Mixtral or Qwen2-MoE saved with save_pretrained: (dir, model)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=8, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=16, num_experts=8,
                                             shared_expert_intermediate_size=16, norm_topk_prob=False,
                                             mlp_only_layers=[1], **common)
        model = transformers.Qwen2MoeForCausalLM(config)
    directory = root / kind
    model.save_pretrained(directory)
    return directory, model.eval()


def write_hf_bundle(out: Path, model_dir: Path, model, placement: dict) -> Path:
    from moeplan.backends.common.shards import shard_name
    from moeplan.backends.torchrun.codegen import write_bundle
    from moeplan.backends.common.model_source import model_files
    from moeplan.backends.common.shards import state_dict_sha256
    from moeplan.core.plan import Plan

    state = model.state_dict()
    arch, files = model_files(str(model_dir))
    topo = placement["topology"]
    plan = Plan(target="torchrun",
                model={"name": model_dir.name, "architecture": arch, "config": "model/config.json", "source": None,
                       "weights_sha256": state_dict_sha256(state)},
                topology=dict(topo), placement=placement, communication={"mode": "coherent", "gating": "dynamic"},
                predicted={}, shards=[shard_name(r) for r in range(topo["nodes"] * topo["gpus_per_node"])])
    write_bundle(out, plan, state, {"architecture": arch, "files": files})
    return out


def single_rank_engine(model, fresh_model, kind: str, mode: str, top_k: int, max_positions: int = 64,
                       record: bool = True):
    """A world-of-one Engine over `fresh_model` (a second instance of `model`'s class) holding every
    expert, with `model`'s weights cut as a bundle cuts them."""
    from moeplan.runtime.counters import Counters
    from moeplan.runtime.ep.engine import Engine
    from moeplan.runtime.ep.exchange import Exchanger
    from moeplan.runtime.ep.expert_table import ExpertTable
    from moeplan.runtime.model.library_model import RankModel, decoder_layers
    from moeplan.runtime.model.moe_adapter import find_containers, split_expert_state

    containers = find_containers(*reversed(decoder_layers(model)))
    weights = split_expert_state({k: v.detach() for k, v in model.state_dict().items()}, containers)
    experts = containers[0].num_experts
    table = ExpertTable.from_placement(contiguous_placement(len(containers), experts, 1, 1))
    rank_model = RankModel(fresh_model, kind, None, {c.moe: list(range(experts)) for c in containers}, weights,
                           max_positions)
    counters = Counters(rank_model.num_layers)
    return Engine(rank_model, table, Exchanger(0, 1, counters, torch.device("cpu")), counters, 0, 1, mode,
                  torch.device("cpu"), top_k, record=record)


def static_run(engine, prompts: list, new_tokens: int) -> dict:
    """`run_batch` of the prompts through a batch worker over `engine` (world of one), as `moeplan run` runs them."""
    from moeplan.runtime.serving.static_batch import run_batch
    from moeplan.runtime.serving.worker import BatchWorker

    worker = BatchWorker(engine, engine.model.kind, tokens_to_rank0=False)
    try:
        return run_batch(worker, prompts, new_tokens)
    finally:
        worker.close()

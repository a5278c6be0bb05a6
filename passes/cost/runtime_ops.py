"""How many framework ops moeplan's runtime dispatches per part of a decode step, and what one costs: the torchrun
cost model's launch counts.

Two sources:
* `FITTED` (ATTN_OPS, MOE_OPS, EXPERT_CALL_OPS, HEAD_OPS, EXCHANGE_OPS, PEER_OPS below): counted off the runtime when it called
  experts one by one, priced at the profile's `op_overhead_s`; CPU profiles (cpu-gloo, `moeplan calibrate`) fitted
  their op cost against these counts, and the demo's predicted ms/token is checked with them, so they stay for
  every profile that does not measure the runtime's own op cost;
* a decode step captured as a CUDA graph (a service's GPU ranks, `runtime/model/graph_decode.py`): the same
  counted ops, each at its device time, the profile's `graph_op_overhead_s` + `graph_op_row_s` x the step's rows
  (its bucket's, `graph_decode.bucket`): `step_profile`. Fitted on one H200 (docs/gpu_checks.md) to the captured
  step's time less the roofline's compute, at batch 1, 16 and 64 with 16 decoder blocks, and confirmed on the
  48-block cells held out of the fit. The part per row stands for kernels whose work grows with the rows (attention
  over the context among them) beyond what the roofline counts; all measured at 1k tokens. Eager, an op costs the
  larger of its host dispatch (`runtime_op_overhead_s`) and that device time: at batch 64 the kernels outlast the
  dispatch;
* counted (runtime_op_counts.json, written by benchmarks/runtime_op_counts.py): the aten ops the runtime's real
  decode step dispatches per decoder block (attention part, MoE block, dense MLP) and per step, per model class, at
  bf16 and at float32 (the dtype the runtime holds the dense weights at: `ModelShape.held_dtype`); an expert touched
  adds none (grouped experts). Coherent mode's step is counted too, as what it dispatches beyond standard mode's step
  at one rank (its hooks, its context, dispatch and merge exchanges, its token sync: per decoder block at 1 and at 2
  ranks, plus a few ops per rank beyond 2, counted at 4). Used where the hardware
  profile gives `runtime_op_overhead_s`, the runtime's measured cost of one such op (h100-sxm, h200-sxm: one H200,
  benchmarks/gpu/decode_step.py; CPU calibrations, `moeplan calibrate` since its method 5: the op cost fitted to
  `moeplan run`'s measured runs over these counts), so counts and cost come from the same counter. A model class the
  table lacks takes the median of the table's rows (named as the source).
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources


@dataclass(frozen=True)
class RuntimeOps:
    """Ops per decoder block's attention part, per MoE block (`moe` on one rank, `moe_ep` on each of several: its
    dispatch and combine exchanges included, None: `moe` plus the exchange calls' own ops), per distinct expert a
    rank calls, per dense block's MLP and per step (embedding, final norm, head, sampling); `source` says where they
    come from."""

    attention: float
    moe: float
    expert_call: float
    dense_mlp: float
    head: float
    source: str
    moe_ep: float | None = None
    moe_gathered: float | None = None  # an MoE block at several ranks whose decode step gathers (captured on GPUs);
                                       # None: the runtime cannot gather this model's blocks
    attention_captured: float | None = None  # the attention part in a service whose steps are captured: its
                                             # caches' layers all spare-column ones (MLA's latents too,
                                             # growable_cache.py); None: `attention`
    coherent_block: float | None = None  # coherent mode's ops a decoder block beyond standard mode's at one rank;
                                         # None: the fitted COHERENT_HOOK_OPS (and coherent exchanges' fitted ops)
    coherent_block_ep: float | None = None  # the same at 2 ranks, its exchanges' own ops included
    coherent_step_ep: float = 0.0  # coherent mode's ops a step beyond standard mode's at 2 ranks (its token sync)
    coherent_block_per_rank: float = 0.0  # what each rank beyond 2 adds to coherent_block_ep (its exchanges' peers)
    coherent_step_per_rank: float = 0.0  # and to coherent_step_ep
    counted_exchanges: tuple = ("dispatch", "combine")  # exchanges whose calls' ops these counts hold (with `moe_ep`)
    dtype: str | None = None  # the dtype the runtime's step was counted at (bfloat16 | float32); None: fitted

    def captured(self) -> RuntimeOps:
        """The counts of a service whose decode steps are captured (its prefills build the same caches)."""
        if self.attention_captured is None:
            return self
        return dataclasses.replace(self, attention=self.attention_captured)

    def moe_block(self, world: int) -> float:
        return self.moe if world == 1 or self.moe_ep is None else self.moe_ep

    def coherent_hooks(self, world: int) -> float:
        """Ops coherent mode adds to a decoder block on each rank (its hooks; counted: its exchanges' too)."""
        if self.coherent_block is None:
            return COHERENT_HOOK_OPS
        return self.coherent_block if world == 1 else self.coherent_block_ep + self.coherent_block_per_rank * (world - 2)

    def coherent_kv_ops(self) -> float:
        """Ops a coherent block spends projecting the other ranks' tokens' K/V: in the counted excess, else 2."""
        return 0.0 if self.coherent_block is not None else 2.0

    def coherent_step(self, world: int) -> float:
        """Ops coherent mode adds to a step on each rank beyond standard mode's (counted: its token sync)."""
        if world == 1 or self.coherent_block is None:
            return 0.0
        return self.coherent_step_ep + self.coherent_step_per_rank * (world - 2)

    def exchange_calls(self, mode: str) -> RuntimeOps:
        """The counts whose `exchange_call` prices `mode`'s exchange calls' ops: standard mode's dispatch and
        combine are in `moe_ep`; coherent mode's every exchange in `coherent_block_ep` where counted, else FITTED."""
        if mode == "standard":
            return self
        if self.coherent_block is None:
            return FITTED
        return dataclasses.replace(self, counted_exchanges=("dispatch", "combine", "merge", "context", "prompt_sync",
                                                            "token_sync"))

    def counts_exchange(self, phase: str) -> bool:
        """Whether a `phase` call's ops are in these counts (priced with its block's or step's ops, not apart)."""
        return self.moe_ep is not None and phase in self.counted_exchanges

    def exchange_call(self, phase: str, world: int) -> float:
        """Ops of one `phase` exchange call among `world` ranks: none where the counts hold them
        (`counts_exchange`), else the fitted EXCHANGE_OPS + PEER_OPS per peer."""
        if self.counts_exchange(phase):
            return 0.0
        return EXCHANGE_OPS + PEER_OPS[phase] * world

    @property
    def counted(self) -> bool:
        return self.source != "fitted"

    def record(self) -> dict:
        """plan.json `predicted.cost.runtime_ops`: what the prediction priced the runtime's launches with."""
        record = dataclasses.asdict(self)
        del record["counted_exchanges"]  # which mode priced them, not a count
        return record


# The fitted counts: torch calls (and Python lines around them) counted off engine.py and tiny_moe.py when experts
# ran one by one: the attention of one block (norm 6, qkv 3, cache writes 8, output 2, ...); one expert call (norm,
# three linears, SiLU, gathers, index_add ~19); the fixed part of an MoE layer (route 11, packing and unpacking 28,
# trace and counters 9, shared experts 8, ...); the head. A dense block's MLP counts as one expert call.
ATTN_OPS = 23
EXPERT_CALL_OPS = 19
MOE_OPS = 60
HEAD_OPS = 6
# per exchange call (counts, concatenation, split) and per peer in it by kind (select rows, unpack them), counted
# off exchange.py when it sent per peer
EXCHANGE_OPS = 8
PEER_OPS = {"dispatch": 12, "combine": 9, "merge": 18, "context": 6, "prompt_sync": 6, "token_sync": 6}
# Coherent mode's hooks, per block and rank (every rank runs every block): the routing captured by
# running the block's norm and router a second time up to the experts, the context hook at the
# attention input and the block-output correction. Measured, not counted: the runtime engine on one
# rank in coherent mode less standard mode, over the fitted op cost, per block and step: 35.6
# (examples/tiny_moe) and 37.3 (examples/qwen3_moe), median of 7 interleaved runs each.
COHERENT_HOOK_OPS = 36
FITTED = RuntimeOps(attention=ATTN_OPS, moe=MOE_OPS, expert_call=EXPERT_CALL_OPS, dense_mlp=EXPERT_CALL_OPS,
                    head=HEAD_OPS, source="fitted")


@lru_cache(maxsize=2)
def _table(dtype: str = "bfloat16") -> dict:
    """The counts at `dtype` (float32: "architectures_float32"; any other dtype the runtime holds a model's dense
    weights at, bf16 or fp16, the bf16 counts: the same ops, casts aside)."""
    data = json.loads(resources.files("moeplan.passes.cost").joinpath("runtime_op_counts.json").read_text())
    return data["architectures_float32"] if dtype == "float32" else data["architectures"]


def _counted(row: dict, source: str, dtype: str) -> RuntimeOps:
    return RuntimeOps(attention=float(row["attention_block"]), moe=float(row["moe_block"]), expert_call=0.0,
                      dense_mlp=float(row["dense_mlp_block"]), head=float(row["fixed"]), source=source, dtype=dtype,
                      moe_ep=float(row["moe_block_ep"]),
                      moe_gathered=None if row.get("moe_block_gathered") is None else float(row["moe_block_gathered"]),
                      attention_captured=None if row.get("attention_block_captured") is None
                      else float(row["attention_block_captured"]),
                      coherent_block=_part(row, "coherent_block"), coherent_block_ep=_part(row, "coherent_block_ep"),
                      coherent_step_ep=float(row.get("coherent_step_ep") or 0.0),
                      coherent_block_per_rank=float(row.get("coherent_block_per_rank") or 0.0),
                      coherent_step_per_rank=float(row.get("coherent_step_per_rank") or 0.0))


def _part(row: dict, part: str) -> float | None:
    return None if row.get(part) is None else float(row[part])


def runtime_ops(profile, architecture: str, dtype: str = "bfloat16") -> RuntimeOps:
    """The launch counts to price a step of `architecture` (the IR's model class) with on `profile`, its dense weights
    held at `dtype` there (`ModelShape.held_dtype`: a float32 step casts nothing, a bf16 one casts its norms' and
    router's inputs to float32 and back)."""
    if profile is None or getattr(profile, "runtime_op_overhead_s", None) is None:
        return FITTED
    counted_at = "float32" if dtype == "float32" else "bfloat16"
    table = _table(counted_at)
    if architecture in table:
        return _counted(table[architecture], f"counted: {architecture}", counted_at)
    median = {part: statistics.median(row[part] for row in table.values() if row.get(part) is not None)
              for part in next(iter(table.values()))}
    return _counted(median, f"counted: median of {len(table)} architectures ({architecture or 'unknown'} not counted)",
                    counted_at)


def decode_graphs_possible(module, ir, profile) -> bool:
    """Whether the runtime can capture this model's decode steps as CUDA graphs on `profile` (`runtime/serving/
    decode_compile.py`, `_why_not_graphs`): a GPU profile with the graph figures, a library model (`module`) whose
    every KV cache layer is a full-attention one with spare columns, and routed experts not held in FP8 there. Standard
    mode, and at several ranks MoE blocks that gather, are checked where it is priced (`captures_decode_graphs`)."""
    if profile is None or getattr(profile, "graph_op_overhead_s", None) is None or profile.device_is_host:
        return False
    if module is None or getattr(module, "config", None) is None:
        return False
    from moeplan.passes.cost.capacity import held_weights
    from moeplan.runtime.model.growable_cache import growable_throughout

    if held_weights(ir, profile)["dtypes"]["experts"].startswith("float8"):
        return False
    try:
        return growable_throughout(module.config)
    except (TypeError, ValueError, AttributeError):  # a config the library's cache cannot be built from
        return False


def captures_decode_graphs(profile, world: int, mode: str, shape, ops: RuntimeOps) -> bool:
    """Whether the priced service's decode steps replay CUDA graphs: standard mode, a shape that can, and at several
    ranks a model whose MoE blocks gather (`ops.moe_gathered`, counted where `gathered_moe.gather_refusal` lets
    them)."""
    if not (shape.decode_graphs and mode == "standard" and profile is not None):
        return False
    return world == 1 or ops.moe_gathered is not None


def graph_rows(rows: int) -> int:
    """The rows a captured step of `rows` rows on its fullest rank runs (its bucket, `graph_decode.bucket`)."""
    from moeplan.runtime.model.graph_decode import bucket

    return bucket(rows, 2 * rows)


def step_profile(profile, rows: int, graphs: bool):
    """`profile` (`runtime_profile`'s) with its op cost for a step of `rows` rows on a rank (module docstring):
    captured (`graphs`), each op's device time at the bucket's rows; eager, the larger of its host dispatch and that
    device time at the step's rows (the host runs ahead of the GPU until the kernels take longer than it). A profile
    without the graph figures: its op cost plus `runtime_op_row_s` x rows where it gives one (CPU calibrations), else
    unchanged."""
    if getattr(profile, "graph_op_overhead_s", None) is None:
        row = getattr(profile, "runtime_op_row_s", None)  # a CPU's op: dispatch and work on one thread, one after the other
        return profile if row is None else dataclasses.replace(profile, op_overhead_s=profile.op_overhead_s + row * rows)
    device = profile.graph_op_overhead_s + profile.graph_op_row_s * (graph_rows(rows) if graphs else rows)
    return dataclasses.replace(profile, op_overhead_s=device if graphs else max(profile.op_overhead_s, device))


def runtime_profile(profile):
    """The profile with its op cost the runtime's own where it gives one (`runtime_op_overhead_s`)."""
    op = getattr(profile, "runtime_op_overhead_s", None) if profile is not None else None
    return profile if op is None else dataclasses.replace(profile, op_overhead_s=op)

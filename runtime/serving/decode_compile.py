"""Turn on a service's compiled decode step (`model/compiled_decode.py`) where it applies, and compile it
before the service says it is ready, so that no request waits for the compiler.

It applies on the CPU to transformers models with no expert cache and no FP8 experts: a rank alone (world of
one, standard mode), or ranks of standard mode whose decode steps gather (`ep/gathered_moe.py`: fixed-shape
exchanges, one graph per step with the exchanges inside). `MOEPLAN_COMPILE=0` turns it off. The warm-up runs
the worker's own steps on throw-away sequences, four per rank: one prefilled eager (the cache's shapes come from
it), a decode step at batch 1 everywhere (torch specialises size 1: its own graph), a prefill of two prompts
(the graph of every prefill of several), a decode step at batch 3 (the graph of every batch above one), then,
rank by rank, a decode step at batch 1 beside ranks at 3 (with several ranks: a rank of one row sending to ranks
of more) with a prefill of one prompt; then it puts the worker's counters back to zero. Prompts of one token
prefill eager. A step the library's code breaks into several graphs (JetMoE's attention experts) stays eager:
measured slower than eager. Several ranks agree on the outcome (any rank eager: every rank eager, and dynamic
gating again), since their exchanges must pair up.

On a GPU the same warm-up captures the decode steps as CUDA graphs instead (`model/graph_decode.py`, over the KV
pools of `row_pool.py`, which replace the worker's row cache), for a rank alone and for ranks of several whose steps
gather (their exchanges inside the graph): the buckets the warm-up's steps need are captured there, by every rank
together, the others at a step's first need. A rank's pools hold its share of the service's sequences (the
scheduler gives no rank more, `scheduler.py`). `MOEPLAN_CUDA_GRAPHS=0` turns it off. A capture that fails in the
warm-up on any rank leaves every rank eager (and, with several, exchanging by dynamic gating).
"""
from __future__ import annotations

import torch.distributed as dist

from ..ep.gathered_moe import enable_gathering, gather_refusal
from ..model.compiled_decode import CompiledDecode, compile_wanted, compiler_missing
from ..model.graph_decode import GraphDecode, graphs_wanted
from ..model.growable_cache import growable_throughout
from .row_cache import RowCache
from .row_pool import PooledRows
from .scheduler import rank_rows
from .step_plan import STEP, Admission, StepPlan

WARM_PROMPTS = ((1, 2, 3), (4, 5))  # token ids of the two warm-up sequences (any ids the vocabulary has)
WARM_ROWS = 3  # sequences a rank alone runs at once in the warm-up
DEFAULT_POOL_ROWS = 64  # a GPU rank's KV pool rows when the caller gives no max_sequences


def why_not_compiled(worker) -> str | None:
    """Why this worker's decode steps stay eager (one line), or None where they compile (CPU) or are captured as
    CUDA graphs (GPU)."""
    engine = worker.engine
    if engine.device.type != "cpu":
        return _why_not_graphs(worker)
    if not compile_wanted():
        return "MOEPLAN_COMPILE is off"
    why = _why_not_library_step(worker)
    if why is None and engine.world > 1:
        why = gather_refusal(engine)
    return why or _why_not_held_experts(worker) or compiler_missing()


def _why_not_library_step(worker) -> str | None:
    """What keeps a worker's decode step from being the library's forward alone, on any device."""
    if worker.coherent:
        return "coherent mode's ranks run eager decode steps"
    if worker.engine.model.kind != "transformers":
        return f"{worker.engine.model.kind} models run eager decode steps"
    return None


def _why_not_held_experts(worker) -> str | None:
    if any(a.expert_cache is not None or a.fp8_block is not None for a in worker.engine.model.adapters):
        return "expert caches and FP8 experts run eager decode steps"
    return None


def _why_not_graphs(worker) -> str | None:
    """Why a GPU rank's decode steps are not captured as CUDA graphs (`model/graph_decode.py`), or None."""
    if not graphs_wanted():
        return "MOEPLAN_CUDA_GRAPHS is off"
    why = _why_not_library_step(worker) or _why_not_held_experts(worker)
    if why is not None:
        return why
    why = gather_refusal(worker.engine) if worker.world > 1 else None
    if why is not None:
        return why
    if not growable_throughout(worker.engine.model.model.config):
        return ("this model's KV cache has layers the captured step does not run (sliding windows, chunked or "
                "linear attention)")
    return None


def enable_compiled_decode(worker, max_sequences: int = DEFAULT_POOL_ROWS) -> str | None:
    """Compile the worker's decode step (CPU) or capture it as CUDA graphs (GPU, KV pools of `max_sequences` rows)
    and warm it up (module docstring); returns why it stays eager, or None. Several ranks call it together."""
    why = _agreed(worker, why_not_compiled(worker))
    if why is not None:
        return why
    engine, model = worker.engine, worker.engine.model
    if engine.device.type != "cpu":
        return enable_graph_decode(worker, max_sequences)
    if engine.world > 1:
        enable_gathering(engine)
    model.compiled_decode = CompiledDecode(model.model, model.cache_kwarg)
    breaks = _graph_breaks()
    try:
        _warm_up(worker)
    except Exception as exc:  # the compiler refused this model: eager steps serve it
        if engine.world > 1:  # the ranks' exchanges no longer pair up: nothing to recover
            raise
        model.compiled_decode = None
        worker.step(StepPlan(STEP, depart=sorted(worker.running)))
        why = f"torch.compile failed on this model ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    else:
        compiled = model.compiled_decode
        why = None
        if compiled.failure is not None:
            why = f"torch.compile failed on this model ({compiled.failure})"
        elif compiled.steps < 2:
            why = ("this model's KV cache has layers the compiled step does not run (sliding windows, chunked or "
                   "linear attention)")
        elif _graph_breaks() > breaks:  # pieces of graphs between eager calls: measured slower than eager (JetMoE 0.84x)
            why = "the library's code breaks this model's step into several graphs, slower than eager steps"
    why = _agreed(worker, why)
    if why is not None:
        model.compiled_decode = None
        engine.stop_gathering()
    worker.forget_counts()  # whatever the outcome, the warm-up's steps are not the service's
    return why


def enable_graph_decode(worker, max_sequences: int) -> str | None:
    """GPU ranks (alone, or several whose steps then gather): the running rows in KV pools (`row_pool.py`) of this
    rank's share of `max_sequences`, decode steps through `GraphDecode`, warmed up on throw-away sequences (the
    first buckets captured, every rank together); a failure on any rank leaves every rank eager."""
    engine, model = worker.engine, worker.engine.model
    if engine.world > 1:
        enable_gathering(engine)
    counters = engine.counters if engine.world > 1 else None  # a rank alone exchanges nothing a replay must count
    graphs = model.compiled_decode = GraphDecode(model.model, model.cache_kwarg, engine.padded, counters)
    worker.rows = PooledRows(worker.kind, max(rank_rows(max_sequences, engine.world), WARM_ROWS), model.cache_columns)
    why = None
    try:
        _warm_up(worker)
        if graphs.failure is not None:
            why = f"CUDA graph capture failed on this model ({graphs.failure})"
        elif graphs.steps < 2:
            why = "the warm-up's decode steps did not run over the KV pools"
    except Exception as exc:  # a rank alone whose model's code the warm-up refuses: eager steps serve it
        if engine.world > 1:  # the ranks' exchanges no longer pair up: nothing to recover
            raise
        why = f"CUDA graph capture failed on this model ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    why = _agreed(worker, why)
    if why is not None:
        model.compiled_decode = None
        engine.stop_gathering()
        for held in (worker.running, worker.owner, worker.sampling, worker.prompt_len, worker.last, worker.context_base):
            held.clear()  # the warm-up's sequences, wherever it stopped
        worker.rows = RowCache(worker.kind)
    elif engine.world > 1:
        graphs.warm_runs = 0  # later captures: one forward's exchanges on every rank, whoever captures (graph_decode.py)
    worker.forget_counts()
    return why


def _warm_up(worker) -> None:
    """The warm-up's step plans (module docstring), the same on every rank."""
    first, world = 1 + max(worker.running, default=-1), worker.world
    seqs = [[first + 4 * r + i for i in range(4)] for r in range(world)]    # rank r's four sequences

    def admit(i: int, prompt: tuple, ranks=range(world)) -> list:
        return [Admission(seqs[r][i], r, prompt, seed=0, temperature=0.0, top_p=1.0, top_k=0) for r in ranks]
    worker.step(StepPlan(STEP, admit(0, WARM_PROMPTS[0])))        # an eager prefill: the cache's shapes come from it
    worker.step(StepPlan(STEP))                                    # decode, batch 1 everywhere
    worker.step(StepPlan(STEP, admit(1, WARM_PROMPTS[1]) + admit(2, WARM_PROMPTS[1])))  # a prefill of two prompts
    worker.step(StepPlan(STEP))                                    # decode, batch 3 everywhere
    for r in range(world):  # rank r at batch 1 beside ranks at 3, with a prefill of one prompt
        worker.step(StepPlan(STEP, admit(3, WARM_PROMPTS[1], [r]), depart=seqs[r][1:3]))
    worker.step(StepPlan(STEP, depart=[s for r in range(world) for s in seqs[r]]))


def _agreed(worker, why: str | None) -> str | None:
    """`why`, or where this rank has no reason but another rank has, the first such rank's, named: every rank of
    several takes the same path (a collective over the worker's control group)."""
    if worker.world == 1:
        return why
    reasons = [None] * worker.world
    dist.all_gather_object(reasons, why, group=worker.group)
    elsewhere = next((f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason is not None), None)
    return why if why is not None else elsewhere


def _graph_breaks() -> int:
    """Graph breaks torch.compile has met in this process so far."""
    import torch._dynamo.utils

    return sum(torch._dynamo.utils.counters["graph_break"].values())

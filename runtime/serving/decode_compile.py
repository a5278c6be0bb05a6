"""Turn on a service's compiled decode step (`model/compiled_decode.py`) where it applies, and compile it
before the service says it is ready, so that no request waits for the compiler.

It applies to a rank alone on the CPU (world of one, standard mode) running a transformers model with
no expert cache and no FP8 experts; `MOEPLAN_COMPILE=0` turns it off. The warm-up runs the worker's own
steps on two throw-away sequences: decode steps at batch 2 (the graph of every batch above one) and at
batch 1 (its own graph: torch specialises size 1), then puts the worker's counters back to zero. A step the
library's code breaks into several graphs (JetMoE's attention experts) stays eager: measured slower than eager.
"""
from __future__ import annotations

from ..model.compiled_decode import CompiledDecode, compile_wanted, compiler_missing
from .step_plan import STEP, Admission, StepPlan

WARM_PROMPTS = ((1, 2, 3), (4, 5))  # token ids of the two warm-up sequences (any ids the vocabulary has)


def why_not_compiled(worker) -> str | None:
    """Why this worker's decode steps stay eager (one line), or None where they can compile."""
    engine, model = worker.engine, worker.engine.model
    if not compile_wanted():
        return "MOEPLAN_COMPILE is off"
    if engine.world != 1 or worker.coherent:
        return "ranks that exchange rows run eager decode steps"
    if engine.device.type != "cpu":
        return "GPU decode steps run eager (compiled steps are measured on CPUs only)"
    if model.kind != "transformers":
        return f"{model.kind} models run eager decode steps"
    if any(a.expert_cache is not None or a.fp8_block is not None for a in model.adapters):
        return "expert caches and FP8 experts run eager decode steps"
    return compiler_missing()


def enable_compiled_decode(worker) -> str | None:
    """Compile the worker's decode step and warm it up (module docstring); returns why it stays eager, or None."""
    why = why_not_compiled(worker)
    if why is not None:
        return why
    model = worker.engine.model
    model.compiled_decode = CompiledDecode(model.model, model.cache_kwarg)
    breaks = _graph_breaks()
    first = 1 + max(worker.running, default=-1)
    seqs = [first, first + 1]
    admit = [Admission(s, worker.rank, prompt, seed=0, temperature=0.0, top_p=1.0, top_k=0)
             for s, prompt in zip(seqs, WARM_PROMPTS)]
    try:
        worker.step(StepPlan(STEP, admit))
        worker.step(StepPlan(STEP))                    # batch 2
        worker.step(StepPlan(STEP, depart=seqs[1:]))   # batch 1
        worker.step(StepPlan(STEP, depart=seqs[:1]))
    except Exception as exc:  # the compiler refused this model: eager steps serve it
        model.compiled_decode = None
        worker.step(StepPlan(STEP, depart=[s for s in seqs if s in worker.running]))
        why = f"torch.compile failed on this model ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    else:
        why = None
        if model.compiled_decode.steps < 2:
            why = ("this model's KV cache has layers the compiled step does not run (sliding windows, MLA latents, "
                   "linear attention)")
        elif _graph_breaks() > breaks:  # pieces of graphs between eager calls: measured slower than eager (JetMoE 0.84x)
            why = "the library's code breaks this model's step into several graphs, slower than eager steps"
    if why is not None:
        model.compiled_decode = None
    _zero_counters(worker)  # whatever the outcome, the warm-up's steps are not the service's
    return why

def _graph_breaks() -> int:
    """Graph breaks torch.compile has met in this process so far."""
    import torch._dynamo.utils

    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _zero_counters(worker) -> None:
    """The worker's and engine's counts back to a fresh service's (the warm-up is not the service's work)."""
    worker.steps = 0
    counters = worker.engine.counters
    fresh = type(counters)(len(counters.layers))
    counters.layers, counters.step = fresh.layers, fresh.step

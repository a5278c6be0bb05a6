"""The step loops: rank 0 plans and broadcasts each step, every rank runs it.

Rank 0 (`run_leader`, in rank 0's engine process, `engine_process.py`, or a thread beside the front): `Scheduler.next_plan` (sleeps on a
condition while idle), broadcast, `BatchWorker.step`, events. Other ranks (`run_follower`, their
main thread): receive the plan (a blocking gloo broadcast: no spinning while idle), run the step.
While idle, rank 0 broadcasts a HEARTBEAT every `heartbeat_s` (world > 1), so an idle rank's
collective never reaches the process group's timeout and a dead peer shows within a second: the
next collective fails, rank 0 marks the client failed and every request ends with FINISH_ERROR.

Why not transformers' own continuous batching (5.24, `transformers/generation/continuous_batching/`:
`ContinuousBatchingManager` running `ContinuousBatchProcessor` and a `Scheduler` over a
`PagedAttentionCache`, sampling in `ModelRunner._forward_process_and_sample`), read for this design:
* its manager owns the loop: its processor decides each batch on its own and skips the forward when
  it has nothing to run. Under expert parallelism rank 0 must decide and every rank must apply the
  same decision in lockstep, and a rank with no sequence must still run a forward to join every
  exchange (standard mode) -- the decision and the dummy forward are the engine's;
* it samples the batch with one generation config and `torch.multinomial` on the global generator,
  so a seeded request's tokens would depend on its neighbours; and in coherent mode only the rank
  the token ends on holds its logits;
* moeplan's own example model (TinyMoE, the throughput target's model) is not a transformers model.
What stays the library's: the model code (attention, masks, norms, rotary, shared experts), its
`DynamicCache` (rows moved by batch index and column, `row_cache.py`; its full-attention layers write
into spare columns, `model/growable_cache.py`), and the K/V exchange hook
on the cache's `update` (which a paged cache's `update(key, value, layer_idx, ...)` would also fit).
"""
from __future__ import annotations

from .step_plan import HEARTBEAT, STEP, STOP, broadcast_plan


def run_leader(worker, client, heartbeat_s: float) -> None:
    """Rank 0's loop until a STOP plan; any failure ends every request with FINISH_ERROR."""
    world = worker.world
    try:
        client.started()
        while True:
            plan = client.next_plan(heartbeat_s if world > 1 else None)
            if world > 1:
                broadcast_plan(plan, 0, worker.group)
            if plan.kind == STOP:
                return
            tokens = worker.step(plan) if plan.kind == STEP else None
            if plan.gather_stats:
                client.set_stats(worker.gather_stats())
            if tokens is not None:
                client.on_tokens(tokens)
    except BaseException as exc:
        client.fail(f"{type(exc).__name__}: {exc}".splitlines()[0][:500])


def run_follower(worker) -> None:
    """A non-zero rank's loop until rank 0's STOP plan (exceptions propagate: the rank exits non-zero)."""
    while True:
        plan = broadcast_plan(None, worker.rank, worker.group)
        if plan.kind == STOP:
            return
        if plan.kind == STEP:
            worker.step(plan)
        if plan.gather_stats:
            worker.gather_stats()
        if plan.kind not in (STEP, HEARTBEAT):
            raise RuntimeError(f"unknown step plan kind {plan.kind}")

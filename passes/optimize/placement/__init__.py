"""Expert placement: which GPU hosts which experts (and their copies) at every MoE layer.

Start at `policies.plan_placement(trace, PlacementRequest(...))`: it checks the request, runs the
algorithm the request names and scores the result with the placement metric.

    policies.py       the entry point: request -> algorithm -> scored `Placement`
    schema.py         `Topology`, `Placement` and placement.json (read, validate, write); the dispatch
                      rule over a placement is the runtime's: runtime/ep/expert_table.py
    metrics.py        the placement metric (GPU/node-local transitions, max/mean load): tokens follow
                      the runtime's replica rule
    algorithms/       contiguous, eplb, ilp behind one enum (`algorithms/__init__.py`); the staged ILP is
                      ilp.py (driver), ilp_stages.py (coordinate sweeps) and ilp_caps.py (replicas, caps)
    local_search/     moves.py (exchange and re-slot moves, steepest exchanges) and the searches that take
                      them: reslot.py, gpu_sweeps.py, routed.py (+ layer_mip.py), joint.py, held_out_repair.py
    bounds/           lower bounds on cross-GPU transitions: pairwise.py (per layer pair), chain.py (whole
                      GPU columns)
    even_split.py     the staged ILP's value model and per-layer gain tables
    held_out.py       how loads move on traffic the trace has not seen (the ILP lowers caps by it)
    budget.py         work budgets: results depend on --effort, never on the clock

Research tools the planner does not run (gap relaxations, a pair MILP, the layer-chain baseline)
are in benchmarks/research/.
"""

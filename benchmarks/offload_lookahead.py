"""Why the moeplan policy stays points below Belady: how much of Belady's advantage needs the future.

Belady evicts the key whose next request is farthest ahead, which depends on the routing of tokens
not yet generated. This script scores the moeplan policy with exact knowledge of a growing window
of the future and reports the demand hit ratio on the held-out stream:
* `look0`: the current token's remaining layers are known exactly (what is routed by tokens already
  in the model; an online system could at best predict it);
* `lookW` (W = 1, 2, 4, 8): also the next W tokens' routing;
keys whose next request falls inside the window get their exact distance, the others the model's
estimate (at least the window). If look0 is close to moeplan and Belady needs several tokens of
exact lookahead, the gap is the unpredictability of future tokens' routing, not a weak use of
the current token's information.

    .venv/bin/python benchmarks/offload_lookahead.py [--models tiny olmoe] [--fractions 0.1 0.3 0.5] [--json]

Traces and the planning split are those of benchmarks/offload.py (same files, same planner).
`--json`: the last line is {"cases": [{"model", "fraction", "capacity", "hit_ratio": {policy: ratio}}]}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import REPO, olmoe_model, trace_of

WINDOWS = (0, 1, 2, 4, 8)
NEVER = np.iinfo(np.int64).max // 4


def lookahead_policy(model, window: int):
    """The moeplan policy with the next `window` tokens (and the current token's rest) known exactly."""
    from moeplan.runtime.offload.next_use import NextUseState
    from moeplan.runtime.offload.policies import Moeplan

    class State(NextUseState):
        def __init__(self, m, stream):
            super().__init__(m, stream)
            R = len(stream.keys)
            step_of_req = stream.step
            self.next_step = np.full(R, NEVER, dtype=np.int64)  # step of the next request of the same key after r
            first = np.full(stream.num_keys, NEVER, dtype=np.int64)
            for r in range(R - 1, -1, -1):
                k = stream.keys[r]
                self.next_step[r] = first[k]
                first[k] = step_of_req[r]
            self.upcoming = first.copy()  # per key: step of its next request after its last served one
            self.s = -1

        def begin_step(self, s, step_keys):
            super().begin_step(s, step_keys)
            self.s = s

        def touch_request(self, r, key):
            self.upcoming[key] = self.next_step[r]

        def scores(self, keys):
            estimate = super().scores(keys)
            horizon = window * self.L + (self.L - 1 - self.layer)
            distance = self.upcoming[keys] - self.s
            out = np.where(distance <= horizon, distance, np.maximum(estimate, horizon + 1)).astype(float)
            out[self.pending[keys]] = -1.0
            return out

    class Lookahead(Moeplan):
        name = f"look{window}"

        def start(self, stream, cached, resident):
            self.state = State(self.model, stream)
            super(Moeplan, self).start(stream, cached, resident)

        def touch(self, r, key, hit):
            super().touch(r, key, hit)
            self.state.touch_request(r, key)

    return Lookahead(model)


def main(argv=None) -> int:
    from moeplan.passes.analysis.activation import popularity_by_layer
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.runtime.offload.next_use import fit_next_use
    from moeplan.passes.optimize.offload.cache_plan import popular_keys, split_by_sequence, tune_mix
    from moeplan.runtime.offload.policies import make_policy
    from moeplan.passes.optimize.offload.simulator import simulate_demand
    from moeplan.passes.optimize.offload.stream import build_stream

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "olmoe"], choices=["tiny", "olmoe"])
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    ap.add_argument("--plan-tokens", type=int, default=8192)
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    cases = []
    out = sys.stderr if args.json else sys.stdout
    for name in args.models:
        model_dir = REPO / "examples" / "tiny_moe" if name == "tiny" else olmoe_model()
        plan = load_trace(trace_of(model_dir, name, "train", args.plan_tokens))
        held = build_stream(load_trace(trace_of(model_dir, name, "heldout", args.heldout_tokens)))
        fit_rows, val_rows = split_by_sequence(plan, 0.2)  # as the planner: fit, then tune on its own held-out part
        fit, val = plan.select(fit_rows), plan.select(val_rows)
        popularity = popularity_by_layer(fit)
        model = fit_next_use(build_stream(fit), popularity)
        val_stream = build_stream(val)
        for frac in args.fractions:
            capacity = max(1, int(round(frac * held.num_keys)))
            resident = popular_keys(popularity, capacity)
            tuned, _ = tune_mix(model, val_stream, capacity, resident)
            ratios = {"moeplan": simulate_demand(held, capacity, make_policy("moeplan", tuned), resident=resident).hit_ratio}
            for w in WINDOWS:
                ratios[f"look{w}"] = simulate_demand(held, capacity, lookahead_policy(tuned, w), resident=resident).hit_ratio
            ratios["belady"] = simulate_demand(held, capacity, make_policy("belady"), resident=resident).hit_ratio
            cases.append({"model": name, "fraction": frac, "capacity": capacity,
                          "hit_ratio": {k: round(v, 4) for k, v in ratios.items()}})
            print(f"{name:<6} {frac:>4.0%} cache {capacity:>4}: " + "  ".join(f"{k} {v:.3f}" for k, v in ratios.items()),
                  file=out, flush=True)
    if args.json:
        print(json.dumps({"cases": cases}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""BO refinement of the popularity table (Alg. 2 of the serverless-MoE paper) with Optuna ask/tell.

Why: the predictor's errors cost money only where they change the sizing. Alg. 2 adjusts Q
key-value pairs of the count table, re-predicts, re-sizes (ODS) and keeps the adjustment whose
plan is cheapest on the *real* loads of held-out batches.

Mechanics (the paper leaves them open; our choices, all constants are options):
* variables: Q pairs (key = (token id, position, attention id, layer, expert), value = count in
  1..`max_value`), Optuna parameters `k{q}` (key encoded as an integer) and `v{q}`;
* acquisition: a multi-dimensional epsilon-greedy Optuna sampler. Dimension q keeps the best
  trial's value with probability 1 - eps_q and explores with probability eps_q. Dimensions
  1..mu*Q explore the limited range L (keys of tokens whose expert load was mispredicted by more
  than `alpha` tokens per replica in the last iteration, with the expert they really went to);
  the rest explore the whole range P (any seen token id / position / attention id, any layer and
  expert). eps_t = eps_0 / (1 + rho t); each misprediction multiplies eps_{1..mu Q} by
  (1 + rho' t) with rho' = rho1 (memory shortfall), rho2 (payload overflow) or rho3 (otherwise),
  capped at 1. The paper's GP surrogate is not used: its acquisition as described only reads the
  history's best values, which the sampler takes from the study.
* objective: mean simulated billed cost of the MoE layers over the J batches' real loads, times
  (1 + `slo_penalty` x relative SLO excess) when a batch misses the SLO;
* stop: when the best cost improves by less than `zeta` (relative) over `lam` consecutive
  iterations, or after `max_iterations`. Trial 0 is the unadjusted table (no-BO baseline).
Optuna's storage can be an RDB URL so several workers can share one study.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable

import numpy as np

from moeplan.passes.analysis.popularity import CountTable
from moeplan.core.errors import UserError


@dataclass(frozen=True)
class BOOptions:
    q: int = 64                 # key-value pairs adjusted per trial (paper: 1000)
    mu: float = 0.5             # share of the pairs drawn from the limited range L
    eps0: float = 0.5           # initial exploration probability of every dimension
    rho: float = 0.5            # decay of eps per iteration
    rho1: float = 0.3           # boost on memory shortfall   (rho > rho1 > rho2 > rho3 > 0)
    rho2: float = 0.2           # boost on payload overflow
    rho3: float = 0.1           # boost on any other misprediction
    alpha: float = 32.0         # tokens per replica of misprediction that count as an error
    max_value: int = 8          # largest count a pair may set
    lam: int = 3                # stop window (iterations)
    zeta: float = 0.005         # relative improvement below which the window counts as flat
    max_iterations: int = 8
    slo_penalty: float = 1.0
    seed: int = 0
    storage: str | None = None   # e.g. sqlite:///bo.db to share the study


@dataclass
class BOResult:
    best_table: CountTable
    best_cost: float
    baseline_cost: float        # trial 0: the unadjusted table
    iterations: int
    history: list = field(default_factory=list)   # per iteration: cost, best, seconds, eps_mean, |L|
    seconds: float = 0.0


class KeyCodec:
    """Packs a (token, position, attention, layer, expert) key into one non-negative integer."""

    def __init__(self, vocab: int, positions: int, layers: int, experts: int):
        self.dims = (vocab, positions, vocab + 1, layers, experts)
        self.high = int(np.prod([float(d) for d in self.dims]))
        if self.high >= 2 ** 62:
            raise UserError("BO refinement: the key space is too large to encode; lower the vocabulary or positions")

    def encode(self, key) -> int:
        t, p, a, l, e = (int(k) for k in key)
        out = 0
        for value, dim in zip((t, p, a + 1, l, e), self.dims):
            out = out * dim + value
        return out

    def decode(self, code: int) -> tuple:
        vals = []
        for dim in reversed(self.dims):
            vals.append(code % dim)
            code //= dim
        t, p, a1, l, e = reversed(vals)
        return (t, p, a1 - 1, l, e)


def _make_sampler(state):
    import optuna

    class EpsilonGreedySampler(optuna.samplers.BaseSampler):
        """Per-dimension epsilon-greedy over the best trial so far (see module docstring)."""

        def infer_relative_search_space(self, study, trial):
            return {}

        def sample_relative(self, study, trial, search_space):
            return {}

        def sample_independent(self, study, trial, name, distribution):
            q = int(name[1:])
            best = state["best_params"]
            if best is not None and name in best and state["rng"].random() >= state["eps"][q]:
                return best[name]
            if name[0] == "v":
                return int(state["rng"].integers(1, state["max_value"] + 1))
            return state["codec"].encode(state["draw_key"](q))

    return EpsilonGreedySampler()


def refine(table: CountTable, evaluate: Callable, *, vocab_tokens: np.ndarray, max_position: int,
           options: BOOptions = BOOptions(), progress: Callable | None = None) -> BOResult:
    """Run Alg. 2. `evaluate(table) -> (cost, mispredictions)`, where mispredictions is a list of
    (kind, keys) with kind in {"memory", "payload", "other"} and keys the [n, 5] keys of tokens
    whose expert load was mispredicted (the range L for the next iteration)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rng = np.random.default_rng(options.seed)
    Q = max(1, int(options.q))
    n_limited = int(round(options.mu * Q))
    codec = KeyCodec(int(max(vocab_tokens.max(), table.token.max()) + 1), int(max_position) + 1,
                     table.num_layers, table.num_experts)
    state = {"best_params": None, "eps": np.full(Q, options.eps0), "rng": rng, "codec": codec,
             "max_value": options.max_value, "limited": np.empty((0, 5), dtype=np.int64)}

    def draw_key(q):
        lim = state["limited"]
        if q < n_limited and len(lim):
            return lim[int(rng.integers(len(lim)))]
        return (int(rng.choice(vocab_tokens)), int(rng.integers(max_position + 1)),
                int(rng.choice(vocab_tokens)), int(rng.integers(table.num_layers)), int(rng.integers(table.num_experts)))

    state["draw_key"] = draw_key
    sampler = _make_sampler(state)
    study = optuna.create_study(direction="minimize", sampler=sampler, storage=options.storage,
                                study_name=f"moeplan-bo-{options.seed}", load_if_exists=options.storage is not None)
    start = time.perf_counter()
    base_cost, misses = evaluate(table)
    best_cost, best_table = base_cost, table
    history = [{"iteration": 0, "cost": base_cost, "best": base_cost, "eps_mean": float(state["eps"].mean()),
                "limited_keys": 0, "seconds": round(time.perf_counter() - start, 3)}]
    state["limited"] = _limited_keys(misses)
    flat = 0
    it = 0
    for it in range(1, options.max_iterations + 1):
        t0 = time.perf_counter()
        state["eps"] = np.full(Q, options.eps0 / (1 + options.rho * it))
        for kind, _keys in misses:
            rho_p = {"memory": options.rho1, "payload": options.rho2}.get(kind, options.rho3)
            state["eps"][:n_limited] = np.minimum(state["eps"][:n_limited] * (1 + rho_p * it), 1.0)
        trial = study.ask()
        keys = np.array([codec.decode(trial.suggest_int(f"k{q}", 0, codec.high - 1)) for q in range(Q)], dtype=np.int64)
        values = np.array([trial.suggest_int(f"v{q}", 1, options.max_value) for q in range(Q)], dtype=float)
        candidate = table.with_values(keys, values)
        cost, misses = evaluate(candidate)
        study.tell(trial, cost)
        previous_best = best_cost
        if cost < best_cost:
            best_cost, best_table = cost, candidate
            state["best_params"] = dict(trial.params)
        state["limited"] = _limited_keys(misses)
        history.append({"iteration": it, "cost": cost, "best": best_cost, "eps_mean": float(state["eps"].mean()),
                        "limited_keys": int(len(state["limited"])), "seconds": round(time.perf_counter() - t0, 3)})
        if progress is not None:
            progress(it, best_cost)
        improved = (previous_best - best_cost) / max(previous_best, 1e-30)
        flat = flat + 1 if improved < options.zeta else 0
        if flat >= options.lam:
            break
    return BOResult(best_table, best_cost, base_cost, it, history, round(time.perf_counter() - start, 3))


def _limited_keys(misses) -> np.ndarray:
    arrays = [np.asarray(k, dtype=np.int64).reshape(-1, 5) for _, k in misses if len(k)]
    if not arrays:
        return np.empty((0, 5), dtype=np.int64)
    return np.unique(np.concatenate(arrays), axis=0)

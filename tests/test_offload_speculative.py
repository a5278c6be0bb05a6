"""The speculative prefetcher and host compute on a miss (issue 33).

* Stream: a trace's speculation becomes, per step and distance, the distinct keys its rows named.
* Stepper rules: a miss goes to the host exactly when the host finishes first (a hand-worked
  step); no copy starts before what decided it is known (hypothesis); perfect speculation on a
  fast link makes every request after a token's first layer resident at its layer start; the
  prefetcher's cost-aware eviction prices a first layer's miss at the whole copy and a later
  layer's at what a right guess leaves unhidden (or the whole copy where no lone copy is issued),
  also through the planner's wrapped policy, and the victim maximises steps per unit of cost.
* Runtime cache: driven step by step with speculation and host compute, it moves what
  `simulate_timed` predicts, counter for counter (hypothesis over streams, capacities, clocks).
* End to end (real CLI, real torchrun): a trace recorded with --speculate, the speculative
  prefetcher with host compute forced by the plan's clock (plan -> codegen: the plan is the
  contract) at 1 rank and 2 ranks (both modes), `run --verify`: verified, measured == simulated
  (host-computed requests and rows included), prefetched experts that hit, misses computed on the
  host; at 1 rank the speculation the runtime computed live equals what the trace recorder
  computes on the same tokens; the planner compares every prefetcher with and without host
  compute; offload plans record the speculation and `simulate` runs it; bad flags stop in one line;
  `calibrate`'s host rates load into profiles.
"""
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeplan.runtime.offload.expert_cache import ExpertCache, ShardStore
from moeplan.passes.analysis.trace.format import make_trace
from synth_routing import synthesize_routed_tokens
from moeplan.runtime.offload.policies import make_policy
from moeplan.runtime.offload.prefetch import make_prefetcher
from moeplan.passes.optimize.offload.simulator import Timing, simulate_timed
from moeplan.runtime.offload.stepper import TimedCache
from moeplan.passes.optimize.offload.stream import build_stream
from moeplan.passes.optimize.offload.tiers import LoadRecorder
from test_offload_prefetch import EXPERT_BYTES, E, K, L, fitted, owner, pool_of, shard  # noqa: F401 (fixtures)
from test_offload_runtime import cli, offload_inputs  # noqa: F401 (fixture)


def speculated_trace(tokens: int, seed: int, right: float = 0.7, depth: int = 2, seq_len: int = 40):
    """A routed trace whose speculation names each real expert of layer l+d with probability `right`."""
    base = synthesize_routed_tokens(tokens=tokens, layers=L, experts=E, top_k=K, seq_len=seq_len, seed=seed)
    rng = np.random.default_rng(seed)
    ex = base.experts.astype(np.int64)
    spec = np.full((tokens, L, depth, K), -1, dtype=np.int64)
    for d in range(1, depth + 1):
        truth = ex[:, d:, :]
        guess = np.where(rng.random(truth.shape) < right, truth, rng.integers(0, E, truth.shape))
        spec[:, : L - d, d - 1] = guess
    return make_trace(base.experts, num_experts=E, sequence=base.sequence, positions=base.positions,
                      speculation=spec, speculation_source="block-output")


def test_stream_speculation_is_the_distinct_keys_of_the_steps_rows():
    trace = speculated_trace(120, seed=3)
    for prompt in (0, 7):
        stream = build_stream(trace, prompt_tokens=prompt)
        assert stream.spec_depth == 2
        order = np.argsort(trace.sequence, kind="stable")  # the trace is in serving order already
        assert (order == np.arange(len(order))).all()
        pos = trace.positions
        for s in range(len(stream.step_layer)):
            f, l = int(stream.step_token[s]), int(stream.step_layer[s])
            rows = np.flatnonzero(_forward_of(trace, prompt) == f)
            for d in (1, 2):
                want = [] if l + d >= L else list(dict.fromkeys(
                    int((l + d) * E + e) for t in rows for e in trace.speculation[t, l, d - 1] if e >= 0))
                assert stream.speculated(s, d).tolist() == want, (prompt, s, d)
            assert stream.speculated(s, 3).tolist() == []
        # rows: how many of the step's rows chose the expert (decode: 1; prefill chunks: several)
        step_of = _forward_of(trace, prompt)
        for r in range(0, stream.num_requests, 7):
            s, key = int(stream.step[r]), int(stream.keys[r])
            rows = np.flatnonzero(step_of == stream.step_token[s])
            assert stream.rows[r] == int((trace.experts[rows, key // E] == key % E).sum())
        assert (stream.rows.max() > 1) == bool(prompt) and (pos < prompt).any() == bool(prompt)


def _forward_of(trace, prompt: int) -> np.ndarray:
    """The forward (decode token or prefill chunk) of each row, as build_stream numbers them."""
    _seq, pos = trace.sequence, trace.positions
    starts = (pos >= prompt) | (pos == 0)
    return np.cumsum(starts) - 1


def test_a_miss_goes_to_the_host_exactly_when_the_host_finishes_first():
    """One step, empty cache, misses with 1, 3 and 1 rows: copy 10 s each on one link; host 8 s per
    expert or 5 s per row, whichever is larger, on one host queue."""
    trace = make_trace(np.array([[[0, 1, 2]]]), num_experts=4)
    stream = build_stream(trace)
    stream = type(stream)(**{**stream.__dict__, "rows": np.array([1, 3, 1])})
    timing = Timing(layer_s=1.0, expert_compute_s=0.0, pcie_copy_s=10.0, host_expert_s=8.0, host_row_s=5.0)
    cache = TimedCache(stream, 4, make_policy("lru"), timing)
    served = cache.serve(0)
    # expert 0: host at 8 < copy at 10; expert 1: host 8 + 15 = 23 > copy 10; expert 2: host 8 + 8 = 16 < copy 20
    assert [(k, host) for k, _, _, host in served] == [(0, True), (1, False), (2, True)]
    assert (cache.host_computed, cache.host_rows, cache.loads) == (2, 2, 1)
    assert cache.cached.tolist() == [False, True, False, False]  # host-computed keys are not admitted
    assert cache.block_done == 16.0 and cache.now == 17.0
    assert cache.decide(0) == []
    with pytest.raises(ValueError, match="must follow serve"):
        cache.decide(0)


class Recording(TimedCache):
    """A TimedCache that checks, at every decision, that no copy starts before it could be decided."""

    def decide(self, s):
        known = self.block_done if getattr(self.prefetcher, "after_experts", False) else self.router_at
        copies = super().decide(s)
        # copies run back to back on the one link from their first start: that start is not before `known`
        assert self.link_free - sum(self.timing.copy_s(k) for k, _ in copies) >= known - 1e-12
        self.decided = getattr(self, "decided", 0) + len(copies)
        return copies


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), capacity=st.integers(2, L * E), copy_over_layer=st.sampled_from([0.05, 0.5, 2.0]),
       prefetcher=st.sampled_from(["speculative", "moeplan", "moe-infinity"]), host=st.booleans())
def test_no_copy_starts_before_its_decision_is_known(fitted, seed, capacity, copy_over_layer, prefetcher, host):
    model, eamc, _ = fitted
    stream = build_stream(speculated_trace(150, seed), prompt_tokens=seed % 5)
    timing = Timing(layer_s=50e-6, expert_compute_s=2e-6, pcie_copy_s=50e-6 * copy_over_layer,
                    host_expert_s=60e-6 if host else 0.0, host_row_s=1e-6)
    policy = "moe-infinity" if prefetcher == "moe-infinity" else "moeplan"
    cache = Recording(stream, capacity, make_policy(policy, model), timing, make_prefetcher(prefetcher, eamc, depth=2),
                      list(range(capacity)))
    for s in range(len(stream.step_layer)):
        cache.step(s)
    assert cache.hits + cache.loads - cache.prefetches + cache.host_computed == cache.requests
    assert cache.decided == cache.prefetches


def test_perfect_speculation_on_a_fast_link_makes_later_layers_resident(fitted):
    model, _, _ = fitted
    trace = speculated_trace(200, seed=5, right=1.0, depth=1)
    stream = build_stream(trace)
    timing = Timing(layer_s=50e-6, expert_compute_s=1e-6, pcie_copy_s=1e-6)
    result = simulate_timed(stream, 3 * K, make_policy("moeplan", model), timing, make_prefetcher("speculative"),
                            resident=list(range(3 * K)))
    later = int((stream.step_layer[stream.step] > 0).sum())  # requests after a token's first layer
    assert result.resident_at_start >= later and result.prefetch_hits > 0
    demand = simulate_timed(stream, 3 * K, make_policy("moeplan", model), timing, resident=list(range(3 * K)))
    assert result.seconds < demand.seconds


def run_runtime(stream, capacity, resident, new_stepper, store, tensors, depth, keep_steps=None):
    """Drive the runtime cache step by step as the engine does: serve, then the step's speculation
    (`keep_steps`: a service's windowed request log)."""
    pool = pool_of(capacity)
    cache = ExpertCache(capacity, store, pool, L, E, new_stepper, resident=resident, spec_depth=depth)
    cache.keep_steps = keep_steps
    for s in range(len(stream.step_layer)):
        a, b = stream.step_start[s], stream.step_start[s + 1]
        keys = stream.keys[a:b]
        cache.token, cache.seq, layer = int(stream.step_token[s]), int(stream.step_seq[s]), int(stream.step_layer[s])
        experts = (keys % E).tolist()
        for i, slot in enumerate(cache.serve(layer, experts, stream.rows[a:b].tolist())):
            if slot is not None:
                assert torch.equal(pool.tensors["up"][slot], tensors[f"blocks.{layer}.experts.{experts[i]}.up"])
        if depth:
            cache.speculate(layer, [stream.speculated(s, d).tolist() for d in range(1, depth + 1)])
    cache.flush()
    assert sorted(cache.slot_of) == np.flatnonzero(cache.cached).tolist()
    if keep_steps:
        assert cache.stream.first_step > 0 and len(cache.stream.spec_groups.items) < 2 * keep_steps
    return cache.stats()


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), capacity=st.integers(1, L * E), copy_over_layer=st.sampled_from([0.1, 0.9, 1.5]),
       depth=st.sampled_from([1, 2]), host=st.sampled_from([0.0, 0.5, 1.2]), prompt=st.sampled_from([0, 6]),
       eviction=st.sampled_from(["lru", "moeplan"]), share=st.sampled_from([0.5, 1.0]))
def test_runtime_speculative_prefetch_and_host_compute_equal_the_simulation(shard, fitted, seed, capacity, copy_over_layer,
                                                                           depth, host, prompt, eviction, share):
    path, tensors = shard
    model, _, _ = fitted
    stream = build_stream(speculated_trace(120, seed, depth=depth), prompt_tokens=prompt)
    copy = 40e-6 * copy_over_layer
    timing = Timing(layer_s=40e-6, expert_compute_s=1e-6, pcie_copy_s=copy, expert_bytes=EXPERT_BYTES,
                    host_expert_s=copy * host, host_row_s=copy * host / 4, host_overhead_s=2e-6 if host else 0.0)
    allowed = np.random.default_rng(seed).random(L * E) < share
    resident = [int(k) for k in np.random.default_rng(seed + 1).permutation(L * E)[:capacity]]

    def new_stepper(st_, c, r):
        return TimedCache(st_, c, make_policy(eviction, model), timing, make_prefetcher("speculative", None, allowed, depth), r)

    m = run_runtime(stream, capacity, resident, new_stepper, ShardStore(path, owner), tensors, depth)
    sim = simulate_timed(stream, capacity, make_policy(eviction, model), timing,
                         make_prefetcher("speculative", None, allowed, depth), resident=resident)
    got = tuple(m[k] for k in ("requests", "hits", "loads", "prefetches", "prefetch_hits", "resident_at_layer_start",
                               "host_computed", "host_rows"))
    assert got == (sim.requests, sim.hits, sim.loads, sim.prefetches, sim.prefetch_hits, sim.resident_at_start,
                   sim.host_computed, sim.host_rows)
    assert m["bytes_moved"] == sim.loads * EXPERT_BYTES and abs(m["modelled_seconds"] - sim.seconds) < 1e-12
    assert (sim.host_computed > 0) <= (host > 0)


def test_a_windowed_log_with_speculation_and_rows_decides_as_the_whole_log(shard, fitted):
    """A service keeps the last steps of the log (`keep_steps`): the speculation and the token rows
    are windowed with the keys, and every counter equals the whole log's."""
    path, tensors = shard
    model, _, _ = fitted
    stream = build_stream(speculated_trace(120, 3, depth=2), prompt_tokens=6)
    timing = Timing(layer_s=40e-6, expert_compute_s=1e-6, pcie_copy_s=20e-6, expert_bytes=EXPERT_BYTES,
                    host_expert_s=10e-6, host_row_s=2.5e-6, host_overhead_s=2e-6)

    def new_stepper(st_, c, r):
        return TimedCache(st_, c, make_policy("moeplan", model), timing, make_prefetcher("speculative", None, None, 2), r)

    runs = [run_runtime(stream, 6, list(range(6)), new_stepper, ShardStore(path, owner), tensors, 2, keep)
            for keep in (None, 4)]
    whole, windowed = ({k: v for k, v in r.items() if k not in ("prefetch_waits", "prefetch_wait_s")} for r in runs)
    assert whole == windowed and whole["prefetches"] > 0 and whole["host_computed"] > 0 and whole["host_rows"] > whole["host_computed"]


# --- end to end ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def speculated(offload_inputs):
    root, model_dir = offload_inputs
    code, out = cli(["trace", str(model_dir), "--data", str(root / "data.txt"), "--out", str(root / "s.npz"),
                     "--seq-len", "32", "--speculate", "2", "--quiet"])
    assert code == 0, out
    (root / "spec_prompts.txt").write_text("ids: 5 9 11 3 40 2\nids: 60 12 33\nids: 7 7 8\n")
    return root, model_dir


def run_verified(bundle, root, mode: str, results=None) -> list:
    args = ["run", str(bundle), "--verify", "--new-tokens", "6", "--mode", mode, "--prompts",
            str(root / "spec_prompts.txt"), "--json"] + (["--results", str(results)] if results else [])
    code, out = cli(args)
    assert code == 0, out
    reports = json.loads(out.strip().splitlines()[-1])
    reports = list(reports["modes"].values()) if mode == "both" else [reports]
    for report in reports:
        assert report["verified"] and report["tokens_match"] and report["max_abs_logit_diff"] <= 1e-4
        c = report["expert_cache"]
        assert c["matches_simulation"] and c["requests_match_routing"], c
        for k in ("requests", "hits", "loads", "prefetches", "prefetch_hits", "resident_at_layer_start", "bytes_moved",
                  "host_computed", "host_rows", "disk_loads", "disk_bytes", "host_loads", "host_bytes"):
            assert c["measured"][k] == c["simulated"][k], k
    return [r["expert_cache"]["measured"] for r in reports]


def forced_host_compute(model_dir, trace, bundle, gpus: int, prefetch: str) -> dict:
    """plan -> a clock on which the host beats the first copy of a step -> codegen: the plan is the contract."""
    plan_file = bundle.parent / f"{bundle.name}.json"
    code, out = cli(["plan", str(model_dir), "--trace", str(trace), "--target", "torchrun", "--policy", "contiguous",
                     "--nodes", "1", "--gpus-per-node", str(gpus), "--expert-cache", "4", "--prefetch", prefetch,
                     "--host-compute", "never", "--out", str(plan_file), "--quiet"])
    assert code == 0, out
    plan = json.loads(plan_file.read_text())
    spec = plan["communication"]["expert_cache"]
    spec["timing"].update(pcie_copy_ns=10000.0, nvme_copy_ns=0.0, host_expert_ns=7000.0, host_row_ns=100.0,
                          host_overhead_ns=1000.0)
    spec["host_compute"] = "cheaper"
    plan_file.write_text(json.dumps(plan))
    code, out = cli(["codegen", str(plan_file), "--out", str(bundle)])
    assert code == 0, out
    return spec


def test_one_rank_speculates_live_what_the_recorder_does_and_computes_misses_on_the_host(speculated, tmp_path):
    from moeplan.passes.analysis.trace.record import record_trace
    from moeplan.passes.importers import load_model

    root, model_dir = speculated
    spec = forced_host_compute(model_dir, root / "s.npz", tmp_path / "b1", 1, "speculative")
    assert spec["prefetch"] == "speculative" and spec["speculation"]["source"] == "block-output"
    assert spec["speculation"]["depth"] in (1, 2) and set(spec["speculation"]["recall"]) == {"1", "2"}
    (m,) = run_verified(tmp_path / "b1", root, "standard", tmp_path / "res")
    assert m["prefetches"] > 0 and m["prefetch_hits"] > 0
    assert 0 < m["host_computed"] and m["host_rows"] >= m["host_computed"]
    assert m["hits"] + m["loads"] - m["prefetches"] + m["host_computed"] == m["requests"]
    # the live speculation equals the recorder's on the same tokens (per forward and layer, as a set)
    result = json.loads((tmp_path / "res" / "standard" / "result.json").read_text())
    log = torch.load(tmp_path / "res" / "standard" / "expert_cache.pt", weights_only=True)["logs"][0]
    D = int(log["spec_depth"])
    sequences = [p + g[:-1] for p, g in zip(result["prompt_ids"], result["generated"])]
    loaded = load_model(str(model_dir))
    recorded = [record_trace(loaded, [np.array(s)], seq_len=len(s), speculate=D).speculation for s in sequences]
    start, keys = log["spec_start"].tolist(), log["spec_keys"].tolist()
    compared = 0
    for s, (f, layer) in enumerate(zip(log["step_token"].tolist(), log["step_layer"].tolist())):
        for d in range(1, D + 1):
            live = set(keys[start[s * D + d - 1]:start[s * D + d]])
            want = set()
            for seq, rec in zip(result["prompt_ids"], recorded):
                rows = range(len(seq)) if f == 0 else [len(seq) + f - 1]
                want |= {(layer + d) * 8 + int(e) for t in rows for e in rec[t, layer, d - 1] if e >= 0}
            assert live == want, (s, d)
            compared += len(want)
    assert compared > 0


@pytest.mark.slow
def test_two_ranks_expert_parallel_speculate_and_compute_on_the_host_in_both_modes(speculated, tmp_path):
    root, model_dir = speculated
    forced_host_compute(model_dir, root / "s.npz", tmp_path / "b2", 2, "speculative")
    for m in run_verified(tmp_path / "b2", root, "both"):
        assert m["prefetches"] > 0 and m["prefetch_hits"] > 0 and m["host_computed"] > 0


def test_the_planner_records_host_compute_when_it_is_predicted_faster(speculated, tmp_path):
    root, model_dir = speculated
    # priced on a GPU workstation whose host's rates the profile knows (--hardware governs the caches too;
    # the default cpu-gloo has no separate host to compute on)
    code, out = cli(["plan", str(model_dir), "--trace", str(root / "s.npz"), "--target", "torchrun", "--policy",
                     "contiguous", "--expert-cache", "6", "--hardware", "rtx4090-pcie4", "--out", str(tmp_path / "p.json"),
                     "--quiet"])
    assert code == 0, out
    plan = json.loads((tmp_path / "p.json").read_text())
    table = plan["predicted"]["expert_cache"]["prefetch"]
    assert "speculative" in table and "speculative+host" in table
    spec = plan["communication"]["expert_cache"]
    label = spec["prefetch"] + ("+host" if spec.get("host_compute") == "cheaper" else "")
    assert table[label]["seconds_per_token"] == min(v["seconds_per_token"] for v in table.values())
    assert ("speculation" in spec) == (spec["prefetch"] == "speculative")


@pytest.mark.parametrize("trace, args, message", [
    ("t.npz", ["--prefetch", "speculative"], "error: expert_cache: --prefetch speculative runs the block-output speculation"),
    ("s.npz", ["--host-compute", "cheaper"], "error: --host-compute needs --gpu-memory"),
])
def test_bad_speculative_and_host_flags_stop_in_one_line(speculated, tmp_path, trace, args, message):
    root, model_dir = speculated
    extra = ["--expert-cache", "4"] if "--prefetch" in args else []
    code, out = cli(["compile", str(model_dir), "--trace", str(root / trace), *extra, *args, "--out", str(tmp_path / "x"),
                     "--quiet"])
    assert code == 2 and out.strip().splitlines()[-1].startswith(message) and len(out.strip().splitlines()) == 1, out
    assert not (tmp_path / "x").exists()


def test_calibrate_measures_the_hosts_expert_rates_into_keys_profiles_accept():
    """`moeplan calibrate` writes host_memory_bytes_per_s and host_flops_per_s (the host compute
    rates, same names as the offload profiles'); a profile may carry them, and refuses bad values."""
    from moeplan.passes.analysis.profile.host_rates import measure_host_experts
    from moeplan.core.errors import UserError
    from moeplan.core.hardware import load_hardware, profile_from_dict

    rates = measure_host_experts()
    assert set(rates) == {"host_memory_bytes_per_s", "host_flops_per_s"}
    assert all(np.isfinite(v) and v > 0 for v in rates.values())
    base = load_hardware("cpu-gloo").to_dict()
    assert "host_memory_bytes_per_s" not in base  # optional keys: a profile without them loads as before
    profile = profile_from_dict({**base, **rates}, "calibrated")
    assert profile.host_flops_per_s == rates["host_flops_per_s"]
    assert profile_from_dict(base, "round trip") == load_hardware("cpu-gloo")
    with pytest.raises(UserError, match="'host_flops_per_s' must be a positive number"):
        profile_from_dict({**base, "host_flops_per_s": -1.0}, "bad")
    hw = load_hardware("rtx4090-pcie4")  # one profile system: the offload figures live in the same profile
    assert hw.host_compute and hw.host_memory_bytes_per_s > hw.host_to_device_bytes_per_s  # DRAM reads beat PCIe


@pytest.mark.slow
def test_offload_plan_records_the_speculation_and_simulate_runs_the_speculative_prefetcher(speculated, tmp_path):
    root, model_dir = speculated
    code, out = cli(["plan", str(model_dir), "--trace", str(root / "s.npz"), "--target", "offload", "--expert-cache", "6",
                     "--out", str(tmp_path / "o.json"), "--quiet"])
    assert code == 0, out
    plan = json.loads((tmp_path / "o.json").read_text())
    spec = plan["inputs"]["speculation"]
    assert spec["source"] == "block-output" and spec["depth"] == 2 and 0 < spec["recall"]["1"] <= 1
    table = plan["predicted"]["prefetch"]
    assert {"speculative", "speculative+host"} <= set(table) and table["speculative"]["depth"] in (1, 2)
    code, out = cli(["simulate", str(tmp_path / "o.json"), "--trace", str(root / "s.npz"), "--json"])
    assert code == 0, out
    simulated = json.loads(out.strip().splitlines()[-1])["prefetch"]
    assert "speculative" in simulated and simulated["speculative"]["requests"] == simulated["none"]["requests"]
    code, out = cli(["simulate", str(tmp_path / "o.json"), "--trace", str(root / "t.npz"), "--json"])
    assert code == 0 and "speculative" not in json.loads(out.strip().splitlines()[-1])["prefetch"]  # no speculation: no such run


@pytest.mark.parametrize("copy_s, hidden", [(65e-6, True), (500e-6, False)])
def test_eviction_weighs_misses_by_what_speculation_hides(fitted, copy_s, hidden):
    """A later layer's miss costs what a right guess (recall(1)) leaves past the next router, a
    first layer's the whole copy; where no lone copy would be issued (slow link), every miss costs
    the copy. The policy's victim is the key with the most expected steps per unit of that cost."""
    model, _, _ = fitted
    stream = build_stream(speculated_trace(120, seed=3))
    timing = Timing(layer_s=50e-6, expert_compute_s=1e-6, pcie_copy_s=copy_s)
    recall = 0.8
    policy = make_policy("moeplan", model)
    cache = TimedCache(stream, 2 * K, policy, timing, make_prefetcher("speculative", speculation={"recall": {1: recall}}),
                       list(range(2 * K)))
    cost = policy.miss_cost
    wrapped = make_policy("moeplan", model)  # the planner and the replay wrap the policy: it must still weigh
    TimedCache(stream, 2 * K, LoadRecorder(wrapped), timing,
               make_prefetcher("speculative", speculation={"recall": {1: recall}}), list(range(2 * K)))
    assert np.array_equal(wrapped.miss_cost, cost)
    first, later = cost[:E], cost[E:]
    assert np.allclose(first, copy_s)
    expected = (1 - recall) * copy_s + recall * (copy_s - 50e-6) if hidden else copy_s
    assert np.allclose(later, expected)
    for s in range(len(stream.step_layer)):  # the victim maximises score / cost among the cached keys
        cache.serve(s)
        scores = policy.state.all_scores()
        weighted = np.where(scores > 0, scores / cost, scores)
        v = policy.victim(-1)
        assert weighted[v] == weighted[cache.cached].max()
        cache.decide(s)

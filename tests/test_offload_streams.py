"""The request streams the runtime verification builds: a batched engine's stream from routing,
a rank's restriction of a stream, and a logged stream read back (passes/optimize/offload/stream.py)."""
import numpy as np
from hypothesis import given, settings, strategies as st

from synth_routing import synthesize_routed_tokens
from moeplan.passes.optimize.offload.stream import batched_stream, build_stream, restrict, stream_from_log


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 60), st.integers(1, 4), st.integers(2, 9), st.integers(0, 10**6))
def test_one_token_per_forward_is_the_simulators_decode_stream(tokens, layers, experts, seed):
    trace = synthesize_routed_tokens(tokens=tokens, layers=layers, experts=experts, top_k=min(2, experts), seq_len=10**6, seed=seed)
    expected = build_stream(trace)
    got = batched_stream(trace.experts, np.arange(trace.num_tokens), experts)
    nonempty = np.diff(expected.step_start) > 0
    assert np.array_equal(got.keys, expected.keys)
    assert np.array_equal(got.step_layer, expected.step_layer[nonempty])
    assert np.array_equal(got.step_token, expected.step_token[nonempty])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 3), st.integers(2, 8), st.integers(0, 10**6), st.integers(1, 4))
def test_a_batched_forward_requests_its_rows_distinct_experts_in_row_order(tokens, layers, experts, seed, forwards):
    trace = synthesize_routed_tokens(tokens=tokens, layers=layers, experts=experts, top_k=min(2, experts), seq_len=10**6, seed=seed)
    forward = np.sort(np.random.default_rng(seed).integers(0, forwards, size=tokens))
    s = batched_stream(trace.experts, forward, experts)
    for i in range(len(s.step_layer)):
        f, l = s.step_token[i], s.step_layer[i]
        rows = trace.experts[forward == f, l].reshape(-1)
        want = list(dict.fromkeys(int(e) for e in rows if e >= 0))
        assert (s.keys[s.step_start[i]:s.step_start[i + 1]] - l * experts).tolist() == want


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 50), st.integers(2, 8), st.integers(0, 10**6), st.integers(1, 3))
def test_rank_restrictions_partition_the_requests_and_a_log_reads_back(tokens, experts, seed, ranks):
    trace = synthesize_routed_tokens(tokens=tokens, layers=2, experts=experts, top_k=2, seq_len=16, seed=seed)
    s = build_stream(trace, prompt_tokens=3)
    owner = np.arange(s.num_keys) % ranks
    parts = [restrict(s, owner == r) for r in range(ranks)]
    assert sum(p.num_requests for p in parts) == s.num_requests
    for r, p in enumerate(parts):
        assert (owner[p.keys] == r).all() and len(p.step_start) == len(s.step_start)
        for i in range(len(p.step_layer)):
            whole = s.keys[s.step_start[i]:s.step_start[i + 1]]
            assert p.keys[p.step_start[i]:p.step_start[i + 1]].tolist() == [k for k in whole.tolist() if owner[k] == r]
    log = {"keys": s.keys, "step_start": s.step_start, "step_layer": s.step_layer, "step_token": s.step_token,
           "step_seq": s.step_seq, "num_layers": s.num_layers, "num_experts": s.num_experts}
    back = stream_from_log(log)
    for field in ("keys", "step", "step_start", "step_layer", "step_token", "step_seq"):
        assert np.array_equal(getattr(back, field), getattr(s, field))

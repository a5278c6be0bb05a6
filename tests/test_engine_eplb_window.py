"""vLLM's --eplb-config sized from the trace's drift (passes/engine_targets/eplb_window.py): traffic whose popular
experts move gets a short window and interval, stationary traffic keeps vLLM's defaults, and what cannot be
measured says why."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.passes.analysis.trace.format import loads_trace, make_trace
from moeplan.passes.engine_targets.eplb_window import (BLOCKS, VLLM_STEP_INTERVAL, VLLM_WINDOW_SIZE, eplb_config,
                                                       measure_drift, block_loads)
from moeplan.passes.optimize.placement.schema import Topology

TOPO = Topology(1, 8)


def routed(shift_per_sequence: float, sequences=128, length=32, layers=3, experts=32, top_k=2, seed=0):
    """Zipf-popular experts whose ranking rotates by `shift_per_sequence` positions per sequence (0: stationary);
    top-k without replacement by Gumbel noise on the log-probabilities. [T, L, K] experts, sequence ids in order."""
    rng = np.random.default_rng(seed)
    base = -1.2 * np.log(np.arange(1, experts + 1))
    seq = np.repeat(np.arange(sequences), length)
    shift = (np.floor(shift_per_sequence * seq).astype(int) % experts)[:, None]
    logp = base[(np.arange(experts)[None, :] - shift) % experts]  # [T, E]
    scores = logp[:, None, :] + rng.gumbel(size=(len(seq), layers, experts))
    chosen = np.argsort(-scores, axis=2)[:, :, :top_k]
    return make_trace(chosen, np.full(chosen.shape, 1.0 / top_k), num_experts=experts, sequence=seq)


def test_stationary_traffic_keeps_vllm_s_defaults_and_drifting_traffic_re_places_sooner():
    still_config, still = eplb_config(routed(0.0), TOPO, 8, 0, 64, 8)
    moving_config, moving = eplb_config(routed(0.1), TOPO, 8, 0, 64, 8)
    assert still["measured"] and still["interval_blocks"] is None  # no drift over the trace
    assert still_config["step_interval"] >= VLLM_STEP_INTERVAL and still_config["num_redundant_experts"] == 8
    assert moving["rise_per_block"] > still["rise_per_block"] and moving["interval_blocks"] is not None
    assert moving_config["step_interval"] < VLLM_STEP_INTERVAL and moving_config["window_size"] < still_config["window_size"]
    assert moving["window_blocks"] < BLOCKS // 2  # a window longer than the drift remembers traffic that moved on
    assert [w["blocks"] for w in moving["windows"]] == [1, 2, 4, 8, 16] and moving["drift"][0] == 0.0


def test_blocks_become_steps_at_the_running_requests_a_step_decodes():
    trace = routed(0.1)
    few, measured = eplb_config(trace, TOPO, 0, 0, 16, 8)
    many, _ = eplb_config(trace, TOPO, 0, 0, 64, 8)
    block_tokens = trace.num_tokens / BLOCKS
    assert few["window_size"] == int(np.ceil(measured["window_blocks"] * block_tokens / 16))
    assert few["window_size"] >= many["window_size"] and few["step_interval"] >= many["step_interval"]
    _, unknown = eplb_config(trace, TOPO, 0, 0, None, 8)  # vLLM's max_num_seqs 128 per engine, 8 engines
    assert unknown["tokens_per_step"] == 128 * 8


def test_traces_without_an_order_keep_the_defaults_and_say_why():
    loads = loads_trace(np.ones((3, 32), dtype=np.int64) * 10, top_k=2)
    config, measured = eplb_config(loads, TOPO, 8, 0, 64, 8)
    assert config == {"window_size": VLLM_WINDOW_SIZE, "step_interval": VLLM_STEP_INTERVAL, "num_redundant_experts": 8}
    assert measured == {"measured": False, "reason": "the trace holds loads only: no order to measure drift in; vLLM's "
                                                     "default window and interval are kept"}
    _, few = eplb_config(routed(0.0, sequences=20), TOPO, 0, 0, 64, 8)
    assert few["measured"] is False and "20 sequences are fewer than 32 blocks" in few["reason"]


def test_blocks_hold_whole_sequences_in_id_order():
    trace = routed(0.0, sequences=64, length=16)
    blocks = block_loads(trace)
    assert blocks.shape == (BLOCKS, 3, 32) and np.array_equal(blocks.sum(axis=0), trace.expert_loads())
    assert np.all(blocks.sum(axis=2) == 2 * 16 * 2)  # two whole sequences of 16 tokens, top-2, per block


@settings(max_examples=12, deadline=None)
@given(shift=st.sampled_from([0.0, 0.05, 0.3]), experts=st.sampled_from([16, 32]), redundant=st.sampled_from([0, 8]),
       running=st.integers(1, 512), seed=st.integers(0, 3))
def test_every_measured_config_is_one_vllm_accepts(shift, experts, redundant, running, seed):
    trace = routed(shift, sequences=64, length=16, layers=2, experts=experts, seed=seed)
    config, measured = eplb_config(trace, TOPO, redundant, 0, running, 8)
    assert set(config) == {"window_size", "step_interval", "num_redundant_experts"}
    assert all(isinstance(v, int) for v in config.values()) and config["num_redundant_experts"] == redundant
    assert config["window_size"] >= 1 and config["step_interval"] >= 1  # EPLBConfig: gt=0
    assert measured["window_blocks"] <= BLOCKS // 2 and len(measured["drift"]) == measured["span_blocks"]
    again = measure_drift(block_loads(trace), TOPO, redundant, 0)
    assert again == {k: measured[k] for k in again}  # the same trace measures the same


def test_blocks_mixing_fewer_requests_than_a_step_say_the_drift_may_be_overstated():
    trace = routed(0.1)  # 128 sequences: 4 a block
    _, small = eplb_config(trace, TOPO, 0, 0, 64, 8)
    assert small["caveat"].startswith("each block holds 4 sequences, fewer than the 64 requests one engine step mixes")
    assert f"at least {BLOCKS * 64} sequences" in small["caveat"]
    _, enough = eplb_config(trace, TOPO, 0, 0, 4, 8)  # 4 running requests: a block mixes as many as a step
    assert "caveat" not in enough
    flat = make_trace(trace.experts, trace.weights, num_experts=32)  # no sequence ids: 128 tokens a block
    _, by_tokens = eplb_config(flat, TOPO, 0, 0, 256, 8)
    assert "each block holds 128 tokens, fewer than the 256" in by_tokens["caveat"]
    assert "caveat" not in eplb_config(flat, TOPO, 0, 0, 128, 8)[1]

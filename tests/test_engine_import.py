"""`moeplan trace import` for serving-engine records: SGLang per_token / stat dumps, TensorRT-LLM
expert statistics; fixtures written from the engines' documented layouts (docs/interop.md)."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from moeplan.passes.analysis.trace.engine_import import detect_format, import_engine_trace
from moeplan.passes.analysis.trace.format import load_trace
from sglang_dump_writer import per_token_records, write_per_token_dump
from moeplan.planner.cli import main
from moeplan.core.errors import UserError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_moe"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def sglang_record(pass_id, rank, input_ids, positions, topk, mode=1, extend_seq_lens=None):
    """One record as SGLang 0.5.23's _DetailSinglePassGatherer.collect + _DetailAccumulator.append build it."""
    topk = torch.tensor(topk, dtype=torch.int32)
    count = torch.zeros((topk.shape[0], 6), dtype=torch.int32)
    return {"forward_pass_id": pass_id, "rank": rank, "gatherer_key": "primary", "input_ids": input_ids,
            "positions": positions, "extend_seq_lens": extend_seq_lens, "forward_mode": mode,
            "topk_ids_of_layer": topk, "misc_objects": [], "global_physical_count": count}


# 3 decoder layers: layer 0 dense, layers 1-2 MoE; 4 logical experts in 6 slots (2 redundant).
SLOT_MAP = [[0, 1, 2, 3, 0, 1], [2, 3, 0, 1, 2, 1], [0, 1, 2, 3, 3, 0]]


def per_token_fixture(directory: Path) -> Path:
    """Rank 0: an EXTEND pass of two requests (lengths 2 and 1) and a DECODE pass; rank 1 logs the
    same EXTEND pass again (tensor-parallel attention) and one IDLE pass."""
    pad = [-1] * 6
    extend = sglang_record(0, 0, [11, 12, 13], [0, 1, 0],
                           [[pad[:2], pad[:2], pad[:2]],  # dense layer: never routed
                            [[0, 5], [4, 1], [3, -1]],  # slots -> experts 2,1 | 2,3 | 1,-
                            [[4, 5], [2, 1], [0, 3]]],  # slots -> experts 3,0 | 2,1 | 0,3
                           mode=1, extend_seq_lens=[2, 1])
    decode = sglang_record(1, 0, [14, 15, 0], [2, 1, 0],  # the third token pads a CUDA-graph batch
                           [[pad[:2]] * 3, [[2, 3], [1, 0], pad[:2]], [[1, 2], [3, 4], pad[:2]]], mode=2)
    idle = sglang_record(0, 1, [], [], np.zeros((3, 0, 2), dtype=np.int32).tolist(), mode=4)
    directory.mkdir()
    slot_map = torch.tensor(SLOT_MAP)
    torch.save({"records": [extend, decode], "last_physical_to_logical_map": slot_map},
               directory / "expert_distribution_recorder_1.0_0.pt")
    torch.save({"records": [dict(extend, rank=1), idle], "last_physical_to_logical_map": slot_map},
               directory / "expert_distribution_recorder_1.0_1.pt")
    return directory


def test_sglang_per_token_maps_slots_to_experts_and_recovers_requests(tmp_path):
    dump = per_token_fixture(tmp_path / "dump")
    assert detect_format(dump) == "sglang"
    out = tmp_path / "t.npz"
    result = run("trace", "import", dump, "--out", out)
    assert result.exit_code == 0, result.output
    assert "5 tokens in 4 sequences x 2 MoE layers, top-2 of 4 experts" in result.output
    trace = load_trace(out)
    assert trace.experts.tolist() == [
        [[2, 1], [3, 0]], [[2, 3], [2, 1]], [[1, -1], [0, 3]],  # extend pass (rank 1's copy dropped)
        [[0, 1], [1, 2]], [[3, 2], [3, 3]],  # decode pass
    ]
    assert trace.token_ids.tolist() == [11, 12, 13, 14, 15]
    assert trace.positions.tolist() == [0, 1, 0, 2, 1]
    assert trace.sequence.tolist() == [0, 0, 1, 2, 3]  # extend_seq_lens splits; decode tokens stand alone
    assert not trace.loads_only


def test_sglang_stat_dump_is_loads_only_and_only_balance_policies_take_it(tmp_path):
    counts = torch.zeros((2, 3, 4), dtype=torch.int32)  # [steps, layers incl. dense layer 0, experts]
    counts[:, 1] = torch.tensor([[5, 1, 0, 2], [1, 1, 1, 1]])
    counts[:, 2] = torch.tensor([[0, 0, 9, 3], [2, 0, 0, 0]])
    dump = tmp_path / "expert_distribution_recorder_2.0.pt"
    torch.save({"rank": 0, "logical_count": counts, "average_utilization_rate_over_window": None}, dump)
    out = tmp_path / "t.npz"
    result = run("trace", "import", dump, "--top-k", 2, "--out", out)
    assert result.exit_code == 0, result.output
    assert "loads-only" in result.output
    trace = load_trace(out)
    assert trace.loads_only and trace.num_tokens == 0 and trace.top_k == 2
    assert trace.loads.tolist() == [[6, 2, 1, 3], [2, 0, 9, 3]]
    placed = run("place", "--trace", out, "--nodes", 1, "--gpus-per-node", 2, "--policy", "eplb", "--out", tmp_path / "p.json")
    assert placed.exit_code == 0, placed.output
    metrics = json.loads((tmp_path / "p.json").read_text())["metrics"]
    assert "gpu_local_fraction" not in metrics and metrics["max_over_mean_load"] >= 1.0
    scored = run("place", "--trace", out, "--evaluate", tmp_path / "p.json", "--json")
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.output)["max_over_mean_load"] == pytest.approx(metrics["max_over_mean_load"], abs=1e-6)
    assert "gpu_local_fraction" not in json.loads(scored.output)  # unknown without tokens, not zero
    refused = run("place", "--trace", out, "--nodes", 1, "--gpus-per-node", 2, "--policy", "ilp", "--out", tmp_path / "q.json")
    assert refused.exit_code == 2 and refused.output.startswith("error: ") and refused.output.count("\n") == 1
    assert "expert loads only" in refused.output and "--policy eplb" in refused.output
    assert not (tmp_path / "q.json").exists()


def test_sglang_per_pass_dump_folds_slot_counts_onto_experts(tmp_path):
    """per_pass mode: _DetailAccumulator records holding only a pass's global_physical_count."""
    def record(pass_id, rank, counts):
        return {"forward_pass_id": pass_id, "rank": rank, "gatherer_key": "primary",
                "global_physical_count": torch.tensor(counts, dtype=torch.int32)}

    dense = [0] * 6
    dump = tmp_path / "expert_distribution_recorder_3.0_0.pt"
    torch.save({"records": [record(0, 0, [dense, [1, 0, 2, 0, 3, 1], [0, 0, 0, 5, 1, 1]]),
                            record(1, 0, [dense, [0, 1, 0, 0, 0, 2], [2, 0, 0, 0, 0, 0]])],
                "last_physical_to_logical_map": torch.tensor(SLOT_MAP)}, dump)
    trace = import_engine_trace(dump, top_k=2)
    # layer 1 slots -> experts [2, 3, 0, 1, 2, 1]; layer 2 slots -> [0, 1, 2, 3, 3, 0]
    assert trace.loads_only and trace.top_k == 2
    assert trace.loads.tolist() == [[2, 3, 4, 1], [3, 0, 0, 6]]


def trtllm_fixture(directory: Path, num_experts=4, per_token=2) -> Path:
    """EXPERT_STATISTIC_PATH as TensorRT-LLM's ExpertStatistic._write lays it out: two ranks,
    iterations 100-101, MoE layers 3 and 4 (decoder-layer indices)."""
    directory.mkdir()
    (directory / "meta_info.json").write_text(json.dumps({"num_experts": num_experts, "num_experts_per_token": per_token}))
    rank0 = {"100_3": np.array([1, 0, 2, 1]), "100_4": np.array([0, 4, 0, 0]),
             "101_3": np.array([2, 2, 0, 0]), "101_4": np.array([1, 1, 1, 1])}
    rank1 = {"100_3": np.array([0, 0, 0, 4]), "100_4": np.array([2, 0, 2, 0]),
             "101_3": np.array([1, 1, 1, 1]), "101_4": np.array([0, 0, 0, 4])}
    save_file({k: v.astype(np.int64) for k, v in rank0.items()}, str(directory / "rank0.safetensors"))
    save_file({k: v.astype(np.int64) for k, v in rank1.items()}, str(directory / "rank1.safetensors"))
    return directory


def test_trtllm_statistics_sum_iterations_and_ranks(tmp_path):
    stats = trtllm_fixture(tmp_path / "expert_statistic")
    assert detect_format(stats) == "trtllm"
    out = tmp_path / "t.npz"
    result = run("trace", "import", stats, "--out", out)
    assert result.exit_code == 0, result.output
    trace = load_trace(out)
    assert trace.loads_only and trace.top_k == 2 and trace.num_experts == 4
    assert trace.loads.tolist() == [[4, 3, 3, 6], [3, 5, 3, 5]]


def test_trtllm_slot_counts_fold_onto_experts_through_the_balancer_yaml(tmp_path):
    stats = trtllm_fixture(tmp_path / "stats")  # 4 slots holding experts 0,1,2,0 (layer 3) / 1,1,0,2 (layer 4)
    yaml_path = tmp_path / "moe_load_balancer.yaml"
    yaml_path.write_text("num_slots: 4\nlayer_updates_per_iter: 0\ninitial_global_assignments:\n"
                         "  3: [0, 1, 2, 0]\n  4: [1, 1, 0, 2]\n")
    trace = import_engine_trace(stats, "trtllm", trtllm_assignments=str(yaml_path))
    assert trace.loads.tolist() == [[10, 3, 3], [3, 8, 5]]
    bad = run("trace", "import", stats, "--format", "sglang", "--trtllm-assignments", yaml_path, "--out", tmp_path / "x.npz")
    assert bad.exit_code == 2 and "--trtllm-assignments applies to TensorRT-LLM" in bad.output


def test_round_trip_through_sglang_per_token_layout_keeps_every_choice(tmp_path):
    """Record with moeplan, write SGLang per_token dumps (redundant slots, two data-parallel ranks
    plus a tensor-parallel duplicate), import back: identical expert choices."""
    data = tmp_path / "text.txt"
    data.write_text((EXAMPLE / "corpus_heldout.txt").read_text()[:400])
    recorded = tmp_path / "recorded.npz"
    result = run("trace", EXAMPLE, "--data", data, "--out", recorded, "--max-tokens", 240, "--batch", 2, "--seq-len", 40)
    assert result.exit_code == 0, result.output
    trace = load_trace(recorded)
    L, E = trace.num_layers, trace.num_experts
    layers = [1 + 2 * l for l in range(L)]  # dense decoder layers between the MoE ones
    rng = np.random.default_rng(0)
    slot_map = np.stack([np.concatenate([rng.permutation(E), rng.permutation(E)[:E // 2]])
                         for _ in range(2 * L + 1)])  # 1.5 slots per expert, shuffled
    records = per_token_records(trace, layers, slot_map)
    dump = tmp_path / "dump"
    dump.mkdir()
    half = len(records) // 2
    write_per_token_dump(dump / "expert_distribution_recorder_9.0_0.pt", records[:half], slot_map)
    write_per_token_dump(dump / "expert_distribution_recorder_9.0_1.pt", records[half:] + records[:1], slot_map)
    physical = torch.load(dump / "expert_distribution_recorder_9.0_0.pt", weights_only=True)["records"][0]
    assert physical["topk_ids_of_layer"].shape == (2 * L + 1, len(physical["input_ids"]), 8)
    back = tmp_path / "back.npz"
    imported = run("trace", "import", dump, "--format", "sglang", "--out", back)
    assert imported.exit_code == 0, imported.output
    again = load_trace(back)
    np.testing.assert_array_equal(again.experts, trace.experts)
    np.testing.assert_array_equal(again.token_ids, trace.token_ids)
    np.testing.assert_array_equal(again.positions, trace.positions)
    np.testing.assert_array_equal(again.sequence, trace.sequence)


@pytest.mark.parametrize("make, message", [
    (lambda d: d.write_bytes(b"not a torch file"), "not a readable SGLang dump"),
    (lambda d: torch.save({"foo": 1}, d), "not an SGLang expert-distribution dump"),
    (lambda d: torch.save([1, 2], d), "not an SGLang expert-distribution dump"),
    (lambda d: torch.save({"records": [{"input_ids": [1]}], "last_physical_to_logical_map": torch.tensor(SLOT_MAP)}, d),
     "a per_token record needs"),
    (lambda d: torch.save({"records": [sglang_record(0, 0, [1], [0], [[[7, 0]], [[0, 1]], [[0, 1]]])],
                           "last_physical_to_logical_map": torch.tensor(SLOT_MAP)}, d), "outside -1..5"),
    (lambda d: torch.save({"records": [sglang_record(0, 0, [1, 2], [0, 1], [[[0, 1]] * 2] * 3, extend_seq_lens=[3])],
                           "last_physical_to_logical_map": torch.tensor(SLOT_MAP)}, d), "does not split"),
    (lambda d: torch.save({"logical_count": torch.zeros((1, 2, 4), dtype=torch.int32)}, d), "counts no tokens"),
])
def test_bad_sglang_dumps_fail_in_one_line_without_output(tmp_path, make, message):
    dump = tmp_path / "dump.pt"
    make(dump)
    out = tmp_path / "t.npz"
    result = run("trace", "import", dump, "--out", out)
    assert result.exit_code == 2 and result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_dumps_that_would_run_code_are_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("pwned",))

    dump = tmp_path / "evil.pt"
    torch.save({"records": Payload(), "last_physical_to_logical_map": torch.tensor(SLOT_MAP)}, dump)
    with pytest.raises(UserError, match="not a readable SGLang dump"):
        import_engine_trace(dump)


@pytest.mark.parametrize("make, message", [
    (lambda d: None, "has no meta_info.json"),
    (lambda d: (d / "meta_info.json").write_text('{"num_experts": 0, "num_experts_per_token": 2}'), "'num_experts' must be"),
    (lambda d: (d / "meta_info.json").write_text('{"num_experts": 4, "num_experts_per_token": 2}'), "no rank<r>.safetensors"),
    (lambda d: ((d / "meta_info.json").write_text('{"num_experts": 4, "num_experts_per_token": 2}'),
                save_file({"100_3": np.ones(3, dtype=np.int64)}, str(d / "rank0.safetensors"))), "must hold 4"),
    (lambda d: ((d / "meta_info.json").write_text('{"num_experts": 4, "num_experts_per_token": 2}'),
                save_file({"layer3": np.ones(4, dtype=np.int64)}, str(d / "rank0.safetensors"))), "is not named"),
])
def test_bad_trtllm_statistics_fail_in_one_line(tmp_path, make, message):
    stats = tmp_path / "stats"
    stats.mkdir()
    make(stats)
    result = run("trace", "import", stats, "--format", "trtllm", "--out", tmp_path / "t.npz")
    assert result.exit_code == 2 and result.output.count("\n") == 1 and message in result.output, result.output


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.lists(st.integers(0, 50), min_size=4, max_size=4), min_size=1, max_size=3),
       iterations=st.integers(1, 3))
def test_trtllm_loads_are_the_sums_of_the_counts(tmp_path_factory, counts, iterations):
    stats = tmp_path_factory.mktemp("stats")
    (stats / "meta_info.json").write_text('{"num_experts": 4, "num_experts_per_token": 1}')
    tensors = {f"{it}_{3 + l}": np.asarray(row, dtype=np.int64) * (it + 1)
               for it in range(iterations) for l, row in enumerate(counts)}
    save_file(tensors, str(stats / "rank0.safetensors"))
    factor = sum(it + 1 for it in range(iterations))
    trace = import_engine_trace(stats)
    assert trace.loads.tolist() == [[c * factor for c in row] for row in counts]


@st.composite
def routed_traces(draw):
    """Small traces whose rows hold their valid choices first (the order SGLang logs them in), at
    least one valid choice per row and one full row, plus a slot map with replicas and dense layers."""
    T, L, K, E = draw(st.integers(1, 10)), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(3, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    experts = np.stack([[rng.choice(E, size=K, replace=False) for _ in range(L)] for _ in range(T)])
    valid = rng.integers(1, K + 1, size=(T, L))
    valid[0, 0] = K
    experts = np.where(np.arange(K)[None, None, :] < valid[:, :, None], experts, -1)
    sequence = np.sort(rng.integers(0, 3, size=T))
    dense = draw(st.integers(0, 2))
    redundant = draw(st.integers(0, E))
    slot_map = np.stack([np.concatenate([rng.permutation(E), rng.integers(0, E, size=redundant)])
                         for _ in range(dense + L)])
    return experts, sequence, dense, slot_map


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=routed_traces())
def test_any_trace_survives_the_sglang_per_token_layout(tmp_path_factory, case):
    from moeplan.passes.analysis.trace.format import make_trace

    experts, sequence, dense, slot_map = case
    E = int(slot_map.max()) + 1
    trace = make_trace(experts, num_experts=E, sequence=sequence, token_ids=np.arange(len(experts)))
    dump = tmp_path_factory.mktemp("dump") / "expert_distribution_recorder_0.0_0.pt"
    write_per_token_dump(dump, per_token_records(trace, range(dense, dense + trace.num_layers), slot_map), slot_map)
    back = import_engine_trace(dump)
    np.testing.assert_array_equal(back.experts, trace.experts)
    np.testing.assert_array_equal(back.token_ids, trace.token_ids)
    assert len(np.unique(back.sequence)) == len(np.unique(sequence))


RECORD_FIELDS = ["forward_pass_id", "input_ids", "positions", "forward_mode", "topk_ids_of_layer", "extend_seq_lens"]
ANY_VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 9) | st.floats(allow_nan=False) | st.text(max_size=3)
    | st.builds(lambda shape: torch.full(shape, 1, dtype=torch.int32), st.lists(st.integers(0, 3), max_size=3).map(tuple)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(RECORD_FIELDS), inner, max_size=4),
    max_leaves=8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=st.lists(st.dictionaries(st.sampled_from(RECORD_FIELDS), ANY_VALUE, max_size=2), min_size=1, max_size=3),
       slot_map=st.sampled_from([torch.tensor(SLOT_MAP), torch.zeros((0,)), [[0, 1]], "x"]))
def test_malformed_sglang_dumps_only_ever_raise_user_errors(tmp_path_factory, overrides, slot_map):
    """Well-formed records with fields replaced by anything: a trace or one UserError line, never a crash."""
    base = sglang_record(0, 0, [1, 2], [0, 1], [[[-1, -1]] * 2, [[0, 5], [4, 1]], [[1, 2], [3, 0]]], extend_seq_lens=[2])
    dump = tmp_path_factory.mktemp("fuzz") / "d.pt"
    torch.save({"records": [dict(base, **o) for o in overrides], "last_physical_to_logical_map": slot_map}, dump)
    try:
        trace = import_engine_trace(dump)
    except UserError as exc:
        assert "\n" not in str(exc)
    else:
        assert trace.num_tokens > 0 and trace.num_experts == 4

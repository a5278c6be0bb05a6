"""Speculative routing in traces (issue 33): what `moeplan trace --speculate D` records, checked
against the library's own modules called by hand, the file format (version 2, version 1 still
read), the recall `trace stats` reports, and bad input."""
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.passes.analysis.trace.format import load_trace, make_trace, save_trace
from moeplan.passes.analysis.trace.record import record_trace
from moeplan.passes.analysis.trace.speculate import speculation_recall
from moeplan.core.errors import UserError
from moeplan.passes.importers import load_model

TEXT = "def speculate(layer, hidden):\n    return router(norm(hidden))  # the next layer's guess\n" * 3


def cli(*args):
    return subprocess.run([sys.executable, "-m", "moeplan.planner.cli", *args], capture_output=True, text=True)


def test_tiny_moe_speculation_is_the_later_routers_on_the_block_output():
    """TinyMoE: at [t, l, d-1], the top-k of blocks[l+d].moe.route(blocks[l+d].moe_norm(output of block l))."""
    loaded = load_model("examples/tiny_moe")
    trace = record_trace(loaded, TEXT, max_tokens=96, seq_len=48, speculate=2)
    assert trace.speculation.shape == (96, 6, 2, 2) and trace.speculation_source == "block-output"
    model = loaded.module
    ids = torch.tensor(np.frombuffer(TEXT.encode(), dtype=np.uint8)[:96].astype(np.int64)).view(2, 48)
    outputs = []
    hooks = [b.register_forward_hook(lambda m, i, o: outputs.append(o.reshape(-1, o.shape[-1]))) for b in model.blocks]
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        for l in range(6):
            for d in (1, 2):
                if l + d >= 6:
                    assert (trace.speculation[:, l, d - 1] == -1).all()
                    continue
                target = model.blocks[l + d]
                _, want, _ = target.moe.route(target.moe_norm(outputs[l]))
                np.testing.assert_array_equal(trace.speculation[:, l, d - 1], want.numpy())
    # the trained model's next router, on the block output, names most of what the next layer uses
    assert speculation_recall(trace.experts, trace.speculation)["1"] > 0.5


def test_hf_speculation_uses_the_library_router_and_norm_on_its_hidden_states():
    """Qwen3-MoE: the block outputs are transformers' own `output_hidden_states`; layer l+1's
    post_attention_layernorm and TopKRouter on them give the recorded speculation."""
    loaded = load_model("examples/qwen3_moe")
    ids = np.arange(5, 69, dtype=np.int64).reshape(2, 32)
    trace = record_trace(loaded, [ids], seq_len=32, speculate=1)
    model = loaded.module
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor(ids), output_hidden_states=True, use_cache=False).hidden_states
        for l in range(3):
            layer = model.model.layers[l + 1]
            _, weights, chosen = layer.mlp.gate(layer.post_attention_layernorm(hidden[l + 1]).reshape(-1, 64))
            order = torch.argsort(-weights, dim=-1, stable=True)
            np.testing.assert_array_equal(trace.speculation[:, l, 0], torch.gather(chosen, 1, order).numpy())


@pytest.mark.parametrize("source", ["residual", "router-input"])
def test_other_stand_ins_are_recorded_and_named(source):
    trace = record_trace(load_model("examples/tiny_moe"), TEXT, max_tokens=64, seq_len=32, speculate=1,
                         speculate_from=source)
    assert trace.speculation_source == source
    assert ((trace.speculation[:, :5, 0] >= 0) & (trace.speculation[:, :5, 0] < 16)).all()


def test_cli_records_and_stats_report_recall(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text(TEXT)
    out = tmp_path / "t.npz"
    r = cli("trace", "examples/tiny_moe", "--data", str(data), "--speculate", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "speculation 3 layers ahead from the block-output" in r.stdout
    with zipfile.ZipFile(out) as z:
        assert {"speculation.npy", "speculation_source.npy"} <= set(z.namelist())
    trace = load_trace(out)
    stats = json.loads(cli("trace", "stats", str(out), "--json").stdout)
    assert set(stats["speculation_recall"]) == {"1", "2", "3"}
    assert stats["speculation_recall"] == speculation_recall(trace.experts, trace.speculation)
    assert stats["speculation_source"] == "block-output"
    table = cli("trace", "stats", str(out)).stdout
    assert "speculation recall" in table and "d=3" in table
    plain = tmp_path / "plain.npz"
    assert cli("trace", "examples/tiny_moe", "--data", str(data), "--out", str(plain), "--quiet").returncode == 0
    assert "speculation_recall" not in json.loads(cli("trace", "stats", str(plain), "--json").stdout)
    assert int(np.load(plain)["version"]) == 1 and int(np.load(out)["version"]) == 2


def test_onnx_traces_refuse_speculation_in_one_line(tmp_path):
    onnx = tmp_path / "m.onnx"
    assert cli("export-onnx", "examples/tiny_moe", "--out", str(onnx)).returncode == 0
    data = tmp_path / "d.txt"
    data.write_text(TEXT)
    r = cli("trace", str(onnx), "--data", str(data), "--speculate", "1", "--out", str(tmp_path / "o.npz"))
    assert r.returncode == 2 and r.stderr.startswith("error: --speculate") and "Traceback" not in r.stderr
    assert not (tmp_path / "o.npz").exists()
    assert cli("trace", str(onnx), "--data", str(data), "--out", str(tmp_path / "o.npz")).returncode == 0


def _speculated(T=4, L=3, D=2, K=2, E=5, seed=0):
    rng = np.random.default_rng(seed)
    experts = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(L)]) for _ in range(T)])
    spec = rng.integers(0, E, (T, L, D, K))
    return make_trace(experts, num_experts=E, speculation=spec, speculation_source="residual")


def test_format_round_trip_select_and_validation(tmp_path):
    trace = _speculated()
    save_trace(trace, tmp_path / "t.npz")
    back = load_trace(tmp_path / "t.npz")
    np.testing.assert_array_equal(back.speculation, trace.speculation)
    assert back.speculation_source == "residual" and back.speculation_depth == 2
    part = back.select(np.array([1, 3]))
    np.testing.assert_array_equal(part.speculation, trace.speculation[[1, 3]])
    with pytest.raises(UserError, match="'speculation' has shape"):
        make_trace(trace.experts, num_experts=5, speculation=np.zeros((4, 3, 2, 3), int), speculation_source="residual")
    with pytest.raises(UserError, match="expert id 7"):
        make_trace(trace.experts, num_experts=5, speculation=np.full((4, 3, 1, 2), 7), speculation_source="residual")
    with pytest.raises(UserError, match="speculation source"):
        make_trace(trace.experts, num_experts=5, speculation=trace.speculation, speculation_source="attention")
    np.savez(tmp_path / "v1.npz", experts=trace.experts, version=np.int64(1), speculation=trace.speculation)
    with pytest.raises(UserError, match="version 1.*unknown arrays"):
        load_trace(tmp_path / "v1.npz")
    np.savez(tmp_path / "bad.npz", experts=trace.experts, version=np.int64(2), speculation=trace.speculation,
             speculation_source=np.int64(9))
    with pytest.raises(UserError, match="'speculation_source' is 9"):
        load_trace(tmp_path / "bad.npz")


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 6), L=st.integers(2, 5), K=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_recall_is_one_for_the_truth_zero_for_disjoint_guesses_and_a_share_between(T, L, K, seed):
    rng = np.random.default_rng(seed)
    E = 2 * K + 1
    experts = np.stack([np.stack([rng.permutation(K)[:K] for _ in range(L)]) for _ in range(T)])  # ids < K
    truth = np.full((T, L, 1, K), -1)
    truth[:, : L - 1, 0] = experts[:, 1:][..., ::-1]  # order does not matter
    assert speculation_recall(experts, truth) == {"1": 1.0}
    assert speculation_recall(experts, np.where(truth >= 0, truth + K, -1)) == {"1": 0.0}  # ids >= K: never right
    guess = rng.integers(0, E, (T, L, 2, K))
    r = speculation_recall(experts, guess)
    assert set(r) == {"1", "2"} and all(0.0 <= v <= 1.0 for v in r.values())
    hits = sum(len(set(experts[t, l + 1]) & set(guess[t, l, 0])) for t in range(T) for l in range(L - 1))
    assert r["1"] == pytest.approx(hits / (T * (L - 1) * K))

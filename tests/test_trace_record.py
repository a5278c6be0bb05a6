"""Trace recording: the recorded routing is the model's own, attention ids agree with an independent
computation, HF MoE models plug in, and bad input fails in one line. (Torch vs ONNX equality of the
same text's routing is in test_onnx_trace.py.)"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moeplan.passes.analysis.trace.record import batch_sequences, chunk_tokens, record_trace
from moeplan.passes.analysis.trace.format import load_trace
from moeplan.planner.cli import main
from moeplan.core.errors import UserError
from moeplan.passes.importers import LoadedModel, load_model
from moeplan.passes.importers.torch_module import import_module

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_moe"
HELDOUT = (EXAMPLE / "corpus_heldout.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def example():
    return load_model(str(EXAMPLE))


def reference_routing(model, input_ids: torch.Tensor):
    """Per MoE layer: route() on the layer's actual input, and the attention argmax recomputed
    from the attention weights (not from the `probs` hook point)."""
    moe_inputs, attn_inputs = [], []
    handles = []
    for block in model.blocks:
        handles.append(block.moe.register_forward_pre_hook(lambda m, args: moe_inputs.append(args[0])))
        handles.append(block.attn.register_forward_pre_hook(lambda m, args: attn_inputs.append(args[0])))
    with torch.no_grad():
        model(input_ids)
    for h in handles:
        h.remove()
    B, S = input_ids.shape
    routes, attention = [], []
    with torch.no_grad():
        for block, x_moe, x_attn in zip(model.blocks, moe_inputs, attn_inputs):
            _, ids, weights = block.moe.route(x_moe.reshape(B * S, -1))
            routes.append((ids.numpy(), weights.numpy()))
            attn = block.attn
            q, k, _ = attn.qkv(x_attn).view(B, S, 3, attn.num_heads, attn.head_dim).unbind(2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(attn.head_dim)
            scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
            best = scores.softmax(-1).sum(1).argmax(-1)  # [B, S]
            attention.append(torch.gather(input_ids, 1, best).reshape(-1).numpy())
    return routes, np.stack(attention, axis=1)


def test_recorded_experts_are_the_models_own_top_k(example):
    text = HELDOUT[:1200]
    seq_len, batch = 64, 4
    trace = record_trace(example, text, batch=batch, seq_len=seq_len)
    data = np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)
    assert trace.num_tokens == len(data)
    assert trace.token_ids.tolist() == data.tolist()
    assert trace.positions.tolist() == [i % seq_len for i in range(len(data))]
    assert trace.sequence.tolist() == [i // seq_len for i in range(len(data))]
    assert trace.num_experts == 16 and trace.experts.shape[1:] == (6, 2)

    row = 0
    for input_ids in batch_sequences(chunk_tokens(data, seq_len), batch):
        routes, attention = reference_routing(example.module, torch.as_tensor(input_ids))
        n = input_ids.size
        for layer, (ids, weights) in enumerate(routes):
            assert np.array_equal(trace.experts[row: row + n, layer], ids)
            np.testing.assert_allclose(trace.weights[row: row + n, layer], weights, rtol=1e-6)
        assert np.array_equal(trace.attention_ids[row: row + n], attention)
        row += n
    assert row == trace.num_tokens
    assert np.all(np.diff(trace.weights, axis=2) <= 0)  # heaviest first


def test_recording_is_deterministic_and_respects_max_tokens(example):
    a = record_trace(example, HELDOUT, max_tokens=300, batch=3, seq_len=50)
    b = record_trace(example, HELDOUT, max_tokens=300, batch=3, seq_len=50)
    assert a.num_tokens == 300
    for name in ("experts", "weights", "token_ids", "positions", "sequence", "attention_ids"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_token_batches_keep_their_rows_as_sequences(example):
    ids = np.frombuffer(HELDOUT[:96].encode(), dtype=np.uint8).astype(np.int64).reshape(3, 32)
    trace = record_trace(example, [ids], seq_len=32)
    assert trace.sequence.tolist() == [i // 32 for i in range(96)]
    text_trace = record_trace(example, HELDOUT[:96], seq_len=32)
    assert np.array_equal(trace.experts, text_trace.experts)


def test_chunking_and_batching():
    chunks = chunk_tokens(np.arange(10), 4)
    assert [c.tolist() for c in chunks] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.shape for b in batch_sequences(chunks, 8)] == [(2, 4), (1, 2)]
    assert [b.shape for b in batch_sequences(chunks, 1)] == [(1, 4), (1, 4), (1, 2)]
    assert [c.tolist() for c in chunk_tokens(np.arange(10), 4, max_tokens=5)] == [[0, 1, 2, 3], [4]]


# ---- Hugging Face transformers 5 MoE models -------------------------------------------------

def tiny_hf(model_type):
    transformers = pytest.importorskip("transformers")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    extra = {
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True),
        "qwen3_moe": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16, head_dim=8),
    }[model_type]
    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, bos_token_id=0, pad_token_id=None, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    return model, LoadedModel(ir=import_module(model, name=model_type), module=model)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_hf_moe_routing_and_attention_are_captured(model_type):
    model, loaded = tiny_hf(model_type)
    text = "def f(x):\n    return x + 1\n"
    assert model.config._attn_implementation == "sdpa"  # returns no probabilities: the recorder switches
    trace = record_trace(loaded, text, batch=2, seq_len=16)
    assert model.config._attn_implementation == "sdpa"  # ... and switches back
    ids = torch.as_tensor(np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64))
    K = model.config.num_experts_per_tok
    assert trace.experts.shape == (len(ids), 2, K)

    model.set_attn_implementation("eager")
    inputs = []
    handles = [layer.mlp.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
               for layer in model.model.layers]
    with torch.no_grad():
        first = ids[:16][None]
        out = model(input_ids=first, output_attentions=True, use_cache=False)
    for h in handles:
        h.remove()
    for layer, (block, x) in enumerate(zip(model.model.layers, inputs)):
        with torch.no_grad():
            _, weights, experts = block.mlp.gate(x.reshape(-1, x.shape[-1]))
        order = torch.argsort(-weights, dim=-1, stable=True)
        assert np.array_equal(trace.experts[:16, layer], torch.gather(experts, 1, order).numpy())
        probs = out.attentions[layer][0].sum(0)  # [S, S]
        assert np.array_equal(trace.attention_ids[:16, layer], first[0][probs.argmax(-1)].numpy())


def test_meta_model_cannot_be_traced():
    model, loaded = tiny_hf("mixtral")
    loaded.has_weights = False
    with pytest.raises(UserError, match="no weights"):
        record_trace(loaded, "some text")


# ---- CLI and bad input ----------------------------------------------------------------------

def test_trace_cli_writes_the_documented_arrays(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(HELDOUT[:500])
    out = tmp_path / "trace.npz"
    result = CliRunner().invoke(main, ["trace", str(EXAMPLE), "--data", str(data), "--out", str(out),
                                       "--max-tokens", "300", "--batch", "2", "--seq-len", "100"])
    assert result.exit_code == 0, result.output
    assert "300 tokens x 6 MoE layers" in result.output
    with np.load(out) as npz:
        assert sorted(npz.files) == ["attention_ids", "experts", "num_experts", "positions", "sequence",
                                     "token_ids", "version", "weights"]
        assert npz["experts"].shape == (300, 6, 2) and npz["weights"].dtype == np.float32
        assert npz["attention_ids"].shape == (300, 6) and int(npz["num_experts"]) == 16
    trace = load_trace(out)
    assert trace.sequence.max() == 2
    quiet = CliRunner().invoke(main, ["trace", str(EXAMPLE), "--data", str(data), "--out", str(tmp_path / "q.npz"),
                                      "--max-tokens", "50", "--quiet"])
    assert quiet.exit_code == 0 and quiet.output == ""


@pytest.mark.parametrize("setup, args, message", [
    (lambda d: None, [], "does not exist"),
    (lambda d: d.write_text("  \n"), [], "is empty"),
    (lambda d: d.write_bytes(b"\xff\xfe\xfa"), [], "not UTF-8"),
    (lambda d: d.mkdir(), [], "is not a file"),
    (lambda d: d.write_text("hello"), ["--seq-len", "1000"], "exceeds the model's 256 positions"),
    (lambda d: d.write_text("hello"), ["--batch", "0"], "--batch must be a positive"),
    (lambda d: d.write_text("hello"), ["--max-tokens", "0"], "--max-tokens must be a positive"),
])
def test_bad_data_fails_in_one_line_without_output(tmp_path, setup, args, message):
    data = tmp_path / "data.txt"
    setup(data)
    out = tmp_path / "out" / "trace.npz"
    result = CliRunner().invoke(main, ["trace", str(EXAMPLE), "--data", str(data), "--out", str(out), *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert message in result.output
    assert not out.exists()


def test_missing_model_fails_in_one_line(tmp_path):
    data = tmp_path / "data.txt"
    data.write_text("hello")
    result = CliRunner().invoke(main, ["trace", str(tmp_path / "nomodel"), "--data", str(data),
                                       "--out", str(tmp_path / "t.npz")])
    assert result.exit_code == 2 and result.output.startswith("error: ")
    assert not (tmp_path / "t.npz").exists()


def test_the_readme_s_trace_command_reads_traffic_as_the_readme_says(tmp_path, monkeypatch):
    """Issue 40: the README said traffic.txt is "one prompt per line"; 40 lines gave 10 sequences. The README
    now says it is one text cut into --seq-len windows, and names --one-per-line for a prompt log: its own
    command, run here on 40 lines, gives what it says."""
    import re
    import shlex

    readme = (EXAMPLE.parents[1] / "README.md").read_text(encoding="utf-8")
    line = next(l for l in readme.splitlines() if l.startswith("moeplan trace examples/qwen3_moe --data traffic.txt"))
    assert "one text, cut into windows" in line and "--one-per-line" in readme and "one prompt per line)" not in readme
    args = shlex.split(line.split("#")[0])[1:]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(EXAMPLE.parents[1] / "examples")
    (tmp_path / "traffic.txt").write_text("".join(f"question {i}: what does the import statement do?\n" for i in range(40)))

    def sequences(extra):
        result = CliRunner().invoke(main, args + extra)
        assert result.exit_code == 0, result.output
        trace = load_trace(tmp_path / "trace.npz")
        assert f"in {int(trace.sequence.max()) + 1} sequence(s)" in result.output
        return trace

    windows = sequences([])
    seq_len = int(re.search(r"windows of `--seq-len` tokens \(default: the model's positions, at most (\d+)\)", readme).group(1))
    assert int(windows.sequence.max()) + 1 == math.ceil(windows.num_tokens / seq_len) < 40
    assert int(windows.positions.max()) == seq_len - 1  # every position a window reaches
    per_line = sequences(["--one-per-line"])
    assert int(per_line.sequence.max()) + 1 == 40 and int(per_line.positions.max()) < seq_len
    assert np.all(per_line.positions[per_line.sequence != np.roll(per_line.sequence, 1)] == 0)  # each from position 0

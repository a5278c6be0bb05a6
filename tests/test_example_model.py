"""The committed TinyMoE checkpoint: small, loads as fp32, predicts held-out text and routes with
real inter-layer affinity; training is deterministic."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeplan.passes.analysis.trace.record import record_trace
from moeplan.passes.analysis.trace.stats import routing_stats
from moeplan.passes.importers import load_model
from moeplan.passes.importers.resolve import import_file

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_moe"
CHECKPOINT = EXAMPLE / "model.safetensors"
HELDOUT_TOKENS = 8192


def _import(name: str):
    return import_file(EXAMPLE / f"{name}.py")


@pytest.fixture(scope="module")
def trained():
    assert CHECKPOINT.is_file(), "examples/tiny_moe/model.safetensors is committed; run examples/tiny_moe/train.py"
    return load_model(str(EXAMPLE))


@pytest.fixture
def restore_torch_settings():
    """Training switches torch to deterministic algorithms and 2 threads; give other tests theirs back."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def test_checkpoint_is_small_and_matches_the_config(trained):
    assert CHECKPOINT.stat().st_size < 8e6
    config = json.loads((EXAMPLE / "config.json").read_text())
    assert (config["num_layers"], config["num_experts"], config["top_k"]) == (6, 16, 2)
    assert all(p.dtype == torch.float32 for p in trained.module.parameters())
    assert len(trained.ir.moe_stages) == 6


def test_checkpoint_predicts_held_out_text(trained):
    data = (EXAMPLE / "corpus_heldout.txt").read_bytes()[: 16 * 128 + 1]
    ids = torch.tensor(list(data))
    with torch.no_grad():
        logits = trained.module(ids[:-1].view(16, 128))
    loss = F.cross_entropy(logits.reshape(-1, 256), ids[1:]).item()
    assert loss < 0.5 * math.log(256)  # uniform guessing is ln 256 = 5.55 nats per byte


def test_trained_routing_has_affinity_well_above_chance(trained):
    text = (EXAMPLE / "corpus_heldout.txt").read_text(encoding="utf-8")
    stats = routing_stats(record_trace(trained, text, max_tokens=HELDOUT_TOKENS, batch=16, seq_len=128))
    assert stats.mean_affinity > 0.5
    assert stats.mean_affinity > 2.5 * stats.mean_shuffled_affinity
    assert min(stats.affinity) > 2 * max(stats.shuffled_affinity)
    assert stats.uniform_affinity < 0.1
    assert all(layer.idle_experts == 0 for layer in stats.loads)  # the balance loss keeps every expert in use


TINY = dict(vocab_size=256, hidden_size=16, num_layers=6, num_heads=2, num_experts=16, top_k=2,
            expert_hidden=8, shared_experts=0, max_positions=32, norm_eps=1e-5)


def _train_tiny(train, seed):
    model, _ = train.train(TINY, steps=3, seed=seed, batch=2, seq_len=16, lr=1e-2, warmup=1,
                           weight_decay=0.01, balance_weight=0.01, log_every=0, heldout=False)
    return model.state_dict()


def test_training_is_deterministic(restore_torch_settings):
    train = _import("train")
    first, second, other = _train_tiny(train, 0), _train_tiny(train, 0), _train_tiny(train, 1)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_saved_weights_load_back_as_fp32_and_if_missing_skips(tmp_path, restore_torch_settings, capsys):
    train = _import("train")
    model_lib = _import("model")
    torch.manual_seed(0)
    model = model_lib.TinyMoE(model_lib.TinyMoEConfig.from_dict(TINY))
    (tmp_path / "config.json").write_text(json.dumps({"moeplan_loader": "model.py:load", **TINY}))
    path = train.save_weights(model, tmp_path)
    loaded = model_lib.load(tmp_path)
    for name, value in model.state_dict().items():
        restored = loaded.state_dict()[name]
        assert restored.dtype == torch.float32
        assert torch.equal(restored, value.half().float())
    before = path.read_bytes()
    assert train.main(["--out", str(tmp_path), "--if-missing"]) == 0
    assert "not retraining" in capsys.readouterr().out
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_what_the_demo_and_readme_say_about_the_example_model_is_true(trained, tmp_path):
    """Issue 40: the demo's reply is noise and nothing said why; the demo (examples/serve_demo.py) and the
    README now say what the example model is. Its numbers: parameters, steps and held-out loss."""
    import re

    from moeplan.core.plan import Plan

    demo = import_file(EXAMPLE.parent / "serve_demo.py")
    readme = (EXAMPLE.parents[1] / "README.md").read_text(encoding="utf-8")
    for text in (demo.EXAMPLE_MODEL, " ".join(readme.split())):
        millions = float(re.search(r"([\d.]+) M parameters", text).group(1))
        assert millions == round(trained.ir.total_params / 1e6, 1)
        assert f"trained for {_import('train').DEFAULTS['steps']} steps" in text
    loss = float(re.search(r"held-out loss \(about ([\d.]+) nats per byte\)", " ".join(readme.split())).group(1))
    data = (EXAMPLE / "corpus_heldout.txt").read_bytes()[: 64 * 128 + 1]
    ids = torch.tensor(list(data))
    with torch.no_grad():
        logits = trained.module(ids[:-1].view(64, 128))
    assert abs(F.cross_entropy(logits.reshape(-1, 256), ids[1:]).item() - loss) < 0.1
    # the demo's own line, read from a bundle's plan.json
    from moeplan.passes.analysis.trace.format import save_trace
    from moeplan.planner.pipeline import flags, targets

    save_trace(record_trace(trained, (EXAMPLE / "corpus_heldout.txt").read_text()[:600], seq_len=64), tmp_path / "t.npz")
    outcome = targets.plan_target("torchrun", str(EXAMPLE), str(tmp_path / "t.npz"), tmp_path / "plan.json",
                                  flags.resolve({"gpus_per_node": 2, "policy": "eplb"}, compile_only=False), {"gpus_per_node", "policy"},
                                  quiet=True)
    assert isinstance(outcome.plan, Plan)
    assert demo.about(tmp_path) == f"model: {demo.EXAMPLE_MODEL}"

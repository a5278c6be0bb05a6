"""Torch importer and `load_model`: TinyMoE figures by hand, the shared stage rule, load paths, errors."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from moeplan.core.errors import UserError
from moeplan.passes.importers import load_model
from moeplan.passes.importers.stages import Param, build_model_ir, classify_parameter_groups
from moeplan.passes.importers.torch_module import import_module, module_params

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny_moe"
sys.path.insert(0, str(EXAMPLE))
from model import TinyMoE, TinyMoEConfig  # noqa: E402

# A TinyMoE with every size spelled out, counted by hand: D=128, V=256, 256 positions, 6 blocks,
# 16 SwiGLU experts of width 128.
D, V, POS, LAYERS, E, I = 128, 256, 256, 6, 16, 128
SIZES = dict(vocab_size=V, hidden_size=D, num_layers=LAYERS, num_heads=4, num_experts=E, top_k=2,
             expert_hidden=I, shared_experts=0, max_positions=POS)
EMBED = V * D
ATTN = D * 3 * D + D * D
NORM = D
ROUTER = E * D
EXPERT = 3 * D * I
MOE = ROUTER + E * EXPERT
HEAD = V * D
TOTAL = EMBED + POS * D + LAYERS * (NORM + ATTN + NORM + MOE) + NORM + HEAD


def hand_count(c: dict) -> int:
    """TinyMoE parameters from its config, by the same hand formula."""
    d, e = c["hidden_size"], c["num_experts"]
    expert = 3 * d * c["expert_hidden"]
    block = 2 * d + 4 * d * d + e * d + (e + c.get("shared_experts", 0)) * expert
    return (c["vocab_size"] + c["max_positions"]) * d + c["num_layers"] * block + d + c["vocab_size"] * d


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TinyMoE(TinyMoEConfig(**SIZES)).eval()


def test_tiny_moe_figures_match_hand_counts(tiny):
    ir = import_module(tiny, name="tiny_moe")
    assert TOTAL == 5_224_064 == hand_count(SIZES)
    assert ir.total_params == TOTAL == sum(p.numel() for p in tiny.parameters())
    assert ir.total_param_bytes == 4 * TOTAL
    assert (ir.hidden_size, ir.vocab_size, ir.dtype, ir.architecture) == (D, V, "float32", "TinyMoE")
    assert len(ir.moe_stages) == LAYERS
    moe = ir.moe_stages[0]
    assert (moe.name, moe.num_experts, moe.top_k, moe.shared_experts) == ("blocks.0.moe", E, 2, 0)
    assert (moe.router_params, moe.expert_params, moe.params) == (ROUTER, EXPERT, MOE)
    assert moe.expert_param_bytes == 4 * EXPERT
    assert moe.flops_per_token == 2 * (ROUTER + 2 * EXPERT)
    assert moe.expert_flops_per_token == 2 * EXPERT
    assert moe.activation_bytes_per_token == 4 * D
    assert ir.dense_params == TOTAL - LAYERS * E * EXPERT
    head = ir.stages[-1]
    assert (head.kind, head.params, head.flops_per_token, head.activation_bytes_per_token) == (
        "head", HEAD, 2 * HEAD, 4 * V)
    norm = ir.stages[2]
    assert (norm.kind, norm.flops_per_token) == ("norm", 4 * D)
    assert ir.stages[0].flops_per_token == 0  # an embedding is a lookup


def test_tiny_moe_stages_are_modules_in_forward_order(tiny):
    ir = import_module(tiny)
    block = ["attn_norm", "attn", "moe_norm", "moe"]
    expected = ["embed", "pos_embed"] + [f"blocks.{i}.{m}" for i in range(LAYERS) for m in block] + [
        "final_norm", "head"]
    assert [s.name for s in ir.stages] == expected
    assert [s.kind for s in ir.stages[:6]] == ["embedding", "embedding", "norm", "attention", "norm", "moe"]
    assert all(s.source == s.name for s in ir.stages)
    assert [s.moe_index for s in ir.moe_stages] == list(range(LAYERS))


def test_names_and_shapes_alone_reproduce_the_torch_import(tiny):
    """The contract the ONNX importer relies on: initializer names + shapes + TopK k give the same IR."""
    ir = import_module(tiny, name="tiny_moe")
    listed = [(n, tuple(p.shape), "float32") for n, p in tiny.named_parameters()]
    groups = classify_parameter_groups(listed)
    again = build_model_ir(groups, name="tiny_moe", architecture="TinyMoE",
                           top_k={g.name: 2 for g in groups if g.is_moe}, source_format="onnx")
    assert again == ir


def test_shared_experts_are_counted_separately():
    cfg = TinyMoEConfig(num_layers=1, num_experts=4, shared_experts=2, hidden_size=32, expert_hidden=16,
                        num_heads=2, max_positions=16)
    ir = import_module(TinyMoE(cfg))
    moe = ir.moe_stages[0]
    expert = 3 * 32 * 16
    assert (moe.shared_experts, moe.shared_expert_params, moe.expert_params) == (2, 2 * expert, expert)
    assert moe.params == 4 * 32 + 4 * expert + 2 * expert
    assert moe.flops_per_token == 2 * (4 * 32 + 2 * expert + 2 * expert)


def test_fused_experts_and_tied_head_by_structure():
    """A generic fused-expert block (any names) and a tied head: params once, head FLOPs still charged."""
    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(8, 4, bias=True)
            self.banks = nn.ParameterDict({"w_in": nn.Parameter(torch.zeros(4, 12, 8)),
                                           "w_out": nn.Parameter(torch.zeros(4, 8, 6))})
            self.k = 3

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(10, 8)
            self.block = Fused()
            self.lm_head = nn.Linear(8, 10, bias=False)
            self.lm_head.weight = self.wte.weight

    net = Net()
    ir = import_module(net)
    assert [s.kind for s in ir.stages] == ["embedding", "moe", "head"]
    moe, head = ir.stages[1], ir.stages[2]
    assert (moe.num_experts, moe.top_k, moe.router_params, moe.expert_params) == (4, 3, 36, 12 * 8 + 8 * 6)
    assert ir.total_params == sum(p.numel() for p in net.parameters()) == 80 + 36 + 4 * 144
    assert (head.params, head.flops_per_token) == (0, 2 * 80)
    assert [p.tied_to for p in module_params(net)][-1] == "wte.weight"


def test_stages_follow_forward_order_not_registration_order():
    """Read from the forward code: call arguments run first, helper methods are followed."""
    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.gate = nn.Linear(8, 4)
            self.top_k = 1

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(8, 10)
            self.moe = Router()
            self.norm = nn.LayerNorm(8)
            self.embed = nn.Embedding(10, 8)

        def forward(self, ids):
            return self.lm_head(self._body(self.embed(ids)))

        def _body(self, x):
            return self.moe(self.norm(x))

    ir = import_module(Net())
    assert [s.name for s in ir.stages] == ["embed", "norm", "moe", "lm_head"]


def test_expert_list_needs_a_matching_router():
    groups = classify_parameter_groups([
        Param("layers.0.w", (8, 8)), Param("layers.1.w", (8, 8)), Param("proj.weight", (3, 8)),
    ])
    assert not any(g.is_moe for g in groups)
    assert [(g.name, g.kind) for g in groups] == [("layers.0", "other"), ("layers.1", "other"), ("proj", "other")]


def test_load_example_directory():
    loaded = load_model(str(EXAMPLE))
    assert loaded.ir.name == "tiny_moe"
    assert loaded.has_weights and loaded.module is not None and loaded.onnx_path is None
    config = json.loads((EXAMPLE / "config.json").read_text())
    assert loaded.ir.total_params == hand_count(config)
    assert len(loaded.ir.moe_stages) == config["num_layers"]


def _small_model_dir(tmp_path):
    """A moeplan model directory holding a small TinyMoE config and the example's model code."""
    shutil.copy(EXAMPLE / "model.py", tmp_path / "model.py")
    cfg = {"moeplan_loader": "model.py:load", "model_type": "tiny_moe", "hidden_size": 16, "num_layers": 2,
           "num_heads": 2, "num_experts": 4, "top_k": 2, "expert_hidden": 8, "max_positions": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return TinyMoE(TinyMoEConfig.from_dict(cfg))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_checkpoint_file_loads_its_weights(tmp_path, suffix):
    torch.manual_seed(1)
    model = _small_model_dir(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    ckpt = tmp_path / f"trained{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file(state, str(ckpt))
    else:
        torch.save({"state_dict": state}, ckpt)
    loaded = load_model(str(ckpt))
    assert loaded.has_weights
    for name, tensor in loaded.module.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert loaded.ir == import_module(model, name="tiny_moe")


def test_checkpoint_that_does_not_fit_is_a_user_error(tmp_path):
    _small_model_dir(tmp_path)
    from safetensors.torch import save_file
    save_file({"embed.weight": torch.zeros(3, 3)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(UserError, match="does not fit"):
        load_model(str(tmp_path / "bad.safetensors"))


def test_factory_spec(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(EXAMPLE)!r})\n"
        "from model import TinyMoE, TinyMoEConfig\n"
        "import torch.nn as nn\n"
        "def small():\n"
        "    return TinyMoE(TinyMoEConfig(num_layers=1, hidden_size=16, num_heads=2, num_experts=4,"
        " expert_hidden=8, max_positions=8))\n"
        "def dense():\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))\n"
        "def broken():\n"
        "    raise RuntimeError('no such checkpoint')\n"
        "NOT_A_FACTORY = 3\n"
    )
    monkeypatch.chdir(tmp_path)
    loaded = load_model("my_models:small")
    assert loaded.ir.name == "my_models:small" and len(loaded.ir.moe_stages) == 1
    assert load_model(f"{tmp_path / 'my_models.py'}:small").ir == loaded.ir
    with pytest.raises(UserError, match="no Mixture-of-Experts layer; moeplan plans MoE models only"):
        load_model("my_models:dense")
    with pytest.raises(UserError, match="failed: RuntimeError: no such checkpoint"):
        load_model("my_models:broken")
    with pytest.raises(UserError, match="no callable"):
        load_model("my_models:NOT_A_FACTORY")
    with pytest.raises(UserError, match="cannot import 'no_such_pkg.models'"):
        load_model("no_such_pkg.models:build")


@pytest.mark.parametrize("setup, spec, message", [
    (None, "missing_dir/model", "not found"),
    ("empty_dir", "d", "has no config.json"),
    ("bad_json", "d/config.json", "is not valid JSON (line 1"),
    ("list_json", "d/config.json", "not an object"),
    ("no_model_type", "d/config.json", "has no \"model_type\""),
    ("unknown_type", "d/config.json", "unknown model_type 'not_a_model'"),
    ("missing_loader", "d", "model code"),
    ("bad_loader", "d", "must be \"file.py:function\""),
    ("orphan_ckpt", "d/w.safetensors", "has no config.json beside it"),
    ("text_file", "d/notes.txt", "unsupported model file type '.txt'"),
])
def test_bad_inputs_are_one_line_user_errors(tmp_path, monkeypatch, setup, spec, message):
    d = tmp_path / "d"
    d.mkdir()
    files = {
        "bad_json": {"config.json": "{\"model_type\": "},
        "list_json": {"config.json": "[1, 2]"},
        "no_model_type": {"config.json": "{\"hidden_size\": 8}"},
        "unknown_type": {"config.json": "{\"model_type\": \"not_a_model\"}"},
        "missing_loader": {"config.json": "{\"moeplan_loader\": \"nowhere.py:load\"}"},
        "bad_loader": {"config.json": "{\"moeplan_loader\": \"model.py\"}"},
        "orphan_ckpt": {"w.safetensors": ""},
        "text_file": {"notes.txt": "hello"},
    }.get(setup, {})
    for name, text in files.items():
        (d / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=message.replace("(", r"\(")) as info:
        load_model(spec)
    assert "\n" not in str(info.value)

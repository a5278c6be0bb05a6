"""The runtime's grouped-query attention (runtime/model/grouped_attention.py) computes what the
library's eager attention computes, without repeating K/V heads, and leaves the modules whose own
eager function differs (gpt-oss's sinks, Llama-4's softmax) to that function."""
import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.passes.importers.resolve import import_file
from moeplan.runtime.model import grouped_attention
from moeplan.runtime.model.library_model import build_transformers

REPO = Path(__file__).resolve().parents[1]
tiny = import_file(REPO / "examples" / "hf_tiny" / "architectures.py")


class _Module(torch.nn.Module):
    """An attention module of a modeling file whose eager function is the library's standard one."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups


_Module.__module__ = "transformers.models.mixtral.modeling_mixtral"


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), g=st.integers(1, 3), n=st.integers(1, 4), q=st.integers(1, 5), extra=st.integers(0, 6),
       d=st.sampled_from([4, 8]), dv=st.sampled_from([4, 6]), mask=st.sampled_from(["none", "rows", "shared"]),
       seed=st.integers(0, 1000))
def test_grouped_equals_the_library_eager_attention(b, g, n, q, extra, d, dv, mask, seed):
    """Shapes: query [B, G*n, Q, d], key [B, G, W, d], value [B, G, W, dv]; masks per row or shared (batch 1)."""
    from transformers.models.mixtral.modeling_mixtral import eager_attention_forward

    gen = torch.Generator().manual_seed(seed)
    w = q + extra
    query = torch.randn(b, q, g * n, d, generator=gen).transpose(1, 2)  # the modules' transposed layout
    key, value = torch.randn(b, g, w, d, generator=gen), torch.randn(b, g, w, dv, generator=gen)
    additive = None
    if mask != "none":
        keep = torch.rand(b if mask == "rows" else 1, 1, q, w, generator=gen) > 0.3
        keep[..., -1] = True
        additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    module = _Module(n).eval()
    out, weights = grouped_attention.grouped_attention(module, query, key, value, additive, scaling=d ** -0.5)
    ref_out, ref_weights = eager_attention_forward(module, query, key, value, additive, scaling=d ** -0.5)
    assert out.shape == ref_out.shape == (b, q, g * n, dv)
    assert torch.allclose(out, ref_out, atol=1e-6) and torch.allclose(weights, ref_weights, atol=1e-6)


@pytest.fixture(scope="module")
def built():
    root = Path(tempfile.mkdtemp())
    return {arch: tiny.build(arch, root / arch) for arch in tiny.ARCHITECTURES}


def test_modules_with_their_own_eager_attention_keep_it(built):
    """Every tiny architecture's attention takes the grouped path except those whose eager function differs."""
    own = {}
    for arch, directory in built.items():
        model = build_transformers(directory, device="meta")
        classes = {type(m) for m in model.modules() if type(m).__name__.endswith("Attention")}
        own[arch] = all(grouped_attention.own_eager(c)[1] for c in classes if grouped_attention.own_eager(c)[0] is not None)
    assert {arch for arch, standard in own.items() if not standard} == {"gpt_oss", "llama4_text"}


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_a_library_model_gives_eager_logits_with_the_grouped_kernel(built, arch, monkeypatch):
    """A left-padded batch and one cached decode step through the library model: the grouped kernel's
    logits equal eager attention's; on the grouped path no K/V head is repeated."""
    import transformers

    directory = built[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation=grouped_attention.register())
    model.eval()
    config = json.loads((directory / "config.json").read_text())
    ids = torch.randint(3, config["vocab_size"], (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])

    def run():
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, use_cache=True)
            step = model(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1),
                         cache=first.past_key_values, use_cache=True)
        return torch.cat([first.logits[:, -1], step.logits[:, -1]])

    assert model.config._attn_implementation == grouped_attention.NAME
    modeling = __import__(type(model).__module__, fromlist=["repeat_kv"])
    if arch == "qwen3_moe":  # the grouped path never repeats K/V
        monkeypatch.setattr(modeling, "repeat_kv", lambda *a: (_ for _ in ()).throw(AssertionError("repeat_kv ran")))
    grouped = run()
    monkeypatch.undo()
    model.config._attn_implementation = "eager"
    eager = run()
    assert isinstance(model, transformers.PreTrainedModel)
    assert torch.allclose(grouped, eager, atol=1e-5), (grouped - eager).abs().max()

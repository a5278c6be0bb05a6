"""The KV cache layer with spare columns (runtime/model/growable_cache.py) holds what the library's
`DynamicLayer` holds after any sequence of steps and of the row moves `row_cache.py` makes, writes a
decode step's column into its buffer instead of copying the cache, and never holds more columns than
it is allowed unless its rows need them."""
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moeplan.passes.importers.resolve import import_file
from moeplan.runtime.model.growable_cache import MIN_SPARE, growable_cache, growable_layer_class

REPO = Path(__file__).resolve().parents[1]
tiny = import_file(REPO / "examples" / "hf_tiny" / "architectures.py")

# one step: ("update", columns) | ("select", rows kept, as a bit mask) | ("crop", columns) | ("join", rows, pad)
OPS = st.one_of(st.tuples(st.just("update"), st.integers(1, 3)), st.tuples(st.just("select"), st.integers(1, 7)),
                st.tuples(st.just("crop"), st.integers(1, 3)), st.tuples(st.just("join"), st.integers(1, 2)))


def _apply(layer, op, arg, gen, b: int):
    """Apply one step to `layer` (new K/V drawn from `gen`, the same draws for both layers of a test)."""
    if op == "update":
        k, v = torch.randn(b, 2, arg, 4, generator=gen), torch.randn(b, 2, arg, 4, generator=gen)
        return layer.update(k, v)
    if op == "select":  # row_cache.leave: rows kept along the batch, as new contiguous tensors
        keep = torch.tensor([i for i in range(b) if arg >> (i % 3) & 1] or [0])
        layer.keys, layer.values = (t.index_select(0, keep).contiguous() for t in (layer.keys, layer.values))
        return None
    if op == "crop":
        layer.crop(-min(arg, layer.keys.shape[-2] - 1))
        return None
    # row_cache.join: rows appended, the narrower side padded on the left
    k, v = torch.randn(arg, 2, 2, 4, generator=gen), torch.randn(arg, 2, 2, 4, generator=gen)
    width = max(layer.keys.shape[-2], 2)
    pad = lambda t: torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))
    layer.keys, layer.values = torch.cat([pad(layer.keys), pad(k)]), torch.cat([pad(layer.values), pad(v)])
    return None


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(OPS, max_size=30), prompt=st.integers(1, 6), rows=st.integers(1, 3), cap=st.integers(1, 80),
       seed=st.integers(0, 1000))
def test_it_holds_what_the_library_layer_holds_after_any_steps_and_row_moves(ops, prompt, rows, cap, seed):
    from transformers.cache_utils import DynamicLayer

    plain, growable = DynamicLayer(), growable_layer_class()(cap)
    for layer in (plain, growable):
        gen = torch.Generator().manual_seed(seed)
        k, v = torch.randn(rows, 2, prompt, 4, generator=gen), torch.randn(rows, 2, prompt, 4, generator=gen)
        layer.update(k, v)
        b = rows
        layer.trace = []
        for op, arg in ops:
            out = _apply(layer, op, arg, gen, b)
            b = layer.keys.shape[0]
            layer.trace.append(None if out is None else [t.clone() for t in out])
    assert torch.equal(plain.keys, growable.keys) and torch.equal(plain.values, growable.values)
    assert growable.get_seq_length() == plain.get_seq_length()
    for a, g in zip(plain.trace, growable.trace):  # what each update returned to the attention
        assert (a is None) == (g is None) and (a is None or all(torch.equal(x, y) for x, y in zip(a, g)))
    buffer = getattr(growable, "_key_buffer", None)
    if buffer is not None and growable.keys.data_ptr() == buffer.data_ptr():
        assert buffer.shape[-2] <= max(cap, growable.keys.shape[-2] + max(MIN_SPARE, growable.keys.shape[-2] // 4))


def test_a_decode_step_writes_into_the_buffer_and_grows_it_rarely():
    layer = growable_layer_class()(4096)
    layer.update(torch.randn(3, 2, 10, 4), torch.randn(3, 2, 10, 4))
    grown = 0
    for step in range(300):
        before = getattr(layer, "_key_buffer", None)
        keys, _ = layer.update(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
        grown += layer._key_buffer is not before
        assert keys.shape == (3, 2, 11 + step, 4) and keys.data_ptr() == layer._key_buffer.data_ptr()
    assert grown <= 300 // MIN_SPARE + 1  # one copy per growth of MIN_SPARE columns or more, not one per step


def test_the_spare_columns_stop_at_the_allowed_columns():
    layer = growable_layer_class()(12)
    layer.update(torch.randn(1, 1, 10, 2), torch.randn(1, 1, 10, 2))
    layer.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    assert layer._key_buffer.shape[-2] == 12  # not 11 + MIN_SPARE
    layer.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
    layer.update(torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))  # beyond the allowed: what the rows need
    assert layer.keys.shape[-2] == 13 and layer._key_buffer.shape[-2] == 13


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_a_library_model_gives_the_same_logits_over_the_growable_cache(arch):
    """Prefill and 6 decode steps of a left-padded batch: logits over the growable cache equal those over the
    library's own DynamicCache, bit for bit; gpt-oss's sliding-window layers stay the library's; DeepSeek-V3's
    latents (MLA) held as compiled and captured steps hold them."""
    import transformers

    directory = tiny.build(arch, Path(tempfile.mkdtemp()) / arch)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])

    def run(cache):
        out, logits, step_mask, step_ids = None, [], mask, ids
        with torch.no_grad():
            for _ in range(7):
                out = model(input_ids=step_ids, attention_mask=step_mask, cache=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits[:, -1])
                step_ids = out.logits[:, -1:].argmax(-1)
                step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        return torch.stack(logits), cache

    reference, _ = run(None)
    grown, cache = run(growable_cache(model.config, 64, latents=True))
    assert torch.equal(reference, grown)
    kinds = {type(layer).__name__ for layer in cache.layers}
    assert "GrowableLayer" in kinds and (arch != "gpt_oss" or "DynamicSlidingWindowLayer" in kinds)


def test_latent_attention_keeps_the_library_layers_in_eager_steps():
    """DeepSeek-V3's MLA projects its whole cached latent every step: in eager steps the library's layers stay
    (spare columns save nothing there); compiled and captured steps hold the latents in spare-column layers."""
    import transformers
    from transformers.cache_utils import DynamicLayer

    directory = tiny.build("deepseek_v3", Path(tempfile.mkdtemp()) / "deepseek_v3")
    config = transformers.AutoConfig.from_pretrained(directory)
    assert all(type(layer) is DynamicLayer for layer in growable_cache(config, 64).layers)
    assert all(type(layer) is growable_layer_class() for layer in growable_cache(config, 64, latents=True).layers)

"""The K/V a Lambda dense function keeps between invocations (runtime/lambda_/kv.py): decoding with the
library's cache rebuilt from stored deltas gives the library's own logits, for full, sliding-window
and linear (recurrent) attention, left-padded prompts of two lengths; the container store hits,
fills what it lacks, and rebuilds. (Functions that hold only some blocks: test_lambda_verify.py,
test_lambda_hf.py, through whole bundles.)"""
import pytest
import torch

from moeplan.runtime.lambda_ import decode
from moeplan.runtime.lambda_ import kv
from moeplan.runtime.lambda_ import wire
from moeplan.runtime.lambda_.model import Batch
from moeplan.passes.importers.resolve import import_file
from runtime_fixtures import EXAMPLE, load_small, small_model_dir

tiny = import_file(EXAMPLE.parent / "hf_tiny" / "architectures.py")
PROMPTS = [[5, 9, 11, 3, 40, 2, 7], [17, 4, 90]]


def through_file(state: dict, append: dict, rows: int) -> tuple:
    """A step's delta as it travels: into a state file's bytes and back."""
    tensors, meta = kv.to_file(kv.delta_of(state, append, rows), append)
    data = wire.to_bytes(tensors, {"kv": meta})
    return kv.from_file(wire.from_bytes(data), wire.meta_of(data)["kv"])


def generate_cold(forward, new_cache, prompts: list, steps: int) -> tuple:
    """Greedy steps where every step's cache is rebuilt from the stored deltas alone (a cold
    container each time). forward(ids, positions, key_mask, cache) -> logits [B, W, V]."""
    doc = decode.initial_state("r", prompts, {"max_tokens": steps, "temperature": 0.0})
    deltas, logits = [], []
    for _ in range(steps):
        past, append = {}, {}
        for delta, grow in deltas:
            append = {**append, **grow}
            past = kv.apply_delta(past, delta, append)
        state = decode.step_rows(doc)
        batch = Batch(state["seq"], state["positions"], state["key_mask"])
        cache, read_back = new_cache(past)
        out = dict(state, logits=batch.unpad(forward(batch.pad(state["ids"]), batch.positions, batch.key_mask, cache)))
        after, grow = read_back(cache)
        deltas.append(through_file(after, grow, decode.rows_per_sequence(state)))
        logits.append(out["logits"][decode.last_rows(out)])
        doc = decode.advance(doc, out)
    return doc["tokens"], logits


def hf_cache(config):
    from transformers.cache_utils import DynamicCache

    def new(past):
        cache = DynamicCache(config=config)
        for i, flat in past.items():
            kv.restore_layer(cache.layers[i], flat)
        return cache, lambda c: ({i: kv.flatten_layer(l) for i, l in enumerate(c.layers)},
                                 {i: kv.append_names(l) for i, l in enumerate(c.layers)})
    return new


def tiny_cache(layers: int):
    def new(past):
        cache = [dict(past.get(i, {})) for i in range(layers)]
        return cache, lambda c: ({i: dict(d) for i, d in enumerate(c)}, {i: {"k", "v"} for i in range(layers)})
    return new


def reference(model_fn, prompts: list, tokens: list) -> list:
    """Per step, [B, V]: the logits of each sequence's last position by full recomputation."""
    out = []
    for t in range(len(tokens[0])):
        rows = [model_fn(torch.tensor([p + g[:t]]))[0, -1] for p, g in zip(prompts, tokens)]
        out.append(torch.stack(rows))
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "qwen3_next", "deepseek_v3"])
def test_decoding_from_stored_deltas_equals_transformers(tmp_path, arch):
    """Full attention (qwen3_moe), sliding windows shorter than the context (gpt_oss), linear
    attention's conv and recurrent states (qwen3_next), MLA (deepseek_v3); prompts of two lengths."""
    import transformers

    path = tiny.build(arch, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if arch == "gpt_oss":
        assert model.config.sliding_window < len(PROMPTS[0]) + 6  # the window binds
    forward = lambda ids, pos, mask, cache: model(input_ids=ids, position_ids=pos, attention_mask=mask.long(),
                                                  cache=cache, use_cache=True).logits
    with torch.no_grad():
        tokens, logits = generate_cold(forward, hf_cache(model.config), PROMPTS, 6)
        ref = reference(lambda ids: model(input_ids=ids).logits, PROMPTS, tokens)
    for mine, theirs in zip(logits, ref):
        assert float((mine - theirs).abs().max()) <= 1e-4
    for p, g in zip(PROMPTS, tokens):
        with torch.no_grad():
            greedy = model.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(p):].tolist()
        assert g == greedy


def test_tiny_moe_decodes_from_stored_deltas(tmp_path):
    directory = small_model_dir(tmp_path)
    model = load_small(directory)
    with torch.no_grad():
        tokens, logits = generate_cold(lambda i, p, m, c: model.forward_incremental(i, p, c, m),
                                       tiny_cache(len(model.blocks)), PROMPTS, 5)
        ref = reference(model, PROMPTS, tokens)
    assert all(float((a - b).abs().max()) <= 1e-5 for a, b in zip(logits, ref))


def test_store_hits_fills_gaps_and_rebuilds_after_a_retry():
    reads = []
    steps = {t: ({0: {"k": torch.full((1, 1, 1, 2), float(t))}}, {0: {"k"}}) for t in range(5)}

    def read(t):
        reads.append(t)
        return steps[t]

    store = kv.Store(budget_bytes=1 << 20)
    state, append = store.load("r", "s000", 3, read)  # cold: reads steps 0, 1, 2
    assert reads == [0, 1, 2] and state[0]["k"][0, 0, :, 0].tolist() == [0, 1, 2]
    after = kv.apply_delta(state, steps[3][0], append)
    store.keep("r", "s000", 4, after, append)
    reads.clear()
    state, _ = store.load("r", "s000", 4, read)  # warm: nothing read
    assert reads == [] and state[0]["k"].shape[-2] == 4 and store.hits == 1
    store.keep("r", "s000", 4, state, append)
    state, _ = store.load("r", "s000", 5, read)  # memory lacks step 4 only
    assert reads == [4] and state[0]["k"][0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    store.keep("r", "s000", 5, state, append)
    reads.clear()
    state, _ = store.load("r", "s000", 2, read)  # a retried earlier step: memory is ahead, rebuild
    assert reads == [0, 1] and state[0]["k"].shape[-2] == 2


def test_store_stays_within_its_budget():
    big = {0: {"k": torch.zeros(1, 1, 100, 10)}}  # 4,000 bytes
    store = kv.Store(budget_bytes=6000)
    store.keep("a", "s000", 1, big, {0: {"k"}})
    store.keep("b", "s000", 1, big, {0: {"k"}})
    assert list(store.entries) == [("b", "s000")]
    store.keep("c", "s000", 1, {0: {"k": torch.zeros(1, 1, 1000, 10)}}, {})
    assert not store.entries  # larger than the budget alone: nothing kept, the next step reads storage


def test_a_cache_attribute_of_an_unknown_type_is_refused():
    class Layer:
        def __init__(self):
            self.keys = torch.zeros(1)
            self.odd = object()

    with pytest.raises(TypeError, match="odd"):
        kv.flatten_layer(Layer())

"""The generation loop's state in a Lambda bundle (runtime/lambda_/decode.py): the rows of each step,
stop tokens, max_tokens, and the end of the loop."""
import torch

from moeplan.runtime.lambda_ import decode


def logits_picking(tokens: list, vocab: int = 16) -> torch.Tensor:
    out = torch.zeros(len(tokens), vocab)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return out


def test_steps_stop_tokens_and_max_tokens():
    doc = decode.initial_state("r", [[1, 2, 3], [4]], {"max_tokens": 3, "temperature": 0.0, "stop_token_ids": [9]})
    rows = decode.step_rows(doc)
    assert rows["ids"].tolist() == [1, 2, 3, 4] and rows["positions"].tolist() == [0, 1, 2, 0]
    assert rows["key_mask"].tolist() == [[True, True, True], [False, False, True]]
    assert decode.last_rows(rows).tolist() == [2, 3]
    # step 0: both pick; step 1: sequence 1 picks the stop token (not emitted), sequence 0 goes on
    doc = decode.advance(doc, dict(rows, logits=logits_picking([5, 6, 7, 8])))
    assert doc["tokens"] == [[7], [8]] and doc["step"] == 1 and not doc["done"] and "prompt" in doc
    rows = decode.step_rows(doc)
    assert rows["ids"].tolist() == [7, 8] and rows["positions"].tolist() == [3, 1]
    assert rows["key_mask"].tolist() == [[True, True, True, True], [False, False, True, True]]
    doc = decode.advance(doc, dict(rows, logits=logits_picking([10, 9])))
    assert doc["tokens"] == [[7, 10], [8]] and doc["finished"] == [None, "stop"] and not doc["done"]
    doc = decode.advance(doc, dict(decode.step_rows(doc), logits=logits_picking([11, 12])))
    assert doc["tokens"] == [[7, 10, 11], [8]] and doc["finished"] == ["length", "stop"] and doc["done"]
    assert not decode.has_next_step(dict(doc, step=2))


def test_seeded_sampling_is_reproducible_per_token():
    gen = {"max_tokens": 4, "temperature": 0.9, "top_p": 0.95, "top_k": 0, "seed": 7}
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    picks = [decode.pick(logits, gen, i)[0] for i in range(20)]
    assert picks == [decode.pick(logits, gen, i)[0] for i in range(20)]
    assert len(set(picks)) > 1  # a new draw per token index, not one fixed sample
    assert decode.pick(logits, dict(gen, temperature=0.0), 0) == [int(logits.argmax())]

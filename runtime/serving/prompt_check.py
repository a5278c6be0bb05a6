"""A checked API request -> the prompt's token ids and the engine's GenerationRequest.

Everything that needs the model is checked here, before the engine sees the request: the model
name, the prompt's ids against the vocabulary, the chat template, and prompt + max_tokens against
the plan's context (`EngineClient.max_context`, the capacity decision); a request that cannot fit
is a 400 (RequestTooLong), as vLLM answers a prompt longer than `max_model_len`. A chat request
without `max_tokens` gets what the context leaves after its prompt (vLLM's default).
"""
from __future__ import annotations

from .api_errors import bad_request
from .api_request import CHAT, ApiRequest
from .contract import GenerationRequest


def prompt_ids(api: ApiRequest, served) -> list:
    """The prompt as token ids: completions' text or ids, or chat messages through the chat format."""
    if api.endpoint == CHAT:
        text = served.chat.render([dict(m) for m in api.messages], api.add_generation_prompt, api.continue_final_message)
        ids = served.codec.encode_text(text, add_special_tokens=served.chat.template is None)
    elif isinstance(api.prompt, str):
        ids = served.codec.encode_text(api.prompt)
    else:
        ids = list(api.prompt)
        bad = [i for i in ids if not 0 <= i < served.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids {bad[:5]} are outside the model's vocabulary of {served.vocab_size}",
                              "prompt")
    if not ids:
        raise bad_request("the prompt encodes to no tokens", "messages" if api.endpoint == CHAT else "prompt")
    return ids


def generation_request(api: ApiRequest, served, ids: list, request_id: str, max_context: int) -> GenerationRequest:
    if api.model is not None and api.model != served.name:
        raise bad_request(f"model '{api.model}' is not served here; this server serves '{served.name}'", "model")
    bad = [i for i in api.stop_token_ids if i >= served.vocab_size]
    if bad:
        raise bad_request(f"stop_token_ids {bad[:5]} are outside the model's vocabulary of {served.vocab_size}",
                          "stop_token_ids")
    room = int(max_context) - len(ids)
    if room < 1:
        raise bad_request(f"the prompt has {len(ids)} tokens and this model's context holds {max_context}; "
                          "shorten the prompt", "messages" if api.endpoint == CHAT else "prompt")
    max_tokens = room if api.max_tokens is None else api.max_tokens
    if max_tokens > room:
        raise bad_request(f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}, together more than this "
                          f"model's context of {max_context} tokens; lower max_tokens to at most {room}", "max_tokens")
    # vLLM's ignore_eos skips the model's end-of-sequence ids but still honours the request's own
    # stop_token_ids, so the EOS ids are left out here rather than switching every stop id off
    eos = () if api.ignore_eos else tuple(served.eos_token_ids)
    return GenerationRequest(request_id=request_id, prompt_ids=tuple(ids), max_tokens=max_tokens,
                             sampling=api.sampling(), stop_token_ids=tuple(dict.fromkeys(eos + api.stop_token_ids)))

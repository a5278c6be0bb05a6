"""Chat messages -> prompt text: the model's own chat template, or a stated plain-text fallback.

Where the template comes from, in the order transformers reads a tokenizer directory:
`model/chat_template.jinja`, else `chat_template` in `model/tokenizer_config.json` (a string, or a
list of named templates of which "default" is taken). It is rendered by transformers' own renderer
(`transformers.utils.chat_template_utils.render_jinja_template`, the sandboxed Jinja environment
`apply_chat_template` uses) with the special tokens the tokenizer config names (`bos_token`,
`eos_token`, ...), so the prompt is the one `tokenizer.apply_chat_template(messages,
add_generation_prompt=True)` gives. The rendered text carries its own special tokens, so it is
encoded without adding more (vLLM's `add_special_tokens=False` default for chat).

Fallback, for models with no template (TinyMoE, whose vocabulary is bytes, and the examples'
Qwen3-MoE, whose tokenizer was trained without one): every message becomes one line
`<role>: <content>` and, with `add_generation_prompt`, a last line `assistant:` (no trailing
space) for the model to continue. It is plain text the model has never been trained to follow, so
it is a format, not an instruction-following promise; `/v1/models` names which one a model uses.
"""
from __future__ import annotations

import json
from pathlib import Path

from .api_errors import bad_request

FALLBACK = "fallback: '<role>: <content>' lines, then 'assistant:'"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatFormat:
    """render(messages, add_generation_prompt, continue_final_message) -> prompt text; `source` says
    which template (a file name, or FALLBACK)."""

    def __init__(self, template: str | None, special_tokens: dict, source: str):
        self.template, self.special_tokens, self.source = template, dict(special_tokens), source

    @classmethod
    def from_model_dir(cls, model_dir: Path | None) -> ChatFormat:
        if model_dir is None:
            return cls(None, {}, FALLBACK)
        config = _read_json(model_dir / "tokenizer_config.json")
        tokens = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if _token_text(config.get(k)) is not None}
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(encoding="utf-8"), tokens, "chat_template.jinja")
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(template, str) and template:
            return cls(template, tokens, "tokenizer_config.json")
        return cls(None, {}, FALLBACK)

    def render(self, messages: list, add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """`messages`: [{"role": str, "content": str, ...}] (content parts already joined to text)."""
        if self.template is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            if continue_final_message:
                return "\n".join(lines)
            return "\n".join(lines + (["assistant:"] if add_generation_prompt else []))
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.template,
                                                add_generation_prompt=add_generation_prompt and not continue_final_message,
                                                continue_final_message=continue_final_message, **self.special_tokens)
        except (TemplateError, ValueError, TypeError) as exc:  # the template's own raise_exception, or a bad shape
            raise bad_request(f"the model's chat template refused the messages: {exc}", "messages") from None
        return rendered[0]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None

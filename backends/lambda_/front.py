"""The HTTP entry of a Lambda bundle: the front function's settings and image requirements.

Why here: the front (runtime/lambda_/front.py) answers the OpenAI API behind a Lambda Function URL
(default) or an API Gateway HTTP API, and how long a request may run and how long a context may be
are set by what stands in front of it:
* time: an HTTP API waits at most 30 s for its integration ("Maximum integration timeout 30
  seconds", API Gateway developer guide, Quotas for HTTP APIs); a Function URL waits for the
  function (up to its timeout), and the synchronous EXPRESS execution the front waits for lasts at
  most 5 minutes (Step Functions developer guide, Standard vs. Express Workflows);
* payload: a Function URL (BUFFERED) and the front's own invocation carry 6 MB each way (Lambda
  quotas, invocation payload); an HTTP API 10 MB, so Lambda's 6 MB binds behind both;
* context: the model's positions, the plan's batch size (what the functions' memory was sized
  for) and a Step Functions execution's 256 KB input, which holds the prompt's ids.
`moeplan plan/compile` refuses a plan whose one-token request would already overrun the time limit
(passes/optimize/serverless/passes.py); the front refuses longer requests with a 400 naming what fits.
"""
from __future__ import annotations

import json

from moeplan.core.platforms import time_limit_s

STATE_LIMIT_BYTES = 256 * 1024
BYTES_PER_ID = 7            # "123456," in the execution's JSON input: vocabularies below a million
ENTRIES = ("function-url", "http-api")
FRONT_TIMEOUT_MARGIN_S = 30  # the front outlives the execution it waits for, to answer its error


def max_context(plan, model_files: dict) -> int:
    """Prompt + new tokens one request may hold (see the module docstring)."""
    config = json.loads(model_files["model/config.json"])
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    positions = int(text.get("max_position_embeddings") or text.get("max_positions") or 1 << 30)
    return min(positions, int(plan.communication.batch_tokens), STATE_LIMIT_BYTES // 2 // BYTES_PER_ID)


def entry(plan, model_files: dict) -> dict:
    """The template's and README's settings of the front function (`plan`: a Plan)."""
    platform = plan.inputs["facts"]["platform"]
    http_entry = plan.deployment.get("http_entry", "function-url")
    limit = time_limit_s(platform, http_entry)
    return {"kind": http_entry, "memory_mb": int(platform.get("front_function_memory_mb", 256)),
            "time_limit_s": limit, "timeout": int(limit) + (0 if http_entry == "http-api" else FRONT_TIMEOUT_MARGIN_S),
            "max_context": max_context(plan, model_files), "api_timeout_ms": int(limit * 1000),
            "payload_limit_bytes": int(plan.deployment["payload_limit_bytes"])}


def settings(plan, entry: dict) -> dict:
    """functions/front.json: what the front serves (the model's name exactly as clients send it, which
    may hold any character, so it stays out of the template), its context and time limit."""
    return {"model_name": str(plan.model["name"]), "max_context": int(entry["max_context"]),
            "time_limit_s": float(entry["time_limit_s"])}


def requirements(model: dict) -> str:
    """The front image's requirements: boto3, the tokenizer library and, for chat templates,
    transformers' renderer and jinja2, at this machine's versions (no torch)."""
    import importlib.metadata

    names = ["boto3", "tokenizers", "jinja2"] + (["transformers"] if "transformers" in model.get("library", {}) else [])
    pins = dict(model.get("library", {}))
    lines = [f"{n}=={pins.get(n) or importlib.metadata.version(n)}" for n in names]
    return "\n".join(sorted(lines)) + "\n"

"""`moeplan run DIR --verify` for a Lambda bundle: greedy generation through the local state machine.

One execution of the bundle's own state machine definition (`lambda_asl.py`, against the local S3 and
Lambda endpoints of `local_cloud.py`) generates every token of every prompt: the prompts' forward,
then one token per sequence per step, each dense function reusing the K/V its earlier
invocations left (`runtime/lambda_/kv.py`). With --verify the functions also write each step's
logits, so the prompt positions (step 0) and every generated position (later steps) are compared
with the source model's, and the greedy tokens too. `recompute=True` runs the former way instead,
kept to measure what it cost: one execution per token, each the forward of the whole sequence.
Measured: invocations, bytes through storage (handlers and client), bytes in payloads, and
billed GB-s = sum over invocations of the handler's measured seconds, rounded up to the billing
granularity, x the function's planned memory; billed dollars add the request fees, the functions'
S3 requests and the EXPRESS executions (`LocalCloud.bill`, the one billing rule of
runtime/lambda_/charges.py). First invocations include loading the weights.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch

from moeplan.planner.launch.lambda_asl import ASLError, Machine
from moeplan.planner.launch.lambda_cloud import CloudError, LocalCloud
from moeplan.runtime.lambda_ import decode
from moeplan.runtime.lambda_ import wire
from moeplan.core.errors import UserError

LOGIT_TOLERANCE = 1e-4


def check_files(root: Path) -> dict:
    """Every bundle file listed with its sha256 and nothing else (manifest.verify_manifest), and the
    lambda plan; one-line UserErrors, before any of the bundle's code or weights is loaded."""
    from moeplan.backends.common.manifest import BundleCheckError, check_model_paths, verify_manifest

    try:
        files = verify_manifest(root)
        if "plan.json" not in files:
            raise BundleCheckError("plan.json is not covered by the manifest; recompile the bundle")
        plan = json.loads((root / "plan.json").read_text(encoding="utf-8"))
        check_model_paths(plan, files)
    except BundleCheckError as exc:
        raise UserError(str(exc)) from None
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"'{root / 'plan.json'}' is not valid JSON; recompile the bundle") from None
    return plan


def load_reference(root: Path, plan: dict):
    """The source model rebuilt from the bundle's model/ files and every function's weights
    (transformers' own model for Hugging Face models, the shipped model.py for moeplan models)."""
    from safetensors.torch import load_file

    from moeplan.backends.common.manifest import bundle_path
    from moeplan.backends.common.model_source import expert_containers
    from moeplan.backends.common.shards import state_dict_sha256
    from moeplan.runtime.model.moe_adapter import join_expert_state
    from moeplan.planner.launch.torchrun_verify import VerifyError, reference_model

    state = {}
    for path in sorted((root / "weights").rglob("weights.safetensors")):
        state.update(load_file(str(path)))
    arch = plan["model"]["architecture"]
    model_dir = bundle_path(root, plan["model"]["config"]).parent
    files = {f"model/{p.name}": p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}
    state = join_expert_state(state, expert_containers(arch, files))
    if state_dict_sha256(state) != plan["model"]["weights_sha256"]:
        raise UserError("the bundle's weights differ from the source model's (weights_sha256); recompile the bundle")
    try:
        return reference_model(root, plan, state)
    except VerifyError as exc:
        raise UserError(str(exc)) from None


def check_library(plan: dict) -> None:
    """The functions run here with this machine's transformers: it must be the version pinned."""
    from moeplan.runtime.bundle_io import BundleError
    from moeplan.runtime.bundle_io import check_library as pinned

    try:
        pinned(plan)
    except BundleError as exc:
        raise UserError(str(exc).replace("requirements.txt", "functions/requirements.txt")) from None


def _codec(root: Path, plan: dict):
    """(TextCodec, max positions) of the bundle's model: its tokenizer.json, or bytes."""
    from moeplan.backends.common.manifest import bundle_path
    from moeplan.runtime.text_codec import TextCodec

    config_path = bundle_path(root, plan["model"]["config"])
    if plan["model"]["architecture"] == "tiny_moe":
        config = json.loads(config_path.read_text())
        return TextCodec(None, int(config["vocab_size"]), native_bytes=True), int(config["max_positions"])
    from moeplan.runtime.model.library_model import transformers_config

    config = transformers_config(config_path.parent)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return (TextCodec(config_path.parent / "tokenizer.json", int(text.vocab_size)),
            int(getattr(text, "max_position_embeddings", 1 << 30)))


def _execute(machine: Machine, request: str, prompts: list, max_tokens: int, keep_logits: bool, seconds: list) -> dict:
    """One execution of the state machine: the generation of max_tokens greedy tokens per prompt;
    its measured length is appended to `seconds` (what an EXPRESS execution bills)."""
    gen = {"max_tokens": int(max_tokens), "temperature": 0.0, "stop_token_ids": [], "keep_logits": bool(keep_logits)}
    start = time.perf_counter()
    try:
        out = machine.run(decode.initial_state(request, prompts, gen))
        seconds.append(time.perf_counter() - start)
    except (CloudError, ASLError) as exc:
        raise UserError(f"the state machine failed on request {request}: {exc}") from None
    if not out.get("done"):
        raise UserError(f"the state machine ended request {request} before it was done")
    return out


def _logits(cloud: LocalCloud, seqs: list, generated: list, units: int, recompute: bool) -> list:
    """Per sequence, [len(prompt) + new_tokens - 1, V] logits: the prompt's positions (the first
    forward) then each generated position but the last's (one per later step, or per execution)."""
    def read(request, step):
        return wire.from_bytes(cloud.get(f"intermediates/{request}/t{step:05d}/state-{units:03d}"))["logits"]

    n = len(generated[0])
    first = read("recompute-000" if recompute else "verify", 0)
    ends = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0)
    out = []
    for b, s in enumerate(seqs):
        rows = [first[int(ends[b]) - len(s):int(ends[b])]]
        for t in range(1, n):
            if recompute:
                logits = read(f"recompute-{t:03d}", 0)
                stop = int(torch.cumsum(torch.tensor([len(x) + t for x in seqs]), 0)[b])
                rows.append(logits[stop - 1:stop])
            else:
                rows.append(read("verify", t)[b:b + 1])
        out.append(torch.cat(rows))
    return out


def _generate(machine: Machine, prefix: str, seqs: list, new_tokens: int, keep_logits: bool, recompute: bool,
              seconds: list) -> list:
    """Generated tokens per prompt: one execution (K/V reuse), or one per token (recompute)."""
    if not recompute:
        return _execute(machine, prefix + "verify", seqs, new_tokens, keep_logits, seconds)["tokens"]
    generated = [[] for _ in seqs]
    for t in range(new_tokens):
        out = _execute(machine, f"{prefix}recompute-{t:03d}", [s + g for s, g in zip(seqs, generated)], 1, keep_logits,
                       seconds)
        for g, tok in zip(generated, out["tokens"]):
            g.extend(tok)
    return generated


def run_lambda_bundle(bundle: str, prompts: list, new_tokens: int, verify: bool, recompute: bool = False,
                      warm: bool = False) -> dict:
    """The report of one generation; `warm`: the same generation runs once before, unmeasured, so
    that every function it touches is a warm container (weights loaded, the library's model built)."""
    root = Path(bundle)
    plan = check_files(root)
    if plan.get("target") != "lambda":
        raise UserError(f"'{root}' is not a lambda bundle")
    check_library(plan)
    platform = plan["inputs"]["facts"]["platform"]
    units = sum(len(s["units"]) for s in plan["placement"]["dense_slices"])
    codec, max_positions = _codec(root, plan)
    try:
        seqs = [codec.encode(p) for p in prompts]
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if max(len(s) for s in seqs) + new_tokens > max_positions:
        raise UserError(f"prompts plus {new_tokens} new tokens exceed the model's {max_positions} positions")
    start = time.perf_counter()
    cloud = LocalCloud(root, platform["payload_limit_bytes"])
    try:
        weight_bytes = cloud.upload_weights()
        for attempt in ("warm-up-", "")[0 if warm else 1:]:
            cloud.invocations.clear()
            start = time.perf_counter()
            machine = Machine(cloud.definition, cloud.subs, cloud.invoke)
            seconds = []
            generated = _generate(machine, attempt, seqs, new_tokens, verify, recompute, seconds)
        logits = _logits(cloud, seqs, generated, units, recompute) if verify else None
        wall = time.perf_counter() - start
    finally:
        cloud.close()
    inv = cloud.invocations
    bill = cloud.bill(platform, seconds)
    io = Counter()
    for i in inv:
        io.update(i.io)
    report = {
        "target": "lambda", "executions": new_tokens if recompute else 1, "generation": "recompute" if recompute else "kv",
        "texts": [codec.decode(s + g) for s, g in zip(seqs, generated)],
        "prompt_encoding": codec.source, "new_tokens": new_tokens,
        "invocations": len(inv), "invocations_by_kind": dict(sorted(Counter(i.kind for i in inv).items())),
        "functions_used": len({i.function for i in inv}), "state_transitions": machine.transitions,
        "storage_bytes": {"functions_get": io["get_bytes"], "functions_put": io["put_bytes"],
                          "client_get": cloud.client_io["get_bytes"], "client_put": cloud.client_io["put_bytes"],
                          "total": io["get_bytes"] + io["put_bytes"] + cloud.client_io["get_bytes"] + cloud.client_io["put_bytes"],
                          "weights_uploaded": weight_bytes},
        "storage_requests": {"functions_get": io["gets"], "functions_put": io["puts"],
                             "client_get": cloud.client_io["gets"], "client_put": cloud.client_io["puts"]},
        "payload_bytes": sum(i.request_bytes + i.response_bytes for i in inv),
        "max_payload_bytes": max((max(i.request_bytes, i.response_bytes) for i in inv), default=0),
        "payload_limit_bytes": int(platform["payload_limit_bytes"]),
        "billed_gb_s": bill["lambda_gb_s"], "billed_usd": bill["usd"]["total"], "billed_usd_by_charge": bill["usd"],
        "measured_seconds": sum(i.seconds for i in inv), "wall_s": wall,
        "state_transitions_per_token": machine.transitions / new_tokens,
    }
    if verify:
        model = load_reference(root, plan)
        from moeplan.planner.launch.torchrun_verify import reference_generate

        max_diff, match = 0.0, True
        torch.set_num_threads(1)
        for s, g, mine in zip(seqs, generated, logits):
            ref_gen, ref_logits = reference_generate(model, s, new_tokens)
            match &= ref_gen == g
            max_diff = max(max_diff, float((mine - ref_logits).abs().max()))
        report.update(max_abs_logit_diff=max_diff, tokens_match=bool(match),
                      verified=bool(match and max_diff <= LOGIT_TOLERANCE))
    return report

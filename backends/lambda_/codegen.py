"""Write a Lambda bundle: SAM template, state machine, handlers, per-function weights, Dockerfiles, README.

Layout: plan.json, template.yaml, statemachine.json, functions/ (runtime/ handlers with serving/,
model/ (the config, the source file of moeplan models, the tokenizer and chat files the front
reads) and requirements.txt for the image, one Dockerfile per function kind; the front function's
requirements-front.txt, front.json and request_cost.json: `front.py`), weights/ (laid out as the
S3 keys: weights/dense/slice-NN/ and weights/experts/layer-LLL/expert-EEE/, each a
weights.safetensors holding only that function's tensors, `layout.py`), model/ (the model files, for local verification), README.md, manifest.json.

`MODEL_FILES` (the model files a Lambda bundle ships, once the runtime is known to cut the model into
functions) and `CODEGEN` (this `write_bundle`) are the target's bundle passes.

Functions: one per dense slice (`DenseNN`) and one per expert replica (`ExpertLlllEeeeRr`), each
with the memory the plan chose, and the front (`Front`), which may only start the state machine. Least privilege: a function's role reads only its own weight
prefix and reads/writes only `intermediates/`; a dense function that routes a direct-method
layer may also invoke exactly that layer's expert functions. Every value interpolated into the
YAML goes through the `y` filter (JSON), so names cannot change its structure; the model name
appears only in the Description, reduced to safe characters (the full name is in plan.json). Bytes depend only on the inputs.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path


from moeplan.backends.common.templating import template_env, to_yaml
from moeplan.backends.lambda_.statemachine import definition
from moeplan.backends.lambda_ import front
from moeplan.backends.lambda_ import layout as lay
from moeplan.runtime.lambda_.charges import CHARGE_LABELS
from moeplan.runtime.model.moe_adapter import split_expert_state
from moeplan.backends.common.files import copy_runtime, finish_bundle, write_file
from moeplan.backends.common import model_source
from moeplan.backends.common.model_source import bundle_model, needs_weights
from moeplan.backends.common.shards import state_dict_sha256, write_shard
from moeplan.core.atomic import atomic_path
from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass

KINDS = ("dense", "expert")
TIMEOUT_S = 900


def dense_id(k: int) -> str:
    return f"Dense{k:02d}"


def expert_id(layer: int, expert: int, replica: int) -> str:
    return f"ExpertL{layer:03d}E{expert:04d}R{replica}"


def tag(layer: int, expert: int, replica: int) -> str:
    return f"L{layer}E{expert}R{replica}"


def safe_text(text: str, limit: int = 200) -> str:
    """Free text for CloudFormation strings: no `${` (read as a substitution), no control characters."""
    return re.sub(r"[^A-Za-z0-9 _.,:/@+()-]", "_", text)[:limit]


def function_suffix(logical_id: str) -> str:
    """Physical name = <stack>-<suffix>; handlers address direct-method experts by it."""
    return logical_id.lower()


def dense_parts(slices: list, segment_of: dict, num_layers: int, layers: list, payload_limit: int,
                layout=None, pieces=None) -> list:
    """Per dense slice, its parts (one per segment it touches) with what each reads, writes, gathers,
    scatters, and (with the model's layout) where in the model it starts and stops."""
    order = [u for s in slices for u in s["units"]]
    index = {u: i for i, u in enumerate(order)}
    out = []
    for _k, s in enumerate(slices):
        parts = []
        for unit in s["units"]:
            seg = segment_of[unit]
            if not parts or parts[-1]["segment"] != seg:
                parts.append({"segment": seg, "units": []})
            parts[-1]["units"].append(unit)
        for p in parts:
            first, last = index[p["units"][0]], index[p["units"][-1]]
            p["read"], p["write"] = f"state-{first:03d}", f"state-{last + 1:03d}"
            seg = p["segment"]
            starts_segment = first == 0 or segment_of[order[first - 1]] != seg
            if starts_segment and seg > 0 and layers[seg - 1]["method"] != "direct":
                p["gather"] = {"layer": seg - 1, "replicas": {str(x["expert"]): x["replicas"] for x in layers[seg - 1]["experts"]}}
            ends_segment = last + 1 == len(order) or segment_of[order[last + 1]] != seg
            if layout is not None:
                p["start"], p["stop"] = lay.part_bounds(layout, pieces, p["units"], seg, starts_segment, ends_segment,
                                                        None if ends_segment else order[last + 1])
            if ends_segment and seg < num_layers:
                L = layers[seg]
                p["scatter"] = {"layer": seg, "method": L["method"], "payload_limit": payload_limit,
                                "replicas": {str(x["expert"]): x["replicas"] for x in L["experts"]}}
                if L["method"] == "direct":
                    p["scatter"]["functions"] = {tag(seg, x["expert"], r): function_suffix(expert_id(seg, x["expert"], r))
                                                 for x in L["experts"] for r in range(x["replicas"])}
        out.append(parts)
    return out


def dense_intermediates(parts: list) -> dict:
    """S3 key patterns (IAM resource syntax) one dense slice reads and writes under intermediates/:
    the states its parts start from (the first part of the model starts from the execution's
    state instead) and end at (read back too: they carry the part's K/V for a container that lacks
    it), the gathered expert outputs of the layer before, the scattered expert inputs of the layer
    it ends (S3 methods only). `*` stands for the request and step."""
    reads, writes = set(), set()
    for p in parts:
        if p["read"] != "state-000":
            reads.add(f"intermediates/*/{p['read']}")
        reads.add(f"intermediates/*/{p['write']}")
        writes.add(f"intermediates/*/{p['write']}")
        if "gather" in p:
            reads.add(f"intermediates/*/layer-{int(p['gather']['layer']):03d}/*.out")
        scatter = p.get("scatter")
        if scatter is not None and scatter["method"] != "direct":
            writes.add(f"intermediates/*/layer-{int(scatter['layer']):03d}/*.in")
    return {"reads": sorted(reads), "writes": sorted(writes)}


def expert_intermediates(layer: int, replica_tag: str, method: str) -> dict:
    """An expert replica's keys: its own rows in, its own output out; none for direct layers."""
    if method == "direct":
        return {"reads": [], "writes": []}
    return {"reads": [f"intermediates/*/layer-{layer:03d}/{replica_tag}.in"],
            "writes": [f"intermediates/*/layer-{layer:03d}/{replica_tag}.out"]}


def charge_rows(call: dict) -> list:
    """(what, dollars) per charge of the priced API call, for the README's table (charges of $0 left out)."""
    what = {"lambda_duration": f"{call['lambda_gb_s']:.3f} GB-s: the front function waiting, every dense and expert invocation",
            "lambda_requests": f"{call['lambda_invocations']:.1f} invocations",
            "s3_requests": f"{call['s3_puts']:.1f} PUTs, {call['s3_gets']:.1f} GETs: states, expert rows, K/V",
            "express": f"{call['executions']} EXPRESS execution", "http": "one HTTP API request"}
    return [(f"{label} ({what[key]})", call["usd"][key]) for key, label in CHARGE_LABELS.items() if call["usd"].get(key)]


def kv_budget_bytes(memory_mb: int, runtime_mb: float, weight_bytes: int) -> int:
    """Memory a dense function may give to the K/V it keeps between invocations: half of what
    the runtime and its weights leave (the other half is the step's activations)."""
    return max(0, int((memory_mb - runtime_mb) * 2**20 - weight_bytes) // 2)


def _nbytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def check_memory(functions: list, runtime_mb: float) -> None:
    """Every function's weights and the runtime must fit its planned memory (sizing counted the
    same bytes; a mismatch means the plan is from another model or moeplan)."""
    for f in functions:
        need = runtime_mb + f["weight_bytes"] / 2**20
        if need > f["memory_mb"]:
            raise UserError(f"function {f['id']} holds {f['weight_bytes'] / 2**20:.1f} MB of weights, which with the "
                            f"{runtime_mb:.0f} MB runtime exceed its planned {f['memory_mb']} MB; regenerate the plan "
                            "from this model ('moeplan plan'), or give the platform larger memory_options_mb")


def function_requirements(model: dict) -> str:
    """The image's requirements: what the runtime imports, the model library at the plan's pins."""
    import boto3
    import numpy
    import safetensors
    import torch

    lines = [f"torch=={torch.__version__.split('+')[0]}", f"safetensors=={safetensors.__version__}",
             f"numpy=={numpy.__version__}", f"boto3=={boto3.__version__}"]
    lines += [f"{name}=={version}" for name, version in sorted(model.get("library", {}).items())]
    return "\n".join(lines) + "\n"


def bundle_plan(plan, state: dict, model_files: dict):
    """The plan with the bundle's layout: the runtime family, the model files' paths and the hash of
    the weights it ships."""
    model = dict(plan.model, architecture=model_files["architecture"], config="model/config.json",
                 weights_sha256=state_dict_sha256(state))
    if "model/model.py" in model_files["files"]:
        model["source"] = "model/model.py"
    return dataclasses.replace(plan, model=model)


def write_bundle(out, plan, state: dict, model_files: dict) -> dict:
    """The Lambda bundle written atomically at `out` from the plan and the source weights (the
    library state dict); returns its manifest. `model_files`: {"architecture", "files"}. When the
    plan already records `weights_sha256` (a bundle regenerated from its plan), `state` must hash to it.
    """
    expected = plan.model.get("weights_sha256")
    plan = bundle_plan(plan, state, model_files)
    if expected is not None and expected != plan.model["weights_sha256"]:
        raise UserError("the weights are not those the plan was made for (weights_sha256 differs); "
                        "give the plan's model with --model or plan again")
    with atomic_path(Path(out), kind="bundle") as tmp:
        write_files(tmp, plan, state, model_files["files"])
        return finish_bundle(tmp)


def write_files(out: Path, plan, state: dict, model_files: dict) -> None:
    """Every file of the bundle but its manifest, into `out` (which must not exist yet).

    Everything comes from the plan (decisions, dense unit segments, payload limit, request rate,
    the request cost spec) and the weights, so `moeplan codegen plan.json` writes the same bytes.
    """
    out = Path(out)
    out.mkdir(parents=True)
    pl = plan.as_written()  # the plan as plan.json holds it: `moeplan codegen plan.json` sees the same values
    write_file(out / "plan.json", plan.to_json())
    segment_of = pl.placement.unit_segments
    payload_limit = int(pl.deployment["payload_limit_bytes"])
    for rel, content in sorted(model_files.items()):
        write_file(out / rel, content)
    layers = pl.placement.layers
    slices = pl.placement.dense_slices
    num_layers = len(layers)
    stages = pl.model["ir"]["stages"]
    model = bundle_model(pl.model["architecture"], model_files)
    layout = lay.with_routing(lay.Layout.of(model), model)
    state = split_expert_state(state, list(layout.containers))
    owner = lay.expert_tensor_owner(layout)
    dense_names = sorted(n for n in state if owner(n) is None)
    layout = lay.with_tail(layout, dense_names, stages)
    covered = set()
    functions = []
    runtime_mb = float(pl.inputs["facts"]["platform"].get("runtime_memory_mb", 0.0))
    parts = dense_parts(slices, segment_of, num_layers, layers, payload_limit, layout, lay.unit_pieces(layout, stages))
    for k, s in enumerate(slices):
        tensors = {n: state[n] for p in parts[k] for n in lay.part_tensors(layout, dense_names, p["start"], p["stop"])}
        covered |= set(tensors)
        prefix = f"weights/dense/slice-{k:02d}/"
        write_shard(out / prefix / "weights.safetensors", tensors, k)
        invokes = [expert_id(p["scatter"]["layer"], int(e), r) for p in parts[k] if p.get("scatter", {}).get("method") == "direct"
                   for e, g in sorted(p["scatter"]["replicas"].items(), key=lambda kv: int(kv[0])) for r in range(g)]
        spec = {"segments": [{k2: v for k2, v in p.items() if k2 != "units"} for p in parts[k]],
                "kv_budget_bytes": kv_budget_bytes(int(s["memory_mb"]), runtime_mb, _nbytes(tensors))}
        functions.append({"id": dense_id(k), "kind": "dense", "handler": "dense_handler", "memory_mb": int(s["memory_mb"]),
                          "weights": prefix, "spec": spec, "invokes": invokes, "weight_bytes": _nbytes(tensors),
                          "units": s["units"], **dense_intermediates(parts[k])})
    missing = sorted(set(dense_names) - covered)
    if missing:
        raise lay.LayoutError(f"dense tensors {missing[:3]} belong to no dense function")
    expert_tensors = {}
    for n in sorted(state):
        o = owner(n)
        if o is not None:
            expert_tensors.setdefault(o, {})[n] = state[n]
    for L in layers:
        l = int(L["layer"])
        for x in L["experts"]:
            e = int(x["expert"])
            prefix = f"weights/experts/layer-{l:03d}/expert-{e:04d}/"
            write_shard(out / prefix / "weights.safetensors", expert_tensors[(l, e)], l * 10000 + e)
            for r in range(int(x["replicas"])):
                functions.append({"id": expert_id(l, e, r), "kind": "expert", "handler": "expert_handler",
                                  "memory_mb": int(x["memory_mb"]), "weights": prefix, "invokes": [],
                                  "weight_bytes": _nbytes(expert_tensors[(l, e)]),
                                  **expert_intermediates(l, tag(l, e, r), L["method"]),
                                  "spec": {"layer": l, "expert": e, "tag": tag(l, e, r), "method": L["method"],
                                           "beta": int(L["beta"])}})
    check_memory(functions, runtime_mb)
    steps = []
    for seg in range(num_layers + 1):
        for k, p in enumerate(parts):
            if any(q["segment"] == seg for q in p):
                steps.append(("dense", dense_id(k), seg))
        if seg < num_layers and layers[seg]["method"] != "direct":
            steps.append(("moe", seg, [(tag(seg, int(x["expert"]), r), expert_id(seg, int(x["expert"]), r))
                                       for x in layers[seg]["experts"] for r in range(int(x["replicas"]))]))
    machine = definition(steps)
    write_file(out / "statemachine.json", json.dumps(machine, indent=2, sort_keys=True) + "\n")
    copy_runtime(out / "functions" / "runtime", "lambda")  # with serving/: the OpenAI API the front function runs
    for rel, content in sorted(model_files.items()):  # the model the functions build, the text the front reads
        write_file(out / "functions" / rel, content)
    write_file(out / "functions" / "requirements.txt", function_requirements(pl.model))
    write_file(out / "functions" / "requirements-front.txt", front.requirements(pl.model))
    rounded = pl.predicted.request_cost  # as plan.json holds it: simulate reads that
    if rounded is None:
        raise UserError("the plan has no request cost model (predicted.request_cost), which the front function states "
                        "per response; regenerate it with this moeplan ('moeplan plan')")
    write_file(out / "functions" / "request_cost.json", json.dumps(rounded, indent=1, sort_keys=True) + "\n")
    entry = front.entry(pl, model_files)
    call = pl.predicted.api_call
    if call is None:
        raise UserError("the plan prices no API call (predicted.api_call), which the README states; regenerate it with "
                        "this moeplan ('moeplan plan')")
    if call["prompt_tokens"] + call["new_tokens"] > entry["max_context"]:
        raise UserError(f"the API call the plan prices ({call['prompt_tokens']} prompt + {call['new_tokens']} new tokens) "
                        f"is longer than the {entry['max_context']} tokens this deployment's front accepts; plan again "
                        "with smaller --prompt-tokens / --new-tokens")
    write_file(out / "functions" / "front.json", json.dumps(front.settings(pl, entry), indent=1, sort_keys=True) + "\n")
    env = template_env("lambda")
    for kind in KINDS:
        write_file(out / "functions" / kind / "Dockerfile", env.get_template("Dockerfile.j2").render(kind=kind))
    write_file(out / "functions" / "front" / "Dockerfile", env.get_template("Dockerfile.front.j2").render())
    predicted = pl.predicted
    moe_cost = float(predicted.moe_cost_per_batch_usd if predicted.moe_cost_per_batch_usd is not None else 0.0)
    per_batch = moe_cost + float(predicted.dense_partition["cost_per_request_usd"])
    ctx = {
        "model_name_json": to_yaml(str(pl.model["name"])), "description": "moeplan Lambda deployment of " + safe_text(str(pl.model["name"])),
        "functions": [dict(f, spec_json=json.dumps(f["spec"], sort_keys=True, separators=(",", ":")),
                           suffix=function_suffix(f["id"])) for f in functions],
        "definition": machine, "timeout": TIMEOUT_S,
        "substitutions": {f["id"]: {"Fn::GetAtt": [f["id"], "Arn"]} for f in functions},
        "layers": layers, "slices": slices, "batch_tokens": int(pl.communication.batch_tokens),
        "cost_per_batch": per_batch, "moe_cost": moe_cost,
        "dense_cost": float(predicted.dense_partition["cost_per_request_usd"]),
        "call": call, "charges": charge_rows(call),
        "num_dense": len(slices), "num_experts": sum(1 for f in functions if f["kind"] == "expert"),
        "front": entry,
    }
    for f in ctx["functions"]:  # Lambda caps a function's environment at 4 KB
        size = len(f["spec_json"]) + len(f["weights"]) + 200
        if size > 4096:
            raise UserError(f"function {f['id']} would need a {size}-byte environment, over Lambda's 4 KB; "
                            "fewer experts per direct layer (--methods s3,pipelined_s3) keep it smaller")
    write_file(out / "template.yaml", env.get_template("template.yaml.j2").render(**ctx))
    write_file(out / "README.md", env.get_template("README.md.j2").render(**ctx))


# --- the Lambda target's bundle passes ---------------------------------------------------------------

def _lambda_model_files(facts):
    """The model files a Lambda bundle ships, once the runtime is known to cut this model into functions."""
    try:
        arch, files = model_source.model_files(facts["model_spec"])
    except UserError as exc:  # its messages name the torchrun target, whose models this one runs too
        raise UserError(str(exc).replace("torchrun", "lambda")) from None
    try:
        lay.Layout.of(bundle_model(arch, files, facts["model_spec"]))
    except lay.LayoutError as exc:
        raise UserError(f"cannot compile '{facts['model_spec']}' for lambda: {exc}") from None
    return {"model_files": {"architecture": arch, "files": files}}


MODEL_FILES = Pass("runtime", ("model_spec",), ("model_files",), _lambda_model_files)


def _codegen(facts):
    return {"manifest": write_bundle(facts["out"], facts["plan"], facts["model"].module.state_dict(), facts["model_files"])}


CODEGEN = Pass("codegen", ("plan", "model", "model_spec", "model_files", "out"), ("manifest",), _codegen, check=needs_weights)

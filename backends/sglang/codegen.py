"""Write the SGLang target: `--init-expert-location` JSON, launch script, README, optional manifests.

Followed: sglang 0.5.23, `python/sglang/srt/eplb/expert_location.py`
(`compute_initial_expert_location_metadata`: a `.json` path is read and every key is passed to
`ExpertLocationMetadata.init_by_mapping`, so the file holds `physical_to_logical_map` only) and
`python/sglang/srt/arg_groups/fields/exec_.py` (`--ep-num-redundant-experts`,
`--ep-dispatch-algorithm`, `--init-expert-location`, `--moe-a2a-backend`), `fields/parallel.py`
(`--tp-size` every GPU, `--attn-dp-size`: the current spelling of the deprecated `--dp-size N
--enable-dp-attention`, `--ep-size`) and `fields/schedule.py` (`--max-running-requests`, over all
attention-DP ranks). The deployment is the plan's (`core/engine_layout.py`); `--ep-dispatch-algorithm
dynamic` is the one SGLang accepts with `--moe-a2a-backend none` too (`arg_groups/parallel_hook.py:
handle_eplb_and_dispatch`: static and lp pick a replica per rank, which needs an all-to-all).
SGLang's map has a row for every decoder layer, dense ones included, and E + R columns; slot s
lives on EP rank s // ((E + R) / ep_size).
Every row must name every logical expert (SGLang builds each expert's replica list from it);
dense layers get SGLang's own trivial row (slot s -> s mod E).
"""
from __future__ import annotations

import json
from pathlib import Path

from moeplan.backends.common.engine_bundle import engine_context, write_engine_bundle
from moeplan.backends.common.files import write_file
from moeplan.backends.common.templating import template_env
from moeplan.backends.kubernetes.codegen import slug

SGLANG_VERSION = "0.5.23"
DEFAULT_IMAGE = f"lmsysorg/sglang:v{SGLANG_VERSION}"
HTTP_PORT = 30000
DIST_PORT = 5000
KUBERNETES_FILES = ("configmap.yaml", "service.yaml", "statefulset.yaml")
# the deployment's moe_a2a -> SGLang --moe-a2a-backend ("none": the MoE input made whole on every rank)
MOE_A2A_BACKEND = {"allgather": "none", "deepep": "deepep"}


def physical_to_logical_map(plan, slots: list) -> list:
    """int [num_hidden_layers][E + R]: the plan's slot lists at MoE layers, trivial rows elsewhere."""
    E = int(plan.model["num_experts"])
    width = len(slots[0])
    rows = [[s % E for s in range(width)] for _ in range(int(plan.model["num_hidden_layers"]))]
    for layer, row in zip(plan.model["moe_layer_indices"], slots):
        rows[layer] = [int(e) for e in row]
    return rows


def expert_location_json(rows: list) -> str:
    """Deterministic, diffable text: one decoder layer per line."""
    body = ",\n".join("  " + json.dumps(row, separators=(",", ":")) for row in rows)
    return '{"physical_to_logical_map": [\n' + body + "\n]}\n"


def _kubernetes_context(plan, ctx: dict, files: dict, image: str) -> dict:
    name = slug(str(plan.model["name"]))
    names = {"configmap": f"{name}-placement", "headless": f"{name}-nodes", "http": f"{name}-http",
             "statefulset": name, "weights": ctx["weights_claim"]}
    selector = {"moeplan.io/deployment": name}
    labels = {"app.kubernetes.io/managed-by": "moeplan", "app.kubernetes.io/name": name}
    gpn = ctx["gpus_per_node"]
    return {**ctx, "names": names, "labels": labels, "selector": selector, "pod_labels": {**labels, **selector},
            "http_selector": {**selector, "apps.kubernetes.io/pod-index": "0"}, "image": image,
            "dist_init_addr": f"{name}-0.{names['headless']}:{DIST_PORT}", "dist_port": DIST_PORT,
            "http_port": HTTP_PORT, "resources": {"nvidia.com/gpu": str(gpn)},
            "configmap_data": sorted(files.items())}


def write_bundle(out, plan) -> dict:
    """The SGLang bundle written atomically at `out` (with kubernetes/ when the plan's deployment
    asks for it); returns the manifest."""
    return write_engine_bundle(out, plan, write_files)


def write_files(out: Path, plan, slots: list) -> None:
    """The SGLang files of `plan` into `out`, from its [MoE layers][slots] lists."""
    kubernetes = bool(plan.deployment.get("kubernetes"))
    env = template_env("sglang")
    image = plan.deployment.get("image") or DEFAULT_IMAGE
    ctx = {**engine_context(plan, slots), "sglang_version": SGLANG_VERSION, "kubernetes": kubernetes, "image": image,
           "weights_claim": f"{slug(str(plan.model['name']))}-weights"}
    ctx["sglang_a2a"] = MOE_A2A_BACKEND[ctx["moe_a2a"]]
    files = {
        "init_expert_location.json": expert_location_json(physical_to_logical_map(plan, slots)),
        "launch.sh": env.get_template("launch.sh.j2").render(**ctx),
    }
    write_file(out / "init_expert_location.json", files["init_expert_location.json"])
    write_file(out / "launch.sh", files["launch.sh"], executable=True)
    write_file(out / "README.md", env.get_template("README.md.j2").render(**ctx))
    if kubernetes:
        kctx = _kubernetes_context(plan, ctx, files, image)
        for name in KUBERNETES_FILES:
            write_file(out / "kubernetes" / name, env.get_template(f"{name}.j2").render(**kctx))

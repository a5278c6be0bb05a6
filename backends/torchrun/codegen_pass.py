"""The codegen pass of the torchrun and Kubernetes targets: the plan's bundle written by
`backends/torchrun/codegen.py` (or `backends/kubernetes/codegen.py`: the torchrun bundle plus
manifests), its weights read from the model.

A Hugging Face directory with safetensors is streamed into the shards tensor by tensor
(`backends/common/checkpoint_index.py`): compile never holds the model's weights. With
`--weights reference` the bundle holds per-rank indexes into the checkpoint instead.
"""
from __future__ import annotations

from moeplan.backends.common.model_source import needs_weights
from moeplan.core.errors import UserError
from moeplan.core.model_dirs import streamable_directory
from moeplan.core.pass_manager import Pass
from moeplan.core.plan import Plan


def weights_source(model_spec: str, loaded, model_files: dict, form: str = "copy") -> tuple:
    """(weights for codegen, referenced checkpoint or None): a Hugging Face safetensors directory is
    streamed (`TensorEntry`s reading one tensor at a time); other models give their state dict."""
    directory = streamable_directory(model_spec) if model_files["architecture"] == "transformers" else None
    if directory is None:
        if form == "reference":
            raise UserError(f"--weights reference needs a Hugging Face model directory with safetensors weights; "
                            f"'{model_spec}' is not one: use --weights copy")
        return loaded.module.state_dict(), None
    from moeplan.backends.common.checkpoint_index import checkpoint_entries, checkpoint_files
    from moeplan.backends.common.model_source import expert_containers

    containers = expert_containers("transformers", model_files["files"], spec=model_spec)
    entries, tensors = checkpoint_entries(directory, loaded.module, containers, model_spec)
    if form != "reference":
        return entries, None
    return entries, {"path": str(directory.resolve()), "files": checkpoint_files(directory, tensors)}


def write_bundle(backend: str, out, plan: Plan, model_spec: str, loaded, model_files: dict) -> dict:
    """The plan's bundle at `out` by `backends/<backend>/codegen.py` (torchrun, or kubernetes: the
    torchrun bundle plus manifests), its weights read from the model."""
    import importlib

    weights, checkpoint = weights_source(model_spec, loaded, model_files, plan.deployment.get("weights", "copy"))
    writer = importlib.import_module(f"moeplan.backends.{backend}.codegen").write_bundle
    return writer(out, plan, weights, model_files, checkpoint)


def codegen_pass(backend: str) -> Pass:
    """The codegen pass writing the bundle with `backends/<backend>/codegen.py`."""
    def codegen(facts):
        return {"manifest": write_bundle(backend, facts["out"], facts["plan"], facts["model_spec"], facts["model"],
                                         facts["model_files"])}

    return Pass("codegen", ("plan", "model", "model_spec", "model_files", "out"), ("manifest",), codegen, check=needs_weights)

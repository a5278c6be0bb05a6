"""The Lambda target's bundle passes: the model files a Lambda bundle ships (`MODEL_FILES`, once the
runtime is known to cut the model into functions) and the codegen pass (`backends/lambda_/codegen.py`)."""
from __future__ import annotations

from moeplan.backends.common.model_source import bundle_model, model_files, needs_weights
from moeplan.backends.lambda_.codegen import write_bundle
from moeplan.backends.lambda_.layout import Layout, LayoutError
from moeplan.core.errors import UserError
from moeplan.core.pass_manager import Pass


def _lambda_model_files(facts):
    """The model files a Lambda bundle ships, once the runtime is known to cut this model into functions."""
    try:
        arch, files = model_files(facts["model_spec"])
    except UserError as exc:  # its messages name the torchrun target, whose models this one runs too
        raise UserError(str(exc).replace("torchrun", "lambda")) from None
    try:
        Layout.of(bundle_model(arch, files, facts["model_spec"]))
    except LayoutError as exc:
        raise UserError(f"cannot compile '{facts['model_spec']}' for lambda: {exc}") from None
    return {"model_files": {"architecture": arch, "files": files}}


MODEL_FILES = Pass("runtime", ("model_spec",), ("model_files",), _lambda_model_files)


def _codegen(facts):
    return {"manifest": write_bundle(facts["out"], facts["plan"], facts["model"].module.state_dict(), facts["model_files"])}


CODEGEN = Pass("codegen", ("plan", "model", "model_spec", "model_files", "out"), ("manifest",), _codegen, check=needs_weights)

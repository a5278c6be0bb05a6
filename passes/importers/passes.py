"""The import pass every target starts with: the model spec -> `model` (a LoadedModel: IR + module).

`STREAMING_IMPORT` is the torchrun and Kubernetes targets' import: a Hugging Face safetensors
directory is built on `meta` (codegen streams its checkpoint into the shards tensor by tensor,
`backends/common/checkpoint_index.py`), so compile never holds the model's weights.
"""
from __future__ import annotations

import dataclasses

from moeplan.core.pass_manager import Pass


def _import(facts):
    from moeplan.passes.importers import load_model

    return {"model": load_model(facts["model_spec"])}


def _streaming_import(facts):
    """The model, on `meta` for a Hugging Face safetensors directory (codegen streams its weights)."""
    from moeplan.core.model_dirs import streamable_directory
    from moeplan.passes.importers.hf_streaming import load_directory_meta

    directory = streamable_directory(facts["model_spec"])
    return {"model": load_directory_meta(directory)} if directory is not None else IMPORT.run(facts)


IMPORT = Pass("import", ("model_spec",), ("model",), _import)
STREAMING_IMPORT = dataclasses.replace(IMPORT, run=_streaming_import)

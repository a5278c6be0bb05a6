"""A Hugging Face checkpoint directory imported without reading its weights, for `compile`.

Planning needs shapes and dtypes, and compile's codegen streams the safetensors tensor by tensor
(`backends/common/checkpoint_index.py`; which directories are streamed: `core/model_dirs.py`), so the model is built on `meta` exactly as
`load_directory` would build it, and marked as having weights (they are in the directory, read
later). The IR is the one `load_directory` gives (same `source_format`), so plans do not depend on
which importer ran.
"""
from __future__ import annotations

from pathlib import Path

from moeplan.passes.importers.loaded import LoadedModel
from moeplan.core.model_dirs import read_json_object


def load_directory_meta(directory: Path) -> LoadedModel:
    """The model of a Hugging Face directory on `meta`, with the IR of its weighted import."""
    # imported here: hf_config switches the hub off (HF_HUB_OFFLINE) when imported, only for Hugging Face models
    from moeplan.passes.importers.hf_config import (build_model, checkpoint_storage, dtype_name, import_module,
                                                      make_config, model_dtype, model_name, multimodal_notes)

    config_path = directory / "config.json"
    data = read_json_object(config_path)
    dtype = model_dtype(data, str(config_path))
    config = make_config(data, str(config_path))
    module = build_model(config, dtype, meta=True).eval()
    storage, notes = checkpoint_storage(data, dtype_name(data), str(config_path))
    ir = import_module(module, name=model_name(data, config_path), config=config, source_format="hf", storage=storage)
    return LoadedModel(ir=ir, module=module, has_weights=True, notes=notes + multimodal_notes(config, module))

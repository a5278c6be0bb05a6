"""Importers: every supported model source becomes a `ModelIR` (and, where it can run, a model).

`load_model(spec)` accepts
* `package.module:factory` - a Python callable returning an `nn.Module`;
* a directory with `config.json`: either a moeplan model directory (its config names a loader,
  `"moeplan_loader": "model.py:load"`, as `examples/tiny_moe/` does) or a Hugging Face model
  directory (config + optional safetensors);
* a Hugging Face `config.json` file alone: the model is built on the `meta` device at full size;
* an `.onnx` file;
* a `.safetensors` / `.pt` checkpoint whose directory holds the model's config.json (moeplan or
  Hugging Face): the model that directory describes, with the checkpoint's weights;
* `path/to/file.py:factory`, like `package.module:factory` but imported from a file.

Every mistake a user can make raises `UserError` with one line naming the problem and the fix.
The forms are resolved in `resolve.py`; stages are derived by the rule in `stages.py`.
"""
from __future__ import annotations

from moeplan.passes.importers.loaded import LoadedModel
from moeplan.passes.importers.resolve import load_model

__all__ = ["LoadedModel", "load_model"]

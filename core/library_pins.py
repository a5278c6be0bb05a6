"""The model library a bundle of an architecture runs on, at this machine's versions (recorded in the
plan as `model.library`, pinned in the bundle's requirements): a rule the plan passes and the
backends both apply.
"""
from __future__ import annotations


def library_pins(arch: str) -> dict:
    """The library versions a bundle of this architecture runs on (recorded in the plan)."""
    if arch != "transformers":
        return {}
    import tokenizers
    import transformers

    return {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__}

"""The profile pass of the Lambda target: the model's operators measured (or read from the profile cache
keyed by the model's content, `--cache-dir`), `operators.py`."""
from __future__ import annotations

from moeplan.core.pass_manager import Pass
from moeplan.passes.analysis.trace.passes import trace_matches_model


def _profile(facts):
    from moeplan.passes.analysis.profile.operators import DEFAULT_CACHE_DIR, profile_model

    loaded, o = facts["model"], facts["serverless_options"]
    prof = profile_model(loaded.ir, loaded.module if loaded.has_weights else None, budget_s=o["profile_budget"],
                         cache_dir=None if o["no_cache"] else (o["cache_dir"] or DEFAULT_CACHE_DIR), seed=o["seed"], onnx_path=loaded.onnx_path)
    return {"profile": prof}


PROFILE = Pass("profile", ("model", "trace", "serverless_options"), ("profile",), _profile, check=trace_matches_model)

"""The analysis passes that stand beside their analyses: the inter-layer affinity of the torchrun
targets (`affinity.py`) and the serverless facts of the Lambda target (`serverless_facts.py`)."""
from __future__ import annotations

import numpy as np

from moeplan.core.pass_manager import Pass


def _affinity(facts):
    from moeplan.passes.analysis.affinity import top1_affinity

    return {"affinity": np.asarray(top1_affinity(facts["trace"]))}


AFFINITY = Pass("affinity", ("trace",), ("affinity",), _affinity)


def _facts(facts):
    from moeplan.passes.analysis.serverless_facts import build_facts

    return {"serverless_facts": build_facts(facts["model"].ir, facts["profile"], facts["platform"])}


FACTS = Pass("facts", ("model", "profile", "platform"), ("serverless_facts",), _facts)

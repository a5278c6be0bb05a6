"""One report page for any target: the summary, then the target's figures (docs/report.md)."""
from __future__ import annotations

import hashlib

from moeplan.planner.report import sections as s
from moeplan.planner.report.page import Section, document
from moeplan.planner.report.summary import summary_section


def build_report(plan: dict, plan_bytes: bytes, facts: dict) -> str:
    """The HTML page of `plan` (its plan.json bytes name it by hash) with the figures of `facts`."""
    target = plan.get("target")
    sections = [summary_section(plan, facts.get("tie", 0.01))]
    rescored = s.rescored_section(facts)
    if rescored is not None:
        sections.append(rescored)
    if target in ("torchrun", "kubernetes", "sglang", "vllm", "trtllm"):
        sections.append(Section("placement", "Placement", [s.placement_map(plan, facts), s.layer_balance(plan, facts)]))
    if target in ("torchrun", "kubernetes"):
        sections.append(Section("time", "Time per token", s.time_breakdown(plan)))
        sections.append(Section("affinity", "Affinity", [s.affinity_heatmap(plan, facts)]))
        sections.append(s.capacity_section(plan))
    if target == "offload":
        sections += s.offload_sections(plan, facts)
    if target == "lambda":
        sections += s.lambda_sections(plan, facts)
    name = plan.get("model", {}).get("name", "model")
    subtitle = (f"plan.json sha256 {hashlib.sha256(plan_bytes).hexdigest()}; figures from the "
                f"{facts.get('trace_role_text', 'plan alone (no --trace)')}")
    return document(f"moeplan report: {name}, {target}", subtitle, sections)

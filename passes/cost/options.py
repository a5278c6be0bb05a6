"""What a plan is priced with: the cost options (`--hardware`, `--workload`), checked before any pass
runs, and the hardware profile a plan recorded, as a person reads it.

* `default_cost_options`: {"hardware", "workload"} with the defaults filled in (facts `cost_options`).
* `parse_workload("8x32+8")`: 8 requests of 32 prompt tokens, 8 generated tokens each.
* `workload_label`, `workload_words`: a workload as '8x32+8' and in words; every time figure
  names the workload it is for (compile, run, report, diff).
* `plan_profile`, `profile_label`, `describe_choice`: the profile and the choice a plan's
  `predicted.cost` records, for summaries, `run` and the report.
"""
from __future__ import annotations

import re

from moeplan.core.errors import UserError
from moeplan.passes.cost.cost_model import Workload

DEFAULT_WORKLOAD = "8x32+8"


def default_cost_options(given: dict | None, nodes: int | None = None) -> dict:
    """{"hardware", "workload"} with the defaults filled in (the default profile is named in the plan);
    both are checked here, before any pass runs (with `nodes`, also that the profile knows every
    figure the cost model needs for that many nodes)."""
    from moeplan.core.hardware import DEFAULT_HARDWARE

    out = {"hardware": DEFAULT_HARDWARE, "workload": DEFAULT_WORKLOAD}
    out.update({k: v for k, v in (given or {}).items() if v is not None})
    cost_profile(out, nodes or 1)
    parse_workload(out["workload"])
    return out


def cost_profile(cost_options: dict, nodes: int):
    """The plan's LoadedProfile, refused in one line if it lacks a figure the cost model needs for
    `nodes` nodes (a one-machine profile over two nodes)."""
    from moeplan.core.hardware import cost_model_figures, load_profile

    given = load_profile(cost_options["hardware"])
    given.profile.require(cost_model_figures(nodes), f"the cost model of a plan over {nodes} node(s)")
    return given


def workload_figures(text: str) -> tuple:
    """'RxP+G' -> (R, P, G): R requests of P prompt tokens, G generated tokens each (every target's
    `--workload`); a one-line UserError otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*\+\s*(\d+)\s*", text if isinstance(text, str) else "")
    if not m or min(int(g) for g in m.groups()) < 1:
        raise UserError(f"--workload must look like REQUESTSxPROMPT+NEW (e.g. {DEFAULT_WORKLOAD}), all at least 1; got {text!r}")
    return tuple(int(x) for x in m.groups())


def parse_workload(text: str) -> Workload:
    """'RxP+G' as the torchrun cost model's Workload (R prompts of P tokens, G generated tokens each)."""
    r, p, g = workload_figures(text)
    return Workload(prompt_lengths=(p,) * r, new_tokens=g)


def workload_label(workload: Workload) -> str:
    """The workload as `--workload` writes it ('8x32+8'); prompts of several lengths as '4x(12..20)+8'."""
    lengths = workload.prompt_lengths
    low, high = min(lengths, default=0), max(lengths, default=0)
    prompt = str(low) if low == high else f"({low}..{high})"
    return f"{len(lengths)}x{prompt}+{workload.new_tokens}"


def workload_words(label: str) -> str:
    """'8x32+8' as a person reads it: '8 requests of 32 prompt tokens, 8 new tokens each'."""
    m = re.fullmatch(r"(\d+)x(\(?[\d.]+\)?)\+(\d+)", label or "")
    if not m:
        return str(label)
    r, p, g = m.groups()
    return f"{r} request{'s' if r != '1' else ''} of {p.strip('()')} prompt tokens, {g} new token{'s' if g != '1' else ''} each"


def plan_profile(cost: dict):
    """The HardwareProfile a plan's `predicted.cost` was priced with (core/hardware.py)."""
    from moeplan.core.hardware import profile_of_record

    return profile_of_record(cost.get("hardware_profile"), cost.get("hardware"))


def profile_label(cost: dict, detail: bool = False) -> str:
    """The profile as a person reads it: 'cpu-gloo', or 'cpu-gloo (this-machine, calibrated DATE)';
    `detail` adds the machine key and the file's hash."""
    recorded = cost.get("hardware_profile")
    if recorded is None:
        return cost.get("hardware", "?")
    calibration = recorded.get("calibration") or {}
    where = recorded["given"]
    if calibration:
        where += f", calibrated {calibration.get('date', '?')}"
        if detail:
            where += f" on {calibration.get('machine_key', '?')}"
    if detail:
        where += f", sha256 {recorded['sha256'][:12]}"
    return f"{cost.get('hardware', '?')} ({where})"


def describe_choice(plan) -> str:
    """One line: policy and mode chosen, predicted seconds per token under each mode, the profile
    (`plan`: a Plan as plan.json holds it, `Plan.as_written`)."""
    cost = plan.predicted.cost
    modes = ", ".join(f"{m} {v['seconds_per_token'] * 1e3:.2f} ms/token {v['total_bytes_per_token']:.0f} B/token"
                      for m, v in sorted(cost["modes"].items()))
    note = (" (the default; pass --hardware for the machine the bundle will run on)"
            if cost["hardware"] == "cpu-gloo" and "hardware_profile" not in cost else "")
    return (f"placement {plan.placement.policy}, mode {cost['mode']} (requested {cost['mode_requested']}); "
            f"predicted for workload {cost['workload']} ({workload_words(cost['workload'])}; routing sampled from the "
            f"planning trace): {modes}; hardware profile {profile_label(cost, detail=True)}{note}{_stop_note(cost)}")


def _stop_note(cost: dict) -> str:
    """--policy auto's early stop, when it skipped candidates: what it skipped and the error it used, with
    where that error comes from (`by_predicted_time.MODEL_ERROR`)."""
    stop = cost.get("auto_stop") or {}
    if not stop.get("skipped"):
        return ""
    return (f"; --policy auto stopped early: no placement is predicted below {stop['floor_seconds_per_token'] * 1e3:.2f} "
            f"ms/token, within the cost model's error ({stop['error']:.0%}: its measured accuracy against `moeplan run`, "
            f"docs/cost_model.md 'How close the demo comes') of the best so far; not tried: {', '.join(stop['skipped'])}")

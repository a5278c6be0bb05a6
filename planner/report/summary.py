"""The report's summary, from plan.json alone: inputs with their hashes, every decision with the
reason the plan's own figures give for it, and the predicted figures beside the alternatives the
planner priced. Every number is a `Num` naming its plan.json path (page.py)."""
from __future__ import annotations

from moeplan.passes.cost.model_error import MARGINAL
from moeplan.planner.report.page import Note, Num, Section, Table, fmt

MS = 1e3


def at(plan: dict, path: str):
    """The value at a dotted path ("predicted.cost.alternatives.0.label"), None where absent."""
    node = plan
    for part in path.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def hardware_name(plan: dict) -> str:
    """The profile that priced the plan's predictions (`predicted.cost.hardware`: a name, or a
    record with a name where the plan keeps more about the profile and its calibration)."""
    hw = at(plan, "predicted.cost.hardware")
    if isinstance(hw, dict):
        return str(hw.get("name", ""))
    return "" if hw is None else str(hw)


def profile_rows(record) -> list:
    """Where a profile that is not built in came from (core/hardware.py `plan_record`): the file as
    given and its sha256, and for a `moeplan calibrate` profile its date, machine key and load."""
    if not isinstance(record, dict):
        return []
    rows = [["hardware profile file", f"{record.get('given', '')} ({record.get('origin', '')})"],
            ["hardware profile sha256", str(record.get("sha256", ""))]]
    calibration = record.get("calibration")
    if isinstance(calibration, dict):
        rows += [["calibrated", str(calibration.get("date", ""))], ["calibration machine", str(calibration.get("machine_key", ""))],
                 ["load average while calibrating", str(calibration.get("load_average", ""))]]
    return rows


def num(plan: dict, path: str, scale: float = 1.0, unit: str = "", digits: int = 4) -> Num:
    return Num(at(plan, path), path, scale, digits, unit)


def _options_text(options) -> str:
    if not isinstance(options, dict):
        return ""
    return ", ".join(f"{k}={v}" for k, v in sorted(options.items()) if not isinstance(v, (dict, list)))


def inputs_table(plan: dict) -> Table:
    """What the plan was computed from, with hashes, and which hardware profile priced it."""
    rows = [["target", plan.get("target", "")], ["model (as given)", str(at(plan, "inputs.model") or "")],
            ["model", f"{at(plan, 'model.name') or ''} ({at(plan, 'model.architecture') or ''})"]]
    if at(plan, "model.weights_sha256"):
        rows.append(["weights sha256", at(plan, "model.weights_sha256")])
    rows.append(["trace sha256", str(at(plan, "inputs.trace_sha256") or "")])
    if at(plan, "inputs.trace_tokens") is not None:
        rows.append(["trace tokens", num(plan, "inputs.trace_tokens")])
    if plan.get("target") in ("torchrun", "kubernetes", "sglang", "vllm", "trtllm"):
        rows.append(["topology", f"{at(plan, 'topology.nodes')} node(s) x {at(plan, 'topology.gpus_per_node')} GPU(s)"])
    if at(plan, "inputs.options"):
        rows.append(["options", _options_text(at(plan, "inputs.options"))])
    cost = at(plan, "predicted.cost")
    if isinstance(cost, dict):
        rows.append(["hardware profile (predictions)", hardware_name(plan)])
        if isinstance(cost.get("hardware"), dict):
            rows += [[f"hardware.{k}", num(plan, f"predicted.cost.hardware.{k}") if isinstance(v, (int, float))
                      and not isinstance(v, bool) else (_options_text(v) if isinstance(v, dict) else str(v))]
                     for k, v in sorted(cost["hardware"].items()) if k != "name"]
        rows += profile_rows(cost.get("hardware_profile"))
        rows.append(["workload (requests x prompt + new tokens)", str(cost.get("workload", ""))])
        for key in sorted(cost):  # what the plan records about the profile's calibration, whatever its keys
            if key not in ("hardware", "hardware_profile") and any(w in key for w in ("hardware", "calibrat", "profile")):
                value = cost[key]
                rows.append([f"{key}", _options_text(value) if isinstance(value, dict) else
                             (num(plan, f"predicted.cost.{key}") if isinstance(value, (int, float)) and not isinstance(value, bool)
                              else str(value))])
    serving = at(plan, "predicted.serving")
    if isinstance(serving, dict):
        rows.append(["hardware profile (serving prediction)", str(serving.get("hardware", ""))])
        rows += profile_rows(serving.get("hardware_profile"))
        rows.append(["workload (requests x prompt + new tokens)", str(serving.get("workload", ""))])
    if plan.get("target") == "offload":
        rows.append(["hardware profile (predictions)", str(at(plan, "topology.hardware") or "")])
        rows += profile_rows(at(plan, "inputs.hardware_profile"))
        rows += [[k, num(plan, f"inputs.{k}")] for k in ("gpu_memory_bytes", "expert_cache", "batch", "max_length",
                                                         "prompt_tokens", "validation_fraction", "seed")
                 if at(plan, f"inputs.{k}") is not None]
    if plan.get("target") == "lambda":
        rows.append(["platform", str(at(plan, "topology.platform") or "")])
        rows += [[k, num(plan, f"inputs.{k}")] for k in ("slo_s", "bo_iterations") if at(plan, f"inputs.{k}") is not None]
        rows.append(["batch tokens", num(plan, "communication.batch_tokens")])
    return Table(["input", "value"], rows, "Inputs")


# ------------------------------------------------------------------------------------- torchrun

def workload_note(plan: dict) -> str:
    """'workload 8x32+8 (8 requests of 32 prompt tokens, 8 new tokens each), routing sampled from the
    planning trace': what every predicted time of the plan is for."""
    from moeplan.passes.cost.options import workload_words

    workload = at(plan, "predicted.cost.workload")
    if workload is None:
        return "the plan's workload"
    return f"workload {workload} ({workload_words(workload)}), routing sampled from the planning trace"


def _policy_reason(plan: dict, tie: float) -> str:
    alts = at(plan, "predicted.cost.alternatives") or []
    requested = at(plan, "inputs.options.policy")
    if requested != "auto" or not alts:
        return f"requested (--policy {requested or at(plan, 'placement.policy')})"
    hw = hardware_name(plan)
    chosen = next((a for a in alts if a.get("chosen")), alts[0])
    others = sorted((a for a in alts if not a.get("chosen")), key=lambda a: a["seconds_per_token"])
    text = (f"auto priced {len(alts)} candidates on {hw} for {at(plan, 'predicted.cost.workload')}: {chosen['label']} at "
            f"{fmt(chosen['seconds_per_token'], MS)} ms/token ({chosen['mode']})")
    if others:
        best = others[0]
        text += f"; fastest other {best['label']} at {fmt(best['seconds_per_token'], MS)} ms/token ({best['mode']})"
    if marginal(plan):
        text += f"; marginal: every candidate is within {MARGINAL:.0%} of it, the cost model's error"
    text += (f"; candidates are tried in order and a later one wins only when more than {tie:.0%} faster "
             "than the best so far")
    stop = at(plan, "predicted.cost.auto_stop") or {}
    if stop.get("skipped"):
        text += (f"; not tried: {', '.join(stop['skipped'])}, as no placement is predicted below "
                 f"{fmt(stop['floor_seconds_per_token'], MS)} ms/token, within the cost model's error "
                 f"({stop['error']:.0%}) of the best")
    return text


def marginal(plan: dict) -> bool:
    """--policy auto's candidates all predicted within the model's error of the chosen one (passes/cost/model_error.py)."""
    from moeplan.passes.cost.model_error import within_error

    alts = at(plan, "predicted.cost.alternatives") or []
    chosen = next((a for a in alts if a.get("chosen")), None)
    return len(alts) > 1 and chosen is not None and within_error([a["seconds_per_token"] for a in alts], chosen["seconds_per_token"])


TERMS = ("compute", "dispatch", "combine", "merge", "context", "token_sync")


def _terms(prediction: dict) -> dict:
    """{term: seconds per token}: compute, and each exchange kind summed over its tiers (call, same node, other node)."""
    out = {"compute": prediction.get("compute_seconds_per_token") or 0.0}
    for kind, tiers in (prediction.get("exchange_seconds_per_token") or {}).items():
        out[kind] = sum(v for v in tiers.values() if isinstance(v, (int, float)))
    return out


def balance_explanation(plan: dict, tie: float) -> str | None:
    """Why the chosen candidate won although another is better balanced (lower max/mean load), in the
    terms of the predicted time: which term the better balance saves and which term costs it more."""
    alts = at(plan, "predicted.cost.alternatives") or []
    chosen = next((a for a in alts if a.get("chosen")), None)
    rated = [a for a in alts if isinstance(a.get("max_over_mean_load"), (int, float))]
    if chosen is None or chosen not in rated:
        return None
    best = min(rated, key=lambda a: (a["max_over_mean_load"], a["seconds_per_token"]))
    if best is chosen or best["max_over_mean_load"] > chosen["max_over_mean_load"] - 0.05:
        return None
    mode = chosen["mode"]
    ours, theirs = _terms(chosen["modes"][mode]), _terms((best.get("modes") or {}).get(mode) or {})
    delta = {k: theirs.get(k, 0.0) - ours.get(k, 0.0) for k in TERMS if k in ours or k in theirs}
    worst = max(delta, key=lambda k: delta[k])
    saved = min(delta, key=lambda k: delta[k])
    spt = lambda a: fmt((a.get("modes") or {}).get(mode, {}).get("seconds_per_token", a["seconds_per_token"]), MS)
    text = (f"{chosen['label']} (max/mean load {fmt(chosen['max_over_mean_load'])}) was chosen over the better balanced "
            f"{best['label']} ({fmt(best['max_over_mean_load'])}) because the choice is by predicted time, not balance: "
            f"{spt(chosen)} against {spt(best)} ms/token in {mode} mode ({workload_note(plan)}, on {hardware_name(plan)}). ")
    if delta[saved] < 0:
        text += f"{best['label']}'s balance saves {fmt(-delta[saved], MS)} ms/token of {saved}"
    else:
        text += f"{best['label']}'s balance saves no predicted time (the slowest rank's {saved} does not drop)"
    if delta[worst] > 0:
        text += f", and it pays {fmt(delta[worst], MS)} ms/token more in {worst}: {worst} decides."
    else:
        text += "."
    if best["seconds_per_token"] < chosen["seconds_per_token"]:
        text += (f" It is faster, but by less than the {tie:.0%} a later candidate must win by, and the order tries "
                 f"{chosen['label']} first.")
    return text


def _mode_reason(plan: dict, tie: float) -> str:
    cost = at(plan, "predicted.cost") or {}
    if cost.get("mode_requested") != "auto":
        return f"requested (--mode {cost.get('mode_requested', at(plan, 'communication.mode'))})"
    modes = cost.get("modes", {})
    chosen = cost.get("mode")
    other = next((m for m in sorted(modes) if m != chosen), None)
    if other is None:
        return f"auto: only {chosen} was priced"
    return (f"auto chose {chosen}: predicted {fmt(modes[chosen]['seconds_per_token'], MS)} vs "
            f"{fmt(modes[other]['seconds_per_token'], MS)} ms/token ({other}) on {hardware_name(plan)}; "
            f"coherent must be more than {tie:.0%} faster to be chosen")


def torchrun_decisions(plan: dict, tie: float) -> Table:
    label = next((a["label"] for a in at(plan, "predicted.cost.alternatives") or [] if a.get("chosen")), None)
    policy = at(plan, "placement.policy")
    rows = [["placement policy", f"{policy}" + (f" ({label})" if label and label != policy else "")
             + f", {at(plan, 'placement.metrics.redundant') or 0} redundant slot(s)", _policy_reason(plan, tie)],
            ["communication mode", str(at(plan, "communication.mode")), _mode_reason(plan, tie)],
            ["gating", str(at(plan, "communication.gating")), "replicas chosen per token at run time (the runtime's rule)"]]
    cache = at(plan, "communication.expert_cache")
    if isinstance(cache, dict):
        rows.append(["expert cache per rank", f"{cache.get('capacity')} entries, eviction {cache.get('eviction')}, "
                     f"prefetch {cache.get('prefetch')}", "by simulation of the planning trace's held-out sequences (docs/offload.md)"])
    return Table(["decision", "value", "reason"], rows, "Decisions")


def choice_notes(plan: dict, tie: float) -> list:
    """Notes beside the decisions: a marginal --policy auto choice, a choice that looks wrong on balance."""
    notes = []
    alts = at(plan, "predicted.cost.alternatives") or []
    if marginal(plan):
        spread = [a["seconds_per_token"] for a in alts]
        notes.append(Note(f"Marginal choice: the {len(alts)} candidates' predicted times span {fmt(min(spread), MS)} to "
                          f"{fmt(max(spread), MS)} ms/token, all within {MARGINAL:.0%} of the chosen one, which is within the "
                          "cost model's error (docs/cost_model.md): on this prediction they are a toss-up, and a measurement "
                          "(moeplan run) decides better than the plan.", tone="warn"))
    why = balance_explanation(plan, tie)
    if why:
        notes.append(Note(why))
    return notes


def torchrun_predicted(plan: dict) -> list:
    tables = [Table(["placement metric (planning trace)", "predicted"],
                    [[k, num(plan, f"predicted.{k}")] for k in ("gpu_local_fraction", "node_local_fraction", "max_over_mean_load")
                     if at(plan, f"predicted.{k}") is not None], "Placement")]
    modes = at(plan, "predicted.cost.modes") or {}
    if modes:
        rows = []
        for m in sorted(modes):
            base = f"predicted.cost.modes.{m}"
            rows.append([m + (" (chosen)" if m == at(plan, "predicted.cost.mode") else ""),
                         num(plan, f"{base}.seconds_per_token", MS, "ms"), num(plan, f"{base}.total_bytes_per_token", unit="B"),
                         num(plan, f"{base}.bytes_per_token_by_tier.other_node", unit="B"),
                         num(plan, f"{base}.all_messages_per_token"), num(plan, f"{base}.compute_share")])
        tables.append(Table(["mode", "time per token", "bytes per token", "of which across nodes", "messages per token",
                             "compute share"], rows, f"The chosen placement under both modes ({workload_note(plan)})"))
    alts = at(plan, "predicted.cost.alternatives") or []
    if alts:
        rows = [[str(a["label"]) + (" (chosen)" if a.get("chosen") else ""), str(a["mode"]),
                 num(plan, f"predicted.cost.alternatives.{i}.seconds_per_token", MS, "ms"),
                 num(plan, f"predicted.cost.alternatives.{i}.total_bytes_per_token", unit="B")]
                for i, a in enumerate(alts)]
        balance = any("max_over_mean_load" in a for a in alts)
        if balance:
            for i, (row, a) in enumerate(zip(rows, alts)):
                row.append(num(plan, f"predicted.cost.alternatives.{i}.max_over_mean_load") if "max_over_mean_load" in a else "")
        tables.append(Table(["candidate", "its mode", "time per token", "bytes per token"] + (["max / mean load"] if balance else []),
                            rows, f"Predicted beside the alternatives priced (--policy auto; {workload_note(plan)})"))
    cache = at(plan, "predicted.expert_cache")
    if isinstance(cache, dict) and "hit_ratio" in cache:
        tables.append(Table(["expert cache", "predicted"], [["hit ratio", num(plan, "predicted.expert_cache.hit_ratio")]],
                            "Expert cache"))
    return tables


# ---------------------------------------------------------------------------------------- engines

def engine_decisions(plan: dict) -> Table:
    requested = at(plan, "inputs.options.policy")
    rows = [
        ["placement policy", str(at(plan, "placement.policy")), f"--policy {requested}: balance is what sets an MoE "
         "layer's time under standard EP (docs/interop.md)"],
        ["redundant slots", num(plan, "communication.redundant"), "given with --redundant"],
        ["slots per rank", num(plan, "communication.slots_per_rank"), "(experts + redundant) / EP ranks"],
        ["objective", str(at(plan, "communication.objective")), "the engine runs standard expert parallelism"],
    ]
    rows += engine_deployment_rows(plan)
    layout = at(plan, "predicted.serving.layout")
    if isinstance(layout, dict):
        attention = (f"data parallel, {layout.get('attention_dp')} replicas of tp {layout.get('attention_tp')}"
                     if (layout.get("attention_dp") or 1) > 1 else f"tensor parallel over {layout.get('attention_tp')} GPUs")
        rows.append(["deployment priced", f"{layout.get('gpus')} GPUs ({layout.get('nodes')} x {layout.get('gpus_per_node')}), "
                     f"attention {attention}, MoE ep {layout.get('moe_ep')} x tp {layout.get('moe_tp')}, tokens to experts by "
                     f"{layout.get('moe_a2a')}, {layout.get('engine')} kernels of its database version "
                     f"{layout.get('database_version')}", "the deployment above, as the launch script runs it (docs/engine_pricing.md)"])
    for i, warning in enumerate(at(plan, "predicted.warnings") or []):
        rows.append([f"warning {i + 1}", str(warning), "predicted.warnings"])
    return Table(["decision", "value", "reason"], rows, "Decisions")


def engine_deployment_rows(plan: dict) -> list:
    """The engine's layout (plan.json `deployment`, core/engine_layout.py), where the plan records one."""
    if at(plan, "deployment.attention_dp") is None:
        return []
    by = f"chosen by {at(plan, 'deployment.chosen_by')}"
    rows = [["attention tensor parallel", num(plan, "deployment.attention_tp"), by],
            ["attention data parallel", num(plan, "deployment.attention_dp"),
             f"{by} (--attention: tp inside one node, dp across nodes unless given)"],
            ["MoE expert parallel", num(plan, "deployment.moe_ep"), "every GPU holds experts"],
            ["token exchange", str(at(plan, "deployment.moe_a2a")), "deepep where expert parallelism spans nodes"],
            ["max running requests", num(plan, "deployment.max_running_requests") if
             at(plan, "deployment.max_running_requests") is not None else "engine's own",
             "--max-running-requests, else --workload's requests"]]
    if at(plan, "deployment.eplb") is not None:
        rows += [[f"vLLM EPLB {key}", num(plan, f"deployment.eplb.{key}"), "from the trace's drift (docs/interop.md)"]
                 for key in ("window_size", "step_interval")]
    return rows


def engine_predicted(plan: dict) -> list:
    tables = [Table(["figure", "predicted"], [["max / mean rank load (mean over layers)", num(plan, "predicted.max_over_mean_load")]],
                    "Predicted (planning trace)")]
    serving = at(plan, "predicted.serving")
    if not isinstance(serving, dict):
        return tables
    base = "predicted.serving"
    fits = "fits" if serving.get("fits") else "does not fit"
    if serving.get("fits") is False:  # issue 40: a plan that does not fit says so, in red, before its figures
        tables.append(Note(f"Does not fit: {fmt(serving.get('memory_per_gpu_bytes'), 2.0 ** -30)} GiB per GPU (weights, KV "
                           f"cache of workload {serving.get('workload')}, the engine's reserve) against the "
                           f"{fmt(at(plan, f'{base}.memory.device_bytes'), 2.0 ** -30)} GiB of a {serving.get('hardware')}: "
                           "the engine would not start. Give more GPUs, fewer requests or shorter contexts.", tone="bad"))
    rows = [["workload (requests x prompt + new tokens, over the deployment)", str(serving.get("workload", ""))],
            ["hardware", str(serving.get("hardware", ""))],
            ["running requests (decode batch)", num(plan, f"{base}.running_requests")],
            ["TPOT (mean decode step)", num(plan, f"{base}.tpot_s", MS, "ms")],
            ["TTFT (mean over requests)", num(plan, f"{base}.ttft_s", unit="s")],
            ["prefill of every request", num(plan, f"{base}.prefill_s", unit="s")],
            ["output tokens per second", num(plan, f"{base}.output_tokens_per_s")],
            ["output tokens per second per GPU", num(plan, f"{base}.output_tokens_per_s_per_gpu")],
            ["busiest over mean EP rank rows (decode batch, trace windows)", num(plan, f"{base}.max_over_mean_load")],
            [f"memory per GPU ({fits} in the GPU's memory)", num(plan, f"{base}.memory_per_gpu_bytes", 1 / 2**30, "GiB")],
            ["of which weights", num(plan, f"{base}.memory.weights_bytes", 1 / 2**30, "GiB")],
            ["of which KV cache at prompt + new tokens", num(plan, f"{base}.memory.kv_bytes", 1 / 2**30, "GiB")],
            ["of which the engine's reserve", num(plan, f"{base}.memory.reserved_bytes", 1 / 2**30, "GiB")],
            ["GPU memory", num(plan, f"{base}.memory.device_bytes", 1 / 2**30, "GiB")]]
    tables.append(Table(["serving figure", "predicted"], rows, f"Serving prediction for workload {serving.get('workload')} "
                        f"on {serving.get('hardware')}, " + ("routing from the planning trace" if serving.get("routing") == "trace"
                        else f"routing {serving.get('routing')}") + " (passes/cost/engine/)"))
    tables += slo_search_tables(plan)
    sources = serving.get("price_sources") or []
    tables.append(Table(["price source", "decode step time at the middle context"],
                        [[str(r.get("source")), num(plan, f"{base}.price_sources.{i}.seconds", MS, "ms")]
                         for i, r in enumerate(sources)], "Where the prices come from"))
    ops = serving.get("op_prices") or []
    tables.append(Table(["op", "time per decode step", "source"],
                        [[str(r.get("op")), num(plan, f"{base}.op_prices.{i}.seconds", MS, "ms"), str(r.get("source"))]
                         for i, r in enumerate(ops)], "The decode step at the middle context, op by op"))
    return tables


def slo_search_tables(plan: dict) -> list:
    """The SLO search's choice, why it won, and its frontier (docs/slo_search.md), where it chose."""
    search = at(plan, "predicted.slo_search")
    if not isinstance(search, dict):
        return []
    base = "predicted.slo_search"
    chosen = search.get("chosen") or {}
    rows = [["objective", f"--slo {search.get('slo')} for --workload {search.get('workload')} on {search.get('hardware')}"],
            ["chosen", _layout_text(chosen)],
            ["why", str(search.get("why", ""))],
            ["GPU counts priced", ", ".join(str(g) for g in search.get("gpu_counts_tried") or [])],
            ["fewest GPUs that hold the model and the workload", num(plan, f"{base}.memory_floor_gpus")]]
    frontier = [[_layout_text(p), num(plan, f"{base}.frontier.{i}.tpot_s", MS, "ms"),
                 num(plan, f"{base}.frontier.{i}.ttft_s", unit="s"),
                 num(plan, f"{base}.frontier.{i}.output_tokens_per_s_per_gpu"), str(p.get("routing")),
                 "yes" if p.get("meets_slo") else "no"] for i, p in enumerate(search.get("frontier") or [])]
    return [Table(["SLO search", "value"], rows, "SLO search (passes/cost/engine/slo_search.py)"),
            Table(["deployment", "TPOT", "TTFT", "output tokens/s per GPU", "routing", "meets the SLO"], frontier,
                  "Frontier: output tokens/s per GPU against TPOT (no priced deployment is better on both)")]


def _layout_text(p: dict) -> str:
    dp, tp = p.get("attention_dp") or 1, p.get("attention_tp")
    attention = f"tp{tp}" if dp == 1 else f"tp{tp} x dp{dp}"
    return (f"{p.get('gpus')} GPUs ({p.get('nodes')} x {p.get('gpus_per_node')}), attention {attention}, ep{p.get('moe_ep')}, "
            f"{p.get('redundant_experts')} redundant, {p.get('max_running_requests')} running")


# ---------------------------------------------------------------------------------------- offload

def offload_decisions(plan: dict) -> Table:
    c = "communication"
    demand = at(plan, "predicted.policies") or {}
    prefetch = at(plan, "predicted.prefetch") or {}
    size_reason = ("--expert-cache given" if at(plan, "inputs.expert_cache") is not None else
                   f"(GPU memory - dense - KV cache - activations - reserve) / expert bytes on {at(plan, 'topology.hardware')}")
    evict = ", ".join(f"{k} {fmt(v['hit_ratio'])}" for k, v in sorted(demand.items()) if k != "belady")
    pref = ", ".join(f"{k} {fmt(v['seconds_per_token'], MS)} ms" for k, v in sorted(prefetch.items()))
    tiers = at(plan, f"{c}.tiers") or {}
    return Table(["decision", "value", "reason"], [
        ["expert cache (GPU entries)", num(plan, f"{c}.expert_cache"), size_reason],
        ["eviction", str(at(plan, f"{c}.eviction")), f"best held-out demand hit ratio ({evict}); a prefetcher brings its paired policy"],
        ["prefetch", str(at(plan, f"{c}.prefetch")), f"lowest simulated time per token ({pref})"],
        ["host compute on a miss", str(at(plan, f"{c}.host_compute") or "never"),
         "the lowest simulated time per token with and without it (+host rows above; docs/offload.md)"],
        ["residents at start", f"{len(at(plan, 'placement.resident') or [])} (layer, expert) entries", "the most popular in the fitting part of the trace"],
        ["host tier", num(plan, f"{c}.tiers.host_experts", unit="experts"), "the most popular experts that fit in host memory"],
        ["disk tier", num(plan, f"{c}.tiers.disk_experts", unit="experts") if tiers else "", "the rest"],
    ], "Decisions")


def chosen_prefetch(plan: dict) -> str:
    """The chosen row of predicted.prefetch: the prefetcher, "+host" with host compute on a miss."""
    return str(at(plan, "communication.prefetch")) + ("+host" if at(plan, "communication.host_compute") == "cheaper" else "")


def offload_predicted(plan: dict) -> list:
    demand = at(plan, "predicted.policies") or {}
    prefetch = at(plan, "predicted.prefetch") or {}
    head = Table(["figure", "predicted"], [
        ["hit ratio", num(plan, "predicted.hit_ratio")], ["time per token", num(plan, "predicted.seconds_per_token", MS, "ms")],
        ["resident at layer start", num(plan, "predicted.resident_at_layer_start")],
        ["bytes moved per token", num(plan, "predicted.bytes_moved_per_token", unit="B")],
        ["points below Belady", num(plan, "predicted.belady_gap_points")],
        ["held-out tokens simulated", num(plan, "predicted.validation_tokens")]], "Predicted (held-out part of the planning trace)")
    pol = Table(["eviction policy", "hit ratio", "bytes moved"],
                [[k + (" (chosen)" if k == at(plan, "communication.eviction") else ""),
                  num(plan, f"predicted.policies.{k}.hit_ratio"), num(plan, f"predicted.policies.{k}.bytes_moved", unit="B")]
                 for k in sorted(demand)], "Beside every eviction policy (demand loading)")
    pre = Table(["prefetch", "hit ratio", "time per token", "resident at layer start"],
                [[k + (" (chosen)" if k == chosen_prefetch(plan) else ""),
                  num(plan, f"predicted.prefetch.{k}.hit_ratio"), num(plan, f"predicted.prefetch.{k}.seconds_per_token", MS, "ms"),
                  num(plan, f"predicted.prefetch.{k}.resident_at_layer_start")] for k in sorted(prefetch)],
                "Beside every prefetcher")
    return [head, pol, pre]


# ----------------------------------------------------------------------------------------- lambda

def lambda_decisions(plan: dict) -> Table:
    methods = at(plan, "communication.methods") or []
    layers = at(plan, "placement.layers") or []
    solves = at(plan, "predicted.solves") or []
    cheapest = ", ".join(f"{s['name']} ${fmt(s.get('objective'))}" for s in solves)
    mems = sorted({x["memory_mb"] for l in layers for x in l.get("experts", [])})
    reps = sorted({x["replicas"] for l in layers for x in l.get("experts", [])})
    slices = at(plan, "placement.dense_slices") or []
    return Table(["decision", "value", "reason"], [
        ["scatter-gather method per MoE layer", ", ".join(methods),
         f"{at(plan, 'predicted.algorithm')}: the cheapest MoE cost per batch within the SLO ({cheapest})"],
        ["expert functions", f"memory {', '.join(map(str, mems))} MB; replicas {', '.join(map(str, reps))}",
         "sized per expert for its predicted tokens (MILP per method, then ODS)"],
        ["dense functions", f"{len(slices)} slices", "HyPAD partitioning: least cost per request within its latency limit"],
        ["functions in all", num(plan, "topology.functions"), ""],
    ], "Decisions")


def lambda_api_call(plan: dict) -> list:
    """The API call the plan prices (--prompt-tokens, --new-tokens at compile), every charge in, and its month."""
    call = at(plan, "predicted.api_call")
    if not isinstance(call, dict):
        return []
    from moeplan.runtime.lambda_.charges import CHARGE_LABELS

    shape = f"{call.get('prompt_tokens')} prompt + {call.get('new_tokens')} new tokens"
    rows = [[f"cost per API call ({shape})", num(plan, "predicted.api_call.usd.total", unit="$")]]
    rows += [[f"  {label}", num(plan, f"predicted.api_call.usd.{key}", unit="$")]
             for key, label in CHARGE_LABELS.items() if (call.get("usd") or {}).get(key)]
    rows += [["latency of that call", num(plan, "predicted.api_call.latency_s", unit="s")],
             [f"per month at {call.get('requests_per_second')} such calls per second",
              num(plan, "predicted.api_call.monthly_usd", unit="$")]]
    return rows


def lambda_predicted(plan: dict) -> list:
    batch = at(plan, "communication.batch_tokens")
    rows = lambda_api_call(plan) + [
            [f"cost per sized batch ({batch} tokens; Lambda duration and request fees: the sizing's objective)",
             num(plan, "predicted.cost_per_request_usd", unit="$")],
            ["MoE cost per batch", num(plan, "predicted.moe_cost_per_batch_usd", unit="$")],
            ["dense cost per batch", num(plan, "predicted.dense_cost_per_batch_usd", unit="$")],
            ["latency per batch", num(plan, "predicted.latency_s", unit="s")],
            ["SLO", num(plan, "inputs.slo_s", unit="s")],
            ["throughput", num(plan, "predicted.throughput_tokens_per_s", unit="tokens/s")],
            ["validation: MoE cost per batch (real loads)", num(plan, "predicted.validation.moe_cost_per_batch_usd", unit="$")],
            ["validation: latency", num(plan, "predicted.validation.latency_s", unit="s")],
            ["validation: SLO violations", num(plan, "predicted.validation.slo_violations")]]
    solves = at(plan, "predicted.solves") or []
    alt = Table(["sizing solve", "status", "MoE cost per batch", "gap"],
                [[str(s.get("name")), str(s.get("status")), num(plan, f"predicted.solves.{i}.objective", unit="$"),
                  num(plan, f"predicted.solves.{i}.gap")] for i, s in enumerate(solves)], "Beside the alternatives priced")
    pred = at(plan, "predicted.predictor_error") or {}
    err = Table(["load predictor", "mean absolute error (tokens per expert per batch)"],
                [[k, num(plan, f"predicted.predictor_error.{k}")] for k in sorted(pred)], "Expert-load predictors")
    return [Table(["figure", "predicted"], rows, "Predicted"), alt, err]


def summary_section(plan: dict, tie: float) -> Section:
    target = plan.get("target")
    if target in ("torchrun", "kubernetes"):
        blocks = [torchrun_decisions(plan, tie)] + choice_notes(plan, tie) + torchrun_predicted(plan)
    elif target in ("sglang", "vllm", "trtllm"):
        blocks = [engine_decisions(plan)] + engine_predicted(plan)
    elif target == "offload":
        blocks = [offload_decisions(plan)] + offload_predicted(plan)
    elif target == "lambda":
        blocks = [lambda_decisions(plan)] + lambda_predicted(plan)
    else:
        blocks = []
    return Section("summary", "Summary", [inputs_table(plan)] + blocks)

"""`moeplan report` and `moeplan diff` on real plans of every target (issue 31).

One module fixture plans each target once (torchrun with --policy auto, kubernetes compiled with
--report, lambda, offload, sglang and trtllm compiled with --report); the page of each is opened
in real headless Chromium (Debian's, driven by playwright: one browser launch for every page),
where no console error may appear, every figure must render with a non-zero size and every
number of the summary must equal plan.json. Screenshots go to the test's tmp dir.
"""
import copy
import json
import math
import os
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeplan.planner.cli import main
from moeplan.planner.report.page import fmt
from moeplan.planner.report.summary import at

TINY = "examples/tiny_moe"
MIXTRAL = "examples/configs/mixtral-8x7b.json"
DEEPSEEK = "examples/configs/deepseek-v3.json"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def run(args):
    import traceback

    result = CliRunner().invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return result.exit_code, result.output + "".join(traceback.format_exception(result.exception))
    return result.exit_code, result.output


def ok(args):
    code, out = run(args)
    assert code == 0, out
    return out


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """{name: (plan.json path, report path)} for every target, and the traces."""
    tmp = tmp_path_factory.mktemp("report")
    ok(["trace", TINY, "--data", "examples/tiny_moe/corpus_heldout.txt", "--max-tokens", 1000, "--out", tmp / "t.npz"])
    ok(["trace", TINY, "--data", "examples/tiny_moe/corpus_train.txt", "--max-tokens", 400, "--out", tmp / "h.npz"])
    ok(["trace", "synth", "--layers", 32, "--experts", 8, "--k", 2, "--tokens", 1000, "--seed", 3, "--out", tmp / "mix.npz"])
    t, h = tmp / "t.npz", tmp / "h.npz"
    ok(["plan", TINY, "--trace", t, "--target", "torchrun", "--nodes", 1, "--gpus-per-node", 2, "--effort", 0.2,
        "--quiet", "--out", tmp / "torchrun.json"])
    ok(["compile", TINY, "--trace", t, "--target", "kubernetes", "--nodes", 2, "--gpus-per-node", 1, "--policy", "eplb",
        "--redundant", 2, "--cpu-only", "--image", "registry.example/moe:1", "--quiet", "--report",
        "--out", tmp / "k8s"])
    ok(["plan", TINY, "--trace", t, "--target", "lambda", "--slo", 5, "--cache-dir", tmp / "cache", "--out", tmp / "lambda.json"])
    ok(["plan", TINY, "--trace", t, "--target", "offload", "--expert-cache", 12, "--out", tmp / "offload.json"])
    for engine, serving in (("sglang", ["--hardware", "h100-sxm", "--workload", "16x256+16"]), ("trtllm", [])):
        ok(["compile", MIXTRAL, "--trace", tmp / "mix.npz", "--target", engine, "--nodes", 1, "--gpus-per-node", 4,
            "--redundant", 4, *serving, "--report", "--quiet", "--out", tmp / engine])
    # issue 40: a torchrun plan whose ranks cannot hold their weights (a profile with 1 GB per device), a
    # DeepSeek-V3-scale placement (58 MoE layers x 256 experts), and the kubernetes bundle's report drawn
    # from the bundle alone (no --trace: the plan's trace summary)
    small = tmp / "small-device.yaml"
    small.write_text(Path("core/hardware_data/cpu-gloo.yaml").read_text().replace("name: cpu-gloo", "name: small-device")
                     .replace("device_memory_bytes: 25276502016", "device_memory_bytes: 1000000000"))
    ok(["plan", TINY, "--trace", t, "--nodes", 1, "--gpus-per-node", 2, "--policy", "eplb", "--hardware", small,
        "--quiet", "--out", tmp / "nofit.json"])
    ok(["trace", "synth", "--layers", 58, "--experts", 256, "--k", 8, "--tokens", 600, "--seed", 3, "--out", tmp / "ds.npz"])
    ok(["plan", DEEPSEEK, "--trace", tmp / "ds.npz", "--target", "sglang", "--nodes", 2, "--gpus-per-node", 8,
        "--redundant", 16, "--quiet", "--out", tmp / "deepseek.json"])
    out = {"kubernetes": (tmp / "k8s" / "plan.json", tmp / "k8s" / "report.html")}
    for engine in ("sglang", "trtllm"):
        out[engine] = (tmp / engine / "plan.json", tmp / engine / "report.html")
    for name, traces in (("torchrun", [t, h]), ("lambda", [t]), ("offload", [t]), ("nofit", []), ("deepseek", [])):
        ok(["report", tmp / f"{name}.json", *[x for tr in traces for x in ("--trace", tr)], "--out", tmp / f"{name}.html"])
        out[name] = (tmp / f"{name}.json", tmp / f"{name}.html")
    ok(["report", tmp / "k8s", "--out", tmp / "k8s-alone.html"])
    out["bundle-alone"] = (tmp / "k8s" / "plan.json", tmp / "k8s-alone.html")
    return {"pages": out, "trace": t, "held_out": h, "tmp": tmp}


def _check_page(page, url: str, plan: dict, shot: Path) -> dict:
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: errors.append(f"request {r.url}") if not r.url.startswith(("file:", "data:")) else None)
    page.goto(url)
    page.screenshot(path=str(shot), full_page=True)
    figures = page.eval_on_selector_all("figure", """els => els.map(f => {
        const svg = f.querySelector('svg.figure'); const r = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
        return {id: f.id, width: r.width, height: r.height, caption: (f.querySelector('figcaption') || {}).textContent || '',
                rows: f.querySelectorAll('table tbody tr').length}; })""")
    numbers = page.eval_on_selector_all("#summary .num", """els => els.map(e => ({path: e.dataset.path || null,
        value: e.dataset.value, scale: e.dataset.scale, text: e.textContent}))""")
    # every pair of texts drawn in one figure whose boxes overlap by more than a sliver (issue 40: 58-layer charts)
    overlaps = page.eval_on_selector_all("svg.figure", """svgs => svgs.map(svg => {
        const boxes = Array.from(svg.querySelectorAll('text')).map(t => [t.textContent.trim(), t.getBoundingClientRect()])
            .filter(([s, r]) => s && r.width > 0 && r.height > 0);
        const hits = [];
        for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
            const [a, r] = boxes[i], [b, q] = boxes[j];
            const w = Math.min(r.right, q.right) - Math.max(r.left, q.left), h = Math.min(r.bottom, q.bottom) - Math.max(r.top, q.top);
            if (w > 1.5 && h > 1.5) hits.push(a + ' / ' + b);
        }
        return {id: svg.dataset.figure, texts: boxes.length, hits: hits.slice(0, 5), count: hits.length}; })""")
    bad = page.eval_on_selector_all(".note.bad", "els => els.map(e => [e.textContent, getComputedStyle(e).color])")
    return {"errors": errors, "figures": figures, "numbers": numbers, "overlaps": overlaps, "bad": bad}


EXPECTED_FIGURES = {
    "torchrun": {"placement-map", "layer-balance", "time-by-kind", "time-by-tier", "affinity"},
    "kubernetes": {"placement-map", "layer-balance", "time-by-kind", "time-by-tier", "affinity"},
    "sglang": {"placement-map", "layer-balance"}, "trtllm": {"placement-map", "layer-balance"},
    "offload": {"cache-curve", "tiers"}, "lambda": {"functions", "stages"},
    "nofit": {"placement-map", "time-by-kind", "time-by-tier"}, "deepseek": {"placement-map", "layer-balance"},
    "bundle-alone": {"placement-map", "layer-balance", "time-by-kind", "time-by-tier", "affinity"},
}


@pytest.mark.skipif(os.environ.get("MOEPLAN_NO_BROWSER") == "1", reason="MOEPLAN_NO_BROWSER=1")
def test_every_target_s_report_renders_in_chromium_and_its_summary_equals_plan_json(plans, tmp_path):
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: 'make venv' installs it as root (apt-get install chromium)"
    from playwright.sync_api import sync_playwright

    seen = {}
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(tempfile.mkdtemp(dir=tmp_path), executable_path=CHROMIUM, headless=True,
                                                       args=CHROMIUM_ARGS, viewport={"width": 1100, "height": 900},
                                                       offline=True)
        try:
            for name, (plan_path, report) in sorted(plans["pages"].items()):
                page = browser.new_page()
                seen[name] = _check_page(page, report.resolve().as_uri(), json.loads(plan_path.read_text()), tmp_path / f"{name}.png")
                page.close()
        finally:
            browser.close()
    for name, got in seen.items():
        plan = json.loads(plans["pages"][name][0].read_text())
        assert got["errors"] == [], (name, got["errors"])
        ids = {f["id"] for f in got["figures"]}
        assert EXPECTED_FIGURES[name] <= ids, (name, ids)
        for f in got["figures"]:
            assert f["width"] > 50 and f["height"] > 50, (name, f)
            assert f["caption"].strip() and f["rows"] > 0, (name, f)
        assert len(got["numbers"]) >= 3, name
        for n in got["numbers"]:
            assert n["path"] is not None, (name, n)  # every number of the summary names its place in plan.json
            value = json.loads(n["value"])
            assert value == at(plan, n["path"]), (name, n)
            assert n["text"].startswith(fmt(value, float(n["scale"]))), (name, n)
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
        for figure in got["overlaps"]:  # no two labels, ticks or cell texts drawn over each other
            assert figure["count"] == 0, (name, figure)
    assert {"torchrun", "kubernetes", "lambda", "offload", "sglang", "trtllm", "nofit", "deepseek", "bundle-alone"} == set(seen)
    assert max(f["texts"] for f in seen["deepseek"]["overlaps"]) > 40  # the 58-layer charts were measured, not empty
    (text, colour), = seen["nofit"]["bad"]  # the plan that does not fit says so, in red
    assert text.startswith("Does not fit") and colour == "rgb(176, 0, 32)", (text, colour)
    assert seen["torchrun"]["bad"] == []


def test_summary_states_the_reasons_the_plan_records(plans):
    page = plans["pages"]["torchrun"][1].read_text()
    plan = json.loads(plans["pages"]["torchrun"][0].read_text())
    cost = plan["predicted"]["cost"]
    std, coh = cost["modes"]["standard"]["seconds_per_token"], cost["modes"]["coherent"]["seconds_per_token"]
    chosen, other = (("standard", coh) if cost["mode"] == "standard" else ("coherent", std))
    assert f"auto chose {chosen}: predicted {fmt(cost['modes'][chosen]['seconds_per_token'], 1e3)} vs {fmt(other, 1e3)} ms/token" in page
    assert f"on {cost['hardware']}" in page and "hardware profile (predictions)" in page
    assert cost["alternatives"] and all(a["label"] in page for a in cost["alternatives"])
    # --policy auto tried candidates until none left could win by more than the cost model's error
    stop = cost["auto_stop"]
    assert stop["floor_seconds_per_token"] <= min(a["seconds_per_token"] for a in cost["alternatives"])
    if stop["skipped"]:
        assert f"not tried: {', '.join(stop['skipped'])}" in page and f"({stop['error']:.0%})" in page
    assert "Predicted beside re-scored on held-out traffic" in page  # torchrun's page had a held-out trace
    capacity = plan["communication"]["capacity"]
    assert "Serving capacity" in page and "records no serving capacity" not in page  # issue 40: it looked elsewhere
    assert f'data-path="communication.capacity.max_sequences" data-value="{capacity["max_sequences"]}"' in page
    assert f"for {cost['workload']}" in page and f"workload {cost['workload']} (" in page  # time figures name their workload


def test_time_breakdown_by_exchange_and_tier_sums_to_the_predicted_time(plans):
    plan = json.loads(plans["pages"]["kubernetes"][0].read_text())
    for mode, pred in plan["predicted"]["cost"]["modes"].items():
        parts = pred["compute_seconds_per_token"] + sum(v for kind in pred["exchange_seconds_per_token"].values()
                                                        for v in kind.values())
        assert math.isclose(parts, pred["seconds_per_token"], rel_tol=1e-6), mode
        # 2 nodes x 1 GPU: every message crosses nodes
        assert sum(k["same_node"] for k in pred["exchange_seconds_per_token"].values()) == 0
        assert sum(k["other_node"] for k in pred["exchange_seconds_per_token"].values()) > 0


def test_compile_report_is_in_the_manifest_and_the_bundle_still_verifies(plans):
    from moeplan.backends.common.manifest import verify_manifest

    for name in ("k8s", "sglang"):
        bundle = plans["tmp"] / name
        manifest = json.loads((bundle / "manifest.json").read_text())
        assert "report.html" in manifest["files"]
        verify_manifest(bundle)


def test_report_recomputations_reproduce_the_plan(plans):
    """The figures the report recomputes agree with what the planner recorded."""
    from moeplan.planner.commands.report_facts import cache_curve, lambda_figures, placement_facts, sort_traces, trace_loads

    off_path = plans["pages"]["offload"][0]
    off = json.loads(off_path.read_text())
    planning, _ = sort_traces(off, [plans["trace"]])
    curve = cache_curve(off, off_path, planning[1], is_planning=True)
    i = curve["sizes"].index(off["communication"]["expert_cache"])
    for policy, result in off["predicted"]["policies"].items():
        assert math.isclose(curve["hit_ratio"][policy][i], result["hit_ratio"], rel_tol=1e-6), policy
    lam_path = plans["pages"]["lambda"][0]
    lam = json.loads(lam_path.read_text())
    figs = lambda_figures(lam_path)
    assert math.isclose(sum(s["latency_s"] for s in figs["stages"]), lam["predicted"]["latency_s"], rel_tol=1e-6)
    assert math.isclose(sum(s["cost_usd"] for s in figs["stages"] if s["stage"].startswith("MoE")),
                        lam["predicted"]["moe_cost_per_batch_usd"], rel_tol=1e-6)
    tr = json.loads(plans["pages"]["torchrun"][0].read_text())
    planning, _ = sort_traces(tr, [plans["trace"]])
    facts = placement_facts(tr, *trace_loads(tr, planning[1], with_affinity=True))
    ours = facts["layer_balance"]["series"]["this plan"]
    assert math.isclose(sum(ours) / len(ours), tr["predicted"]["max_over_mean_load"], rel_tol=1e-6)
    assert facts["affinity"]["crossing"] <= facts["affinity"]["transitions"]


def test_the_bundle_alone_gives_the_planning_trace_s_figures(plans):
    """Issue 40: `moeplan report BUNDLE` without --trace drew no load chart and no affinity; the plan now keeps
    the planning trace's summary, from which the report computes the same numbers as from the trace itself."""
    from moeplan.planner.commands.report_facts import report_facts, sort_traces

    plan_path = plans["pages"]["kubernetes"][0]
    plan = json.loads(plan_path.read_text())
    summary = plan["inputs"]["trace_summary"]
    assert len(summary["expert_loads"]) == plan["model"]["moe_layers"]  # one line of E loads per MoE layer
    planning, _ = sort_traces(plan, [plans["trace"]])
    with_trace = report_facts(plan, plan_path, planning, None, 0.01)
    alone = report_facts(plan, plan_path, None, None, 0.01)
    for key in ("device_load", "layer_balance", "affinity"):
        assert alone[key] == with_trace[key], key
    assert alone["trace_role_text"] != with_trace["trace_role_text"]  # each page says where its numbers come from
    page = plans["pages"]["bundle-alone"][1].read_text()
    assert "plan.json&#x27;s trace summary" in page and "needs a routing trace" not in page and "pass --trace" not in page


def test_a_marginal_choice_and_one_worse_on_balance_are_explained(plans, tmp_path):
    """Issue 40: candidates within the model's error are called marginal; a chosen plan with max/mean load 1.31
    that beat a better balanced candidate says it won on predicted time, naming the term that decides."""
    plan = json.loads(plans["pages"]["torchrun"][0].read_text())
    cost = plan["predicted"]["cost"]
    mode = cost["mode"]
    chosen = next(a for a in cost["alternatives"] if a["chosen"])
    if all(a["chosen"] for a in cost["alternatives"]):  # --policy auto stopped early: a second candidate, made from the first
        cost["alternatives"].append({**copy.deepcopy(chosen), "label": "eplb+2", "policy": "eplb", "chosen": False})
    other = next(a for a in cost["alternatives"] if not a["chosen"])
    for a in cost["alternatives"]:
        a["max_over_mean_load"] = 1.31 if a is chosen else 1.03 if a is other else 1.5
    base = chosen["modes"][mode]
    for a in cost["alternatives"]:  # every other candidate 3 % slower, the better balanced one through its dispatch term
        if a is not chosen:
            a["seconds_per_token"] = a["modes"][mode]["seconds_per_token"] = base["seconds_per_token"] * 1.03
    other["modes"][mode]["compute_seconds_per_token"] = base["compute_seconds_per_token"] * 0.98
    extra = base["seconds_per_token"] * 0.03 + base["compute_seconds_per_token"] * 0.02
    other["modes"][mode]["exchange_seconds_per_token"] = {k: dict(v) for k, v in base["exchange_seconds_per_token"].items()}
    other["modes"][mode]["exchange_seconds_per_token"]["dispatch"]["call"] += extra
    (tmp_path / "p.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    ok(["report", tmp_path / "p.json", "--out", tmp_path / "p.html"])
    import html

    page = html.unescape((tmp_path / "p.html").read_text())
    assert "Marginal choice" in page and "within 6% of the chosen one" in page
    assert (f"{chosen['label']} (max/mean load 1.31) was chosen over the better balanced {other['label']} (1.03) because "
            "the choice is by predicted time, not balance") in page
    assert f"{other['label']}'s balance saves" in page and "ms/token of compute" in page and "dispatch decides" in page
    for a in cost["alternatives"]:  # 30 % apart: no longer marginal
        if a is not chosen:
            a["seconds_per_token"] = a["modes"][mode]["seconds_per_token"] = base["seconds_per_token"] * 1.3
    (tmp_path / "p.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    ok(["report", tmp_path / "p.json", "--out", tmp_path / "p.html"])
    assert "Marginal choice" not in (tmp_path / "p.html").read_text()


def test_report_refuses_a_bundle_that_fails_its_manifest_and_diff_one_whose_plan_does(plans, tmp_path):
    """Issue 40: `moeplan report` accepted a bundle whose shard failed its hash (exit 0)."""
    import shutil

    bundle = tmp_path / "k8s"
    shutil.copytree(plans["tmp"] / "k8s", bundle)
    shard = json.loads((bundle / "plan.json").read_text())["shards"][0]
    data = bytearray((bundle / shard).read_bytes())
    data[-1] ^= 1
    (bundle / shard).write_bytes(bytes(data))
    code, out = run(["report", bundle, "--out", tmp_path / "r.html"])
    assert code == 2 and out.startswith("error: ") and len(out.strip().splitlines()) == 1, out
    assert shard in out and "sha256" in out and not (tmp_path / "r.html").exists()
    ok(["diff", plans["tmp"] / "k8s", bundle])  # diff reads plan.json alone, which is intact
    plan = (bundle / "plan.json").read_text()
    (bundle / "plan.json").write_text(plan.replace('"mode": "', '"mode": "x', 1))
    code, out = run(["diff", plans["tmp"] / "k8s", bundle])
    assert code == 2 and "plan.json" in out and "sha256" in out and len(out.strip().splitlines()) == 1, out


def test_report_and_diff_are_byte_deterministic(plans, tmp_path):
    src, _ = plans["pages"]["torchrun"]
    pages = []
    for i, traces in enumerate(([plans["trace"], plans["held_out"]], [plans["held_out"], plans["trace"]])):
        ok(["report", src, *[x for t in traces for x in ("--trace", t)], "--out", tmp_path / f"{i}.html"])
        pages.append((tmp_path / f"{i}.html").read_bytes())
    assert pages[0] == pages[1] == plans["pages"]["torchrun"][1].read_bytes()
    a = ok(["diff", src, plans["pages"]["kubernetes"][0], "--json"])
    assert a == ok(["diff", src, plans["pages"]["kubernetes"][0], "--json"])


def test_report_bad_input_is_one_line_and_exit_2(plans, tmp_path):
    (tmp_path / "x.json").write_text('{"a": 1}')
    cases = [["report", tmp_path / "missing.json", "--out", tmp_path / "r.html"],
             ["report", tmp_path / "x.json", "--out", tmp_path / "r.html"],
             ["report", plans["pages"]["torchrun"][0], "--trace", plans["held_out"], "--trace", plans["held_out"],
              "--out", tmp_path / "r.html"],
             ["report", plans["pages"]["sglang"][0], "--trace", plans["trace"], "--out", tmp_path / "r.html"]]
    for args in cases:
        code, out = run(args)
        assert code == 2 and out.startswith("error: ") and len(out.strip().splitlines()) == 1, (args, out)
        assert not (tmp_path / "r.html").exists()


# -------------------------------------------------------------------------- diff --fail-on

def _variant(tmp_path: Path, plan_path: Path, name: str, path: str, factor: float) -> Path:
    plan = json.loads(plan_path.read_text())
    node = plan
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = node[last] * factor
    out = tmp_path / f"{name}.json"
    out.write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    return out


def test_diff_fail_on_exit_codes_for_each_figure(plans, tmp_path):
    tr = plans["pages"]["torchrun"][0]
    mode = json.loads(tr.read_text())["predicted"]["cost"]["mode"]
    cases = [  # (plan, figure path changed, factor, --fail-on that must cross, --fail-on that must not)
        (tr, f"predicted.cost.modes.{mode}.seconds_per_token", 1.06, "seconds_per_token>+5%", "seconds_per_token>+7%"),
        (tr, f"predicted.cost.modes.{mode}.total_bytes_per_token", 0.5, "bytes_per_token<-40%", "bytes_per_token>+0%"),
        (tr, "predicted.max_over_mean_load", 1.1, "max_over_mean_load>+0.05", "max_over_mean_load>+0.2"),
        (tr, "predicted.gpu_local_fraction", 0.5, "gpu_local_fraction<-0.1", "gpu_local_fraction>+0%"),
        (plans["pages"]["lambda"][0], "predicted.api_call.usd.total", 1.000001, "cost>+0%", "cost<-0%"),
        (plans["pages"]["lambda"][0], "predicted.api_call.latency_s", 1.5, "latency>+20%", "latency>+60%"),
        (plans["pages"]["offload"][0], "predicted.hit_ratio", 0.5, "hit_ratio<-0.01", "hit_ratio>+0%"),
        (plans["pages"]["sglang"][0], "predicted.max_over_mean_load", 1.03, "max_over_mean_load>+2%", "max_over_mean_load>=+4%"),
    ]
    for i, (base, path, factor, crosses, holds) in enumerate(cases):
        changed = _variant(tmp_path, base, f"v{i}", path, factor)
        code, out = run(["diff", base, changed, "--fail-on", crosses])
        assert code == 1 and "CROSSED" in out, (crosses, out)
        code, out = run(["diff", base, changed, "--fail-on", holds])
        assert code == 0, (holds, out)
        code, out = run(["diff", base, base, "--fail-on", crosses])
        assert code == 0 and "no decision or predicted figure differs" in out
    code, out = run(["diff", tr, plans["pages"]["kubernetes"][0]])
    assert code == 0 and "placement.policy" in out and "B / A" in out


def test_diff_is_compact_each_figure_once_changed_first(plans, tmp_path):
    """Issue 40: diff printed 35-80 lines with every figure twice, and a bundle against its own plan
    reported `weights_sha256 ... -> -` as a change."""
    tr, k8s = plans["pages"]["torchrun"][0], plans["pages"]["kubernetes"][0]
    out = ok(["diff", tr, k8s])
    lines = out.strip().splitlines()
    assert len(lines) <= 20, out
    figure_rows = [l.split()[0] for l in lines[lines.index(next(l for l in lines if l.startswith("figure "))) + 1:]
                   if l and not l.startswith(("unchanged", "recorded", "fail-on")) and not l[0].isdigit()]
    assert figure_rows and len(figure_rows) == len(set(figure_rows)), out  # each figure once
    assert not any(r.startswith("predicted.") for r in figure_rows), out  # the aliases stand for their paths
    assert "placement (layout digest)" in out and "MoE layers moved" in out and "placement.layer." not in out
    assert out.startswith("figures for ") and "workload 8x32+8" in out
    assert "other predicted number(s) changed (--all lists them" in out
    every = ok(["diff", tr, k8s, "--all"]).strip().splitlines()
    rows = [l.split()[0] for l in every if l.startswith("predicted.")]
    assert len(rows) == len(set(rows)) > 0
    as_json = json.loads(ok(["diff", tr, k8s, "--json"]))
    assert [r["changed"] for r in as_json["headline"]] == sorted((r["changed"] for r in as_json["headline"]), reverse=True)
    # a plan against the bundle compiled from it: nothing differs (the bundle's weights hash is not a change)
    plan = tmp_path / "k8s-plan.json"
    ok(["plan", TINY, "--trace", plans["trace"], "--target", "kubernetes", "--nodes", 2, "--gpus-per-node", 1, "--policy", "eplb",
        "--redundant", 2, "--cpu-only", "--image", "registry.example/moe:1", "--quiet", "--out", plan])
    out = ok(["diff", plan, plans["tmp"] / "k8s"])
    assert "no decision or predicted figure differs" in out and "weights_sha256" in out.splitlines()[-1], out
    assert "recorded by one plan only (not compared): B: weights_sha256" in out


def test_diff_bad_expression_is_one_line_and_exit_2(plans):
    tr = plans["pages"]["torchrun"][0]
    for expr in ("seconds_per_token>>5%", "", "seconds_per_token", "speed>+5%", "seconds_per_token>+5%,", "x<y",
                 "seconds_per_token>5", "bytes_per_token>+2ms", "gpu_local_fraction<-1KB"):
        code, out = run(["diff", tr, tr, "--fail-on", expr])
        assert code == 2 and out.startswith("error: ") and len(out.strip().splitlines()) == 1, (expr, out)
    code, out = run(["diff", tr, tr, "--fail-on", "cost>+0%"])  # an alias these plans lack: noted, not an error
    assert code == 0 and "neither plan has this figure" in out

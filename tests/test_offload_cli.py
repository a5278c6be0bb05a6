"""`moeplan plan --target offload` and `moeplan simulate` on offload plans: decisions, determinism,
the planner's prediction reproduced by the simulator, full-size configs, one-line errors."""
import json

import pytest
from click.testing import CliRunner

from moeplan.passes.analysis.trace.format import save_trace
from synth_routing import synthesize_routed_tokens
from moeplan.planner.cli import main

TINY = "examples/tiny_moe"


def run(args):
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    save_trace(synthesize_routed_tokens(tokens=1500, layers=6, experts=16, top_k=2, seq_len=100, seed=0), tmp / "t.npz")
    save_trace(synthesize_routed_tokens(tokens=600, layers=6, experts=16, top_k=2, seq_len=100, seed=1), tmp / "h.npz")
    return tmp


def test_plan_then_simulate(tiny):
    base = ["plan", TINY, "--trace", str(tiny / "t.npz"), "--target", "offload", "--expert-cache", "30"]
    code, out = run(base + ["--out", str(tiny / "plan.json"), "--json"])
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["expert_cache"] == 30 and summary["total_experts"] == 96
    plan = json.loads((tiny / "plan.json").read_text())
    assert plan["target"] == "offload"
    c, p = plan["communication"], plan["predicted"]
    assert c["eviction"] in ("moeplan", "lru", "lfu", "lifo", "moe-infinity") and c["prefetch"] in ("none", "moe-infinity", "moeplan")
    assert len(plan["placement"]["resident"]) == 30 and len({tuple(k) for k in plan["placement"]["resident"]}) == 30
    assert c["tiers"]["host_experts"] + c["tiers"]["disk_experts"] == 96
    pol = p["policies"]
    assert set(pol) == {"lru", "lfu", "lifo", "moe-infinity", "belady", "moeplan"}
    assert all(r["hit_ratio"] <= pol["belady"]["hit_ratio"] + 1e-9 for r in pol.values())
    assert p["hit_ratio"] == pol[c["eviction"]]["hit_ratio"] and p["seconds_per_token"] > 0
    # same inputs -> same bytes
    code, _ = run(base + ["--out", str(tiny / "plan2.json"), "--quiet"])
    assert code == 0 and (tiny / "plan.json").read_bytes() == (tiny / "plan2.json").read_bytes()
    code, out = run(["simulate", str(tiny / "plan.json"), "--trace", str(tiny / "h.npz"), "--json"])
    assert code == 0, out
    sim = json.loads(out.strip().splitlines()[-1])
    assert set(sim["policies"]) == set(pol) and set(sim["prefetch"]) == {"none", "moe-infinity", "moeplan"}
    for r in sim["prefetch"].values():
        assert 0 <= r["resident_at_layer_start"] <= r["hit_ratio"] <= 1 and r["seconds_per_token"] > 0
    assert sim["policies"]["moeplan"]["bytes_moved"] == sim["policies"]["moeplan"]["loads"] * c["memory"]["expert_bytes"]
    code, out = run(["simulate", str(tiny / "plan.json"), "--trace", str(tiny / "h.npz"), "--prompt-tokens", "20"])
    assert code == 0 and "belady" in out and "Belady" in out


def test_simulate_reproduces_the_planners_validation(tiny, tmp_path):
    """The plan stores everything the simulator needs: on the planner's own validation sequences
    `simulate` gives the planner's predicted hit ratios exactly."""
    from moeplan.passes.analysis.trace.format import load_trace
    from moeplan.passes.optimize.offload.cache_plan import split_by_sequence

    code, out = run(["plan", TINY, "--trace", str(tiny / "t.npz"), "--target", "offload", "--expert-cache", "12",
                     "--out", str(tmp_path / "p.json"), "--quiet"])
    assert code == 0, out
    tr = load_trace(tiny / "t.npz")
    _, val = split_by_sequence(tr, 0.2)
    save_trace(tr.select(val), tmp_path / "val.npz")
    code, out = run(["simulate", str(tmp_path / "p.json"), "--trace", str(tmp_path / "val.npz"), "--json"])
    sim = json.loads(out.strip().splitlines()[-1])
    planned = json.loads((tmp_path / "p.json").read_text())["predicted"]["policies"]
    assert {k: (v["requests"], v["hits"], v["loads"]) for k, v in sim["policies"].items()} == \
        {k: (v["requests"], v["hits"], v["loads"]) for k, v in planned.items()}


def test_full_size_mixtral_on_24_gib(tmp_path):
    save_trace(synthesize_routed_tokens(tokens=640, layers=32, experts=8, top_k=2, seq_len=128, seed=0), tmp_path / "t.npz")
    code, out = run(["plan", "examples/configs/mixtral-8x7b.json", "--trace", str(tmp_path / "t.npz"), "--target", "offload",
                     "--gpu-memory", "24GiB", "--out", str(tmp_path / "plan.json"), "--json"])
    assert code == 0, out
    m = json.loads((tmp_path / "plan.json").read_text())["communication"]["memory"]
    assert m["expert_bytes"] == 3 * 4096 * 14336 * 2 and m["total_experts"] == 256
    # 24 GiB - dense (embeddings, attention, norms, routers) - KV (4096 tokens) - activations - reserve
    assert m["kv_cache_bytes"] == 4096 * 32 * 2 * 8 * 128 * 2
    left = 24 * 2**30 - m["dense_bytes"] - m["kv_cache_bytes"] - m["activation_bytes"] - m["reserve_bytes"]
    assert m["capacity"] == left // m["expert_bytes"] and 40 < m["capacity"] < 70


def test_bad_input_is_one_line(tiny, tmp_path):
    base = ["plan", TINY, "--trace", str(tiny / "t.npz"), "--target", "offload", "--out", str(tmp_path / "x.json"), "--quiet"]
    for extra, words in ((["--expert-cache", "4", "--gpu-memory", "1GiB"], "exactly one of"), ([], "exactly one of"),
                         (["--gpu-memory", "12MB"], "cannot hold"), (["--gpu-memory", "lots"], "not a size"),
                         (["--expert-cache", "0"], "at least 1"), (["--expert-cache", "4", "--hardware", "abacus"], "unknown hardware")):
        result = CliRunner().invoke(main, base + extra)
        assert result.exit_code == 2, (extra, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines
        assert not (tmp_path / "x.json").exists()
    result = CliRunner().invoke(main, ["plan", TINY, "--trace", str(tiny / "t.npz"), "--target", "lambda", "--out",
                                       str(tmp_path / "x.json")])
    assert result.exit_code == 2 and "--slo" in result.output

"""Long run of the CLI fuzz suite (issue 17): the generators of tests/fuzz_cases.py with fresh
random seeds and many more examples; prints, per family, the cases tried and their outcomes
(accepted with valid output / refused in one line / contract broken) and the distinct failures.

    python benchmarks/fuzz.py [--examples 500] [--families trace,jsonl,placement,plan,config] [--seed S] [--json]

Exit code 1 when any case broke the contract. `--json` prints one JSON object as the last line.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fuzz_cases as F  # noqa: E402
from moeplan.passes.analysis.trace.format import save_trace  # noqa: E402
from synth_routing import synthesize_routed_tokens  # noqa: E402

FAMILIES = ("trace", "jsonl", "placement", "plan", "config")


def make_corpus(root: Path) -> dict:
    """The same good trace, placement and lambda plan the CI suite mutates."""
    trace = root / "trace.npz"
    save_trace(synthesize_routed_tokens(tokens=2000, layers=2, experts=8, top_k=2, seq_len=64, seed=0), trace)
    model = root / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(F.HF_CONFIG))
    placement, plan = root / "placement.json", root / "plan.json"
    F.invoke(["place", "--trace", trace, "--nodes", 1, "--gpus-per-node", 2, "--policy", "eplb", "--redundant", 2,
              "--out", placement])
    result = F.invoke(["plan", model, "--trace", trace, "--target", "lambda", "--slo", 30, "--batch-tokens", 1000, "--profile-budget", 0,
                       "--cache-dir", root / "cache", "--out", plan, "--quiet"])
    if result.exit_code != 0:
        raise SystemExit(f"could not make the lambda plan to mutate: {result.output[-300:]}")
    return {"trace": trace, "placement": json.loads(placement.read_text()), "plan": json.loads(plan.read_text())}


def run_family(family: str, corpus: dict, examples: int, seed: int) -> dict:
    outcomes, failures = Counter(), Counter()

    def attempt(case):
        with tempfile.TemporaryDirectory() as work:
            try:
                outcomes[case(Path(work))] += 1
            except Exception as err:
                outcomes["broken"] += 1
                if not isinstance(err, F.FuzzFailure):
                    err = F.FuzzFailure(f"harness: {err!r}")
                text = re.sub(r"/tmp/\S+", "<tmp>", str(err))
                lines = text.splitlines()
                where = next((l.strip() for l in reversed(lines) if l.strip().startswith("File ")), "")
                failures[(lines[-1][:120] + " at " + where[-90:]) if "traceback" in lines[0] else text[:160]] += 1

    strategies = {
        "trace": st.tuples(F.trace_file_bytes(), st.sampled_from(["stats", "contiguous", "eplb"])).map(
            lambda a: lambda w: F.trace_case(w, *a)),
        "jsonl": st.tuples(F.routing_log_bytes(), st.sampled_from([None, None, 1, 8, 2**40])).map(
            lambda a: lambda w: F.jsonl_case(w, *a)),
        "placement": F.mutated_json(corpus["placement"]).map(lambda d: lambda w: F.placement_case(w, d, corpus["trace"])),
        "plan": F.mutated_json(corpus["plan"]).map(lambda d: lambda w: F.plan_case(w, d, corpus["trace"])),
        "config": F.config_bytes().map(lambda b: lambda w: F.config_case(w, b)),
    }

    @hypothesis_seed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategies[family])
    def drive(case):
        attempt(case)

    drive()
    return {"cases": sum(outcomes.values()), "ok": outcomes[F.OK], "refused": outcomes[F.REFUSED],
            "broken": outcomes["broken"], "failures": dict(failures.most_common(10))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=500, help="cases per family")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time()) % 100000
    report = {"seed": seed, "examples_per_family": args.examples, "families": {}}
    with tempfile.TemporaryDirectory() as root:
        corpus = make_corpus(Path(root))
        for family in args.families.split(","):
            start = time.perf_counter()
            result = run_family(family, corpus, args.examples, seed)
            result["seconds"] = round(time.perf_counter() - start, 1)
            report["families"][family] = result
            print(f"{family:>9}: {result['cases']} cases, {result['ok']} accepted with valid output, "
                  f"{result['refused']} refused in one line, {result['broken']} broke the contract "
                  f"({result['seconds']} s)")
            for text, n in result["failures"].items():
                print(f"           {n} x {text}")
    totals = Counter()
    for r in report["families"].values():
        totals.update({k: r[k] for k in ("cases", "ok", "refused", "broken")})
    report["total"] = dict(totals)
    print(f"    total: {totals['cases']} cases, {totals['ok']} ok, {totals['refused']} refused, {totals['broken']} broken "
          f"(seed {seed})")
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 1 if totals["broken"] else 0


if __name__ == "__main__":
    sys.exit(main())

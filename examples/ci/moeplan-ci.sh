#!/usr/bin/env bash
# moeplan's CI step, called by examples/ci/github-actions.yml and examples/ci/gitlab-ci.yml:
#   1. compile the model's placement (config only: no weights) from the committed routing trace,
#      with its report (report.html, in the bundle, for the job's artifacts);
#   2. diff the new plan against the plan committed on the default branch, failing the job when
#      the new one is predicted worse by more than the thresholds.
# Usage: examples/ci/moeplan-ci.sh [BASE_REF]   (BASE_REF e.g. origin/main; none: no diff)
# Settings (environment): MOEPLAN_MODEL, MOEPLAN_TRACE, MOEPLAN_PLAN (the committed plan's path in
# the repository), MOEPLAN_OUT, MOEPLAN_FAIL_ON.
set -euo pipefail
model=${MOEPLAN_MODEL:-examples/configs/mixtral-8x7b.json}
trace=${MOEPLAN_TRACE:-examples/ci/mixtral-8x7b.trace.npz}
committed=${MOEPLAN_PLAN:-examples/ci/plan.json}
out=${MOEPLAN_OUT:-build/ci}
fail_on=${MOEPLAN_FAIL_ON:-max_over_mean_load>+2%,seconds_per_token>+5%,cost>+0%,hit_ratio<-0.01}
base_ref=${1:-}

mkdir -p "$out"
moeplan compile "$model" --trace "$trace" --target sglang --nodes 1 --gpus-per-node 8 --redundant 8 \
    --report --out "$out/bundle"
if [ -n "$base_ref" ] && git cat-file -e "$base_ref:$committed" 2>/dev/null; then
    git show "$base_ref:$committed" > "$out/base-plan.json"
    moeplan diff "$out/base-plan.json" "$out/bundle/plan.json" --fail-on "$fail_on"
else
    echo "no plan at ${base_ref:-(no base ref)}:$committed to diff against; commit $out/bundle/plan.json as $committed"
fi

"""AIConfigurator 0.12.0's own decode step for fixed deployments: the peer of benchmarks/gpu_cost_vs_aic.py.

Runs in a Python that has `aiconfigurator==0.12.0` (never a dependency of moeplan; the benchmark starts
this file with --aic-python). Reads a JSON list of cells on stdin, writes a JSON list of results on
stdout. Each cell: {label, model, system, tp, dp, moe_tp, moe_ep, batch (per attention-DP replica), isl,
osl, distribution ("balanced" or "power_law")}. Result: {label, tpot_ms, ttft_ms, memory_gib, error}.

How (aiconfigurator/cli/api.py, 0.12.0): `cli_estimate(model, system, mode="static", backend_name=
"sglang", backend_version="0.5.14", ...)`; its MoE routing assumption (ModelConfig.workload_distribution,
"power_law" by default) has no flag, so `_build_model_config` is wrapped to set it, as
/work/scratch/aic/balanced_override.py did. Mixtral-8x7B is not among its offline model ids: the config
it bundles (aiconfigurator_core/model_configs/mistralai--Mixtral-8x7B-v0.1_config.json) is copied into a
temporary directory that is passed as the model path.
"""
import json
import logging
import os
import shutil
import sys
import tempfile

logging.disable(logging.WARNING)


def mixtral_dir() -> str:
    import aiconfigurator_core

    folder = tempfile.mkdtemp(prefix="aic-mixtral-")
    shutil.copy(os.path.join(os.path.dirname(aiconfigurator_core.__file__), "model_configs",
                             "mistralai--Mixtral-8x7B-v0.1_config.json"), os.path.join(folder, "config.json"))
    return folder


def main() -> None:
    import aiconfigurator.cli.api as api

    cells = json.load(sys.stdin)
    original = api._build_model_config
    paths = {"mistralai/Mixtral-8x7B-v0.1": mixtral_dir()}
    out = []
    for cell in cells:
        def build(*a, _dist=cell["distribution"], **k):
            config = original(*a, **k)
            config.workload_distribution = _dist
            return config

        api._build_model_config = build
        try:
            r = api.cli_estimate(paths.get(cell["model"], cell["model"]), cell["system"], mode="static",
                                 backend_name="sglang", backend_version="0.5.14", isl=cell["isl"], osl=cell["osl"],
                                 batch_size=cell["batch"], tp_size=cell["tp"], attention_dp_size=cell["dp"],
                                 moe_tp_size=cell["moe_tp"], moe_ep_size=cell["moe_ep"])
            out.append({"label": cell["label"], "tpot_ms": float(r.tpot), "ttft_ms": float(r.ttft),
                        "memory_gib": float(r.memory) if r.memory is not None else None, "error": None})
        except Exception as exc:  # a cell AIC cannot estimate is reported, not fatal
            out.append({"label": cell["label"], "tpot_ms": None, "ttft_ms": None, "memory_gib": None,
                        "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        finally:
            api._build_model_config = original
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

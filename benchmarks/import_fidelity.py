"""Import fidelity: moeplan's parameter counts beside transformers' own, and ONNX imports beside torch.

Run:  .venv/bin/python benchmarks/import_fidelity.py [--configs-only | --onnx-only] [--only NAME ...] [--json]

Part 1, full-size configs (every `examples/configs/*.json`, built on `meta`, no weights): our
total parameters (`moeplan inspect`'s IR) beside transformers' own count of the model class the
config names (`architectures[0]`, else the causal-LM auto class), built on `meta` in the same run
(`sum(p.numel() for p in model.parameters())`, tied weights once), with the deviation. Also our
active parameters per token in both conventions (with and without the input embedding) beside
the figure the model card publishes, and the stored bytes (quantized where `quantization_config`
says so). Documented conventions that make totals differ, printed in the `convention` column:
* multimodal configs (Llama 4): moeplan plans the text model; the row's deviation is the vision
  tower and projector, which `inspect` names in a note.

Part 2, ONNX: tiny random models of each Hugging Face MoE architecture, exported by
`moeplan export-onnx`'s code (`planner/onnx_export.py`) and imported back; stage count, total and
active parameters of the ONNX import beside the torch import of the same model. Then the same
token ids are traced both ways (`record_trace`: hooks on the library's router in torch,
onnxruntime on the file): whether every token's experts agree, and the largest gap between the
gate weights. An architecture torch's exporter cannot capture is listed with the reason (its
error, whole). Measured with torch 2.13 and transformers 5.23, all 15 architectures here export,
import equal to their torch import and trace the torch trace's experts (weights within float32
rounding). qwen3_next (not in the table) does not export: torch.export specialises the sequence
length through its chunked Gated DeltaNet ("Constraints violated (sequence)").
What it took beyond transformers' `batched_mm` experts and no KV cache:
* phimoe: its sparsemixer picks two experts by ArgMax, masking the first (no TopK node); the
  importer reads repeated ArgMax + masking as a top-k router (`onnx_argmax_gating.py`);
* dbrx: its experts loop over the experts the batch hit (`for expert_idx in expert_hit`), a
  data-dependent count torch.export cannot capture and for which transformers offers no
  export-friendly implementation; export swaps in a batched gather of the same arithmetic;
* deepseek_v2, llama4_text: complex-valued rotary embeddings (`torch.polar`), for which
  torch.onnx has no translation ("No decompositions registered for the complex-valued input");
  export swaps in the real-valued form (`planner/onnx_export_equivalents.py`). Rotary scaling of
  type `dynamic` still cannot be exported: its update branches on the sequence length
  (`modeling_rope_utils.py`, `if seq_len > max_seq_len_cached`), a data-dependent guard;
* deepseek_v3, glm4_moe, ernie4_5_moe: they select by score + correction bias but weigh with the
  uncorrected scores; the ONNX tracer reads the weights the router hands on, not the TopK values.
Score-correction biases get a nonzero ramp here (see `tiny_model`) so that this is tested.

`--json` prints one JSON object on the last line: configs (rows), onnx (rows), and
configs_exact / onnx_equal / onnx_trace_equal (counts of rows meeting the targets: totals equal
to transformers' or explained by a convention; ONNX IR equal to the torch IR; ONNX trace choosing
the torch trace's experts).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "examples" / "configs"

# Active parameters per token as model cards publish them (rounded as published).
PUBLISHED_ACTIVE = {
    "dbrx": 36e9, "deepseek-v2-lite": 2.4e9, "deepseek-v3": 37e9, "ernie-4.5-21b-a3b": 3e9,
    "glm-4.5-air": 12e9, "gpt-oss-120b": 5.13e9, "gpt-oss-20b": 3.61e9, "granite-3.0-3b-a800m": 800e6,
    "hunyuan-a13b": 13e9, "jetmoe-8b": 2.2e9, "llama-4-scout-17b-16e": 17e9, "mixtral-8x7b": 12.9e9,
    "olmoe-1b-7b": 1.3e9, "phi-3.5-moe": 6.6e9, "qwen3-30b-a3b": 3.3e9, "qwen3-next-80b-a3b": 3e9,
}

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, bos_token_id=0, pad_token_id=None)
# model_type -> config overrides for a tiny model of that architecture (2 layers, D=32, V=64).
TINY = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=32, decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16, head_dim=8),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                        num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1,
                        q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                        num_key_value_heads=4),
    "deepseek_v2": dict(num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2,
                        num_experts_per_tok=2, moe_intermediate_size=16, q_lora_rank=None, kv_lora_rank=8,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, num_key_value_heads=4,
                        topk_method="greedy"),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"]),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=16, moe_num_shared_experts=1,
                         moe_layer_start_index=0, head_dim=8),
    "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
                     first_k_dense_replace=1, head_dim=8, n_group=1, topk_group=1),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, num_shared_expert=1, moe_intermediate_size=16, head_dim=8),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=48, head_dim=8,
                        interleave_moe_layer_step=1),
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8, num_key_value_heads=4),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2)),
}


def tiny_model(model_type: str):
    """A tiny random model of `model_type` (seeded), as an eval-mode transformers causal LM.

    Score-correction biases (DeepSeek-V3, GLM-4.5, ERNIE-4.5 buffers, zeros in a fresh model) get
    a nonzero ramp, as trained checkpoints have, so that selection scores and gate weights differ.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**{**BASE, **TINY[model_type]})
    model = AutoModelForCausalLM.from_config(config).eval()
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            with torch.no_grad():
                bias.copy_(torch.linspace(-0.4, 0.4, bias.numel()).reshape(bias.shape))
    return model


TRACE_IDS = ((5, 17, 33, 2, 60, 41, 8, 23, 50, 12, 3, 37), (44, 9, 28, 61, 15, 6, 39, 20, 55, 11, 30, 47))


def trace_agreement(model, model_type: str, onnx_path) -> dict:
    """Routing of the same token ids recorded from torch (hooks on the library's router) and from
    the ONNX file (onnxruntime): whether every token's experts agree, and the largest weight gap."""
    import numpy as np

    from moeplan.passes.analysis.trace.record import record_trace
    from moeplan.passes.importers import LoadedModel, load_model
    from moeplan.passes.importers.torch_module import import_module

    ids = [np.asarray(TRACE_IDS)]
    loaded = LoadedModel(ir=import_module(model, name=model_type, config=model.config), module=model)
    ours = record_trace(loaded, ids, batch=2, seq_len=len(TRACE_IDS[0]))
    theirs = record_trace(load_model(str(onnx_path)), ids, batch=2, seq_len=len(TRACE_IDS[0]))
    return {"trace_experts_equal": bool(np.array_equal(ours.experts, theirs.experts)),
            "trace_max_weight_gap": float(np.abs(ours.weights - theirs.weights).max())}


def transformers_count(data: dict) -> tuple:
    """(class name, parameter count) of the model class the config names, built on meta."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    from moeplan.passes.importers.hf_config import _auto_class, make_config

    config = make_config(data, "config")
    cls = getattr(transformers, (data.get("architectures") or [""])[0], None) or _auto_class(config)
    with torch.device("meta"), no_init_weights():
        model = cls(config) if cls is not _auto_class(config) else cls.from_config(config)
    model.tie_weights()
    return cls.__name__, sum(p.numel() for p in model.parameters())


def config_rows(only=None) -> list:
    from moeplan.passes.importers import load_model

    rows = []
    for path in sorted(CONFIGS.glob("*.json")):
        if only and path.stem not in only:
            continue
        data = json.loads(path.read_text())
        loaded = load_model(str(path))
        ir = loaded.ir
        cls, theirs = transformers_count(data)
        multimodal = any("multimodal" in n for n in loaded.notes)
        rows.append({
            "config": path.stem,
            "class": cls,
            "ours_total": ir.total_params,
            "transformers_total": theirs,
            "deviation": ir.total_params - theirs,
            "convention": "text model only (vision tower left out)" if multimodal else "",
            "active": ir.active_params,
            "active_excluding_embedding": ir.active_params_excluding_embedding,
            "published_active": PUBLISHED_ACTIVE.get(path.stem),
            "stored_gib": round(ir.total_param_bytes / 2**30, 2),
            "quantization": ir.quantization,
        })
        del loaded
    return rows


def onnx_rows(only=None) -> list:
    from moeplan.core.errors import UserError
    from moeplan.passes.importers.onnx_graph import import_onnx
    from moeplan.passes.importers.torch_module import import_module
    from moeplan.planner.onnx_export import export_onnx

    rows = []
    for model_type in sorted(TINY):
        if only and model_type not in only:
            continue
        model = tiny_model(model_type)
        ours = import_module(model, name=model_type, config=model.config)
        row = {"arch": model_type, "torch_stages": len(ours.stages), "torch_total": ours.total_params,
               "torch_active": ours.active_params}
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            try:
                export_onnx(model, Path(tmp) / "m.onnx", name=model_type)
            except UserError as exc:
                row.update(exported=False, reason=str(exc))
                rows.append(row)
                continue
            row["export_s"] = round(time.perf_counter() - start, 1)
            try:
                back = import_onnx(Path(tmp) / "m.onnx")
            except UserError as exc:
                row.update(exported=True, imported=False, reason=str(exc))
                rows.append(row)
                continue
            try:
                row.update(trace_agreement(model, model_type, Path(tmp) / "m.onnx"))
            except UserError as exc:
                row.update(trace_experts_equal=False, trace_max_weight_gap=None, trace_reason=str(exc))
        row.update(exported=True, imported=True, onnx_stages=len(back.stages), onnx_total=back.total_params,
                   onnx_active=back.active_params, equal=back == ours)
        if not row["equal"]:
            mine = {(s.name, s.kind, s.params) for s in ours.stages}
            theirs = {(s.name, s.kind, s.params) for s in back.stages}
            row["torch_only"] = sorted(map(str, mine - theirs))[:6]
            row["onnx_only"] = sorted(map(str, theirs - mine))[:6]
        rows.append(row)
    return rows


def _b(n) -> str:
    return "" if n is None else f"{n / 1e9:.3f}B"


def print_tables(configs: list, onnx: list) -> None:
    if configs:
        head = ("config", "ours total", "transformers", "deviation", "active (no emb)", "active (emb)",
                "published", "stored GiB", "convention / storage")
        print("Full-size configs, built on meta (parameters):")
        print("  ".join(f"{h:>16}" for h in head))
        for r in configs:
            print("  ".join(f"{v:>16}" for v in (
                r["config"][:16], f"{r['ours_total']:,}", f"{r['transformers_total']:,}", f"{r['deviation']:+,}",
                _b(r["active_excluding_embedding"]), _b(r["active"]), _b(r["published_active"]),
                f"{r['stored_gib']:.2f}", r["convention"] or r["quantization"])))
    if onnx:
        print("\nTiny models exported to ONNX and imported back, beside their torch import:")
        head = ("arch", "torch stages", "onnx stages", "torch params", "onnx params", "IR equal", "export s",
                "trace experts", "max |dw|")
        print("  ".join(f"{h:>14}" for h in head))
        for r in onnx:
            if not r.get("imported"):
                print(f"{r['arch']:>14}  {r['torch_stages']:>14}  {'-':>14}  {r['torch_total']:>14,}  "
                      f"{'-':>14}  {'no':>14}  ({'import' if r['exported'] else 'export'} failed: {r['reason']})")
                continue
            print("  ".join(f"{v:>14}" for v in (
                r["arch"], r["torch_stages"], r["onnx_stages"], f"{r['torch_total']:,}", f"{r['onnx_total']:,}",
                "yes" if r["equal"] else "NO", r["export_s"], "equal" if r["trace_experts_equal"] else "DIFFER",
                "-" if r["trace_max_weight_gap"] is None else f"{r['trace_max_weight_gap']:.1e}")))
            if r.get("trace_reason"):
                print(f"{'':>14}  trace failed: {r['trace_reason']}")
            if not r["equal"]:
                print(f"{'':>14}  torch only {r['torch_only']}; onnx only {r['onnx_only']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs-only", action="store_true")
    ap.add_argument("--onnx-only", action="store_true")
    ap.add_argument("--only", nargs="*", help="config stems or model types to run (default: all)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import warnings

    warnings.simplefilter("ignore")
    configs = [] if args.onnx_only else config_rows(args.only)
    onnx = [] if args.configs_only else onnx_rows(args.only)
    print_tables(configs, onnx)
    summary = {
        "configs": configs,
        "onnx": onnx,
        "configs_exact": sum(1 for r in configs if r["deviation"] == 0 or r["convention"]),
        "configs_total": len(configs),
        "onnx_equal": sum(1 for r in onnx if r.get("equal")),
        "onnx_trace_equal": sum(1 for r in onnx if r.get("trace_experts_equal")),
        "onnx_exported": sum(1 for r in onnx if r.get("exported")),
        "onnx_total": len(onnx),
    }
    print(f"\nconfigs exact or explained: {summary['configs_exact']}/{len(configs)}; "
          f"ONNX imports equal to torch: {summary['onnx_equal']}/{summary['onnx_exported']} exported "
          f"of {len(onnx)} architectures; ONNX traces choosing the torch trace's experts: "
          f"{summary['onnx_trace_equal']}/{summary['onnx_exported']}")
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

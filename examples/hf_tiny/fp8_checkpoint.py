"""A Hugging Face checkpoint rewritten in the fine-grained FP8 format that DeepSeek-V3 and Qwen3's
`-FP8` releases ship: every linear weight [N, K] except the head and the routers stored as
float8_e4m3fn beside `<name>.weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] (w = q * scale_inv
block by block), the config carrying `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [bn, bk]} and `dtype` bfloat16. Norms,
embeddings, routers and the head stay bfloat16.

The format followed: transformers 5.24 `integrations/finegrained_fp8.py` (`Fp8Dequantize`, the
names `weight_scale_inv` and `weight_block_size`) and `quantizers/quantizer_finegrained_fp8.py`.
Used by the tests and benchmarks that load FP8 checkpoints; nothing is downloaded.

    python examples/hf_tiny/fp8_checkpoint.py SOURCE_DIR OUT_DIR [--block 8 8]
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

NOT_CONVERTED = ("lm_head", "mlp.gate", "router", "embed")


def convert(source: Path, out: Path, block: tuple = (8, 8)) -> Path:
    """Write `source`'s checkpoint into `out` in the FP8 format; returns `out`."""
    import torch
    from safetensors.torch import load_file, save_file

    from moeplan.runtime.fp8_blocks import quantize

    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(path))
    written = {}
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith(".weight") and t.dim() == 2 and not any(m in name for m in NOT_CONVERTED):
            written[name], written[name + "_scale_inv"] = quantize(t.float(), block)
        else:
            written[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": list(NOT_CONVERTED)}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--block", type=int, nargs=2, default=(8, 8))
    args = ap.parse_args(argv)
    print(convert(args.source, args.out, tuple(args.block)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time the kernels engine pricing leans on, on the GPU at hand, beside aiconfigurator-core's rows for the
same shapes (issue 38 item 6). Never used in tests.

Two modes:
* here, with aiconfigurator-core installed: `python benchmarks/gpu/op_check.py --write-db-rows` writes
  benchmarks/gpu/op_check_db_rows.json (the database's times of every shape below, for H100 and H200),
  which travels with the tree to a GPU machine that has no internet;
* on the GPU (benchmarks/gpu/op_check.sh): times each shape with torch (CUDA events, median of 20 after 5
  warm-ups) and prints ours beside the database's row and their ratio.

Shapes: GEMM [m, k] x [k, n] in bf16 and FP8 (torch._scaled_mm, per-tensor scales, where the GPU has
FP8), m in 1..4096 at Qwen3-30B-A3B's qkv/o and DeepSeek-V3's q_a shapes; grouped GEMM of 16 local
experts (Qwen3-30B-A3B at EP 8: hidden 2048, width 768, top-8) by torch._grouped_mm where it exists,
else a loop, beside the database's fused MoE under balanced routing; decode attention (SDPA, bf16,
32 query / 4 KV heads of 128) for 16 sequences at 1k, 4k and 16k tokens of context.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = HERE / "op_check_db_rows.json"
GEMMS = [(m, n, k) for m in (1, 16, 64, 256, 1024, 4096) for n, k in ((5120, 2048), (2048, 4096), (2112, 7168))]
MOE = [(tokens, 2048, 768, 8, 128, 8) for tokens in (16, 128, 512, 2048)]  # tokens, hidden, inter, top_k, experts, ep
ATTENTION = [(16, context, 32, 4, 128) for context in (1024, 4096, 16384)]  # batch, kv length, heads, kv heads, dim


def write_rows() -> None:
    """The database's times (ms) of every shape, per system."""
    from moeplan.passes.cost.engine import measured
    from moeplan.passes.cost.engine import ops as O

    out = {}
    for system in ("h100_sxm", "h200_sxm"):
        tables = measured.tables(system, "sglang", "0.5.14")
        row = {}
        for m, n, k in GEMMS:
            for quant in ("bfloat16", "fp8"):
                got = tables.price(O.Gemm("g", m, n, k, quant))
                row[f"gemm {quant} {m}x{n}x{k}"] = got and got.seconds * 1e3
        for tokens, h, inter, top_k, experts, ep in MOE:
            got = tables.price(O.FusedMoe("moe", tokens, h, inter, top_k, experts, 1, ep, "bfloat16", "balanced"))
            row[f"moe {tokens}"] = got and got.seconds * 1e3
        for batch, context, heads, kv, dim in ATTENTION:
            got = tables.price(O.Attention("a", "decode", batch, 1, context, heads, kv, dim, 0, "bfloat16", False))
            row[f"attention {batch}x{context}"] = got and got.seconds * 1e3
        out[system] = row
    ROWS.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"wrote {ROWS}")


def timed(fn) -> float:
    """Median ms of 20 runs after 5 warm-ups (CUDA events)."""
    import torch

    for _ in range(5):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(system: str) -> None:
    import torch
    import torch.nn.functional as F

    rows = json.loads(ROWS.read_text()).get(system, {})
    dev = torch.device("cuda")
    fp8 = hasattr(torch, "float8_e4m3fn") and torch.cuda.get_device_capability() >= (8, 9)
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}; database rows: aiconfigurator-core 0.12.0 "
          f"sglang 0.5.14 {system}; load average {os.getloadavg()[0]:.2f}")
    print(f"{'op':40s} {'ours ms':>9s} {'database ms':>12s} {'ratio':>6s}")

    def show(name: str, ours: float) -> None:
        theirs = rows.get(name)
        ratio = f"{ours / theirs:6.2f}" if theirs else "     -"
        print(f"{name:40s} {ours:9.4f} {theirs if theirs else float('nan'):12.4f} {ratio}")

    one = torch.ones((), device=dev)
    for m, n, k in GEMMS:
        a, b = torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        show(f"gemm bfloat16 {m}x{n}x{k}", timed(lambda a=a, b=b: a @ b.t()))
        if fp8:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            if m % 16 == 0:  # _scaled_mm wants m divisible by 16
                show(f"gemm fp8 {m}x{n}x{k}", timed(lambda a8=a8, b8=b8: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)))
    for tokens, h, inter, top_k, experts, ep in MOE:
        local, rows_per = experts // ep, max(tokens * top_k // experts, 1)
        x = torch.randn(local * rows_per, h, device=dev, dtype=torch.bfloat16)
        w1 = torch.randn(local, h, 2 * inter, device=dev, dtype=torch.bfloat16)
        w2 = torch.randn(local, inter, h, device=dev, dtype=torch.bfloat16)
        offs = torch.arange(1, local + 1, device=dev, dtype=torch.int32) * rows_per
        if hasattr(torch, "_grouped_mm"):
            def run(x=x, w1=w1, w2=w2, offs=offs, inter=inter):
                up = torch._grouped_mm(x, w1, offs=offs)
                return torch._grouped_mm(F.silu(up[:, :inter]) * up[:, inter:], w2, offs=offs)
        else:
            def run(x=x, w1=w1, w2=w2, rows_per=rows_per, local=local, inter=inter):
                for e in range(local):
                    part = x[e * rows_per:(e + 1) * rows_per] @ w1[e]
                    (F.silu(part[:, :inter]) * part[:, inter:]) @ w2[e]
        show(f"moe {tokens}", timed(run))
    for batch, context, heads, kv, dim in ATTENTION:
        q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(batch, kv, context, dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        show(f"attention {batch}x{context}", timed(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-db-rows", action="store_true", help="write the database's rows (here, no GPU needed)")
    parser.add_argument("--system", default=None, help="h100_sxm or h200_sxm (default: from the GPU's name)")
    args = parser.parse_args()
    if args.write_db_rows:
        write_rows()
        return
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; op_check times kernels on a GPU (run it on an H100 or H200)")
    system = args.system or ("h200_sxm" if "H200" in torch.cuda.get_device_name() else "h100_sxm")
    measure(system)


if __name__ == "__main__":
    main()

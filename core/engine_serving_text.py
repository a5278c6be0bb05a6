"""An engine plan's serving prediction (plan.json `predicted.serving`) in one line of text: what `plan`
and `compile` print and what the engine bundles' READMEs state, from the same words."""
from __future__ import annotations


def serving_line(serving: dict) -> str:
    """The serving prediction in one line, as compile and plan print it."""
    layout = serving["layout"]
    attention = f"dp{layout['attention_dp']}" if layout["attention_dp"] > 1 else f"tp{layout['attention_tp']}"
    fits = "fits" if serving["fits"] else "does NOT fit"
    return (f"serving {serving['workload']} on {layout['gpus']}x {serving['hardware']} (attention {attention}, "
            f"ep{layout['moe_ep']}): TPOT {serving['tpot_s'] * 1e3:.2f} ms, TTFT {serving['ttft_s']:.3f} s, "
            f"{serving['output_tokens_per_s']:.0f} output tokens/s ({serving['output_tokens_per_s_per_gpu']:.0f} per GPU), "
            f"{serving['memory_per_gpu_bytes'] / 2**30:.1f} GiB per GPU ({fits} in "
            f"{serving['memory']['device_bytes'] / 2**30:.0f} GiB); prices: {price_sources_text(serving)}")


def price_sources_text(serving: dict) -> str:
    """Share of the decode step's time per price source, largest first."""
    sources = serving.get("price_sources") or []
    total = sum(r["seconds"] for r in sources) or 1.0
    return ", ".join(f"{r['seconds'] / total:.0%} {r['source']}" for r in sorted(sources, key=lambda r: -r["seconds"]))

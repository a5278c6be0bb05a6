"""Figures of the report as inline SVG, drawn by matplotlib's SVG backend (docs/report.md says why).

Every function returns the `<svg>` element as text, byte-identical for the same inputs: the
figure's own id salts matplotlib's element ids (`svg.hashsalt`), so several figures share a page
without clashing ids; text stays text (`svg.fonttype: none`, no embedded glyphs: the browser's
sans-serif draws it); no date, no creator string. No pyplot: each call builds its own Figure.
"""
from __future__ import annotations

import io
import re

import numpy as np

# Labels that fit without overlapping (docs/report.md; tests/test_report.py measures them in Chromium):
# the axes are about 5.8 in = 418 pt wide, a rotated 8 pt label needs about 11 pt, an upright one 26.
MAX_ROTATED_LABELS = 36
MAX_TICKS = 16
# Cell text (6-7 pt, up to "+12" or "3 7* 12") fits cells of at least 13 x 8 pt: at most this many rows x columns.
MAX_ANNOTATED_ROWS, MAX_ANNOTATED_COLS = 48, 32


def tick_step(count: int, most: int) -> int:
    """Every how many categories a tick label is drawn so that at most `most` are."""
    return max(1, -(-count // most))


PALETTE = ("#4269d0", "#efb118", "#ff725c", "#6cc5b0", "#3ca951", "#ff8ab7", "#a463f2", "#97bbf5", "#9c6b4e", "#9498a0")
WIDTH_IN = 7.2


def _figure(height_in: float, ncols: int = 1):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, height_in), dpi=96)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(labelsize=8)
    return fig, axes


def to_svg(fig, figure_id: str) -> str:
    """The figure as an inline `<svg>` (no XML prolog), deterministic, ids unique to `figure_id`."""
    import matplotlib
    from matplotlib.backends.backend_svg import FigureCanvasSVG

    FigureCanvasSVG(fig)
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"moeplan-{figure_id}", "svg.fonttype": "none",
                                "svg.image_inline": True, "font.family": "sans-serif"}):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")
    text = buf.getvalue()
    start = text.index("<svg")
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", text[start:].strip(), flags=re.S)
    # ids matplotlib does not salt (e.g. the figure's own patch): prefix every id and its references
    svg = re.sub(r'id="([^"]+)"', lambda m: f'id="{figure_id}-{m.group(1)}"', svg)
    svg = re.sub(r'url\(#([^)]+)\)', lambda m: f'url(#{figure_id}-{m.group(1)})', svg)
    svg = re.sub(r'xlink:href="#([^"]+)"', lambda m: f'xlink:href="#{figure_id}-{m.group(1)}"', svg)
    return svg.replace("<svg ", f'<svg class="figure" data-figure="{figure_id}" role="img" ', 1)


def grouped_bars(figure_id: str, categories: list, series: dict, ylabel: str, reference: float | None = None,
                 reference_label: str = "") -> str:
    """Bars per category, one colour per series ({name: [value per category]}); optional horizontal line."""
    fig, (ax,) = _figure(2.6)
    n = max(len(series), 1)
    width = 0.8 / n
    x = np.arange(len(categories))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (n - 1) / 2) * width, [np.nan if v is None else v for v in values], width,
               label=name, color=PALETTE[i % len(PALETTE)])
    if reference is not None:
        ax.axhline(reference, color="#333333", linewidth=0.8, linestyle="--", label=reference_label or None)
        values = [v for vs in series.values() for v in vs if v is not None] + [reference]
        low, high = min(values), max(values)
        ax.set_ylim(max(0.0, low - 0.15 * (high - low + 1e-9)), high + 0.1 * (high - low + 1e-9))
    step = tick_step(len(categories), MAX_ROTATED_LABELS)
    ax.set_xticks(x[::step], [str(c) for c in categories][::step], rotation=0 if len(categories) <= 16 else 90)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.legend(fontsize=7, frameon=False, ncols=min(n + (reference is not None), 4), loc="upper left", bbox_to_anchor=(0, 1.18))
    return to_svg(fig, figure_id)


def stacked_bars(figure_id: str, labels: list, parts: dict, xlabel: str, reference: float | None = None,
                 reference_label: str = "") -> str:
    """Horizontal stacked bars: one bar per label, segments {part: [value per label]}."""
    fig, (ax,) = _figure(0.6 + 0.32 * max(len(labels), 1))
    y = np.arange(len(labels))
    left = np.zeros(len(labels))
    for i, (name, values) in enumerate(parts.items()):
        v = np.asarray(values, dtype=float)
        ax.barh(y, v, left=left, label=name, color=PALETTE[i % len(PALETTE)], height=0.6)
        left += v
    if reference is not None:
        ax.axvline(reference, color="#d62728", linewidth=1.0, linestyle="--", label=reference_label or None)
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel, fontsize=8)
    ax.legend(fontsize=7, frameon=False, ncols=4, loc="lower left", bbox_to_anchor=(0, 1.0))
    return to_svg(fig, figure_id)


def heatmap(figure_id: str, matrix: np.ndarray, xlabel: str, ylabel: str, colorbar: str,
            annotations: list | None = None, xticks: list | None = None, yticks: list | None = None) -> str:
    """A [rows, cols] matrix as coloured cells (rows top to bottom); optional text per cell."""
    matrix = np.asarray(matrix, dtype=float)
    rows, cols = matrix.shape
    annotated = annotations is not None and rows <= MAX_ANNOTATED_ROWS and cols <= MAX_ANNOTATED_COLS
    fig, (ax,) = _figure(min(1.2 + 0.28 * rows, 7.0) if annotated else min(1.4 + 0.12 * rows, 6.5))
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", interpolation="nearest")
    cbar = fig.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    cbar.set_label(colorbar, fontsize=8)
    cbar.ax.tick_params(labelsize=7)
    if annotations is not None and (rows > MAX_ANNOTATED_ROWS or cols > MAX_ANNOTATED_COLS):
        annotations = None  # cells too small for text: the figure's table has the numbers
    if annotations is not None:
        top = np.nanmax(matrix) if matrix.size else 0.0
        low = np.nanmin(matrix) if matrix.size else 0.0
        for r in range(rows):
            for c in range(cols):
                bright = matrix[r, c] > low + 0.6 * (top - low)
                ax.text(c, r, annotations[r][c], ha="center", va="center", fontsize=6 if cols > 8 else 7,
                        color="#111111" if bright else "#ffffff")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    if xticks is not None:
        step = tick_step(len(xticks), MAX_TICKS)
        ax.set_xticks(range(0, len(xticks), step), [str(t) for t in xticks[::step]])
    if yticks is not None:
        step = tick_step(len(yticks), MAX_TICKS)
        ax.set_yticks(range(0, len(yticks), step), [str(t) for t in yticks[::step]])
    ax.spines[["left", "bottom"]].set_visible(False)
    return to_svg(fig, figure_id)


def lines(figure_id: str, x: list, series: dict, xlabel: str, ylabel: str, marker_x: float | None = None,
          marker_label: str = "") -> str:
    """One line per series ({name: [y per x]}); optional vertical marker (the plan's choice)."""
    fig, (ax,) = _figure(2.8)
    for i, (name, values) in enumerate(series.items()):
        ax.plot(x, values, marker="o", markersize=3, linewidth=1.2, label=name, color=PALETTE[i % len(PALETTE)])
    if marker_x is not None:
        ax.axvline(marker_x, color="#333333", linewidth=0.8, linestyle="--", label=marker_label or None)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    ax.legend(fontsize=7, frameon=False, ncols=4, loc="lower left", bbox_to_anchor=(0, 1.0))
    return to_svg(fig, figure_id)


def scatter(figure_id: str, groups: dict, xlabel: str, ylabel: str) -> str:
    """Points per group ({name: ([x], [y])})."""
    fig, (ax,) = _figure(2.8)
    for i, (name, (xs, ys)) in enumerate(groups.items()):
        ax.scatter(xs, ys, s=10, label=name, color=PALETTE[i % len(PALETTE)])
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.grid(True, linewidth=0.3, alpha=0.5)
    if len(groups) > 1:
        ax.legend(fontsize=7, frameon=False, ncols=min(len(groups), 8), loc="lower left", bbox_to_anchor=(0, 1.0))
    return to_svg(fig, figure_id)


def stages(figure_id: str, labels: list, latency: list, cost: list, reference: float | None) -> str:
    """Left: each stage's latency as a bar and the running total as a line against `reference` (the SLO);
    right: each stage's cost. Stages top to bottom in order."""
    fig, (ax, bx) = _figure(0.8 + 0.22 * max(len(labels), 1), ncols=2)
    y = np.arange(len(labels))
    colours = [PALETTE[0] if lab.startswith("MoE") else PALETTE[1] for lab in labels]
    ax.barh(y, latency, color=colours, height=0.6)
    ax.plot(np.cumsum(latency), y, color="#333333", linewidth=1.0, marker="o", markersize=2.5, label="running total")
    if reference is not None:
        ax.axvline(reference, color="#d62728", linewidth=1.0, linestyle="--", label="SLO")
    ax.set_yticks(y, labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds", fontsize=8)
    ax.legend(fontsize=7, frameon=False, loc="lower right")
    bx.barh(y, np.asarray(cost) * 1e6, color=colours, height=0.6)
    bx.set_yticks(y, [""] * len(labels))
    bx.invert_yaxis()
    bx.set_xlabel("cost per batch (1e-6 $)", fontsize=8)
    return to_svg(fig, figure_id)

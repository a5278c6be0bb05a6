"""The report's HTML: sections of tables and figures in one self-contained page.

No script, no external style, font or image: the page opens from disk with no network. Numbers
read from the plan are `<span class="num" data-path="predicted.cost.mode..." data-value=JSON
data-scale=S>` so that a reader (and the browser test) can check each one against plan.json:
the text shows value x scale in the unit that follows.
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Num:
    """A number shown in the page; `path` (dotted, list indices as numbers) names it in plan.json."""

    value: float | int | None
    path: str | None = None
    scale: float = 1.0
    digits: int = 4
    unit: str = ""

    def text(self) -> str:
        return fmt(self.value, self.scale, self.digits) + (f" {self.unit}" if self.unit and self.value is not None else "")


@dataclass
class Table:
    columns: list
    rows: list            # [[str | Num]]
    caption: str = ""


@dataclass
class Figure:
    figure_id: str
    title: str
    caption: str
    svg: str
    table: Table


@dataclass
class Section:
    section_id: str
    title: str
    blocks: list = field(default_factory=list)   # Table | Figure | Note
    intro: str = ""


@dataclass(frozen=True)
class Note:
    """A sentence in place of (or beside) a figure; `tone` "bad" draws it in red (a plan that does not fit)."""

    text: str
    tone: str = ""


def fmt(value, scale: float = 1.0, digits: int = 4) -> str:
    """A number for people: integers as integers with thousands separators, floats to `digits`
    significant digits (no exponent between 1e-4 and 1e9)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and scale == 1.0:
        return f"{value:,}"
    v = float(value) * scale
    if not math.isfinite(v):
        return "n/a"
    if v == 0:
        return "0"
    if abs(v) >= 1e9 or abs(v) < 1e-4:
        return f"{v:.{digits - 1}e}"
    if abs(v) >= 10 ** digits:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def _cell(value) -> str:
    if isinstance(value, Num):
        attrs = ""
        if value.path is not None:
            attrs = (f' data-path="{html.escape(value.path)}" data-value="{html.escape(json.dumps(value.value))}"'
                     f' data-scale="{value.scale!r}"')
        return f'<span class="num"{attrs}>{html.escape(value.text())}</span>'
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f'<span class="num">{html.escape(fmt(value))}</span>'
    return html.escape(str(value))


def table_html(table: Table, css: str = "numbers") -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in table.rows)
    caption = f"<caption>{html.escape(table.caption)}</caption>" if table.caption else ""
    return f'<table class="{css}">{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def figure_html(f: Figure) -> str:
    return (f'<figure id="{html.escape(f.figure_id)}"><h3>{html.escape(f.title)}</h3>{f.svg}'
            f'<figcaption>{html.escape(f.caption)}</figcaption>'
            f'<details{" open" if len(f.table.rows) <= 12 else ""}><summary>numbers behind the figure</summary>{table_html(f.table)}</details></figure>')


def section_html(s: Section) -> str:
    parts = [f'<section id="{html.escape(s.section_id)}"><h2>{html.escape(s.title)}</h2>']
    if s.intro:
        parts.append(f"<p>{html.escape(s.intro)}</p>")
    for block in s.blocks:
        if isinstance(block, Figure):
            parts.append(figure_html(block))
        elif isinstance(block, Table):
            parts.append(table_html(block, "summary" if s.section_id == "summary" else "numbers"))
        else:
            parts.append(f'<p class="note{" " + block.tone if block.tone else ""}">{html.escape(block.text)}</p>')
    parts.append("</section>")
    return "".join(parts)


STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0 auto;max-width:1000px;
padding:1.2em 1.5em 3em;color:#1b1b1b;background:#fff;line-height:1.4}
h1{font-size:1.5em;margin-bottom:.1em}h2{font-size:1.2em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.8em}
h3{font-size:1em;margin:.2em 0}.sub{color:#555;margin-top:0}nav a{margin-right:1em;font-size:.9em}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}caption{text-align:left;font-weight:600;padding:.2em 0}
th,td{border:1px solid #ddd;padding:.2em .5em;text-align:left;vertical-align:top}th{background:#f4f4f4}
td .num{font-variant-numeric:tabular-nums;white-space:nowrap}figure{margin:1em 0 2em}
figure svg.figure{max-width:100%;height:auto;display:block}figcaption{font-size:.9em;color:#333;margin:.3em 0}
details summary{cursor:pointer;font-size:.85em;color:#555}.note{color:#555;font-size:.9em;font-style:italic}
.note.bad{color:#b00020;font-weight:600;font-style:normal}.note.warn{color:#8a5a00;font-style:normal}
"""


def document(title: str, subtitle: str, sections: list) -> str:
    nav = "".join(f'<a href="#{html.escape(s.section_id)}">{html.escape(s.title)}</a>' for s in sections)
    body = "".join(section_html(s) for s in sections)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p class=\"sub\">{html.escape(subtitle)}</p><nav>{nav}</nav>{body}"
            "</body></html>\n")

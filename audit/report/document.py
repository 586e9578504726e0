"""The report as a document model, built once and rendered to HTML and to Markdown.

A :class:`Report` is a title and :class:`Section` s; a section holds blocks —
:class:`Paragraph`, :class:`BulletList`, :class:`Table` (typed cells, formatted by the
renderer), :class:`Figure` (an image file with its caption), :class:`CodeBlock` — and
may hold sections of its own (one heading level down). A section whose inputs were not
produced says so (``missing``) instead of holding placeholders.

:func:`render_html` gives one self-contained page (figures embedded as data URIs, each
section one ``<section>`` element),
:func:`render_markdown` a twin that links the figure files.
"""

from __future__ import annotations

import base64
import html
import math
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "Report",
    "Section",
    "Paragraph",
    "Strong",
    "Emphasis",
    "BulletList",
    "Table",
    "Figure",
    "CodeBlock",
    "format_cell",
    "render_html",
    "render_markdown",
]


@dataclass(frozen=True)
class Strong:
    text: str


@dataclass(frozen=True)
class Emphasis:
    text: str


Inline = str | Strong | Emphasis


@dataclass(frozen=True)
class Paragraph:
    parts: tuple[Inline, ...]

    @classmethod
    def of(cls, *parts: Inline) -> Paragraph:
        return cls(tuple(parts))


@dataclass(frozen=True)
class BulletList:
    items: tuple[tuple[Inline, ...], ...]

    @classmethod
    def of(cls, items) -> BulletList:
        """Items given as strings or tuples of inline parts."""
        return cls(tuple((i,) if isinstance(i, str) else tuple(i) for i in items))


#: a table cell: shown with :func:`format_cell` (numbers to 4 significant digits)
Cell = str | int | float | bool | None


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]

    @classmethod
    def of(cls, headers, rows) -> Table:
        return cls(tuple(headers), tuple(tuple(r) for r in rows))


@dataclass(frozen=True)
class Figure:
    """An image file in the report folder: ``src`` is its path relative to that folder."""

    src: str
    caption: str


@dataclass(frozen=True)
class CodeBlock:
    text: str
    language: str = ""


@dataclass
class Section:
    title: str
    blocks: list = field(default_factory=list)
    missing: str | None = None  # why the section has no content

    def add(self, *blocks) -> Section:
        self.blocks.extend(blocks)
        return self


@dataclass
class Report:
    title: str
    generated: str  # ISO timestamp
    sections: list[Section] = field(default_factory=list)

    def section(self, title: str) -> Section:
        s = Section(title)
        self.sections.append(s)
        return s

    @property
    def missing(self) -> list[str]:
        return [s.title for s in self.sections if s.missing]


def save_figure(fig, stem: Path) -> list[Path]:
    """Write ``fig`` as STEM.png (130 dpi) and STEM.svg, close it; the two paths."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    for p in paths:
        fig.savefig(p, dpi=130)
    plt.close(fig)
    return paths


def format_cell(x, nd: int = 4) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if isinstance(x, float):
        if math.isinf(x):
            return "∞"
        if math.isnan(x):
            return "nan"
        return f"{x:.{nd}g}"
    return str(x)


def _missing_block(s: Section) -> Paragraph:
    return Paragraph.of(Emphasis(f"missing: {s.missing}"))


# --------------------------------------------------------------------------- HTML

_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}"
    "th{background:#f3f3f3}pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}h2{border-bottom:2px solid #ddd}"
)


def _html_inline(parts) -> str:
    out = []
    for p in parts:
        if isinstance(p, Strong):
            out.append(f"<b>{html.escape(p.text)}</b>")
        elif isinstance(p, Emphasis):
            out.append(f"<i>{html.escape(p.text)}</i>")
        else:
            out.append(html.escape(p))
    return "".join(out)


def _html_block(b, base: Path, level: int) -> str:
    if isinstance(b, Section):
        return _html_section(b, base, level)
    if isinstance(b, Paragraph):
        return f"<p>{_html_inline(b.parts)}</p>"
    if isinstance(b, BulletList):
        return "<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Table):
        h = "".join(f"<th>{html.escape(x)}</th>" for x in b.headers)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(format_cell(c))}</td>" for c in r) + "</tr>"
            for r in b.rows
        )
        return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"
    if isinstance(b, Figure):
        path = base / b.src
        data = base64.b64encode(path.read_bytes()).decode()
        return (
            f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}" '
            'style="max-width:100%">'
        )
    if isinstance(b, CodeBlock):
        return f"<pre>{html.escape(b.text)}</pre>"
    raise TypeError(f"unknown report block {type(b).__name__}")


def _html_section(s: Section, base: Path, level: int) -> str:
    blocks = [_missing_block(s)] if s.missing else s.blocks
    head = f"<h{level}>{html.escape(s.title)}</h{level}>"
    body = "".join(_html_block(b, base, level + 1) for b in blocks)
    return f"<section>{head}{body}</section>"


def render_html(report: Report, base: Path) -> str:
    """One self-contained page; figures are read from ``base`` and embedded."""
    title = html.escape(report.title)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{_CSS}</style></head><body><h1>{title}</h1>"
        f"<p>Generated {html.escape(report.generated)} by fedlora-audit.</p>"
        + "".join(_html_section(s, base, 2) for s in report.sections)
        + "</body></html>"
    )


# --------------------------------------------------------------------------- Markdown


def _md_inline(parts) -> str:
    out = []
    for p in parts:
        if isinstance(p, Strong):
            out.append(f"**{p.text}**")
        elif isinstance(p, Emphasis):
            out.append(f"*{p.text}*")
        else:
            out.append(p)
    return "".join(out)


def _md_block(b, level: int) -> list[str]:
    """The block's lines, each block followed by one blank line."""
    if isinstance(b, Section):
        return _md_section(b, level)
    if isinstance(b, Paragraph):
        lines = [_md_inline(b.parts)]
    elif isinstance(b, BulletList):
        lines = [f"- {_md_inline(i)}" for i in b.items]
    elif isinstance(b, Table):
        lines = ["| " + " | ".join(b.headers) + " |", "|" + "---|" * len(b.headers)]
        lines += ["| " + " | ".join(format_cell(c) for c in r) + " |" for r in b.rows]
    elif isinstance(b, Figure):
        lines = [f"![{b.caption}]({b.src})"]
    elif isinstance(b, CodeBlock):
        lines = [f"```{b.language}", *(b.text.split("\n") if b.text else []), "```"]
    else:
        raise TypeError(f"unknown report block {type(b).__name__}")
    return [*lines, ""]


def _md_section(s: Section, level: int) -> list[str]:
    blocks = [_missing_block(s)] if s.missing else s.blocks
    lines = ["#" * level + f" {s.title}", ""]
    for b in blocks:
        lines += _md_block(b, level + 1)
    return lines


def render_markdown(report: Report) -> str:
    lines = [f"# {report.title}", "", f"Generated {report.generated}.", ""]
    for s in report.sections:
        lines += _md_section(s, 2)
    return "\n".join(lines)

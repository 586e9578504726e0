"""The report as a document model, built once and rendered to HTML and to Markdown.

A :class:`Report` is a title and :class:`Section` s; a section holds blocks —
:class:`Paragraph`, :class:`BulletList`, :class:`Table` (typed cells, formatted by the
renderer), :class:`Figure` (an image file with its caption), :class:`CodeBlock` — and
may hold sections of its own (one heading level down). A section whose inputs were not
produced says so (``missing``) instead of holding placeholders.

:func:`render_html` gives one self-contained page (figures embedded as data URIs, each
section one ``<section>`` element, the one-line ``summary`` under the title): readable on
a phone as on a laptop — every table scrolls sideways in its own container, a wide one
(:data:`STACK_COLUMNS` columns or more) becomes one card per row under 600 px, so the
page itself never scrolls sideways. :func:`render_markdown` gives a twin that links the
figure files.

Figures are written small (:func:`save_figure`, :func:`copy_figure`: PNG at most
:data:`MAX_WIDTH` pixels wide, quantised to a 256-colour palette, optimised), so that the
page with every figure embedded stays light (the default job's: under 1 MB).
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import math
import re
import shutil
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
    "save_figure",
    "copy_figure",
    "compress_png",
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
    summary: str = ""  # one line under the title (the verdicts counted)

    def section(self, title: str) -> Section:
        s = Section(title)
        self.sections.append(s)
        return s

    @property
    def missing(self) -> list[str]:
        return [s.title for s in self.sections if s.missing]


#: the widest figure a report holds, in pixels (the page's column is about 1 070 CSS px)
MAX_WIDTH = 1000
#: the resolution of the figures the report draws itself
DPI = 120


def compress_png(data: bytes, max_width: int = MAX_WIDTH) -> bytes:
    """A PNG made small: flattened on white, scaled down to ``max_width`` pixels when
    wider, quantised to a 256-colour palette (fast octree: distinct line colours stay
    distinct, which a median cut does not guarantee) and written with zlib's best effort.
    Plots of lines, markers and text lose nothing a reader sees; a PNG is typically 3 to
    5 times smaller."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.load()
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        im = Image.alpha_composite(Image.new("RGBA", rgba.size, "white"), rgba)
    im = im.convert("RGB")
    if im.width > max_width:
        im = im.resize((max_width, max(1, round(im.height * max_width / im.width))),
                       Image.Resampling.LANCZOS)  # fmt: skip
    q = im.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    # the octree averages the background with the lightest anti-aliasing (254, 254, 254):
    # near-white entries back to white, so the figure sits on the page without a frame
    pal = q.getpalette()
    for i in range(0, len(pal), 3):
        if min(pal[i : i + 3]) >= 245:
            pal[i : i + 3] = [255, 255, 255]
    q.putpalette(pal)
    out = io.BytesIO()
    q.save(out, "PNG", optimize=True)
    return out.getvalue()


def save_figure(fig, stem: Path, dpi: int = DPI) -> list[Path]:
    """Write ``fig`` as STEM.png (``dpi``, compressed: :func:`compress_png`) and close it;
    the path, in a list. A figure with a layout engine (constrained layout) keeps it."""
    import matplotlib.pyplot as plt

    if fig.get_layout_engine() is None:
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    plt.close(fig)
    path = stem.with_suffix(".png")
    path.write_bytes(compress_png(buf.getvalue()))
    return [path]


def copy_figure(src: Path, dst: Path) -> Path:
    """Copy a figure someone else drew (an analysis, an attack) into the report folder,
    compressed (:func:`compress_png`); a file Pillow cannot read (an SVG) is copied as it
    is."""
    try:
        data = compress_png(Path(src).read_bytes())
    except (OSError, ValueError, SyntaxError):
        shutil.copyfile(src, dst)
        return Path(dst)
    Path(dst).write_bytes(data)
    return Path(dst)


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
    "*{box-sizing:border-box}"
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
    "color:#222;line-height:1.45}"
    "p,li{overflow-wrap:anywhere}"
    ".scroll{overflow-x:auto;margin:1em 0;max-width:100%}"
    "table{border-collapse:collapse;font-size:13px}"
    "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}"
    "th{background:#f3f3f3}td{min-width:4em}td:first-child{white-space:nowrap}"
    "pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}"
    "h2{border-bottom:2px solid #ddd}"
    "figure{margin:1em 0}img{max-width:100%;height:auto}"
    "figcaption{font-size:13px;color:#555}"
    ".lead{font-size:17px}"
    "@media (max-width:600px){body{margin:1em auto;padding:0 .6em}h1{font-size:1.5em}"
    "table{font-size:12px}td,th{padding:3px 5px}"
    # a wide table becomes one card per row, each cell under its column's name
    "table.stack,.stack tbody,.stack tr{display:block;width:100%}"
    ".stack thead{display:none}.stack tr{border:1px solid #ccc;margin:0 0 .7em}"
    ".stack td{display:grid;grid-template-columns:35% 1fr;gap:.6em;width:100%;border:0;"
    "border-bottom:1px solid #eee;min-width:0;white-space:normal}"
    ".stack td::before{font-weight:600;color:#666}"
    ".stack td:first-child{background:#f3f3f3;font-weight:600}}"
)
#: tables of at least this many columns are shown as cards on a phone (``.stack``)
STACK_COLUMNS = 5
#: embedded figures' media types, by suffix
_MIME = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg"}


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


def _stack_class(headers: tuple[str, ...]) -> str | None:
    """The class of a wide table (at least :data:`STACK_COLUMNS` columns), named after its
    headers; None for a narrow one."""
    if len(headers) < STACK_COLUMNS:
        return None
    return "t" + hashlib.sha1("\x1f".join(headers).encode()).hexdigest()[:10]


def _css_string(text: str) -> str:
    """``text`` as a CSS string inside a <style> element (no HTML escaping applies there)."""
    esc = text.replace("\\", "\\\\").replace('"', '\\"').replace("<", "\\3c ")
    return '"' + esc.replace("\n", " ") + '"'


def _tables(blocks):
    for b in blocks:
        if isinstance(b, Table):
            yield b
        elif isinstance(b, Section):
            yield from _tables(b.blocks)


def _stack_css(report: Report) -> str:
    """On a phone, every wide table's cells labelled with their column's name (one rule per
    column of each kind of table, not an attribute per cell)."""
    rules = {}
    for t in _tables(report.sections):
        cls = _stack_class(t.headers)
        if cls and cls not in rules:
            rules[cls] = "".join(
                f".{cls} td:nth-child({i})::before{{content:{_css_string(h)}}}"
                for i, h in enumerate(t.headers, 1)
            )
    return f"@media (max-width:600px){{{''.join(rules.values())}}}" if rules else ""


def _breakable(text: str) -> str:
    """``text`` escaped, with a line-break opportunity (``<wbr>``) after each ``_``, ``/``
    and ``:`` inside a word: a finding's code (``noise_multiplier_mismatch``) or a test's
    name (``sampling:release:exchangeable``) may wrap at its parts, so that a wide table
    fits a laptop's page instead of scrolling sideways."""
    out = re.sub(r"([_/:])(?=\w)", r"\1<wbr>", html.escape(text))
    # and inside a CamelCase name (DifferentialPrivacyServerSideFixedClipping)
    return re.sub(r"(?<=[a-z])(?=[A-Z])", "<wbr>", out)


def _html_table(t: Table) -> str:
    """The table in a container that scrolls sideways on its own; a wide one is shown as
    cards on a phone (class ``stack``, labels from :func:`_stack_css`)."""
    cls = _stack_class(t.headers)
    h = "".join(f"<th>{_breakable(x)}</th>" for x in t.headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{_breakable(format_cell(c))}</td>" for c in r) + "</tr>"
        for r in t.rows
    )
    attr = f' class="stack {cls}"' if cls else ""
    table = f"<table{attr}><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"
    return f'<div class="scroll">{table}</div>'


def _html_block(b, base: Path, level: int) -> str:
    if isinstance(b, Section):
        return _html_section(b, base, level)
    if isinstance(b, Paragraph):
        return f"<p>{_html_inline(b.parts)}</p>"
    if isinstance(b, BulletList):
        return "<ul>" + "".join(f"<li>{_html_inline(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Table):
        return _html_table(b)
    if isinstance(b, Figure):
        path = base / b.src
        data = base64.b64encode(path.read_bytes()).decode()
        mime = _MIME.get(path.suffix.lower(), "image/png")
        cap = html.escape(b.caption)
        return (
            f'<figure><img alt="{cap}" src="data:{mime};base64,{data}">'
            f"<figcaption>{cap}</figcaption></figure>"
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
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{title}</title><style>{_CSS}{_stack_css(report)}</style></head><body><h1>{title}</h1>"
        + (f"<p class='lead'>{html.escape(report.summary)}</p>" if report.summary else "")
        + f"<p>Generated {html.escape(report.generated)} by fedlora-audit.</p>"
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
    """The report as Markdown text (report.md)."""
    lines = [f"# {report.title}", ""]
    if report.summary:
        lines += [report.summary, ""]
    lines += [f"Generated {report.generated}.", ""]
    for s in report.sections:
        lines += _md_section(s, 2)
    return "\n".join(lines)

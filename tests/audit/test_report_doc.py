"""The report's document model: built once, the HTML and Markdown renderers show the same
sections, tables (typed cells, one formatting), figures and text."""

import base64
import math
import re

from audit.report.document import (
    BulletList,
    CodeBlock,
    Emphasis,
    Figure,
    Paragraph,
    Report,
    Section,
    Strong,
    Table,
    format_cell,
    render_html,
    render_markdown,
)

PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


def _report(tmp_path):
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "f.png").write_bytes(PNG)
    r = Report("T <1>", "2026-01-01T00:00:00+00:00")
    r.section("One").add(
        Table.of(["a", "b|c"], [["x & y", 0.123456], [None, math.inf], [True, 3]]),
        Paragraph.of(Strong("Lead."), " text <b>", Emphasis(" em")),
        BulletList.of(["plain", (Strong("code"), " (error): msg")]),
        Figure("figures/f.png", "a caption"),
        Section("Sub", [CodeBlock("cmd 1\ncmd 2", "bash")]),
    )
    r.sections.append(Section("Two", missing="nothing was given."))
    return r


def test_both_renderers_show_the_same_content(tmp_path):
    r = _report(tmp_path)
    page, md = render_html(r, tmp_path), render_markdown(r)
    assert r.missing == ["Two"]
    # sections and nesting
    assert "<h2>One</h2>" in page and "<h3>Sub</h3>" in page and "<h2>Two</h2>" in page
    assert "\n## One\n" in md and "\n### Sub\n" in md and "\n## Two\n" in md
    # typed cells formatted once, escaped for HTML only
    assert [format_cell(c) for c in (0.123456, None, math.inf, True)] == [
        "0.1235",
        "—",
        "∞",
        "True",
    ]
    assert "<td>x &amp; y</td><td>0.1235</td>" in page and "<td>—</td><td>∞</td>" in page
    assert "| x & y | 0.1235 |" in md and "| — | ∞ |" in md and "|---|---|" in md
    # inline markup, lists, missing note, code
    assert (
        "<p><b>Lead.</b> text &lt;b&gt;<i> em</i></p>" in page and "**Lead.** text <b>* em*" in md
    )
    assert "<li><b>code</b> (error): msg</li>" in page and "- **code** (error): msg" in md
    assert (
        "<p><i>missing: nothing was given.</i></p>" in page
        and "*missing: nothing was given.*" in md
    )
    assert "<pre>cmd 1\ncmd 2</pre>" in page and "```bash\ncmd 1\ncmd 2\n```" in md
    # the figure: embedded in the page, linked with its caption in the Markdown
    assert f"data:image/png;base64,{base64.b64encode(PNG).decode()}" in page
    assert "![a caption](figures/f.png)" in md
    assert "<title>T &lt;1&gt;</title>" in page and md.startswith("# T <1>\n")


def test_html_for_small_screens(tmp_path):
    """The page sets a viewport; every table scrolls in its own container; a wide table
    (at least STACK_COLUMNS columns) is labelled to be shown as cards on a phone, with one
    CSS rule per column (no attribute per cell); a figure has its caption; the one-line
    summary sits under the title in both renderers; SVG figures get their media type."""
    from audit.report.document import STACK_COLUMNS

    r = _report(tmp_path)
    wide = [f'col "{i}" <x>' for i in range(STACK_COLUMNS)]
    r.sections[0].add(Table.of(wide, [list(range(STACK_COLUMNS))] * 3))
    (tmp_path / "figures" / "v.svg").write_text("<svg xmlns='http://www.w3.org/2000/svg'/>")
    r.sections[0].add(Figure("figures/v.svg", "vector"))
    r.summary = "2 runs: 2 private as claimed."
    page, md = render_html(r, tmp_path), render_markdown(r)
    assert "<meta name='viewport' content='width=device-width,initial-scale=1'>" in page
    assert page.count('<div class="scroll"><table') == 2
    (cls,) = re.findall(r'<table class="stack (t[0-9a-f]+)">', page)
    assert '<div class="scroll"><table><thead><tr><th>a</th>' in page  # narrow: no cards
    # the labels, escaped for CSS inside <style>, one rule per column
    for i in range(STACK_COLUMNS):
        assert f'.{cls} td:nth-child({i + 1})::before{{content:"col \\"{i}\\" \\3c x>"}}' in page
    assert page.count("::before{content:") == STACK_COLUMNS and "data-label" not in page
    assert "<figcaption>a caption</figcaption>" in page and 'alt="a caption"' in page
    assert "data:image/svg+xml;base64," in page
    assert "<h1>T &lt;1&gt;</h1><p class='lead'>2 runs: 2 private as claimed.</p>" in page
    assert md.startswith("# T <1>\n\n2 runs: 2 private as claimed.\n\nGenerated ")

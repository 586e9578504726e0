"""The report: ``fedlora report`` and the default job's report.

Takes run directories (and analyses, attack results) and gives one document, Markdown and HTML:
the verdict per run (``verdict``), its sections (``build``, ``empirical``, ``analyses``,
``lm``) and the document model with its figures (``document``).

A run's verdict is :func:`audit.report.verdict.verdict` (it shares its module's name, so it
is not re-exported here). The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "build_report": "audit.report.build",
    "SECTIONS": "audit.report.build",
    "train_command": "audit.report.build",
    "run_verdict": "audit.report.verdict_table",
    "VERDICT_COLUMNS": "audit.report.verdict_table",
    "strongest_attack": "audit.report.verdict_table",
    "Evidence": "audit.report.verdict",
    "CHANCE_BALANCED": "audit.report.verdict",
    "findings_summary": "audit.report.verdict",
    "Report": "audit.report.document",
    "Section": "audit.report.document",
    "Paragraph": "audit.report.document",
    "Table": "audit.report.document",
    "Figure": "audit.report.document",
    "render_html": "audit.report.document",
    "render_markdown": "audit.report.document",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

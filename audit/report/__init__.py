"""The report: ``fedlora report`` and the default job's report.

Takes run directories (and analyses, attack results) and gives one document, Markdown and HTML:
the verdict per run (``verdict``), its sections (``build``, ``empirical``, ``analyses``,
``lm``) and the document model with its figures (``document``).
"""

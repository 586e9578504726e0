"""Where the committed measurement outputs live (data only: JSON, JSONL, Markdown)."""

from pathlib import Path

#: the committed results, one folder per measurement (``results/README.md`` indexes them)
RESULTS = Path(__file__).resolve().parent / "results"

__all__ = ["RESULTS"]

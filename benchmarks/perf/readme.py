"""The README's Performance table, rendered from a committed ``fedlora bench`` document.

``python -m benchmarks.perf.readme benchmarks/results/DIR/bench.json`` prints the table; the
README quotes it verbatim under the file's name, and ``tests/benchmarks/test_bench.py``
checks that the README's table is the one its named file renders (so the README's
figures are always those of a committed, measured file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: (ratio id, what the README calls it); the issue-20 ratios, in the README's order.
ROWS = (
    ("dp_step_over_nodp_step/cpu/minilm", "DP-SGD step / non-DP step, minilm"),
    (
        "dp_per_parameter_step_over_nodp_step/cpu/minilm",
        "the same with the per-parameter DP step it replaced (same run)",
    ),
    ("engine_wall_over_local_compute", "engine wall / local training, per round"),
    (
        "engine_wall_over_local_compute_incl_prefix_cache",
        "the same with the one-off frozen-prefix caches left in",
    ),
    ("powerdp_factored_speedup/4096/K10", "PowerDP dense / factored time, 4096², K = 10"),
    ("powerdp_factored_speedup_1thread/4096/K10", "the same, one thread on both sides"),
    ("keyed_over_seeded_step/cpu/minilm", "keyed CSPRNG / seeded DP step, minilm"),
    ("dp_step_over_nodp_step/cuda/bert-base/bf16", "DP / non-DP step on a GPU, BERT-base bf16"),
)


def _value(e: dict | None) -> str:
    if e is None:
        return "not in this file"
    if not e["measured"]:
        return "not measured (no CUDA device)" if "CUDA" in e["reason"] else "not measured"
    sp, v = e["spread"], e["value"]

    def f(x: float) -> str:  # time ratios near 1 need three decimals
        return f"{x:.3f}" if e["kind"] == "time" else f"{x:.3g}"

    if sp is None:
        return f"{f(v)}× (point estimate)"
    if "boot_lo" in sp:
        return (
            f"{f(v)}× ({f(sp['boot_lo'])}–{f(sp['boot_hi'])}; "
            f"{f(sp['min'])}–{f(sp['max'])}, n = {sp['n']})"
        )
    return f"{f(v)}× (one run)" if sp["n"] == 1 else f"{f(v)}× ({f(sp['min'])}–{f(sp['max'])})"


def table(doc: dict) -> str:
    """The Markdown table: ratio, value with its spread, target, met."""
    by_id = {e["id"]: e for e in doc["ratios"]}
    lines = ["| ratio | measured | target | met |", "|---|---|---|---|"]
    for id_, what in ROWS:
        e = by_id.get(id_)
        met = {True: "yes", False: "**no**", None: "–"}[e["met"] if e else None]
        target = (e or {}).get("target") or "–"
        lines.append(f"| {what} | {_value(e)} | {target} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.perf.readme RESULTS/bench.json", file=sys.stderr)
        return 2
    print(table(json.loads(Path(argv[0]).read_text(encoding="utf-8"))), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

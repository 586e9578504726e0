"""The report's optional sections: causal-LM runs (perplexity of the base model and of the
adapters) and the client-level membership attack. Each appears only when some run has
its content (a causal-LM run; ``RUN/attacks/clients.json`` from ``fedlora attack RUN
--client-level``), so a classification report keeps its usual sections.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from audit.report.analyses import figure_paragraph
from audit.report.document import Paragraph, Section, Table, copy_figure, save_figure
from audit.report.document import format_cell as _fmt

LM_TITLE = "Language models"
CLIENT_TITLE = "Client-level membership inference"
#: random-init base models: membership results on them say nothing about real LLMs
RANDOM_INIT = ("tiny-gpt2",)


def _ci(x, ci) -> str:
    if x is None:
        return "–"
    return f"{_fmt(x, 3)} [{_fmt(ci[0], 3)}, {_fmt(ci[1], 3)}]" if ci else _fmt(x, 3)


def _ppl(lm: dict, role: str, which: str):
    return ((lm.get("perplexity") or {}).get(role) or {}).get(which)


def lm_section(rows: list[dict], figdir: Path) -> Section | None:
    """Causal-LM runs: test perplexity of the run's evaluation, and the perplexity of the
    adapter and of its base model (adapter off) on members, non-members and test examples
    (from the run's attacks.json)."""
    lm_rows = [r for r in rows if (r.get("config") or {}).get("task") == "causal-lm"]
    if not lm_rows:
        return None
    sec = Section(LM_TITLE)
    table, bars = [], []
    for r in lm_rows:
        lm = (r.get("attacks") or {}).get("lm") or {}
        cfg = r["config"]
        eps = r.get("epsilon_claimed") if r.get("level") not in (None, "none") else "no DP"
        cells = [
            _ppl(lm, role, w)
            for role in ("test", "member", "nonmember")
            for w in ("base", "adapter")
        ]
        table.append([r["run"], cfg.get("model"), r.get("method"), r.get("level"), eps,
                      r.get("perplexity"), *cells])  # fmt: skip
        if lm:
            bars.append((r["run"], cells))
    hd = ["run", "base model", "method", "DP level", "ε claimed", "test ppl (run's evaluation)",
          "test: base", "test: adapter", "members: base", "members: adapter",
          "non-members: base", "non-members: adapter"]  # fmt: skip
    sec.add(Table.of(hd, table))
    sec.add(
        Paragraph.of(
            "Perplexity = exp(token-weighted mean next-token NLL over the scored tokens); "
            "base = the same model with the adapter disabled (the public base of a released "
            "LoRA, the reference of the reference-calibrated attack). The per-role columns "
            "come from `fedlora attack RUN` (– where it was not run). An adapter that lowers "
            "the members' perplexity more than the non-members' is what the LM membership "
            "signals detect; their ROC curves are in the Membership inference section."
        )
    )
    if any(r["config"].get("model") in RANDOM_INIT for r in lm_rows):
        sec.add(
            Paragraph.of(
                "Runs on a random-init base (tiny-gpt2) are smoke tests: membership results on "
                "a base that knows no language are meaningless (use a pretrained base, e.g. "
                "one from `fedlora base pretrain`)."
            )
        )
    if bars:
        fig = _plot_perplexity(bars, figdir / "lm_perplexity")
        sec.add(figure_paragraph(fig, "perplexity of base and adapter per run and role"))
    return sec


def _plot_perplexity(bars: list[tuple[str, list]], stem: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = ["test: base", "test: adapter", "members: base", "members: adapter",
              "non-members: base", "non-members: adapter"]  # fmt: skip
    fig = Figure(figsize=(max(5.0, 1.8 * len(bars) + 2), 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    w = 0.8 / len(labels)
    for j, lab in enumerate(labels):
        xs = [i + (j - (len(labels) - 1) / 2) * w for i in range(len(bars))]
        ys = [np.nan if c[j] is None else c[j] for _, c in bars]
        ax.bar(xs, ys, width=w, label=lab)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([n for n, _ in bars], rotation=15, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("perplexity (log scale)")
    ax.set_title("Perplexity of the base model and the adapter")
    ax.legend(fontsize=7)
    return save_figure(fig, stem)[0]


def client_section(rows: list[dict], figdir: Path) -> Section | None:
    """The client-level attack of every run that has ``attacks/clients.json``."""
    done = [(r, r["clients"]) for r in rows if r.get("clients")]
    if not done:
        return None
    sec = Section(CLIENT_TITLE)
    sec.add(
        Paragraph.of(
            "Did a candidate client take part in training? Participating clients are the "
            "run's client shards; non-participating clients are twins drawn from the run's "
            "non-members with a participant's size and label histogram. A client's score is "
            "the mean of an example-level attack's scores over its examples; intervals are "
            "bootstrap 95% intervals over clients. τ is calibrated on half of the twins at the "
            "target FPR; TPR at τ is over the participants, FPR over the other half of the "
            "twins. A run with client-level DP promises that no client is detected much better "
            "than chance."
        )
    )
    for r, c in done:
        t = []
        for name, a in (c.get("attacks") or {}).items():
            ci = a.get("ci") or {}
            op = a.get("calibrated") or {}
            t.append([
                name,
                _ci(a.get("auc"), ci.get("auc")),
                _ci(a["tpr_at_fpr"].get("0.01"), (ci.get("tpr_at_fpr") or {}).get("0.01")),
                op.get("target_fpr"),
                op.get("tpr"),
                op.get("fpr_held_out"),
            ])  # fmt: skip
        size = c.get("client_size") or {}
        sub = Section(r["run"])
        sec.add(sub)
        sub.add(
            Paragraph.of(
                f"{c.get('n_participating')} participating and {c.get('n_nonparticipating')} "
                f"non-participating clients of {size.get('min')}–{size.get('max')} examples "
                f"(mean {_fmt(size.get('mean'), 3)}); DP level {r.get('level')}."
            ),
            Table.of(
                [
                    "attack (example scores)",
                    "AUC [95% CI]",
                    "TPR at 1% FPR [95% CI]",
                    "target FPR",
                    "TPR at τ",
                    "held-out FPR at τ",
                ],
                t,
            ),  # fmt: skip
        )
        adir = Path(r["path"]) / "attacks"
        for stem, caption in (
            ("roc_clients", "client-level ROC"),
            ("client_hist", "client scores"),
        ):
            src = adir / f"{stem}.png"
            if src.is_file():
                dst = copy_figure(src, figdir / f"{r['run']}-{src.name}")
                sub.add(figure_paragraph(dst, f"{caption} {r['run']}"))
    return sec

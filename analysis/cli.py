"""`fedlora analyze NAME`: the noise analyses as sub-commands.

Every analysis takes ``--seed``, ``--out DIR`` (default reports/analysis/NAME),
``--json`` (print only the JSON document), ``--runs DIR...`` (measure factors or
metrics of run directories instead of synthetic ones) and ``--no-figure``, plus its
own size flags. It writes NAME.json, NAME.png and NAME.svg to DIR.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys

from fl.errors import UsageError

ANALYSES = {
    "amplification": "noise power reaching ΔW = BA vs σ: both factors / B only / W-space / PowerDP",
    "exactness": "relative aggregation error of every server rule vs oversketch p and clients K",
    "hetero": "initialization and aggregation noise per round (FLoRA, FlexLoRA, HETLoRA, PLoRA)",
    "refactorization": "PowerDP vs input vs output perturbation at equal ε",
    "claims": "the papers' claims checked as experiments (holds / does not hold)",
}


def _int_in(lo: int, hi: int):
    """An argparse type: a whole number in [lo, hi] (argparse names the flag on error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}], got {v}")
        return v

    return parse


def _float_in(lo: float, hi: float, lo_open: bool = True):
    """An argparse type: a finite number in (lo, hi] (or [lo, hi] with ``lo_open=False``)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            raise argparse.ArgumentTypeError(
                f"must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {text}"
            )
        return v

    return parse


SEED = _int_in(0, 2**32 - 1)
DIM = _int_in(1, 4096)  # matrix sides m, n
COUNT = _int_in(1, 100_000)  # trials, steps, rounds, iterations


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise UsageError(f"{what}: expected comma-separated numbers, got {text!r}") from exc
    if not vals:
        raise UsageError(f"{what}: empty list")
    bad = [v for v in vals if not (math.isfinite(v) and 0 < v <= 1e6)]
    if bad:
        raise UsageError(f"{what}: every value must be a number in (0, 1e6], got {bad[0]}")
    return vals


def _ints(text: str, what: str) -> list[int]:
    vals = _floats(text, what)
    if any(v != int(v) for v in vals):
        raise UsageError(f"{what}: expected integers, got {text!r}")
    return [int(v) for v in vals]


def _shapes(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        bits = part.strip().lower().split("x")
        try:
            m, n, r = (int(b) for b in bits)
        except ValueError as exc:
            raise UsageError(f"--shapes: expected MxNxR[,MxNxR...], got {part!r}") from exc
        if not (1 <= m <= 4096 and 1 <= n <= 4096 and 1 <= r <= min(m, n)):
            raise UsageError(f"--shapes: need 1 <= M, N <= 4096 and 1 <= R <= min(M, N): {part!r}")
        out.append((m, n, r))
    return out


def _add_common(p: argparse.ArgumentParser, runs_help: str) -> None:
    p.add_argument("--seed", type=SEED, default=0, help="seed (the analysis is deterministic)")
    p.add_argument("--out", default=None, help="output folder (default reports/analysis/NAME)")
    p.add_argument("--json", action="store_true", help="print only the JSON document")
    p.add_argument("--runs", nargs="+", default=None, metavar="DIR", help=runs_help)
    p.add_argument("--no-figure", action="store_true", help="skip the PNG/SVG figure")


def _kwargs(name: str, a: argparse.Namespace) -> dict:
    kw: dict = {}
    if name == "amplification":
        if a.shapes:
            kw["shapes"] = _shapes(a.shapes)
        if a.sigmas:
            kw["sigmas"] = _floats(a.sigmas, "--sigmas")
        kw.update(trials=a.trials, lr=a.lr, clip=a.clip, powerdp_trials=a.powerdp_trials)
        if a.runs:
            if len(a.runs) % 2:
                raise UsageError("--runs takes pairs: NOISY_RUN CLEAN_RUN [NOISY CLEAN ...]")
            kw["runs"] = list(zip(a.runs[0::2], a.runs[1::2]))
    elif name == "exactness":
        kw.update(m=a.m, n=a.n, rank=a.rank, clients=_ints(a.clients, "--clients"))
        if a.oversketch:
            kw["oversketch"] = _ints(a.oversketch, "--oversketch")
        kw["shared_a"] = {"both": (True, False), "shared": (True,), "independent": (False,)}[
            a.shared_a
        ]
    elif name == "hetero":
        kw.update(
            m=a.m,
            n=a.n,
            ranks=_ints(a.ranks, "--ranks"),
            rounds=a.rounds,
            steps=a.steps,
            lr=a.lr,
            methods=[x.strip() for x in a.methods.split(",") if x.strip()],
        )
    elif name == "refactorization":
        kw.update(
            m=a.m,
            n=a.n,
            rank=a.rank,
            clients=a.clients,
            delta=a.delta,
            iters=a.iters,
            trials=a.trials,
        )
        if a.epsilons:
            kw["epsilons"] = _floats(a.epsilons, "--epsilons")
    if a.runs and "runs" not in kw:
        kw["runs"] = list(a.runs)
    if getattr(a, "grids", None):
        kw["grids"] = list(a.grids)
    return kw


def _cmd(args: argparse.Namespace) -> int:
    from analysis import figures  # matplotlib: only when an analysis runs, not for --help

    name = args.analysis
    mod = importlib.import_module(f"analysis.{name}")
    out = args.out if args.out is not None else str(figures.default_out(name))
    doc = mod.run(seed=args.seed, out=out, figure=not args.no_figure, **_kwargs(name, args))
    if args.json:
        sys.stdout.write(figures.to_json_text(doc) + "\n")
    else:
        print(f"fedlora analyze {name} (seed {args.seed})")
        print(mod.table(doc))
        files = [f"{name}.json"] + ([] if args.no_figure else [f"{name}.png", f"{name}.svg"])
        print(f"\nwrote {', '.join(files)} to {out}")
    return 0


def register(subparsers) -> None:
    """Add `analyze` with one sub-command per analysis to the fedlora CLI."""
    p = subparsers.add_parser(
        "analyze", help="noise analyses with figures (analysis/)", description=__doc__
    )
    sub = p.add_subparsers(dest="analysis", metavar="NAME", parser_class=type(p))
    sub.required = True
    for name, helptext in ANALYSES.items():
        q = sub.add_parser(name, help=helptext, description=helptext)
        if name == "amplification":
            _add_common(q, "pairs of run directories NOISY CLEAN (same seed, σ > 0 and σ = 0)")
            q.add_argument(
                "--shapes", default=None, help="LoRA shapes MxNxR,... (64x64x4,128x32x8)"
            )
            q.add_argument("--sigmas", default=None, help="σ grid, comma-separated (1e-2..1e1)")
            q.add_argument("--trials", type=COUNT, default=200, help="Monte Carlo draws per σ")
            q.add_argument("--powerdp-trials", type=COUNT, default=30, help="PowerDP draws per σ")
            q.add_argument(
                "--lr", type=_float_in(0, 100), default=1.0, help="learning rate η of the DP step"
            )
            q.add_argument("--clip", type=_float_in(0, 1e6), default=1.0, help="clipping bound C")
        elif name == "exactness":
            _add_common(q, "run directories, each used as one client")
            q.add_argument("--m", type=DIM, default=64)
            q.add_argument("--n", type=DIM, default=48)
            q.add_argument("--rank", type=DIM, default=4, help="client rank r")
            q.add_argument("--clients", default="2,4,8", help="grid of client counts K")
            q.add_argument("--oversketch", default=None, help="FedASK oversketch grid p")
            q.add_argument(
                "--shared-a",
                choices=("both", "shared", "independent"),
                default="both",
                help="client A factors shared, independent or both",
            )
        elif name == "hetero":
            _add_common(q, "run directories (metrics.jsonl init_noise / agg_noise)")
            q.add_argument("--methods", default="flora,flexlora,hetlora,plora")
            q.add_argument("--m", type=DIM, default=32)
            q.add_argument("--n", type=DIM, default=32)
            q.add_argument("--ranks", default="2,4,6,8", help="client ranks (global R = max)")
            q.add_argument("--rounds", type=COUNT, default=8)
            q.add_argument("--steps", type=COUNT, default=10, help="local gradient steps")
            q.add_argument("--lr", type=_float_in(0, 100), default=0.1)
        elif name == "refactorization":
            _add_common(q, "run directories (their aggregated update, per module)")
            q.add_argument("--m", type=DIM, default=64)
            q.add_argument("--n", type=DIM, default=48)
            q.add_argument("--rank", type=DIM, default=4)
            q.add_argument(
                "--clients", type=_int_in(1, 10**6), default=200, help="clients K (Δ = C/K)"
            )
            q.add_argument("--epsilons", default=None, help="ε grid (0.25..32)")
            q.add_argument("--delta", type=_float_in(0, 0.5), default=1e-5)
            q.add_argument(
                "--iters", type=_int_in(1, 1000), default=2, help="PowerDP power iterations"
            )
            q.add_argument("--trials", type=COUNT, default=4)
        else:
            _add_common(q, "run directories (a_rowspace_angle, init_noise, agg_noise metrics)")
            q.add_argument(
                "--grids",
                nargs="+",
                default=None,
                metavar="DIR",
                help="benchmarks.grids.runner result folders (results.jsonl), or a folder of them "
                "(benchmarks/results/claims): adds the privacy-utility "
                "claims decided over seeds with 95%% intervals (holds / does not hold / "
                "inconclusive) and the accuracy-vs-ε figure claims_utility.png",
            )
        q.set_defaults(func=_cmd)

"""What a DP run's privacy block states and who took part in it: the first two steps of the
recomputation of :mod:`audit.bundle.recompute`.

:class:`Stated` reads the privacy block (σ, δ, the ledger, ε per accountant, per-client σ);
:class:`Participation` holds, per client, its sampling rate q = batch / n, its local steps per
round and the rounds it took part in: from a run directory (client sizes from splits.json,
cohorts from metrics.jsonl: :func:`run_participation`) or from a bundle (the public rates and
the ledger: :func:`bundle_participation`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from audit.findings import Code, Finding
from fl.errors import UsageError
from fl.privacy.accounting import PrivacyError
from fl.privacy.ledger import Ledger

__all__ = [
    "ACCOUNTANTS",
    "Participation",
    "Stated",
    "bundle_participation",
    "client_releases",
    "local_steps",
    "rounds_done",
    "run_participation",
]

ACCOUNTANTS = ("pld", "rdp")


def local_steps(cfg: dict, n: int) -> int:
    """Local DP-SGD steps of a client with n records per round (as fl.run.engine does)."""
    if cfg["local_epochs"] > 0:
        return max(1, math.ceil(cfg["local_epochs"] * n / cfg["batch_size"]))
    return cfg["local_steps"]


def client_releases(method: str, cfg: dict) -> int | None:
    """Gaussian releases per round of a method under client-level DP (None if unknown)."""
    try:
        from fl.methods import registry
        from fl.methods.base import parse_options

        cls = registry.get(method)
        opts = parse_options(cls.Options, cfg.get("opts") or {})
        # Methods read only configuration in __init__; give them the run's config.
        cfg_ns = SimpleNamespace(**cfg)
        server = SimpleNamespace(cfg=cfg_ns, dp_level=cfg.get("dp_level"))
        return int(cls(server, opts).client_dp_releases())
    except Exception:  # an unknown/removed method: fall back to the ledger's per-round count
        return None


@dataclass(frozen=True)
class Stated:
    """What a DP run's privacy block states: σ, δ, the composed ledger, ε per accountant."""

    level: str
    sigma: float
    delta: float
    ledger: Ledger
    epsilon: dict  # accountant -> stated ε (None when absent)
    # sample level: σ_k per client (each calibrated to its own rate); {} in runs written
    # before per-client σ, where every client used ``sigma``
    client_sigmas: dict = field(default_factory=dict)

    def sigma_of(self, client: str) -> float:
        """σ_k, never above the block's σ (their maximum): a tampered block cannot make
        the recomputation use more noise than it states."""
        return min(float(self.client_sigmas.get(str(client), self.sigma)), self.sigma)

    @classmethod
    def read(cls, p: dict) -> Stated:
        delta = float(p["delta"])
        if not (0.0 < delta < 1.0):
            raise UsageError(f"manifest.json: privacy.delta must be in (0, 1), got {delta!r}")
        try:
            ledger = Ledger.from_state_dict(p["ledger"])
        except PrivacyError as exc:
            raise UsageError(f"manifest.json: privacy.ledger: {exc}") from None
        eps = {a: p["epsilon"].get(a) for a in ACCOUNTANTS}
        per = p.get("client_noise_multipliers") or {}
        if not isinstance(per, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in per.values()
        ):
            raise UsageError(
                "manifest.json: privacy.client_noise_multipliers must map client ids to σ >= 0"
            )
        sigmas = {str(k): float(v) for k, v in per.items()}
        return cls(p["level"], float(p["noise_multiplier"]), delta, ledger, eps, sigmas)


@dataclass(frozen=True)
class Participation:
    """Per client: (q = batch / n, local steps per round) and the rounds it took part in."""

    units: dict  # client -> (q, steps per round)
    rounds_in: dict  # client -> rounds it took part in
    rounds_done: int  # rounds that ran (client level: every one releases)


def _every_client_every_round(p: dict) -> bool:
    cs = p["client_sampling"]
    return float(cs["clients_per_round"]) >= int(cs["total_clients"])


def rounds_done(p: dict, shown: int | None) -> int:
    """Rounds that ran: the larger of ``privacy.rounds_completed`` and the rounds the
    metrics show (a contradiction between them is a ``fields_contradict`` finding);
    ``privacy.rounds`` when neither is there."""
    stated = p.get("rounds_completed")
    if stated is None and shown is None:
        return int(p["rounds"])
    return max(int(stated or 0), int(shown or 0))


def bundle_participation(
    cfg: dict, p: dict, ledger: Ledger, rows: list[dict] | None = None
) -> tuple[Participation, list]:
    """A bundle's participation, from the public manifest and its public metrics;
    returns it and the checks it cannot make (``{"check", "reason"}``).

    The member ids (``splits.json``) and the sampled cohorts (the operator's
    ``metrics.jsonl``) are not in a bundle; it has the sampling rates q_c = B / n_c and
    the ledger, which records which units took part in which round. The steps per round
    are derived from the configuration (``local_steps``, or ``local_epochs`` with n_c =
    B / q_c), never lowered by ``privacy.steps_per_round``; the rounds that ran are the
    larger of ``privacy.rounds_completed`` and the rows of the bundle's metrics.jsonl.
    When every client takes part in every round, each took part in every round that ran;
    otherwise the ledger says which (taken on trust)."""
    from audit.bundle.crosscheck import metrics_rounds

    rates = p.get("sample_rates") or {}
    steps = p.get("steps_per_round") or {}
    done = rounds_done(p, metrics_rounds(rows))
    units: dict[str, tuple[float, int]] = {}
    for c, q in rates.items():
        q = float(q)
        st = steps.get(c)
        if cfg["local_epochs"] > 0 and q >= 1.0 and isinstance(st, int):
            # q = min(1, B/n) = 1 does not give n (n <= B): the recorded count is used
            units[str(c)] = (q, st)
            continue
        derived = local_steps(cfg, round(cfg["batch_size"] / q))
        units[str(c)] = (q, max(derived, st) if isinstance(st, int) else derived)
    rounds_of: dict[str, set] = {}
    for e in ledger.events:
        rounds_of.setdefault(e.unit, set()).add(e.round)
    if _every_client_every_round(p):
        rounds_in = dict.fromkeys(units, done)
    else:
        rounds_in = {c: len(rounds_of.get(f"client:{c}", ())) for c in units}
    skipped = [
        {
            "check": "client_sizes",
            "reason": "client sizes are counted in splits.json (operator-only); the bundle's "
            "sampling rates q = batch / n are used as stated, so sample_rate_mismatch cannot "
            "be checked",
        },
        {
            "check": "participation",
            "reason": "the clients sampled in each round are in the operator's metrics.jsonl; "
            + (
                "every client takes part in every round here, so each is counted in every "
                "round that ran"
                if _every_client_every_round(p)
                else "the bundle's participation is read from the ledger's events, so the "
                "config recomputation checks the ledger's step counts and σ, not which "
                "clients took part"
            ),
        },
    ]
    return Participation(units, rounds_in, done), skipped


def _client_sizes(run, p: dict, splits: dict | None) -> dict[str, int]:
    if splits is not None and isinstance(splits.get("clients"), dict):
        # Sampling rates use the member count before canaries were added (canary
        # ids start with "canary:"), so they do not reveal secret inclusions.
        return {
            str(c): sum(1 for i in ids if not str(i).startswith("canary:"))
            for c, ids in splits["clients"].items()
        }
    sizes = {str(c): int(n) for c, n in (p.get("client_sizes") or {}).items()}
    if not sizes:
        raise UsageError(f"{run}: no client sizes (splits.json 'clients' nor privacy.client_sizes)")
    return sizes


def _nonempty(sizes: dict[str, int], where: str) -> dict[str, int]:
    empty = sorted(c for c, n in sizes.items() if n <= 0)
    if empty:
        raise UsageError(
            f"{where}: client(s) {', '.join(empty[:5])} hold no examples: a run with an empty "
            "client has no sampling rate B/n for it (the engine refuses to train one)"
        )
    return sizes


def run_participation(
    run, cfg: dict, p: dict, splits: dict | None, rows: list[dict] | None
) -> tuple[Participation, list[Finding]]:
    """A run directory's participation: client sizes from splits.json, the clients of each
    round from metrics.jsonl; findings: ``metrics_missing``, ``sample_rate_mismatch``."""
    found: list[Finding] = []
    if rows is None:
        found.append(
            Finding(
                Code.METRICS_MISSING,
                "metrics.jsonl is missing: every client is assumed to take part in every round.",
            )
        )
    from audit.bundle.crosscheck import metrics_rounds

    done = rounds_done(p, metrics_rounds(rows))
    sizes = _nonempty(_client_sizes(run, p, splits), f"{run}/splits.json")
    rounds_in = dict.fromkeys(sizes, 0)
    for i, row in enumerate((rows or []) + [{"clients": list(sizes)}] * (done - len(rows or []))):
        cl = row.get("clients")
        if not isinstance(cl, list):
            raise UsageError(f"metrics.jsonl: round line {i + 1} has no 'clients' list")
        for c in cl:
            if str(c) not in rounds_in:
                raise UsageError(f"metrics.jsonl: round {i + 1} names unknown client {c!r}")
            rounds_in[str(c)] += 1
    rates = p.get("sample_rates") or {}
    units = {}
    for c, n in sorted(sizes.items()):
        q = min(1.0, cfg["batch_size"] / n)
        if p["level"] == "sample" and c in rates and abs(float(rates[c]) - q) > 1e-12:
            found.append(
                Finding(
                    Code.SAMPLE_RATE_MISMATCH,
                    f"Client {c} holds {n} records, so its sampling rate is batch "
                    f"{cfg['batch_size']} / {n} = {q:.4g}, but the manifest records "
                    f"{float(rates[c]):.4g}.",
                )
            )
        units[c] = (q, local_steps(cfg, n))
    return Participation(units, rounds_in, done), found

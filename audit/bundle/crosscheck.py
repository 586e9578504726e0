"""Every field that decides privacy, checked against every other copy the audit holds.

A manifest says the same thing in several places: the configuration (``config``), the
privacy block, the ledger, the noise block, the per-round metrics. An edit of one copy
(``privacy.noise`` made keyed on an ``--insecure-deterministic-noise`` run, the steps per
round lowered below ``config.local_steps``, ``rounds_completed`` below the rounds the
metrics show) must not go unseen: each disagreement is a ``fields_contradict`` finding
(tampering), and the recomputation uses the value that gives the larger ε
(:mod:`audit.bundle.recompute` derives steps from the configuration and rounds from the
metrics).

Non-finite and out-of-range values of the fields ε is computed from are bad input: a
:class:`fl.errors.UsageError` naming the field (exit code 2), never a traceback.
"""

from __future__ import annotations

import math

from audit.findings import Code, Finding
from fl.errors import UsageError

__all__ = ["validate_numbers", "cross_check", "metrics_rounds"]


def _num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _field(where: str, v, *, lo=None, lo_open=False, hi=None, integer=False, allow_none=False):
    if v is None and allow_none:
        return
    if not _num(v) or (integer and not isinstance(v, int)) or not math.isfinite(float(v)):
        kind = "a whole number" if integer else "a finite number"
        raise UsageError(f"manifest.json: {where} must be {kind}, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise UsageError(
            f"manifest.json: {where} must be {'>' if lo_open else '>='} {lo}, got {v!r}"
        )
    if hi is not None and v > hi:
        raise UsageError(f"manifest.json: {where} must be <= {hi}, got {v!r}")


def validate_numbers(m: dict) -> None:
    """The numbers ε is recomputed from, each finite and in range (UsageError naming the
    first that is not). The stated ε itself is checked by the recomputation (a NaN or
    negative ε is a finding, not bad input: it is the claim under audit)."""
    cfg, p = m["config"], m["privacy"]
    _field("config.batch_size", cfg.get("batch_size"), lo=1, integer=True)
    _field("config.local_steps", cfg.get("local_steps"), lo=0, integer=True)
    _field("config.local_epochs", cfg.get("local_epochs"), lo=0, hi=1e6)
    for name in ("epsilon", "delta", "clip"):
        if name in cfg:
            _field(f"config.{name}", cfg.get(name), lo=0)
    if "noise_multiplier" in cfg and cfg["noise_multiplier"] != -1:  # -1: not set (--epsilon)
        _field("config.noise_multiplier", cfg.get("noise_multiplier"), lo=0)
    _field("config.members", cfg.get("members"), lo=1, integer=True)
    _field("config.clients", cfg.get("clients"), lo=1, integer=True)
    if cfg.get("local_steps", 0) == 0 and not cfg.get("local_epochs", 0) > 0:
        raise UsageError("manifest.json: config.local_steps and config.local_epochs are both 0")
    if "rounds" in cfg:
        _field("config.rounds", cfg.get("rounds"), lo=1, integer=True)
    if p.get("level") == "none":
        return
    _field("privacy.noise_multiplier", p.get("noise_multiplier"), lo=0)
    _field("privacy.delta", p.get("delta"), lo=0, lo_open=True, hi=1)
    _field("privacy.rounds", p.get("rounds"), lo=0, integer=True)
    if "rounds_completed" in p:
        _field("privacy.rounds_completed", p.get("rounds_completed"), lo=0, integer=True)
    if "clipping_norm" in p:
        _field("privacy.clipping_norm", p.get("clipping_norm"), lo=0, allow_none=True)
    cs = p["client_sampling"]
    _field("privacy.client_sampling.total_clients", cs.get("total_clients"), lo=1, integer=True)
    _field("privacy.client_sampling.clients_per_round", cs.get("clients_per_round"), lo=0)
    if cs.get("scheme") not in ("uniform", "poisson"):
        raise UsageError(
            "manifest.json: privacy.client_sampling.scheme must be uniform or poisson, got "
            f"{cs.get('scheme')!r}"
        )
    for name in ("sample_rates", "steps_per_round", "client_noise_multipliers", "client_sizes"):
        d = p.get(name)
        if d is None:
            continue
        if not isinstance(d, dict):
            raise UsageError(f"manifest.json: privacy.{name} must map client ids to numbers")
        for c, v in d.items():
            if name == "sample_rates":
                _field(f"privacy.sample_rates.{c}", v, lo=0, lo_open=True, hi=1)
            elif name == "client_noise_multipliers":
                _field(f"privacy.client_noise_multipliers.{c}", v, lo=0)
            else:
                _field(f"privacy.{name}.{c}", v, lo=0, integer=True)


def metrics_rounds(rows: list[dict] | None) -> int | None:
    """Rounds the metrics show (rows with a ``round``), None without metrics."""
    if rows is None:
        return None
    return sum(1 for r in rows if isinstance(r, dict) and _num(r.get("round")))


def _contradict(found: list, what: str) -> None:
    found.append(Finding(Code.FIELDS_CONTRADICT, what))


def cross_check(m: dict, rows: list[dict] | None, bundle: bool) -> list[Finding]:
    """``fields_contradict`` findings: the configuration, the privacy block, its noise
    block, the ledger and the metrics disagree on a field that decides privacy."""
    found: list[Finding] = []
    cfg, p = m["config"], m["privacy"]
    level = p.get("level")
    if cfg.get("method") is not None and cfg.get("method") != m.get("method"):
        _contradict(found, f"config.method is {cfg.get('method')!r}, method {m.get('method')!r}.")
    dp = cfg.get("dp_level")
    if dp is not None and dp != level:
        _contradict(
            found,
            f"config.dp_level is {dp!r}, but privacy.level is {level!r}: the run was configured "
            "for another level of privacy than the block states.",
        )
    noise = p.get("noise")
    if cfg.get("insecure_deterministic_noise") and isinstance(noise, dict):
        if noise.get("source") != "seeded" or noise.get("private") is not False:
            _contradict(
                found,
                "config.insecure_deterministic_noise is true (the noise was seeded from the "
                f"public seed), but privacy.noise says source {noise.get('source')!r}, private "
                f"{noise.get('private')!r}: the noise block was replaced.",
            )
    if level == "none":
        return found
    ledger = p.get("ledger") or {}
    if isinstance(ledger, dict):
        if ledger.get("level") not in (None, level):
            _contradict(found, f"privacy.ledger.level is {ledger.get('level')!r}, level {level!r}.")
        if ledger.get("neighbouring") not in (None, p.get("neighbouring")):
            _contradict(
                found,
                f"privacy.ledger.neighbouring is {ledger.get('neighbouring')!r}, but "
                f"privacy.neighbouring is {p.get('neighbouring')!r}.",
            )
    pairs = [
        ("config.rounds", cfg.get("rounds"), "privacy.rounds", p.get("rounds")),
        (
            "config.clients",
            cfg.get("clients"),
            "privacy.client_sampling.total_clients",
            p["client_sampling"].get("total_clients"),
        ),
        (
            "config.client_sampling",
            cfg.get("client_sampling"),
            "privacy.client_sampling.scheme",
            p["client_sampling"].get("scheme"),
        ),
    ]
    if _num(cfg.get("delta")) and cfg["delta"] > 0:
        pairs.append(("config.delta", cfg["delta"], "privacy.delta", p.get("delta")))
    if _num(cfg.get("epsilon")) and cfg["epsilon"] > 0:
        pairs.append(
            ("config.epsilon", cfg["epsilon"], "privacy.target_epsilon", p.get("target_epsilon"))
        )
    if level == "sample" and _num(cfg.get("clip")) and "clipping_norm" in p:
        pairs.append(("config.clip", cfg["clip"], "privacy.clipping_norm", p.get("clipping_norm")))
    data = m.get("data") or {}
    if _num(data.get("n_members")) and _num(cfg.get("members")):
        pairs.append(("config.members", cfg["members"], "data.n_members", data["n_members"]))
    for a, va, b, vb in pairs:
        if va is None or vb is None:
            continue
        same = (
            math.isclose(float(va), float(vb), rel_tol=1e-12, abs_tol=0.0)
            if _num(va) and _num(vb)
            else va == vb
        )
        if not same:
            _contradict(found, f"{a} is {va!r}, but {b} is {vb!r}.")
    # rounds: the block, the metrics and the ledger
    done = p.get("rounds_completed")
    shown = metrics_rounds(rows)
    if _num(done) and shown is not None and shown != done:
        _contradict(
            found,
            f"privacy.rounds_completed is {done}, but metrics.jsonl shows {shown} rounds; ε "
            "is recomputed over the larger.",
        )
    if _num(done) and _num(p.get("rounds")) and done > p["rounds"]:
        _contradict(found, f"privacy.rounds_completed {done} exceeds privacy.rounds {p['rounds']}.")
    if rows:
        last = next(
            (r.get("epsilon") for r in reversed(rows) if _num((r or {}).get("epsilon"))), None
        )
        stated = (p.get("epsilon") or {}).get("pld")
        if _num(last) and _num(stated) and not math.isclose(last, stated, rel_tol=1e-6):
            _contradict(
                found,
                f"metrics.jsonl's last round states ε = {last:.6g}, but privacy.epsilon.pld is "
                f"{stated:.6g}.",
            )
    # steps per round (sample level): what the configuration gives each client
    steps = p.get("steps_per_round") or {}
    rates = p.get("sample_rates") or {}
    if level == "sample" and isinstance(steps, dict) and isinstance(rates, dict):
        wrong = []
        for c, st in sorted(steps.items()):
            q = rates.get(c)
            if not _num(q) or not _num(st) or q <= 0:
                continue
            if cfg.get("local_epochs", 0) > 0:
                if q >= 1:
                    continue  # q = min(1, B/n) = 1 does not give n
                n = round(cfg["batch_size"] / q)
                want = max(1, math.ceil(cfg["local_epochs"] * n / cfg["batch_size"]))
            else:
                want = cfg.get("local_steps")
            if st != want:
                wrong.append(f"client {c}: {st} recorded, {want} configured")
        if wrong:
            _contradict(
                found,
                "privacy.steps_per_round disagrees with the configuration's local steps ("
                + "; ".join(wrong[:4])
                + (f"; and {len(wrong) - 4} more" if len(wrong) > 4 else "")
                + "); ε is recomputed from the configuration.",
            )
    return found

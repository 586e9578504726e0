"""Audit a run directory: recompute its ε from the recorded mechanism and check its files.

:func:`audit_run` recomputes ε twice, independently, and compares both with the ε the run
stores in ``manifest.json`` (``privacy.epsilon``):

(a) *ledger*: from the composed DP events the run recorded
    (``Ledger.from_state_dict(privacy.ledger).epsilon(...)``);
(b) *config*: from the configuration and the privacy block alone — σ, the clients' data
    sizes (counted in ``splits.json``), batch size and local steps (``config``), and the
    clients that actually took part in each round (``metrics.jsonl`` ``"clients"``).
    Sample level: per client c, ``steps_c × rounds_c`` Poisson-subsampled Gaussian steps at
    q_c = batch_size / n_c; ε = max over clients. Client level: ``releases × rounds``
    Gaussian releases, Poisson-subsampled at q = clients_per_round / total_clients when
    clients were Poisson-sampled, plain Gaussians otherwise.

The reported ε is the larger of (a) and (b) per accountant (PLD headline, RDP beside). A
stored ε below it by more than 1% is an understatement. The run's files are checked for
tampering (hashes, ledger copy) and for internal contradictions (σ = 0 with a finite ε, a
ledger with fewer events than the rounds and participants imply).

With ``one_run=True`` the run's canaries (``splits.json`` ``"canaries"``, inserted by
``fedlora train --canaries M``) are scored with the released adapter (score = −loss) and
:func:`audit.empirical.epsilon_one_run` gives an empirical lower bound on ε.

Release bundles (``RUN/release/``, ``fedlora export``; public manifest, no ``splits.json``,
``ledger.json`` or ``config.json``) are audited too: ε is recomputed from the public
ledger and configuration, and the checks that need operator files are listed in
``skipped`` with the reason.

Noise: a run whose noise was seeded from the public seed (``privacy.noise.source =
"seeded"``, or no ``privacy.noise`` block: runs made before keyed noise) gets the error
``noise_reproducible``: the noise can be regenerated and subtracted, so the stated ε does
not hold against anyone who knows or guesses the seed.

Trust and replay: the recomputations check that the stated ε follows from the stated
mechanism, not that the mechanism is the one that ran: a manifest edited consistently
(σ, ledger, ε, hashes) cannot be told from a real one. Without the key, ``trusted`` lists
what was taken on trust. With ``key`` (the run's ``private/noise.key``) the whole run is
retrained on the CPU from its configuration and key (:func:`fl.engine.train`): the
replayed adapter must equal the released one bit for bit (within
:data:`CUDA_RTOL` of each tensor's scale when the run was made on CUDA, whose kernels are
not bit-deterministic) and the replay's privacy block must equal the audited one;
otherwise ``replay_mismatch``.
"""

from __future__ import annotations

import math
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from audit.claims import UNDERSTATE_TOLERANCE
from fl import rundir
from fl.config import RUNTIME_FIELDS
from fl.errors import UsageError
from fl.io import file_sha256, read_json
from fl.privacy.accounting import (
    Event,
    Ledger,
    PrivacyError,
    client_level_event,
    epsilon_of_events,
)
from fl.rundir import SCHEMA_VERSION

__all__ = [
    "audit_run",
    "canary_scores",
    "compare_adapters",
    "TAMPER_CODES",
    "SCHEMA_VERSION",
    "CUDA_RTOL",
]

#: findings that mean the run's files contradict each other or the replay (exit code 1
#: in the CLI). ``noise_reproducible`` and ``key_mismatch`` are errors, not tampering.
TAMPER_CODES = (
    "adapter_hash_mismatch",
    "adapter_missing",
    "splits_hash_mismatch",
    "splits_missing",
    "ledger_file_mismatch",
    "config_file_mismatch",
    "noise_not_applied",
    "ledger_incomplete",
    "sigma_mismatch",
    "sample_rate_mismatch",
    "replay_mismatch",
)
_ACCS = ("pld", "rdp")

#: Replay tolerance for runs made on CUDA (the replay runs on the CPU): every tensor of
#: the replayed adapter must lie within CUDA_RTOL × (the released tensor's largest
#: magnitude) of the released one. GPU kernels (cuBLAS reductions, atomics in backward
#: passes) are not bit-deterministic and round differently from the CPU's; a run's
#: float32 rounding differences are ~1e-7 per operation and grow over the steps, but the
#: DP noise, the batches and the cohorts are the same draws (from the key), so an honest
#: replay is expected to stay well below 1e-4 (not yet measured on a GPU), while a different σ, C, sampling or data
#: changes the noisy updates at their own scale (≥ 1e-2 relative for a material
#: change; a relative σ edit below ~1e-4 could pass, with a negligible effect on ε).
#: CPU-made runs are compared bit for bit.
CUDA_RTOL = 1e-4
#: config fields that do not change results (a replay forces device=cpu, progress off):
#: fl.config.RUNTIME_FIELDS, the field metadata's one list
_RUNTIME_FIELDS = RUNTIME_FIELDS
#: privacy-block fields a replay must reproduce
_REPLAY_PRIVACY_FIELDS = (
    "level",
    "noise_multiplier",
    "clipping_norm",
    "delta",
    "target_epsilon",
    "sample_rates",
    "steps_per_round",
    "client_sampling",
    "rounds_completed",
    "epsilon",
    "ledger",
)
_TRUSTED_NOTE = (
    "Without the run's noise key these fields are taken on trust: the audit checks that the "
    "stated ε follows from them, not that they describe what ran; a manifest edited "
    "consistently (σ, ledger, ε, hashes) cannot be told from a real one. `fedlora audit "
    "RUN --key RUN/private/noise.key` retrains the run and verifies them."
)


# --------------------------------------------------------------------------- reading


def _need(d: dict, key: str, where: str, types=None):
    if not isinstance(d, dict) or key not in d:
        raise UsageError(f"manifest.json: missing field {where}{key!r}")
    v = d[key]
    if types is not None and (
        isinstance(v, bool) and bool not in types or not isinstance(v, types)
    ):
        raise UsageError(
            f"manifest.json: field {where}{key!r} has type {type(v).__name__}, "
            f"expected {' or '.join(t.__name__ for t in types)}"
        )
    return v


def _read_manifest(run: Path) -> dict:
    m = rundir.read_manifest(run, check_schema=True)
    _need(m, "method", "", (str,))
    cfg = _need(m, "config", "", (dict,))
    for k in ("batch_size", "local_steps", "seed", "members", "clients"):
        _need(cfg, k, "config.", (int,))
    _need(cfg, "local_epochs", "config.", (int, float))
    p = _need(m, "privacy", "", (dict,))
    level = _need(p, "level", "privacy.", (str,))
    if level not in ("sample", "client", "none"):
        raise UsageError(f"manifest.json: privacy.level must be sample|client|none, got {level!r}")
    if level != "none":
        _need(p, "noise_multiplier", "privacy.", (int, float))
        _need(p, "delta", "privacy.", (int, float))
        _need(p, "epsilon", "privacy.", (dict,))
        _need(p, "ledger", "privacy.", (dict,))
        _need(p, "rounds", "privacy.", (int,))
        cs = _need(p, "client_sampling", "privacy.", (dict,))
        for k in ("scheme", "clients_per_round", "total_clients"):
            _need(cs, k, "privacy.client_sampling.")
    return m


def _read_metrics(run: Path) -> list[dict] | None:
    return rundir.read_metrics(run, strict=True)


# --------------------------------------------------------------------------- recomputation


def _local_steps(cfg: dict, n: int) -> int:
    """Local DP-SGD steps of a client with n records per round (as fl.engine does)."""
    if cfg["local_epochs"] > 0:
        return max(1, math.ceil(cfg["local_epochs"] * n / cfg["batch_size"]))
    return cfg["local_steps"]


def _client_releases(method: str, cfg: dict) -> int | None:
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


def _eps_pair(events: list[Event], delta: float) -> dict:
    return {a: epsilon_of_events(events, delta, a) for a in _ACCS}


def _fmt(x) -> str:
    if x is None:
        return "none"
    return "inf" if math.isinf(x) else f"{x:.4g}"


# --------------------------------------------------------------------------- audit


def audit_run(
    run_dir,
    one_run: bool = False,
    alpha: float = 0.05,
    key: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Audit one run directory or release bundle.

    Args:
        run_dir: a finished run directory or a release bundle (see docs/run_directory.md).
        one_run: also compute the one-run empirical lower bound from the run's canaries
            (run directories only: a bundle carries no canaries).
        alpha: confidence level 1 − alpha of the empirical bound.
        key: the run's noise key file (``RUN/private/noise.key``): replay the whole run on
            the CPU and compare it with the release (see the module docstring).
        log: called with progress lines (the replay's announcement); None = silent.

    Returns:
        ``{"run_dir", "kind" ("run" | "bundle"), "method", "level", "claimed_epsilon"
        (stored PLD ε), "delta", "epsilon_pld", "epsilon_rdp" (max of the ledger and config
        recomputations), "understated", "tampered", "ratio", "stored", "recomputed":
        {"ledger", "config"}, "findings": [{"code", "severity", "message"}], "skipped":
        [{"check", "reason"}], "trusted": [field, ...], "trusted_note", "replay" (None, or
        {"verified", "performed", "max_abs_diff", "seconds", ...}), "one_run" (when
        asked)}``; ε in nats.

    Raises:
        UsageError: not a run directory or bundle, unreadable or malformed manifest (naming
        the field), ``one_run`` on a bundle, ``key`` for a run without keyed noise.
    """
    run = Path(run_dir)
    m = _read_manifest(run)
    bundle = rundir.is_release(m)
    cfg, p = m["config"], m["privacy"]
    level = p["level"]
    findings: list[dict] = []
    skipped: list[dict] = []

    def add(code: str, severity: str, message: str) -> None:
        findings.append({"code": code, "severity": severity, "message": message})

    def skip(check: str, reason: str) -> None:
        skipped.append({"check": check, "reason": reason})

    if one_run and bundle:
        raise UsageError(
            f"{run} is a release bundle: it carries no canaries (they are listed in the "
            "operator's splits.json); audit the run directory for --one-run"
        )
    _check_files(run, m, add, skip, bundle)
    splits = None if bundle else _read_splits(run)
    rows = _read_metrics(run)
    out: dict = {
        "run_dir": str(run),
        "kind": "bundle" if bundle else "run",
        "method": m["method"],
        "level": level,
        "claimed_epsilon": None,
        "delta": p.get("delta"),
        "epsilon_pld": None,
        "epsilon_rdp": None,
        "understated": False,
        "tampered": False,
        "ratio": None,
        "stored": None,
        "recomputed": None,
        "findings": findings,
        "skipped": skipped,
        "trusted": [],
        "trusted_note": None,
        "replay": None,
    }
    if level == "none":
        add("no_dp", "info", "The run claims no differential privacy (privacy.level = none).")
    else:
        _check_noise(m, add)
        _audit_privacy(run, m, cfg, p, splits, rows, out, add, skip, bundle)
    if one_run:
        out["one_run"] = _one_run(run, m, splits, alpha, out, add)
    if key is not None:
        out["replay"] = _replay(run, m, bundle, Path(key), add, log)
    if not (out["replay"] or {}).get("performed"):
        out["trusted"] = _trusted_fields(level, bundle)
        out["trusted_note"] = _TRUSTED_NOTE
    out["tampered"] = any(f["code"] in TAMPER_CODES for f in findings)
    return out


def _trusted_fields(level: str, bundle: bool) -> list[str]:
    """What an audit without the key takes on trust (see _TRUSTED_NOTE)."""
    fields = ["config"]
    if level != "none":
        fields += [
            "privacy.noise_multiplier",
            "privacy.clipping_norm",
            "privacy.delta",
            "privacy.ledger.events",
            "privacy.sampling",
            "privacy.sample_rates",
            "privacy.client_sampling",
            "privacy.noise",
        ]
        if bundle:
            fields.append("privacy.steps_per_round")
        else:
            fields += ["splits.json (client sizes)", "metrics.jsonl (clients per round)"]
    fields.append("adapter (that the stated configuration produced it)")
    return fields


def _check_noise(m: dict, add) -> None:
    """``noise_reproducible``: DP noise drawn from the public seed."""
    noise = m["privacy"].get("noise")
    seed = (m.get("seeds") or {}).get("seed", (m.get("config") or {}).get("seed"))
    consequence = (
        "anyone who knows or guesses the seed can regenerate every noise draw (and the Poisson "
        "batches and client cohorts) and subtract the noise from the released adapter, so the "
        "stated ε does not hold against them"
    )
    if noise is None:
        add(
            "noise_reproducible",
            "error",
            "The manifest has no privacy.noise block: the run was made before DP noise was "
            f"drawn from a secret key, when it was seeded from the public seed ({seed}); "
            f"{consequence}. Retrain it with the current version.",
        )
    elif not isinstance(noise, dict):
        raise UsageError("manifest.json: field privacy.'noise' must be an object")
    elif noise.get("source") != "keyed_csprng" or noise.get("private") is not True:
        add(
            "noise_reproducible",
            "error",
            f"privacy.noise.source is {noise.get('source')!r} (private: "
            f"{noise.get('private')!r}): the noise was seeded from the public seed ({seed}, "
            f"--insecure-deterministic-noise); {consequence}.",
        )


def _read_splits(run: Path) -> dict | None:
    return rundir.read_splits(run)


def _check_files(run: Path, m: dict, add, skip, bundle: bool) -> None:
    """Tampering: hashes of the adapter and splits, the ledger and config copies."""
    adapter = run / rundir.ADAPTER / rundir.ADAPTER_WEIGHTS
    want = m.get("adapter_sha256")
    if not adapter.is_file():
        add("adapter_missing", "error", f"The released adapter {adapter} is missing.")
    elif want is None:
        add("adapter_hash_mismatch", "error", "manifest.json records no adapter_sha256.")
    else:
        got = file_sha256(adapter)
        if got != want:
            add(
                "adapter_hash_mismatch",
                "error",
                f"adapter/adapter_model.safetensors has sha256 {got[:16]}…, but the manifest "
                f"records {str(want)[:16]}…: the released adapter is not the one the run wrote.",
            )
    if bundle:
        skip(
            "splits_hash",
            "needs splits.json and data.splits_sha256 (operator-only: member ids)",
        )
        skip("ledger_file", "needs ledger.json (the operator's copy of the ledger)")
        skip(
            "config_file", "needs config.json (the operator's copy); the manifest's config is used"
        )
        return
    splits = run / rundir.SPLITS
    want = (m.get("data") or {}).get("splits_sha256")
    if not splits.is_file():
        add("splits_missing", "error", f"{splits} is missing.")
    elif want is not None and file_sha256(splits) != want:
        add(
            "splits_hash_mismatch",
            "error",
            f"splits.json has sha256 {file_sha256(splits)[:16]}…, but the manifest records "
            f"{str(want)[:16]}…: the membership record was changed after the run.",
        )
    ledger_file = run / rundir.LEDGER
    if ledger_file.is_file() and m.get("privacy", {}).get("ledger") is not None:
        if read_json(ledger_file) != m["privacy"]["ledger"]:
            add(
                "ledger_file_mismatch",
                "error",
                "ledger.json differs from the ledger embedded in manifest.json.",
            )
    saved = rundir.read_config(run)
    if saved is not None:
        cfg = m["config"]
        diff = sorted(
            k
            for k in set(saved) | set(cfg)
            if k not in _RUNTIME_FIELDS and saved.get(k, _ABSENT) != cfg.get(k, _ABSENT)
        )
        if diff:
            add(
                "config_file_mismatch",
                "error",
                f"config.json differs from the manifest's config in {', '.join(diff)}.",
            )


_ABSENT = object()


def _bundle_units(cfg: dict, p: dict, ledger: Ledger, skip) -> tuple[dict, dict, int]:
    """A bundle's per-client (q, steps) and participation, from the public manifest.

    The member ids (``splits.json``) and the sampled cohorts (``metrics.jsonl``) are the
    operator's; the bundle has the sampling rates q_c = B / n_c, the steps per round and
    the ledger, which records which units took part in which round."""
    rates = p.get("sample_rates") or {}
    steps = p.get("steps_per_round") or {}
    units: dict[str, tuple[float, int]] = {}
    for c, q in rates.items():
        q = float(q)
        if not 0.0 < q <= 1.0:
            raise UsageError(f"manifest.json: privacy.sample_rates.{c} must be in (0, 1], got {q}")
        n = cfg["batch_size"] / q
        st = steps.get(c)
        units[str(c)] = (q, int(st) if isinstance(st, int) else _local_steps(cfg, round(n)))
    rounds_of: dict[str, set] = {}
    for e in ledger.events:
        rounds_of.setdefault(e.unit, set()).add(e.round)
    participation = {c: len(rounds_of.get(f"client:{c}", ())) for c in units}
    active_rounds = len({r for rs in rounds_of.values() for r in rs})
    skip(
        "client_sizes",
        "client sizes are counted in splits.json (operator-only); the bundle's sampling rates "
        "q = batch / n are used as stated, so sample_rate_mismatch cannot be checked",
    )
    skip(
        "participation",
        "the clients sampled in each round are in the operator's metrics.jsonl; the bundle's "
        "participation is read from the ledger's events, so the config recomputation checks "
        "the ledger's step counts and σ, not which clients took part",
    )
    return units, participation, active_rounds


def _audit_privacy(run, m, cfg, p, splits, rows, out, add, skip, bundle) -> None:
    level = p["level"]
    sigma, delta = float(p["noise_multiplier"]), float(p["delta"])
    if not (0.0 < delta < 1.0):
        raise UsageError(f"manifest.json: privacy.delta must be in (0, 1), got {delta!r}")
    try:
        ledger = Ledger.from_state_dict(p["ledger"])
    except PrivacyError as exc:
        raise UsageError(f"manifest.json: privacy.ledger: {exc}") from None
    stored = {a: p["epsilon"].get(a) for a in _ACCS}
    ledger_eps = {a: ledger.epsilon(a) for a in _ACCS}

    # --- (b) independent recomputation from config + privacy block + metrics -------
    if bundle:
        units, participation, active_rounds = _bundle_units(cfg, p, ledger, skip)
    else:
        if rows is None:
            add(
                "metrics_missing",
                "warning",
                "metrics.jsonl is missing: every client is assumed to take part in every round.",
            )
        rounds_done = len(rows) if rows is not None else int(p.get("rounds_completed", p["rounds"]))
        if splits is not None and isinstance(splits.get("clients"), dict):
            # Sampling rates use the member count before canaries were added (canary
            # ids start with "canary:"), so they do not reveal secret inclusions.
            sizes = {
                str(c): sum(1 for i in ids if not str(i).startswith("canary:"))
                for c, ids in splits["clients"].items()
            }
        else:
            sizes = {str(c): int(n) for c, n in (p.get("client_sizes") or {}).items()}
            if not sizes:
                raise UsageError(
                    f"{run}: no client sizes (splits.json 'clients' nor privacy.client_sizes)"
                )
        participation = dict.fromkeys(sizes, 0)
        active_rounds = 0
        for i, row in enumerate(rows or [{"clients": list(sizes)}] * rounds_done):
            cl = row.get("clients")
            if not isinstance(cl, list):
                raise UsageError(f"metrics.jsonl: round line {i + 1} has no 'clients' list")
            active_rounds += bool(cl)
            for c in cl:
                if str(c) not in participation:
                    raise UsageError(f"metrics.jsonl: round {i + 1} names unknown client {c!r}")
                participation[str(c)] += 1
        rates = p.get("sample_rates") or {}
        units = {}
        for c, n in sorted(sizes.items()):
            q = min(1.0, cfg["batch_size"] / n)
            if level == "sample" and c in rates and abs(float(rates[c]) - q) > 1e-12:
                add(
                    "sample_rate_mismatch",
                    "error",
                    f"Client {c} holds {n} records, so its sampling rate is batch "
                    f"{cfg['batch_size']} / {n} = {q:.4g}, but the manifest records "
                    f"{float(rates[c]):.4g}.",
                )
            units[c] = (q, _local_steps(cfg, n))

    implied: dict[str, int] = {}  # accounting unit -> composed step count
    event_sigma = sigma  # the multiplier the ledger's events must carry
    cfg_events: list[Event] = []
    if level == "sample":
        per_unit_eps: list[dict] = []
        memo: dict[tuple, dict] = {}
        for c, (q, steps) in sorted(units.items()):
            count = steps * participation[c]
            implied[f"client:{c}"] = count
            if count:
                ev = Event(
                    "poisson_gaussian" if q < 1 else "gaussian",
                    sigma,
                    q,
                    count,
                    unit=f"client:{c}",
                )
                cfg_events.append(ev)
                key = (ev.kind, q, count)  # clients with equal mechanisms: one computation
                if key not in memo:
                    memo[key] = _eps_pair([ev], delta)
                per_unit_eps.append(memo[key])
        cfg_eps = {a: max((e[a] for e in per_unit_eps), default=0.0) for a in _ACCS}
        population, unit_name = int(cfg["members"]), "records"
    else:
        cs = p["client_sampling"]
        K = int(cs["total_clients"])
        m_cl = float(cs["clients_per_round"])
        # The engine's accounting of the cohort (fl.privacy.accounting.client_level_event):
        # Poisson with amplification; every client every round; or a fixed count drawn
        # without replacement, sensitivity 2C under add/remove (multiplier σ/2).
        if cs["scheme"] == "poisson":
            scheme = "poisson" if m_cl < K else "all"
        else:
            scheme = "uniform" if round(m_cl) < K else "all"
        releases = _client_releases(m["method"], cfg)
        if releases is None:
            by_round: dict[int, int] = {}
            for e in ledger.events:
                by_round[e.round] = by_round.get(e.round, 0) + e.count
            releases = max(by_round.values(), default=1)
            add(
                "releases_from_ledger",
                "warning",
                f"Method {m['method']!r} is unknown here; {releases} release(s) per round were "
                f"read from the ledger.",
            )
        # The server releases every round, an empty cohort included (skipping would
        # reveal that no client was sampled), so every completed round counts.
        done = int(p.get("rounds_completed", p["rounds"])) if bundle else rounds_done
        count = releases * done
        implied["federation"] = count
        m_eff = K if scheme == "all" else (round(m_cl) if scheme == "uniform" else m_cl)
        cfg_ev = client_level_event(scheme, m_eff, K, sigma, max(count, 0))
        event_sigma = cfg_ev.noise_multiplier
        if count:
            cfg_events.append(cfg_ev)
        cfg_eps = _eps_pair(cfg_events, delta)
        population, unit_name = K, "clients"

    # --- internal consistency ----------------------------------------------------
    cfg_sigma = cfg.get("noise_multiplier")
    if (
        not (cfg.get("epsilon") or 0) > 0
        and isinstance(cfg_sigma, int | float)
        and abs(float(cfg_sigma) - sigma) > 1e-12
    ):
        add(
            "sigma_mismatch",
            "error",
            f"The configuration sets σ = {cfg_sigma:g}, but the privacy block records "
            f"σ = {sigma:g}.",
        )
    ev_sigmas = sorted({e.noise_multiplier for e in ledger.events})
    if ev_sigmas and any(abs(s - event_sigma) > 1e-12 for s in ev_sigmas):
        add(
            "sigma_mismatch",
            "error",
            f"The ledger's events use σ = {', '.join(f'{s:g}' for s in ev_sigmas)}, but the "
            f"privacy block records σ = {sigma:g}"
            + (f" (events of multiplier {event_sigma:g} expected)" if event_sigma != sigma else "")
            + ".",
        )
    if (sigma == 0.0 or 0.0 in ev_sigmas) and any(
        isinstance(stored[a], int | float) and math.isfinite(stored[a]) for a in _ACCS
    ):
        add(
            "noise_not_applied",
            "error",
            f"A noise multiplier of 0 is recorded (privacy block σ = {sigma:g}; ledger σ "
            f"{', '.join(f'{s:g}' for s in ev_sigmas) or 'none'}) yet the run states a finite "
            f"ε = {_fmt(stored['pld'])}: without noise the release is not private (ε = inf).",
        )
    ledger_counts: dict[str, int] = {}
    for e in ledger.events:
        ledger_counts[e.unit] = ledger_counts.get(e.unit, 0) + e.count
    short = {
        u: (ledger_counts.get(u, 0), n) for u, n in implied.items() if ledger_counts.get(u, 0) < n
    }
    if short:
        desc = "; ".join(f"{u}: {have} of {need}" for u, (have, need) in sorted(short.items()))
        add(
            "ledger_incomplete",
            "error",
            f"The ledger records fewer DP steps than the rounds and participants imply ({desc}).",
        )
    extra = {u: n for u, n in ledger_counts.items() if n > implied.get(u, 0)}
    if extra:
        add(
            "ledger_extra_events",
            "info",
            "The ledger records more DP steps than one training call per round implies ("
            + "; ".join(f"{u}: {n} vs {implied.get(u, 0)}" for u, n in sorted(extra.items()))
            + "); they are included in the ledger ε.",
        )
    if delta >= 1.0 / population:
        add(
            "delta_too_large",
            "error",
            f"δ = {delta:g} is at least 1/n = {1.0 / population:.3g} (n = {population} "
            f"{unit_name}).",
        )

    # --- compare ----------------------------------------------------------------------
    recomputed = {a: max(ledger_eps[a], cfg_eps[a]) for a in _ACCS}
    understated = False
    for a in _ACCS:
        s = stored[a]
        if not isinstance(s, int | float):
            add(
                "epsilon_missing",
                "error",
                f"The run states no {a.upper()} ε (privacy.epsilon.{a}) for a DP run; it "
                f"recomputes to ε = {_fmt(recomputed[a])}.",
            )
            understated = True
        elif recomputed[a] > float(s) * (1.0 + UNDERSTATE_TOLERANCE):
            understated = True
            add(
                "epsilon_understated",
                "error",
                f"The run states ε = {_fmt(float(s))} ({a.upper()}), but its mechanism gives "
                f"ε = {_fmt(recomputed[a])} (ledger {_fmt(ledger_eps[a])}, config "
                f"{_fmt(cfg_eps[a])}) at δ = {delta:g}: understated by a factor "
                f"{recomputed[a] / float(s) if s else math.inf:.3g}.",
            )
    if cfg_eps["pld"] > ledger_eps["pld"] * (
        1 + UNDERSTATE_TOLERANCE
    ) and "ledger_incomplete" not in {f["code"] for f in out["findings"]}:
        add(
            "ledger_below_config",
            "warning",
            f"The configuration implies ε = {_fmt(cfg_eps['pld'])} (PLD), more than the ledger's "
            f"{_fmt(ledger_eps['pld'])}.",
        )
    s_pld = stored["pld"]
    out.update(
        claimed_epsilon=s_pld,
        delta=delta,
        epsilon_pld=recomputed["pld"],
        epsilon_rdp=recomputed["rdp"],
        understated=understated,
        ratio=(recomputed["pld"] / s_pld if isinstance(s_pld, int | float) and s_pld > 0 else None),
        stored=stored,
        recomputed={"ledger": ledger_eps, "config": cfg_eps},
        sigma=sigma,
    )


# --------------------------------------------------------------------------- replay


def _trained_device(run: Path, m: dict, bundle: bool) -> tuple[str, str]:
    """Where the run trained: ("cpu" | "cuda" | "unknown", how we know)."""

    def kind(dev) -> str | None:
        if not isinstance(dev, str):
            return None
        dev = dev.lower()
        return "cpu" if dev == "cpu" else "cuda" if dev.startswith("cuda") else None

    for where, dev in (
        ("manifest device", m.get("device")),
        ("manifest runtime.device", (m.get("runtime") or {}).get("device")),
    ):
        if kind(dev):
            return kind(dev), where
    if not bundle and (run / "run.log").is_file():
        # The engine's start line: "fedlora train: ... device=cpu"; the last one counts.
        found = re.findall(
            r"^fedlora train:.* device=(\S+)",
            (run / "run.log").read_text(encoding="utf-8", errors="replace"),
            re.M,
        )
        if found and kind(found[-1]):
            return kind(found[-1]), "run.log"
    dev = (m.get("config") or {}).get("device")
    if kind(dev):
        return kind(dev), f"config.device = {dev!r}"
    return "unknown", f"config.device = {dev!r} (the device the run used is not recorded)"


def compare_adapters(released: Path, replayed: Path, rtol: float = 0.0) -> dict:
    """Compare two ``adapter_model.safetensors`` tensor by tensor.

    Returns ``{"equal" (bit for bit), "within_tolerance" (every tensor's max |Δ| <=
    rtol × its largest released magnitude), "max_abs_diff", "max_rel_diff" (max over
    tensors of max |Δ| / scale), "worst_tensor", "problem" (names/shapes/dtypes that
    differ, or None)}``."""
    import torch
    from safetensors.torch import load_file

    try:
        a, b = load_file(str(released)), load_file(str(replayed))
    except Exception as exc:  # safetensors raises its own error types on corrupt files
        return {
            "equal": False,
            "within_tolerance": False,
            "max_abs_diff": None,
            "max_rel_diff": None,
            "worst_tensor": None,
            "problem": f"cannot read {released.name}: {exc}",
        }
    problem = None
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        problem = f"tensor names differ (released only: {only_a[:3]}, replay only: {only_b[:3]})"
    equal, within = problem is None, problem is None
    worst, max_abs, max_rel = None, 0.0, 0.0
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            problem = problem or (
                f"tensor {k}: released {list(x.shape)} {x.dtype}, replay {list(y.shape)} {y.dtype}"
            )
            equal = within = False
            continue
        if torch.equal(x, y):
            continue
        equal = False
        d = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
        scale = x.double().abs().max().item() if x.numel() else 0.0
        rel = d / scale if scale > 0 else math.inf
        if not (rel <= rtol):  # NaN-safe
            within = False
        if worst is None or not (d <= max_abs):
            worst, max_abs = k, d
        max_rel = rel if not (rel <= max_rel) else max_rel
    return {
        "equal": equal,
        "within_tolerance": within,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "worst_tensor": worst,
        "problem": problem,
    }


def _diff_paths(a, b, path: str, out: list[str], rel: float = 1e-9) -> None:
    """Paths where two JSON values differ (floats within ``rel`` count as equal)."""
    num = (int, float)
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}")
            else:
                _diff_paths(a[k], b[k], f"{path}.{k}", out, rel)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path} ({len(b)} entries in the replay, {len(a)} audited)")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_paths(x, y, f"{path}[{i}]", out, rel)
    elif isinstance(a, num) and isinstance(b, num) and not isinstance(a, bool):
        if isinstance(b, bool) or not math.isclose(float(a), float(b), rel_tol=rel, abs_tol=0.0):
            out.append(path)
    elif a != b:
        out.append(path)


def _get_path(d, path: str):
    for part in re.findall(r"[^.\[\]]+", path.split(" ", 1)[0]):
        if isinstance(d, list) and part.isdigit() and int(part) < len(d):
            d = d[int(part)]
        elif isinstance(d, dict) and part in d:
            d = d[part]
        else:
            return None
    return d


def _replay(run: Path, m: dict, bundle: bool, key_path: Path, add, log) -> dict:
    """Retrain the run from its configuration and key on the CPU; compare with the
    release (adapter bit for bit, privacy block field by field)."""
    from fl.config import TrainConfig
    from fl.engine import train
    from fl.privacy.rng import NoiseKey

    noise = m["privacy"].get("noise")
    if not isinstance(noise, dict) or noise.get("source") != "keyed_csprng":
        src = noise.get("source") if isinstance(noise, dict) else None
        raise UsageError(
            f"{run}: its noise was not drawn from a key (privacy.noise.source = {src!r}); there "
            "is no key to replay with (see the noise_reproducible finding)"
        )
    key = NoiseKey.read(key_path)
    if key.key_id != noise.get("key_id"):
        add(
            "key_mismatch",
            "error",
            f"{key_path} has key id {key.key_id}, but the run's manifest records "
            f"privacy.noise.key_id = {noise.get('key_id')!r}: it is not this run's key (or the "
            "manifest's key id was changed); nothing was replayed.",
        )
        return {"performed": False, "verified": False, "reason": "key_mismatch"}
    if bundle:
        cfg_dict, cfg_src = m["config"], "the manifest's config"
    elif (run / rundir.CONFIG).is_file():
        cfg_dict, cfg_src = read_json(run / rundir.CONFIG), "config.json"
    else:
        cfg_dict, cfg_src = m["config"], "the manifest's config (config.json is missing)"
    if not isinstance(cfg_dict, dict):
        raise UsageError(f"{run}: {cfg_src} must be a JSON object")
    cfg = TrainConfig.from_dict(cfg_dict)
    cfg.device, cfg.progress = "cpu", False  # neither changes the results
    trained_on, how = _trained_device(run, m, bundle)
    rtol = 0.0 if trained_on == "cpu" else CUDA_RTOL
    say = log or (lambda line: None)
    say(
        f"replay: retraining the whole run on the CPU from {cfg_src} and the key "
        f"({cfg.method}, {cfg.rounds} rounds, {cfg.clients} clients, model {cfg.model}); this "
        "takes about as long as the original training on a CPU"
    )
    if rtol:
        say(
            f"replay: the run was made on {'CUDA' if trained_on == 'cuda' else 'an unrecorded device'}"
            f" ({how}); the replay runs on the CPU and compares within {rtol:g} of each tensor's "
            "scale (GPU kernels are not bit-deterministic)"
        )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedlora-replay-") as tmp:
        try:
            train(cfg, Path(tmp) / "replay", quiet=True, noise_key=key)
        except UsageError as exc:
            raise UsageError(f"replay of {run} failed: {exc}") from None
        seconds = time.perf_counter() - t0
        rm = read_json(Path(tmp) / "replay" / "manifest.json")
        released = run / "adapter" / "adapter_model.safetensors"
        if released.is_file():
            cmp = compare_adapters(
                released, Path(tmp) / "replay" / "adapter" / "adapter_model.safetensors", rtol
            )
        else:
            cmp = {
                "equal": False,
                "within_tolerance": False,
                "max_abs_diff": None,
                "max_rel_diff": None,
                "worst_tensor": None,
                "problem": "the released adapter is missing",
            }
    adapter_ok = cmp["equal"] or (rtol > 0 and cmp["within_tolerance"])
    if not adapter_ok:
        if cmp["problem"]:
            what = cmp["problem"]
        else:
            what = (
                f"largest difference {cmp['max_abs_diff']:.3g} in {cmp['worst_tensor']} "
                f"({cmp['max_rel_diff']:.3g} of its scale"
                + (f"; tolerance {rtol:g}" if rtol else "; a CPU-made run replays bit for bit")
                + ")"
            )
        add(
            "replay_mismatch",
            "error",
            "Retrained from the stated configuration and the run's key, the run gives an "
            f"adapter that differs from the released one ({what}): the release was not made "
            "by the stated mechanism (σ, C, sampling, data or method differ), so the stated ε "
            "is not established.",
        )
    elif not cmp["equal"]:
        add(
            "replay_inexact",
            "info",
            f"The replay matches within the tolerance {rtol:g} (largest difference "
            f"{cmp['max_abs_diff']:.3g} in {cmp['worst_tensor']}), not bit for bit: the run "
            f"was made on {'CUDA' if trained_on == 'cuda' else 'an unrecorded device'} ({how}).",
        )
    diffs: list[str] = []
    mine, theirs = m["privacy"], rm.get("privacy") or {}
    for f in _REPLAY_PRIVACY_FIELDS:
        if f in mine or f in theirs:
            _diff_paths(mine.get(f), theirs.get(f), f"privacy.{f}", diffs)
    if diffs:
        shown = []
        for d in diffs[:6]:
            a, b = _get_path({"privacy": mine}, d), _get_path({"privacy": theirs}, d)
            scalar = not isinstance(a, dict | list) and not isinstance(b, dict | list)
            shown.append(f"{d} (audited {a!r}, replay {b!r})" if scalar else d)
        more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
        add(
            "replay_mismatch",
            "error",
            "The replay's privacy block differs from the audited manifest's in "
            f"{'; '.join(shown)}{more}: the stated mechanism or its accounting is not the one "
            "the configuration and key produce.",
        )
    return {
        "performed": True,
        "verified": bool(adapter_ok and not diffs),
        "exact": bool(cmp["equal"]),
        "max_abs_diff": cmp["max_abs_diff"],
        "max_rel_diff": cmp["max_rel_diff"],
        "worst_tensor": cmp["worst_tensor"],
        "tolerance": rtol,
        "trained_on": trained_on,
        "replayed_on": "cpu",
        "config_source": cfg_src,
        "privacy_fields_differing": diffs,
        "seconds": seconds,
    }


# --------------------------------------------------------------------------- one-run audit


def canary_scores(run_dir, texts: list[str], labels: list[int], batch_size: int = 64) -> np.ndarray:
    """Membership scores −loss (nats) of ``texts``/``labels`` under the run's released model.

    Loads the base model (same name and seed as the run), the released PEFT adapter
    (LoRA factors + head) and returns the per-example cross-entropy negated, shape (n,).
    """
    import torch

    from fl.engine import TokenizedData
    from fl.models import load_base_model, load_tokenizer

    run = Path(run_dir)
    m = _read_manifest(run)
    cfg = m["config"]
    num_labels = (m.get("data") or {}).get("num_classes")
    if not isinstance(num_labels, int):
        raise UsageError("manifest.json: missing field data.'num_classes'")
    try:  # the attacks package's signals (shared loader, shape checks) when present
        from attacks.signals import adapter_signals
    except ImportError:
        adapter_signals = None
    if adapter_signals is not None:
        sig = adapter_signals(
            run / "adapter",
            cfg["model"],
            list(texts),
            np.asarray(labels, dtype=np.int64),
            int(cfg.get("max_length", 64)),
            device="cpu",
            seed=cfg["seed"],
            num_labels=num_labels,
            batch_size=batch_size,
            progress=False,
        )
        return -np.asarray(sig.loss, dtype=np.float64)
    from peft import PeftModel

    net = load_base_model(cfg["model"], num_labels, seed=cfg["seed"])
    try:
        model = PeftModel.from_pretrained(net, str(run / "adapter"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot load the adapter of {run}: {exc}") from None
    model.eval()
    data = TokenizedData(
        list(texts),
        np.asarray(labels, dtype=np.int64),
        load_tokenizer(cfg["model"]),
        int(cfg.get("max_length", 64)),
    )
    losses = []
    with torch.no_grad():
        for s in range(0, len(data), batch_size):
            batch = data.batch(torch.arange(s, min(len(data), s + batch_size)), torch.device("cpu"))
            y = batch.pop("labels")
            logits = model(**batch).logits.float()
            losses.append(torch.nn.functional.cross_entropy(logits, y, reduction="none"))
    return -torch.cat(losses).numpy().astype(np.float64)


def _one_run(run: Path, m: dict, splits: dict | None, alpha: float, out: dict, add) -> dict:
    from audit.empirical import epsilon_one_run

    canaries = (splits or {}).get("canaries")
    if not canaries:
        raise UsageError(
            f"{run} has no canaries in splits.json; train with `fedlora train --canaries M`"
        )
    for i, c in enumerate(canaries):
        for k in ("text", "label", "included"):
            if not isinstance(c, dict) or k not in c:
                raise UsageError(f"splits.json: canary {i} is missing field {k!r}")
    delta = out["delta"] if out["delta"] else float(m["privacy"].get("delta") or 1e-5)
    scores = canary_scores(run, [c["text"] for c in canaries], [int(c["label"]) for c in canaries])
    included = np.array([bool(c["included"]) for c in canaries])
    res = epsilon_one_run(scores, included, delta, alpha=alpha)
    res = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in res.items()}
    res["score"] = "-loss (nats) under the released adapter"
    res["n_included"] = int(included.sum())
    eps_claim = out.get("epsilon_pld")
    if isinstance(eps_claim, int | float) and res["epsilon_lb"] > eps_claim:
        add(
            "empirical_exceeds_claim",
            "error",
            f"The one-run audit bounds ε >= {res['epsilon_lb']:.3g} with confidence "
            f"{1 - alpha:g} from {len(canaries)} canaries, above the recomputed ε = "
            f"{eps_claim:.4g}: the mechanism leaks more than its accounting allows.",
        )
    return res

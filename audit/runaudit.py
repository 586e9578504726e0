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
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from audit.claims import UNDERSTATE_TOLERANCE
from fl.errors import UsageError
from fl.io import file_sha256, read_json
from fl.privacy.accounting import Event, Ledger, PrivacyError, epsilon_of_events

__all__ = ["audit_run", "canary_scores", "TAMPER_CODES", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1
#: findings that mean the run's files contradict each other (exit code 1 in the CLI)
TAMPER_CODES = (
    "adapter_hash_mismatch",
    "adapter_missing",
    "splits_hash_mismatch",
    "splits_missing",
    "ledger_file_mismatch",
    "noise_not_applied",
    "ledger_incomplete",
    "sigma_mismatch",
    "sample_rate_mismatch",
)
_ACCS = ("pld", "rdp")


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
    if not run.is_dir():
        raise UsageError(f"run directory not found: {run}")
    path = run / "manifest.json"
    if not path.is_file():
        raise UsageError(f"{run} has no manifest.json (not a finished run directory)")
    m = read_json(path)
    if not isinstance(m, dict):
        raise UsageError(f"{path}: must hold a JSON object")
    ver = m.get("schema_version")
    if ver != SCHEMA_VERSION:
        raise UsageError(f"{path}: unsupported schema_version {ver!r} (expected {SCHEMA_VERSION})")
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
    path = run / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise UsageError(f"{path}: line {i} is not valid JSON") from None
        if not isinstance(row, dict):
            raise UsageError(f"{path}: line {i} is not a JSON object")
        rows.append(row)
    return rows


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


def audit_run(run_dir, one_run: bool = False, alpha: float = 0.05) -> dict:
    """Audit one run directory.

    Args:
        run_dir: a finished run directory (see docs/run_directory.md).
        one_run: also compute the one-run empirical lower bound from the run's canaries.
        alpha: confidence level 1 − alpha of the empirical bound.

    Returns:
        ``{"run_dir", "method", "level", "claimed_epsilon" (stored PLD ε), "delta",
        "epsilon_pld", "epsilon_rdp" (max of the ledger and config recomputations),
        "understated", "tampered", "ratio", "stored", "recomputed": {"ledger", "config"},
        "findings": [{"code", "severity", "message"}], "one_run" (when asked)}``; ε in nats.

    Raises:
        UsageError: not a run directory, unreadable or malformed manifest (naming the field).
    """
    run = Path(run_dir)
    m = _read_manifest(run)
    cfg, p = m["config"], m["privacy"]
    level = p["level"]
    findings: list[dict] = []

    def add(code: str, severity: str, message: str) -> None:
        findings.append({"code": code, "severity": severity, "message": message})

    _check_files(run, m, add)
    splits = _read_splits(run)
    rows = _read_metrics(run)
    out: dict = {
        "run_dir": str(run),
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
    }
    if level == "none":
        add("no_dp", "info", "The run claims no differential privacy (privacy.level = none).")
    else:
        _audit_privacy(run, m, cfg, p, splits, rows, out, add)
    if one_run:
        out["one_run"] = _one_run(run, m, splits, alpha, out, add)
    out["tampered"] = any(f["code"] in TAMPER_CODES for f in findings)
    return out


def _read_splits(run: Path) -> dict | None:
    path = run / "splits.json"
    if not path.is_file():
        return None
    d = read_json(path)
    if not isinstance(d, dict):
        raise UsageError(f"{path}: must hold a JSON object")
    return d


def _check_files(run: Path, m: dict, add) -> None:
    """Tampering: hashes of the adapter and splits, the ledger copy."""
    adapter = run / "adapter" / "adapter_model.safetensors"
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
    splits = run / "splits.json"
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
    ledger_file = run / "ledger.json"
    if ledger_file.is_file() and m.get("privacy", {}).get("ledger") is not None:
        if read_json(ledger_file) != m["privacy"]["ledger"]:
            add(
                "ledger_file_mismatch",
                "error",
                "ledger.json differs from the ledger embedded in manifest.json.",
            )


def _audit_privacy(run, m, cfg, p, splits, rows, out, add) -> None:
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
    if rows is None:
        add(
            "metrics_missing",
            "warning",
            "metrics.jsonl is missing: every client is assumed to take part in every round.",
        )
    rounds_done = len(rows) if rows is not None else int(p.get("rounds_completed", p["rounds"]))
    if splits is not None and isinstance(splits.get("clients"), dict):
        sizes = {str(c): len(ids) for c, ids in splits["clients"].items()}
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

    implied: dict[str, int] = {}  # accounting unit -> composed step count
    cfg_events: list[Event] = []
    if level == "sample":
        rates = p.get("sample_rates") or {}
        per_unit_eps: list[dict] = []
        memo: dict[tuple, dict] = {}
        for c, n in sorted(sizes.items()):
            q = min(1.0, cfg["batch_size"] / n)
            if c in rates and abs(float(rates[c]) - q) > 1e-12:
                add(
                    "sample_rate_mismatch",
                    "error",
                    f"Client {c} holds {n} records, so its sampling rate is batch {cfg['batch_size']}"
                    f" / {n} = {q:.4g}, but the manifest records {float(rates[c]):.4g}.",
                )
            count = _local_steps(cfg, n) * participation[c]
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
        q = float(cs["clients_per_round"]) / K if cs["scheme"] == "poisson" else 1.0
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
        count = releases * active_rounds
        implied["federation"] = count
        if count:
            cfg_events.append(
                Event(
                    "poisson_gaussian" if q < 1 else "gaussian",
                    sigma,
                    q if q < 1 else 1.0,
                    count,
                    unit="federation",
                )
            )
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
    if ev_sigmas and any(abs(s - sigma) > 1e-12 for s in ev_sigmas):
        add(
            "sigma_mismatch",
            "error",
            f"The ledger's events use σ = {', '.join(f'{s:g}' for s in ev_sigmas)}, but the "
            f"privacy block records σ = {sigma:g}.",
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

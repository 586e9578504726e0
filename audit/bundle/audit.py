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
:func:`audit.bounds.one_run.epsilon_one_run` gives an empirical lower bound on ε.

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
retrained on the CPU from its configuration and key (:func:`fl.run.engine.train`): the
replayed adapter must equal the released one bit for bit (within
:data:`CUDA_RTOL` of each tensor's scale when the run was made on CUDA, whose kernels are
not bit-deterministic) and the replay's privacy block must equal the audited one;
otherwise ``replay_mismatch``.

Modules: the recomputation and its consistency checks are :mod:`audit.bundle.recompute`, the
replay :mod:`audit.bundle.replay`, the finding codes :mod:`audit.findings`; this module reads
the run, checks its files and noise source, and runs the one-run canary audit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from audit.bundle.crosscheck import cross_check
from audit.bundle.one_run import one_run_audit
from audit.bundle.reading import read_manifest, read_metrics
from audit.bundle.recompute import audit_privacy
from audit.bundle.replay import CUDA_RTOL, compare_adapters, replay
from audit.findings import TAMPER_CODES, Code, Finding, Findings
from audit.records import Record
from fl.errors import UsageError
from fl.io import file_sha256, read_json
from fl.run import rundir
from fl.run.config import RUNTIME_FIELDS
from fl.run.integrity import check_files
from fl.run.rundir import SCHEMA_VERSION

__all__ = [
    "audit_run",
    "RunAudit",
    "flag_shared_keys",
    "compare_adapters",
    "TAMPER_CODES",
    "SCHEMA_VERSION",
    "CUDA_RTOL",
]


_TRUSTED_NOTE = (
    "Without the run's noise key these fields are taken on trust: the audit checks that the "
    "stated ε follows from them, not that they describe what ran; a manifest edited "
    "consistently (σ, ledger, ε, hashes) cannot be told from a real one. `fedlora audit "
    "RUN --key RUN/private/noise.key` retrains the run and verifies them."
)


# --------------------------------------------------------------------------- audit


@dataclass(frozen=True, kw_only=True, eq=False)
class RunAudit(Record):
    """The result of :func:`audit_run`: one run directory's or release bundle's audit (a
    read-only dict too, see :mod:`audit.records`; ``fedlora audit RUN --json`` writes it).
    ε in nats."""

    optional_keys: ClassVar[frozenset[str]] = frozenset({"sigma", "one_run"})

    #: the audited folder
    run_dir: str
    #: ``"run"`` (a run directory) or ``"bundle"`` (a release bundle)
    kind: str
    method: str
    #: ``"sample"``, ``"client"`` or ``"none"``
    level: str
    #: the ε the manifest stores (PLD)
    claimed_epsilon: float | None
    delta: float | None
    #: ε recomputed by each accountant: the larger of the ledger's and the config's
    epsilon_pld: float | None
    epsilon_rdp: float | None
    #: the stored ε is below the recomputed one by more than 1%
    understated: bool
    #: a finding means tampering (:attr:`audit.findings.Code.tampering`)
    tampered: bool
    #: epsilon_pld / claimed_epsilon
    ratio: float | None
    #: the stored ε per accountant
    stored: dict | None
    #: ``{"ledger": {...}, "config": {...}}``: each recomputation per accountant
    recomputed: dict | None
    #: :class:`audit.findings.Finding` dicts ``{"code", "severity", "message"}``
    findings: list[dict]
    #: ``{"check", "reason"}`` of the checks that could not run
    skipped: list[dict]
    #: the fields taken on trust (no verified replay), and why
    trusted: list[str]
    trusted_note: str | None
    #: None, or ``{"verified", "performed", "max_abs_diff", "seconds", ...}`` (``key=``)
    replay: dict | None
    #: the run's noise key id
    key_id: str | None
    #: the noise multiplier σ (DP runs only; not in the dict otherwise)
    sigma: float | None = None
    #: the one-run canary audit (``one_run=True`` only; not in the dict otherwise)
    one_run: dict | None = None
    adapter_sha256: str | None


def audit_run(
    run_dir,
    one_run: bool = False,
    alpha: float = 0.05,
    key: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> RunAudit:
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
        a :class:`RunAudit`, a read-only dict ``{"run_dir", "kind" ("run" | "bundle"),
        "method", "level", "claimed_epsilon" (stored PLD ε), "delta", "epsilon_pld",
        "epsilon_rdp" (max of the ledger and config recomputations), "understated",
        "tampered", "ratio", "stored", "recomputed": {"ledger", "config"}, "findings":
        [{"code", "severity", "message"}], "skipped": [{"check", "reason"}], "trusted":
        [field, ...], "trusted_note", "replay" (None, or {"verified", "performed",
        "max_abs_diff", "seconds", ...}), "key_id", "sigma" (DP runs), "one_run" (when
        asked), "adapter_sha256"}``; ε in nats.

    Raises:
        UsageError: not a run directory or bundle, unreadable or malformed manifest (naming
        the field), ``one_run`` on a bundle, ``key`` for a run without keyed noise.
    """
    run = Path(run_dir)
    m = read_manifest(run)
    bundle = rundir.is_release(m)
    level = m["privacy"]["level"]
    if one_run and bundle:
        raise UsageError(
            f"{run} is a release bundle: it carries no canaries (they are listed in the "
            "operator's splits.json); audit the run directory for --one-run"
        )
    findings = Findings()
    skipped: list[dict] = []
    _check_files(run, m, findings, skipped, bundle)
    splits = None if bundle else _read_splits(run)
    rows = read_metrics(run)
    out: dict = {
        "run_dir": str(run),
        "kind": "bundle" if bundle else "run",
        "method": m["method"],
        "level": level,
        "claimed_epsilon": None,
        "delta": m["privacy"].get("delta"),
        "epsilon_pld": None,
        "epsilon_rdp": None,
        "understated": False,
        "tampered": False,
        "ratio": None,
        "stored": None,
        "recomputed": None,
        "findings": [],
        "skipped": skipped,
        "trusted": [],
        "trusted_note": None,
        "replay": None,
        "key_id": _key_id(m),
    }
    for f in cross_check(m, rows, bundle):
        findings.add(f.code, f.message)
    if level == "none":
        findings.add(Code.NO_DP, "The run claims no differential privacy (privacy.level = none).")
    else:
        _check_noise(m, findings)
        pa = audit_privacy(run, m, splits, rows, bundle)
        findings += pa.findings
        skipped += pa.skipped
        out.update(pa.fields())
    if one_run:
        out["one_run"] = one_run_audit(run, m, splits, alpha, out, findings)
    if key is not None:
        out["replay"], more = replay(run, m, bundle, Path(key), log)
        findings += more
    if not (out["replay"] or {}).get("performed"):
        out["trusted"] = _trusted_fields(level, bundle, rows)
        out["trusted_note"] = _TRUSTED_NOTE
    out["adapter_sha256"] = m.get("adapter_sha256")
    out["tampered"] = any(f.tampering for f in findings)
    out["findings"] = findings.to_dicts()
    return RunAudit(**out)


def _key_id(m: dict) -> str | None:
    noise = (m.get("privacy") or {}).get("noise")
    kid = noise.get("key_id") if isinstance(noise, dict) else None
    return kid if isinstance(kid, str) else None


def flag_shared_keys(results: list[dict]) -> int:
    """Add a ``key_shared`` finding to every audit result (of :func:`audit_run`) whose
    noise key id another result in ``results`` also has, unless the two are the same
    release (equal adapter hashes: one bundle audited twice, or a bit-exact replay), and
    mark it tampered-free but failing (an error). Returns how many results were flagged.

    Two different releases made with one key share every noise draw: their difference
    cancels the noise, whatever each one's ε says."""
    by_key: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        if r.get("key_id"):
            by_key.setdefault(r["key_id"], []).append(i)
    flagged = 0
    for kid, idx in by_key.items():
        if len(idx) < 2:
            continue
        hashes = {results[i].get("adapter_sha256") for i in idx}
        if len(hashes) == 1 and None not in hashes:
            continue  # the same release, seen twice
        for i in idx:
            others = [results[j]["run_dir"] for j in idx if j != i]
            results[i]["findings"].append(
                Finding(
                    Code.KEY_SHARED,
                    f"Noise key {kid} is shared with {', '.join(others[:3])}"
                    + (f" and {len(others) - 3} more" if len(others) > 3 else "")
                    + ": releases made with one key share their noise draws, so the "
                    "difference of two of them cancels the noise; at most one of them may be "
                    "published.",
                ).to_dict()
            )
            flagged += 1
    return flagged


def _trusted_fields(level: str, bundle: bool, rows: list[dict] | None) -> list[str]:
    """What an audit without a verified replay takes on trust (see _TRUSTED_NOTE): every
    field of the manifest that no check ties to another copy. Without the key the
    manifest's MAC (``integrity.mac``) cannot be checked, so the manifest as a whole is
    trusted to be the one the run wrote; the entries say which of its fields decide ε or
    what a reader concludes."""
    fields = [
        "manifest.json as a whole (its integrity.mac needs the run key)",
        "config",
        "method, method_options, released",
        "model, client_ranks, seeds, device, versions, tool, tool_version, created",
        "data (dataset, label_names, n_nonmembers, n_test)",
        "metrics.final",
        "integrity.files (the hashes the released files are checked against)",
        "integrity.mac (checked with the key only)",
        "disclosed, visibility",
    ]
    if level != "none":
        fields += [
            "privacy.noise_multiplier",
            "privacy.client_noise_multipliers",
            "privacy.clipping_norm",
            "privacy.delta",
            "privacy.ledger.events",
            "privacy.sampling",
            "privacy.sample_rates",
            "privacy.client_sampling",
            "privacy.noise",
            "privacy.neighbouring",
            "privacy.mechanism, privacy.method_mechanism, privacy.participation_accounting, "
            "privacy.assumptions",
            "privacy.target_epsilon",
            "privacy.ledger.budget (a target; ε is recomputed from the events)",
        ]
        if level != "sample":
            fields.append("privacy.steps_per_round (not used at client level)")
        if rows is None:
            fields.append("privacy.rounds_completed (no metrics.jsonl to check it against)")
        if not bundle:
            fields += ["splits.json (client sizes)", "metrics.jsonl (clients per round)"]
        else:
            fields.append("metrics.jsonl (rounds and ε per round)")
    fields.append("adapter (that the stated configuration produced it)")
    return fields


def _check_noise(m: dict, findings: Findings) -> None:
    """``noise_reproducible``: DP noise drawn from the public seed."""
    noise = m["privacy"].get("noise")
    seed = (m.get("seeds") or {}).get("seed", (m.get("config") or {}).get("seed"))
    consequence = (
        "anyone who knows or guesses the seed can regenerate every noise draw (and the Poisson "
        "batches and client cohorts) and subtract the noise from the released adapter, so the "
        "stated ε does not hold against them"
    )
    if noise is None:
        findings.add(
            Code.NOISE_REPRODUCIBLE,
            "The manifest has no privacy.noise block: the run was made before DP noise was "
            f"drawn from a secret key, when it was seeded from the public seed ({seed}); "
            f"{consequence}. Retrain it with the current version.",
        )
    elif not isinstance(noise, dict):
        raise UsageError("manifest.json: field privacy.'noise' must be an object")
    elif noise.get("source") == "keyed_csprng" and isinstance(noise.get("reused_key"), dict):
        reuse = noise["reused_key"]
        findings.add(
            Code.KEY_REUSED,
            f"The run's noise key {reuse.get('key_id') or noise.get('key_id')} was made for "
            f"another configuration ({reuse.get('original_config_sha256') or 'unknown'}; this "
            f"run's is {reuse.get('config_sha256')}) and reused with --allow-key-reuse: this "
            "run and the key's first run share every noise draw, so their difference cancels "
            "the noise; the run is marked not private and its stated ε does not hold.",
        )
    elif noise.get("source") != "keyed_csprng" or noise.get("private") is not True:
        findings.add(
            Code.NOISE_REPRODUCIBLE,
            f"privacy.noise.source is {noise.get('source')!r} (private: "
            f"{noise.get('private')!r}): the noise was seeded from the public seed ({seed}, "
            f"--insecure-deterministic-noise); {consequence}.",
        )


def _read_splits(run: Path) -> dict | None:
    return rundir.read_splits(run)


def _check_files(run: Path, m: dict, findings: Findings, skipped: list, bundle: bool) -> None:
    """Tampering: hashes of the adapter and splits, the ledger and config copies."""
    adapter = run / rundir.ADAPTER / rundir.ADAPTER_WEIGHTS
    want = m.get("adapter_sha256")
    if not adapter.is_file():
        findings.add(Code.ADAPTER_MISSING, f"The released adapter {adapter} is missing.")
    elif want is None:
        findings.add(Code.ADAPTER_HASH_MISMATCH, "manifest.json records no adapter_sha256.")
    else:
        got = file_sha256(adapter)
        if got != want:
            findings.add(
                Code.ADAPTER_HASH_MISMATCH,
                f"adapter/adapter_model.safetensors has sha256 {got[:16]}…, but the manifest "
                f"records {str(want)[:16]}…: the released adapter is not the one the run wrote.",
            )
    if adapter.is_file():
        _check_adapter_values(adapter, findings)
    for name, what in check_files(run, m):
        findings.add(
            Code.SEALED_FILE_MISMATCH,
            f"{name} {what}: the manifest's integrity.files vouches for another file, so it "
            "was changed (or removed) after the run wrote its manifest.",
        )
    if not isinstance(m.get("integrity"), dict):
        findings.add(
            Code.MANIFEST_UNSEALED,
            "The manifest has no integrity block (file hashes and MAC): it was written before "
            "manifests were sealed, so adapter_config.json and metrics.jsonl are not tied to "
            "it, and no key can show that the manifest is the one the run wrote.",
        )
    if bundle:
        skipped += [
            {
                "check": "splits_hash",
                "reason": "needs splits.json and data.splits_sha256 (operator-only: member ids)",
            },
            {
                "check": "ledger_file",
                "reason": "needs ledger.json (the operator's copy of the ledger)",
            },
            {
                "check": "config_file",
                "reason": "needs config.json (the operator's copy); the manifest's config is used",
            },
        ]
        return
    splits = run / rundir.SPLITS
    want = (m.get("data") or {}).get("splits_sha256")
    if not splits.is_file():
        findings.add(Code.SPLITS_MISSING, f"{splits} is missing.")
    elif want is not None and file_sha256(splits) != want:
        findings.add(
            Code.SPLITS_HASH_MISMATCH,
            f"splits.json has sha256 {file_sha256(splits)[:16]}…, but the manifest records "
            f"{str(want)[:16]}…: the membership record was changed after the run.",
        )
    ledger_file = run / rundir.LEDGER
    if ledger_file.is_file() and m.get("privacy", {}).get("ledger") is not None:
        if read_json(ledger_file) != m["privacy"]["ledger"]:
            findings.add(
                Code.LEDGER_FILE_MISMATCH,
                "ledger.json differs from the ledger embedded in manifest.json.",
            )
    saved = rundir.read_config(run)
    if saved is not None:
        cfg = m["config"]
        diff = sorted(
            k
            for k in set(saved) | set(cfg)
            if k not in RUNTIME_FIELDS and saved.get(k, _ABSENT) != cfg.get(k, _ABSENT)
        )
        if diff:
            findings.add(
                Code.CONFIG_FILE_MISMATCH,
                f"config.json differs from the manifest's config in {', '.join(diff)}.",
            )


_ABSENT = object()


def _check_adapter_values(adapter: Path, findings: Findings) -> None:
    """``adapter_nonfinite``: NaN or Inf in the released weights (a model that is no
    model; whatever made it, the stated mechanism did not)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(adapter))
    except (SafetensorError, OSError, ValueError) as exc:
        findings.add(Code.ADAPTER_HASH_MISMATCH, f"{adapter.name} cannot be read: {exc}")
        return
    bad = sorted(
        k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())
    )
    if bad:
        findings.add(
            Code.ADAPTER_NONFINITE,
            f"The released adapter holds NaN or Inf values in {len(bad)} tensor(s) ("
            f"{', '.join(bad[:3])}{', …' if len(bad) > 3 else ''}).",
        )

"""Reading a run directory or bundle for its audit: the manifest (each required field
checked, named when missing or of the wrong type) and the metrics rows."""

from __future__ import annotations

from pathlib import Path

from audit.bundle.crosscheck import validate_numbers
from fl.errors import UsageError
from fl.run import rundir

__all__ = ["need", "read_manifest", "read_metrics"]


def need(d: dict, key: str, where: str, types=None):
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


def read_manifest(run: Path) -> dict:
    m = rundir.read_manifest(run, check_schema=True)
    need(m, "method", "", (str,))
    cfg = need(m, "config", "", (dict,))
    for k in ("batch_size", "local_steps", "seed", "members", "clients"):
        need(cfg, k, "config.", (int,))
    need(cfg, "local_epochs", "config.", (int, float))
    p = need(m, "privacy", "", (dict,))
    level = need(p, "level", "privacy.", (str,))
    if level not in ("sample", "client", "none"):
        raise UsageError(f"manifest.json: privacy.level must be sample|client|none, got {level!r}")
    if level != "none":
        need(p, "noise_multiplier", "privacy.", (int, float))
        need(p, "delta", "privacy.", (int, float))
        need(p, "epsilon", "privacy.", (dict,))
        need(p, "ledger", "privacy.", (dict,))
        need(p, "rounds", "privacy.", (int,))
        cs = need(p, "client_sampling", "privacy.", (dict,))
        for k in ("scheme", "clients_per_round", "total_clients"):
            need(cs, k, "privacy.client_sampling.")
    validate_numbers(m)
    return m


def read_metrics(run: Path) -> list[dict] | None:
    return rundir.read_metrics(run, strict=True)

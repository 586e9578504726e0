"""`fedlora export RUN --out DIR`: write the release bundle of a finished run.

The bundle (:mod:`fl.run.release`) is what a run may publish: the adapter, the public
manifest (allow-listed fields) and the public per-round metrics. ``DIR`` must be new,
empty, or an earlier bundle (replaced atomically); anything else is refused, so no
unrelated file is ever overwritten. Errors are one line, exit code 2.
"""

from __future__ import annotations

from pathlib import Path

from fl.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write the public release bundle of a finished run (adapter + public manifest)",
        description=(
            "Write the release bundle of a finished run directory: adapter/, the public "
            "manifest.json (allow-listed fields only) and the public metrics.jsonl. The run "
            "directory itself (member ids, cohorts, training losses, the noise key) is the "
            "operator's and is never published. DIR must be new, empty or an earlier bundle."
        ),
    )
    p.add_argument("run_dir", metavar="RUN", help="a finished fedlora run directory")
    p.add_argument("--out", required=True, metavar="DIR", help="bundle folder to write")
    p.set_defaults(func=cmd_export)


def _check_run(run: Path) -> None:
    if not run.exists():
        raise UsageError(f"run directory not found: {run}")
    if not run.is_dir():
        raise UsageError(f"{run} is not a directory (give a fedlora run directory)")
    if (run / "manifest.json").is_file():
        return
    if (run / "config.json").is_file():
        raise UsageError(
            f"{run} is an unfinished run (config.json but no manifest.json): training did not "
            f"complete; finish it with `fedlora train --resume {run}` before exporting"
        )
    raise UsageError(f"{run} is not a fedlora run directory (no manifest.json)")


def _check_private(run: Path) -> None:
    """Refuse a DP run whose noise is not private: seeded from the public seed
    (``--insecure-deterministic-noise``, or a run made before keyed noise) or drawn under
    a key reused from another configuration (``--allow-key-reuse``). Its bundle would
    claim a guarantee the noise does not give; nothing is written."""
    from fl.io import read_json

    m = read_json(run / "manifest.json")
    privacy = (m.get("privacy") if isinstance(m, dict) else None) or {}
    noise = privacy.get("noise") if isinstance(privacy.get("noise"), dict) else {}
    if privacy.get("level") in (None, "none") or noise.get("private") is True:
        return
    if noise.get("reused_key") or noise.get("source") == "keyed_csprng":
        orig = (noise.get("reused_key") or {}).get("original_config_sha256") or "unknown"
        why = (
            "was drawn under a noise key reused from a run of another configuration "
            f"({orig}; --allow-key-reuse): it cancels against that run's noise"
        )
    else:
        why = (
            "was seeded from the public seed (--insecure-deterministic-noise, or a run made "
            "before keyed noise): anyone who knows the seed can remove it"
        )
    raise UsageError(f"{run}: this run's DP noise {why}; it is NOT private and is not exported")


def cmd_export(args) -> int:
    from fl.run.release import write_release

    run, out = Path(args.run_dir), Path(args.out)
    _check_run(run)
    _check_private(run)
    out_dir = write_release(run, out)
    print(f"wrote release bundle {out_dir} (adapter/, manifest.json, metrics.jsonl)")
    return 0

"""`fedlora export RUN --out DIR`: write the release bundle of a finished run.

The bundle (:mod:`fl.release`) is what a run may publish: the adapter, the public
manifest (allow-listed fields) and the public per-round metrics. ``DIR`` must be new,
empty, or an earlier bundle (replaced atomically); anything else is refused, so no
unrelated file is ever overwritten. Errors are one line, exit code 2.
"""

from __future__ import annotations

import sys
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


def cmd_export(args) -> int:
    from fl.io import read_json
    from fl.release import write_release

    run, out = Path(args.run_dir), Path(args.out)
    _check_run(run)
    out_dir = write_release(run, out)
    privacy = read_json(out_dir / "manifest.json").get("privacy") or {}
    noise = privacy.get("noise") or {}
    if privacy.get("level") not in (None, "none") and noise.get("private") is not True:
        sys.stderr.write(
            "fedlora: warning: this run's DP noise was seeded from the public seed "
            "(--insecure-deterministic-noise, or a run made before keyed noise): anyone who "
            "knows the seed can remove it, so this bundle is NOT private\n"
        )
    print(f"wrote release bundle {out_dir} (adapter/, manifest.json, metrics.jsonl)")
    return 0

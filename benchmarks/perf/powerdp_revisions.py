"""PowerDP factored path of an earlier git revision against this one, in one run.

    python -m benchmarks.perf.powerdp_revisions REV [--reps N] [--threads T] [--size S] [--K K]

Loads ``fl/privacy/powerdp.py`` as it was at ``REV`` (``git show``) next to the current
module and times, interleaved (:func:`benchmarks.perf.harness.interleaved`), the current
dense path and both factored paths on the ``aggregation`` benchmark's inputs (m = n =
``size``, r = 16, ``K`` clients, 2 iterations, σ = 1, C = 1). Prints the paired
speed-ups dense / factored before and after, the after / before factored time, and
whether the two factored paths return the same factors. Both revisions share the
current ``fl.linalg``, so this isolates powerdp.py (the earlier module must still run
on it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks.perf import harness
from benchmarks.perf.aggregation import RANK, random_factors


def load_revision(rev: str):
    src = subprocess.run(
        ["git", "show", f"{rev}:fl/privacy/powerdp.py"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"powerdp_{rev}", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--K", type=int, default=10)
    a = p.parse_args(argv)
    from fl.privacy import powerdp as new

    old = load_revision(a.rev)
    torch.set_num_threads(a.threads)
    Bs, As = random_factors(a.size, a.size, a.K, RANK, seed=a.size + a.K)
    w = [1.0 / a.K] * a.K

    def call(mod, dense=False):
        gen = torch.Generator().manual_seed(1)
        return mod.powerdp(Bs, As, w, RANK, 2, 1.0, 1.0, generator=gen, dense=dense, seed=3)

    same = all(torch.equal(x, y) for x, y in zip(call(old)[:2], call(new)[:2]))
    load = os.getloadavg()
    t = harness.interleaved(
        {"dense": lambda: call(new, True), "before": lambda: call(old), "after": lambda: call(new)},
        reps=a.reps,
        warmup=1,
    )
    out = {
        "rev": a.rev,
        "threads": torch.get_num_threads(),
        "size": a.size,
        "K": a.K,
        "load_average": [load, os.getloadavg()],
        "identical_factors": same,
        "speedup_before": harness.paired_ratio(t["before"], t["dense"]),
        "speedup_after": harness.paired_ratio(t["after"], t["dense"]),
        "after_over_before_time": harness.paired_ratio(t["before"], t["after"]),
        "seconds": {k: harness.summarize(v) for k, v in t.items()},
    }
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Sampler canaries: records that the trainer's own sampler draws into batches, with
gradients on coordinates of their own (``fedlora train --sampler-canaries M``; sample-level
DP-SGD flat or a method's own space).

Gradient canaries (:mod:`fl.privacy.gradient_canaries`) get Poisson coins that the auditor
draws; they cannot see a sampler that is not what the ledger says (shuffled or fixed batches
accounted as Poisson). A sampler canary is instead one more row of its client's data set:
the local training's batch masks are drawn over n + M rows by the trainer's sampler (the
Poisson masks, or whatever the code really does), and row n + j is canary j. Its
per-example gradient is K·C·e_j (K = 100) on an isolated coordinate e_j that no example and
no model parameter touches; the step's clip reduces it to exactly C·e_j, and the step's noise
stream adds N(0, σ²C²) there, drawn by the same noise code as the parameters' (after them,
from the same stream). The operator's observation file records, at every step, the
privatized sums at the M coordinates: C·s_{t,j} + N(0, σ²C²), s the sampler's decision.

Privacy: the canary rows are records independent of the data; under Poisson sampling each
real example's inclusion is unchanged in law, and the canaries' coordinates are not part of
any released parameter. The ledger, σ and the expected batch (q·n, n the real rows) do not
change. The batches of the real examples do change (the masks are drawn over more rows), so a
run with sampler canaries is not bit-for-bit the run without them; nothing here runs when
M = 0.

The audit (:mod:`audit.bounds.sampling`) tests that each canary's series is exchangeable
over the steps, which Poisson sampling implies whatever σ, q and the data are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fl.privacy import rng as R
from fl.privacy.dpsgd import flat_noise

#: the operator's observation files, under the run's private folder
OBS_DIR = "sampler_canaries"
#: a canary's pre-clip gradient is K·C·e_j
PRE_CLIP = 100.0

__all__ = ["OBS_DIR", "SamplerCanaries", "read_observations"]


@dataclass
class SamplerCanaries:
    """The sampler canaries of one local training: the trainer calls :meth:`step` with the
    canary rows' part of each batch mask after the privatizer has run, and :meth:`finish`
    at the end."""

    m: int
    clip: float
    sigma: float
    meta: dict
    observed: list = field(default_factory=list)

    def step(self, mask: torch.Tensor, noise_source, noise_factor: float = 1.0) -> None:
        """Privatize this step's canary coordinates: each sampled canary's K·C clipped to C,
        plus the step's N(0, σ²C²) from ``noise_source`` (the DP-SGD stream, after the
        parameters' draw); ``noise_factor`` (a planted fault, tests only; 1 otherwise)
        scales that noise as it scales the parameters'."""
        g = torch.full((self.m,), PRE_CLIP * self.clip, dtype=torch.float64)
        g = torch.where(g.abs() > self.clip, self.clip * (g / g.abs()), g)  # the clip: C
        summed = torch.where(mask.cpu(), g, torch.zeros_like(g))
        block = torch.zeros(self.m, dtype=torch.float32)
        noise = flat_noise([block], self.sigma * self.clip, noise_source, torch.device("cpu"))
        if noise_factor != 1.0:
            noise = noise * noise_factor
        self.observed.append((summed + noise.double()).numpy())

    def finish(self, out: Path | None) -> Path | None:
        """Write the observations (operator only): ``obs`` (steps, M) and the meta."""
        if out is None:
            return None
        d = out / R.PRIVATE_DIR
        d.mkdir(mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
        d = d / OBS_DIR
        d.mkdir(mode=0o700, exist_ok=True)
        meta = self.meta
        name = f"{meta['stage']}-r{meta['round']}-c{meta['client']}"
        if meta.get("attempt"):
            name += f"-a{meta['attempt']}"
        obs = np.stack(self.observed) if self.observed else np.zeros((0, self.m))
        tmp = d / f".{name}.{os.getpid()}.tmp.npz"
        np.savez(
            tmp,
            obs=obs,
            **{
                k: np.asarray(v, dtype=np.str_ if isinstance(v, str) else None)
                for k, v in meta.items()
            },
        )
        path = d / f"{name}.npz"
        os.replace(tmp, path)
        return path


def read_observations(run_dir: str | Path) -> list[dict]:
    """Every sampler-canary observation file of a run (operator only); [] when none."""
    d = Path(run_dir) / R.PRIVATE_DIR / OBS_DIR
    out = []
    for p in sorted(d.glob("*.npz")) if d.is_dir() else []:
        with np.load(p, allow_pickle=False) as z:
            rec = {k: z[k] for k in z.files}
        for k in ("round", "attempt"):
            rec[k] = int(rec.get(k, 0))
        for k in ("sigma", "clip", "q"):
            rec[k] = float(rec[k])
        for k in ("client", "stage"):
            rec[k] = str(rec[k])
        rec["obs"] = np.asarray(rec["obs"], dtype=np.float64)
        rec["file"] = p.name
        out.append(rec)
    return out

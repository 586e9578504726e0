"""Gradient-space (Dirac) canaries for sample-level DP-SGD: a white-box one-run audit.

``fedlora train --canaries M --canary-kind gradient`` (``--dp-level sample`` only).

Canary j owns one coordinate e_j of the trained parameters and joins one client's data as
a *record* whose clipped gradient is C·e_j:

- **the set** (stream ``("gradient-canaries",)`` of the run's secret key): M distinct
  coordinates, stratified over the trained parameter groups (the A factors, the B factors,
  the head; B and the head only for FFA-LoRA and FedASK): each group gets a share of M
  proportional to its size, but at least min(M/G, its size) (G groups, :func:`allocate`),
  drawn uniformly without replacement within the group (its tensors laid end to end), so
  that a fault confined to one group (its noise left out) has canaries to show it; M larger
  than all trained coordinates is refused. Each canary gets a client (uniform) and an
  inclusion bit b_j ~ Bernoulli(½). Nothing of it derives from the public seed.
- **the steps**: at every DP-SGD step of its client, an included canary is Poisson-sampled
  with that client's rate q_k (coins from the stream ``("gradient-canary-coins", round,
  client, stage[, "attempt", a])``, one Bernoulli(q_k) per canary of the client per step,
  drawn whether it is included or not); a sampled included canary enters the step as a
  per-example gradient K·C·e_j (K = :data:`PRE_CLIP` = 100), which the step's clip reduces
  to exactly C·e_j, added to the clipped sum before the noise of the same call
  (:func:`fl.privacy.dpsgd.clip_and_noise`). The noise, σ, q_k, the expected batch and
  the ledger do not change: the sampling rate is B/n_k with the client's public size, as
  for every record, and a canary adds at most one record's worth (‖C·e_j‖ = C) per step:
  it is accounted as an example under add/remove.
- **the observation** (the federated white-box threat model: the auditor sees each
  client's privatized step sums, the DP outputs the guarantee covers): at every step the
  privatized sum Σ clip(g_i) + [canaries] + N(0, σ²C²) (before the division by the
  expected batch) is read at the coordinates of every canary of the client, included or
  not, and written per local training to ``RUN/private/canary_observations/`` (operator
  only, never released).

Under FedASK's W-space privatizer (:mod:`fl.privacy.wspace`, its default ``clip_space=w``)
the B canaries live in W-space: the slot (layer, a·r + k) of B (m×r) is the unit W-space
direction e_a ⊗ V[:,k] (A = U S Vᵀ, the thin SVD of the fixed public A), whose clipped
gradient C·(e_a ⊗ V[:,k]) is added to the W-space sum before its noise; the observation is
c = (released B row a)·U[:,k]/(s·S_k) = (privatized W-space sum, row a)·V[:,k], a public
linear function of the released B gradient, distributed as the flat observation
(N(data + b_j·s_t·C, σ²C²), i.i.d. over the slots). The head's canaries stay coordinates.
The observation files then carry ``space = "w"``.

Nothing here runs unless the canary kind is ``gradient``: the default training path is
untouched.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fl.errors import UsageError
from fl.privacy import rng as R

#: where the observations go, under the run's private folder
OBS_DIR = "canary_observations"
KIND = "gradient"
SET_STREAM = ("gradient-canaries",)
COIN_STREAM = "gradient-canary-coins"

#: K: a canary enters the step as a per-example gradient K·C·e_j, before the clip (which
#: must reduce it to C·e_j; a skipped clip lets K·C through)
PRE_CLIP = 100.0

#: which LoRA factors each method trains under sample-level DP (default: A and B)
_FACTORS_TRAINED = {"ffa": ("B",), "fedask": ("B",), "probe": ()}


@dataclass(frozen=True)
class Coordinate:
    param: str  # flat state key: factors/<layer>/<A|B> or head/<name>
    index: int  # index into the flattened tensor


def candidate_groups(
    lora: dict[str, dict[str, torch.nn.Parameter]],
    head: dict[str, torch.nn.Parameter],
    factors: tuple[str, ...] = ("A", "B"),
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(LoRA tensors, head tensors) as ``(flat state key, numel)`` in a fixed order."""
    lo = [
        (f"factors/{k}/{ab}", int(p.numel()))
        for k, abs_ in lora.items()
        for ab, p in abs_.items()
        if ab in factors
    ]
    hd = [(f"head/{k}", int(p.numel())) for k, p in head.items()]
    return lo, hd


def _pick(tensors: list[tuple[str, int]], flat: np.ndarray) -> list[Coordinate]:
    """Flat indices into ``tensors`` laid end to end → coordinates."""
    ends = np.cumsum([n for _, n in tensors])
    out = []
    for f in flat.tolist():
        t = int(np.searchsorted(ends, f, side="right"))
        start = int(ends[t - 1]) if t else 0
        out.append(Coordinate(tensors[t][0], int(f - start)))
    return out


def allocate(m: int, sizes: list[int]) -> list[int]:
    """How many of ``m`` canaries each group of ``sizes`` coordinates gets: a share
    proportional to its size, but at least min(m/G, its size) (G groups), in whole numbers
    summing to m (largest remainders; ``m`` <= Σ sizes)."""
    G = len(sizes)
    fixed: dict[int, float] = {}
    while True:
        free = [g for g in range(G) if g not in fixed]
        rest = m - sum(fixed.values())
        tot = sum(sizes[g] for g in free)
        share = {g: rest * sizes[g] / tot for g in free} if tot else {}
        low = [g for g in free if share[g] < min(m / G, sizes[g])]
        if not low:
            break
        for g in low:
            fixed[g] = min(m / G, sizes[g])
    want = {**fixed, **share}
    out = [min(int(math.floor(want[g])), sizes[g]) for g in range(G)]
    order = sorted(range(G), key=lambda g: (-(want[g] - math.floor(want[g])), g))
    while sum(out) < m:
        for g in order:
            if sum(out) < m and out[g] < sizes[g]:
                out[g] += 1
    return out


def coordinate_groups(
    lora: list[tuple[str, int]], head: list[tuple[str, int]]
) -> list[tuple[str, list[tuple[str, int]]]]:
    """The trained parameter groups the canaries are stratified over: every factor A, every
    factor B, the head (those with coordinates), in that order."""
    groups = [
        ("A", [t for t in lora if t[0].endswith("/A")]),
        ("B", [t for t in lora if t[0].endswith("/B")]),
        ("head", list(head)),
    ]
    return [(g, ts) for g, ts in groups if sum(n for _, n in ts)]


def group_of(param: str) -> str:
    """The group (``A``, ``B`` or ``head``) of a canary's flat state key."""
    return "head" if param.startswith("head/") else param.rsplit("/", 1)[-1]


def choose_coordinates(
    source, m: int, lora: list[tuple[str, int]], head: list[tuple[str, int]]
) -> list[Coordinate]:
    """M distinct coordinates (module doc), stratified over the trained parameter groups
    (:func:`coordinate_groups`: the A factors, the B factors, the head) by
    :func:`allocate`, uniform within a group (its tensors laid end to end); refused beyond
    the total. Shuffled, so canary j's coordinate says nothing of j."""
    n_lora, n_head = sum(n for _, n in lora), sum(n for _, n in head)
    if m < 1:
        raise UsageError(f"--canaries must be >= 1 for gradient canaries, got {m}")
    if m > n_lora + n_head:
        raise UsageError(
            f"--canaries {m} gradient canaries need {m} distinct coordinates, but the trained "
            f"parameters have {n_lora + n_head} ({n_lora} in the LoRA factors, {n_head} in "
            "the head): lower M or raise --rank / --lora-layers"
        )
    groups = coordinate_groups(lora, head)
    counts = allocate(m, [sum(n for _, n in ts) for _, ts in groups])
    coords: list[Coordinate] = []
    for (_, ts), k in zip(groups, counts):
        size = sum(n for _, n in ts)
        coords += _pick(ts, np.arange(size) if k == size else R.random_subset(source, size, k))
    order = np.argsort(R.integers(source, 1 << 30, m), kind="stable")
    return [coords[i] for i in order]


def make_canary_set(
    rand: R.RunRandomness,
    m: int,
    cids: list[str],
    lora: list[tuple[str, int]],
    head: list[tuple[str, int]],
) -> list[dict]:
    """The canary records for ``splits.json``: ``{"id", "kind": "gradient", "param",
    "index", "client", "included"}``, every choice from the secret stream
    ``("gradient-canaries",)``."""
    src = rand.stream(*SET_STREAM)
    coords = choose_coordinates(src, m, lora, head)
    client_of = R.integers(src, len(cids), m)
    included = R.bernoulli_mask(src, m, 0.5).numpy()
    return [
        {
            "id": f"canary:{j}",
            "kind": KIND,
            "param": c.param,
            "index": c.index,
            "client": cids[int(client_of[j])],
            "included": bool(included[j]),
        }
        for j, c in enumerate(coords)
    ]


@dataclass
class ClientCanaries:
    """The canaries of one local training (:meth:`GradientCanaries.begin`): what
    :func:`fl.privacy.dpsgd.clip_and_noise` calls at each step."""

    ids: np.ndarray  # canary numbers j observed in this training (their params are trained)
    flat: torch.Tensor  # their flat coordinates in the concatenated trained parameters
    included: np.ndarray  # bool
    coins: list[np.ndarray]  # per step, bool: sampled at rate q
    clip: float
    meta: dict
    step: int = 0
    observed: list = field(default_factory=list)
    _flat_dev: torch.Tensor | None = None

    def _on(self, device: torch.device) -> torch.Tensor:
        if self._flat_dev is None or self._flat_dev.device != device:
            self._flat_dev = self.flat.to(device)
        return self._flat_dev

    def sampled(self) -> np.ndarray:
        """The canaries (positions in :attr:`ids`) that enter this step: included and
        sampled by this step's coin (host values only: no device sync)."""
        if self.step >= len(self.coins):
            raise RuntimeError("gradient canaries: more DP-SGD steps than coins drawn")
        return np.flatnonzero(self.coins[self.step] & self.included)

    def clipped(
        self, n: int, dtype: torch.dtype, device: torch.device, clip: bool = True
    ) -> torch.Tensor:
        """The coefficients of ``n`` sampled canaries along their unit vectors after the
        step's clip: K·C (K = :data:`PRE_CLIP`) clipped as the clip's definition says,
        g·min(1, C/‖g‖), computed as C·(g/‖g‖) so that the result is C bit for bit
        (g/‖g‖ = 1.0 exactly: one non-zero coefficient along a unit vector). ``clip=False``
        (only under the planted fault ``no_clip``, tests only) lets K·C through."""
        g = torch.full((n,), PRE_CLIP * self.clip, dtype=dtype, device=device)
        if clip:
            norm = g.abs()  # ‖K·C·e_j‖: one non-zero coordinate
            g = torch.where(norm > self.clip, self.clip * (g / norm), g)
        return g

    def contribute(self, summed: torch.Tensor, clip: bool = True) -> None:
        """Add the clipped gradients of the included canaries sampled in this step to the
        clipped sum (before the noise); nothing else is touched.

        A canary's per-example gradient is K·C·e_j (K = :data:`PRE_CLIP`); the step clips
        it to C·e_j (:meth:`clipped`). ``clip=False`` (only under the planted fault
        ``no_clip``, tests only) lets K·C through: a skipped clip is then K times the
        contribution."""
        sel = self.sampled()
        if sel.size:
            at = self._on(summed.device)[torch.as_tensor(sel, device=summed.device)]
            g = self.clipped(sel.size, summed.dtype, summed.device, clip)
            summed.index_put_((at,), g, accumulate=True)  # distinct coordinates

    def observe(self, noisy: torch.Tensor) -> None:
        """Record the privatized sum at every canary coordinate of the client (no host
        sync: kept on the device until :meth:`result`)."""
        self.record(noisy.index_select(0, self._on(noisy.device)))

    def record(self, values: torch.Tensor) -> None:
        """Record this step's observation of every canary of the training (a vector in
        :attr:`ids` order, on any device) and move to the next step."""
        self.observed.append(values.detach().clone())
        self.step += 1

    def result(self) -> dict:
        obs = (
            torch.stack(self.observed).double().cpu().numpy()
            if self.observed
            else np.zeros((0, len(self.ids)))
        )
        return {**self.meta, "ids": self.ids.astype(np.int64), "obs": obs}


class GradientCanaries:
    """The run's gradient canaries: the set and the observation writer. The trainer calls
    :meth:`begin` before a DP-SGD local training and :meth:`finish` after it."""

    def __init__(self, records: list[dict], rand: R.RunRandomness, out: Path | None):
        self.records = records
        self.rand = rand
        self.out = out
        self.by_client: dict[str, list[int]] = {}
        for j, c in enumerate(records):
            self.by_client.setdefault(c["client"], []).append(j)

    @classmethod
    def for_engine(cls, engine) -> GradientCanaries:
        """Build the set for an :class:`fl.run.engine.Engine` after its trainer exists, attach
        it to the trainer, and return it (``engine.setup``)."""
        cfg = engine.cfg
        factors = _FACTORS_TRAINED.get(cfg.method, ("A", "B"))
        lora, head = candidate_groups(engine.trainer.lora, engine.trainer.head, factors)
        if not getattr(engine.method_cls, "trains_factors", True):
            lora = []
        records = make_canary_set(engine.rand, cfg.canaries, engine.client_ids(), lora, head)
        gc = cls(records, engine.rand, Path(engine.out))
        engine.trainer.gradient_canaries = gc
        return gc

    def splits_doc(self) -> dict:
        return {"canaries": [dict(c) for c in self.records]}

    def begin(
        self,
        noise_source,
        params: list[torch.nn.Parameter],
        names: list[str],
        q: float,
        steps: int,
        clip: float,
        sigma: float,
        space: str | None = None,
    ) -> ClientCanaries:
        """The canaries of the local training whose DP-SGD noise stream is
        ``noise_source`` (named ``("dpsgd-noise", round, client, stage[, "attempt",
        a])``): its client's canaries on the trained ``params``, and their coins from
        ``("gradient-canary-coins", round, client, stage[, "attempt", a])``.

        ``space``: None (DP-SGD's flat clipped sum: every canary is a coordinate) or
        ``"w"`` (FedASK's W-space privatizer, :mod:`fl.privacy.wspace`: a B canary's slot
        is a W-space direction, the head's a coordinate); recorded in the observation
        file's ``space`` field (absent when None)."""
        parts = getattr(noise_source, "parts", None)
        if not parts or parts[0] != "dpsgd-noise" or len(parts) < 4:
            raise RuntimeError("gradient canaries need the run's DP-SGD noise stream")
        rnd, cid, stage = parts[1], str(parts[2]), str(parts[3])
        attempt = int(parts[5]) if len(parts) >= 6 and parts[4] == "attempt" else 0
        mine = self.by_client.get(cid, [])
        src = self.rand.stream(COIN_STREAM, *parts[1:])
        # coins for every canary of the client, included or not, trained or not: the
        # stream's use never depends on the secret inclusion bits
        coins = [R.bernoulli_mask(src, len(mine), q).numpy() for _ in range(steps)]
        offsets, at = {}, 0
        for p, nm in zip(params, names):
            offsets[nm] = (at, p.numel())
            at += p.numel()
        keep = [k for k, j in enumerate(mine) if self.records[j]["param"] in offsets]
        flat = [
            offsets[self.records[mine[k]]["param"]][0] + int(self.records[mine[k]]["index"])
            for k in keep
        ]
        for k in keep:
            j = mine[k]
            if not 0 <= int(self.records[j]["index"]) < offsets[self.records[j]["param"]][1]:
                raise RuntimeError(f"gradient canary {j}: index outside its parameter")
        keep_a = np.asarray(keep, dtype=np.int64)
        return ClientCanaries(
            ids=np.asarray(mine, dtype=np.int64)[keep_a] if keep else np.zeros(0, np.int64),
            flat=torch.as_tensor(flat, dtype=torch.long),
            included=np.asarray([self.records[mine[k]]["included"] for k in keep], dtype=bool),
            coins=[c[keep_a] if keep else c[:0] for c in coins],
            clip=float(clip),
            meta={
                "round": int(rnd),
                "client": cid,
                "stage": stage,
                "attempt": attempt,
                "sigma": float(sigma),
                "clip": float(clip),
                "q": float(q),
                **({"space": str(space)} if space is not None else {}),
            },
        )

    def finish(self, cc: ClientCanaries) -> Path | None:
        """Write the observations of one local training (operator only)."""
        res = cc.result()
        if self.out is None:
            return None
        d = self.out / R.PRIVATE_DIR
        d.mkdir(mode=0o700, exist_ok=True)
        os.chmod(d, 0o700)
        d = d / OBS_DIR
        d.mkdir(mode=0o700, exist_ok=True)
        name = f"{res['stage']}-r{res['round']}-c{res['client']}"
        if res["attempt"]:
            name += f"-a{res['attempt']}"
        path = d / f"{name}.npz"
        tmp = d / f".{name}.{os.getpid()}.tmp.npz"
        np.savez(
            tmp,
            **{
                k: (np.asarray(v) if not isinstance(v, str) else np.asarray(v, dtype=np.str_))
                for k, v in res.items()
            },
        )
        os.replace(tmp, path)
        return path


def read_observations(run_dir: str | Path) -> list[dict]:
    """Every observation file of a run (operator only), as dicts of :meth:`ClientCanaries.
    result`'s fields; [] when there is none."""
    d = Path(run_dir) / R.PRIVATE_DIR / OBS_DIR
    out = []
    for p in sorted(d.glob("*.npz")) if d.is_dir() else []:
        with np.load(p, allow_pickle=False) as z:
            rec = {k: z[k] for k in z.files}
        for k in ("round", "attempt"):
            rec[k] = int(rec[k])
        for k in ("sigma", "clip", "q"):
            rec[k] = float(rec[k])
        for k in ("client", "stage", "space"):
            if k in rec:
                rec[k] = str(rec[k])
        rec["file"] = p.name
        out.append(rec)
    return out


def observation_coins(stream, records: list[dict], ob: dict) -> np.ndarray:
    """(steps, canaries) bool: the Poisson coins of one observation file's canaries (its
    ``ids``), drawn again from the run's coin stream exactly as :meth:`GradientCanaries.begin`
    drew them. ``stream(*parts)`` gives the run's stream of that name (the key's, or the
    seeded one of an insecure run); the auditor draws the coins itself rather than trust a
    record of them."""
    cid = str(ob["client"])
    mine = [j for j, c in enumerate(records) if str(c["client"]) == cid]
    pos = {j: k for k, j in enumerate(mine)}
    ids = np.asarray(ob["ids"], dtype=np.int64)
    try:
        idx = np.asarray([pos[int(j)] for j in ids], dtype=np.int64)
    except KeyError as exc:
        raise ValueError(
            f"{ob.get('file')}: canary {exc} is not a canary of client {cid}"
        ) from None
    attempt = int(ob.get("attempt", 0))
    src = stream(
        COIN_STREAM,
        int(ob["round"]),
        cid,
        str(ob["stage"]),
        *(("attempt", attempt) if attempt else ()),
    )
    steps = np.asarray(ob["obs"]).reshape(-1, len(ids)).shape[0]
    return (
        np.stack(
            [R.bernoulli_mask(src, len(mine), float(ob["q"])).numpy()[idx] for _ in range(steps)]
        )
        .reshape(steps, len(ids))
        .astype(bool)
    )


__all__ = [
    "observation_coins",
    "GradientCanaries",
    "ClientCanaries",
    "Coordinate",
    "candidate_groups",
    "choose_coordinates",
    "make_canary_set",
    "read_observations",
    "OBS_DIR",
    "KIND",
]

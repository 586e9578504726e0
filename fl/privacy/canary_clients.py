"""Over 500 lines on purpose: one concept, the CanaryClients set, whose draw, participation coins, dense and factored directions, contributions and observation file share its state (split, each half would reach into the other's).

Canary clients for client-level DP: a one-run empirical privacy estimate (Andrew et al.
2024, "One-shot empirical privacy estimation for federated learning").

``fedlora train --dp-level client --canary-clients M`` (default 0: nothing here runs).

- **The set** (stream ``("canary-clients",)`` of the run's secret key; nothing from the
  public seed): M 63-bit seeds and M inclusion bits b_j ~ Bernoulli(½). Canary j's update
  is a fixed random direction of ℓ2 norm exactly C drawn from its seed (a torch generator
  seeded with the secret seed), in the space the method clips and noises:

  * ``dense`` (FedAvg-LoRA, FFA-LoRA, FedProx, and every method that aggregates through
    ``Method.client_level_dp_average``): the flattened update of the released, clipped
    parameters (A and B, or B alone for FFA-LoRA, plus the head), a standard Gaussian
    vector normalized to C;
  * ``factored`` (FedPower): the server clips the effective product ΔW_k = s·B_kA_k
    jointly over layers to C and, separately, the head update to C. The canary is a
    random rank-R product per layer (B, A standard Gaussian), scaled so that
    sqrt(Σ_ℓ ‖ΔW^ℓ‖_F²) = C, plus a standard Gaussian head update normalized to C: it is
    at the boundary of both clips. It enters ``server_aggregate`` as one more client state.

  Other methods have no client-level DP (their ``dp_levels``) and are refused.
- **Participation** follows the cohort scheme. Every client every round: an included
  canary takes part in every round. Poisson client sampling at rate q: each round one
  Bernoulli(q) coin per canary (stream ``("canary-client-coins", round[, "attempt",
  a])``, drawn for all M, included or not); an included canary whose coin is 1 takes
  part. A fixed-count cohort drawn without replacement is refused: the cohort cannot take
  an extra client without changing its size or displacing a real client.
- **Contribution**: a canary that takes part adds its update (norm C) to the clipped sum,
  through the same clip as the real clients, *before* the server's noise; the noise, σ,
  the fixed denominator m and the ledger are those of the run without canaries.
- **Accounting** (docs/privacy.md): canaries are outside K and outside the sampling
  denominator. For a real client the canaries' total contribution is a random vector
  independent of the data and of the noise, so the release with canaries is a
  post-processing of the release without them: the ledger's ε holds unchanged. For a
  canary, everything else (the real clients, the other canaries) is fixed, and adding or
  removing it changes the clipped sum by its norm-C update in every round it takes part
  in, with the same participation law as a real client (every round, or Poisson at q):
  it is exactly one client under add/remove of the mechanism the ledger accounts, so the
  ledger's ε is the one its inclusion bit is protected by.
- **Observation** (operator only, ``RUN/private/canary_clients.npz``, rewritten after
  each round, never in the release bundle): for every canary, included or not, the cosine
  of its direction with each round's aggregated noisy update (dense: the released global
  minus the previous one; FedPower: the released product s·B A of every layer, which is
  the refactorized noisy average, and the head's released change) and with the final model
  delta (final minus initial global), plus the seeds, inclusion bits and participation.
  Dense space, for the conformance tests (:mod:`audit.bounds.conformance`): also
  ``proj_rounds`` (rounds × M), the projection of the server's *privatized* clipped sum
  (clipped client updates + taking-part canaries + the server's Gaussian noise, before the
  division by m) on each canary's unit direction, in units of C: the noise's part is
  exactly N(0, σ²) and a taking-part canary adds 1; ``coin_attempts`` (rounds), the
  attempt of each round's coin stream. FedPower (factored) records no projection
  (:data:`CONFORMANCE_NOTES`): its release is a noisy power iteration
  (:mod:`fl.privacy.powerdp`), 2·iters + 1 Gaussian projections on bases that depend on
  the earlier noise, at σ_round·√k each, then an SVD, so no direction of what it releases
  carries "a canary's 1 plus N(0, σ²)".
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from fl.errors import UsageError
from fl.privacy import rng as R

#: the operator file under RUN/private/
FILE = "canary_clients.npz"
SET_STREAM = ("canary-clients",)
COIN_STREAM = "canary-client-coins"
#: method -> the space its canary lives in
SPACES = {"fedavg": "dense", "ffa": "dense", "fedprox": "dense", "fedpower": "factored"}
#: space -> why the conformance tests do not apply there ("" where they do)
CONFORMANCE_NOTES = {
    "dense": "",
    "factored": "FedPower's mechanism is not tested by conformance: its release is a noisy "
    "power iteration (PowerDP), 2·iters + 1 Gaussian projections W̄X + G of the clipped "
    "average on bases X that depend on the earlier noise, at σ_round·√k each, refactorized "
    "by an SVD; along no direction do the released factors carry a canary's C plus "
    "N(0, σ²C²). A test would have to read each projection inside PowerDP (where a canary "
    "adds ‖ΔW_j X‖ <= C, not C), and those are not recorded",
}
SPACE_NOTES = {
    "dense": "the flattened update of the clipped, released parameters (the averaged LoRA "
    "factors and the head), one joint clip to C",
    "factored": "FedPower's ΔW = s·B A (jointly over layers, norm C) plus the head update "
    "(norm C): the two clips of the server",
}


def check_supported(method: str, dp_level: str, scheme: str, m: int) -> str:
    """The canary space of ``method``, or a UsageError naming why canary clients cannot be
    placed honestly in this run."""
    if m <= 0:
        return ""
    if dp_level != "client":
        raise UsageError(
            f"--canary-clients audits client-level DP: it needs --dp-level client (got {dp_level})"
        )
    if method not in SPACES:
        raise UsageError(
            f"--canary-clients: method {method!r} has no server-side clipped sum to place a "
            "canary client in (client-level DP: "
            f"{', '.join(sorted(SPACES))}); fedsa, scaffold, fedask, flora, flexlora, hetlora, "
            "plora and probe are refused"
        )
    if scheme == "uniform":
        raise UsageError(
            "--canary-clients: a fixed-count cohort drawn without replacement cannot take a "
            "canary client without changing its size or displacing a real client (a different "
            "mechanism from the one accounted); use --client-sampling poisson or every client "
            "every round (--clients-per-round 0)"
        )
    return SPACES[method]


def _atomic_savez(path: Path, **arrays) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


class CanaryClients:
    """The run's canary clients: the set, their per-round participation and updates, and
    the observation file. Built by the server context on first use."""

    def __init__(
        self,
        m: int,
        clip: float,
        rand: R.RunRandomness,
        out: Path | None,
        *,
        method: str,
        scheme: str,
        rate: float,
        rounds: int,
        sigma: float,
        delta: float,
    ):
        if m < 1:
            raise ValueError("need at least one canary client")
        self.m, self.clip, self.rand, self.out = int(m), float(clip), rand, out
        self.method, self.space = method, SPACES[method]
        self.scheme, self.rate, self.rounds = scheme, float(rate), int(rounds)
        self.sigma, self.delta = float(sigma), float(delta)
        src = self._src = rand.stream(*SET_STREAM)
        self.seeds = R.integers(src, 1 << 62, self.m).astype(np.int64)
        self.included = R.bernoulli_mask(src, self.m, 0.5).numpy().astype(bool)
        self.participated = np.zeros((self.rounds, self.m), dtype=bool)
        self.cos_rounds = np.full((self.rounds, self.m), np.nan)
        self.cos_final = np.full(self.m, np.nan)
        self.observed = np.zeros(self.rounds, dtype=bool)
        # dense space: each round's privatized clipped sum projected on every canary's unit
        # direction, in units of C (the conformance tests); None where they do not apply
        self.proj_rounds = (
            np.full((self.rounds, self.m), np.nan) if not CONFORMANCE_NOTES[self.space] else None
        )
        # the attempt of each round's coin stream (-1: not drawn)
        self.coin_attempts = np.full(self.rounds, -1, dtype=np.int64)
        self._coins: dict[int, np.ndarray] = {}
        self._dense_set: dict | None = None  # dense directions (:meth:`dense`)
        self._fac: dict | None = None  # factored: per-layer stacked B, A and head
        self._initial: dict[str, np.ndarray] = {}
        self._load()

    # ------------------------------------------------------------------ participation
    def taking_part(self, r: int) -> np.ndarray:
        """Indices of the canaries that contribute in round ``r``: included and (Poisson
        sampling) their round coin is 1. The coins are drawn for all M canaries."""
        r = int(r)
        if r not in self._coins:
            if self.scheme == "poisson":
                coins = R.bernoulli_mask(
                    self.rand.round_stream(COIN_STREAM, r), self.m, self.rate
                ).numpy()
            else:
                coins = np.ones(self.m, dtype=bool)
            self._coins[r] = coins.astype(bool)
            if r < self.rounds:
                self.participated[r] = self._coins[r] & self.included
                self.coin_attempts[r] = int(self.rand.attempts.get(r, 0))
        return np.flatnonzero(self._coins[r] & self.included)

    # ------------------------------------------------------------------ dense space
    def dense(self, names: list[str], shapes: list[tuple[int, ...]]) -> dict:
        """The dense directions, drawn once the clipped parameters are known (d of them).

        M <= d: *disjoint supports* (exactly orthogonal canaries): a random permutation of
        the d coordinates (set stream) gives canary j the block perm[j·k:(j+1)·k],
        k = ⌊d/M⌋, with random signs (set stream), entries ±1/√k. Orthogonality matters:
        with isotropic directions the included canaries' updates add a cross term
        Σ_i ⟨ĉ_j, ĉ_i⟩ that is the same in every round and has variance (M/2)/d per round,
        which deflates the all-iterates separation by 1/sqrt(1 + Mμ²/(2d)) (μ the run's
        GDP μ). M > d: isotropic directions (Andrew et al.), standard normals from canary
        j's seed, normalized (refused above 4·10⁸ stored entries)."""
        if self._dense_set is None:
            shapes = [tuple(int(x) for x in s) for s in shapes]
            d = sum(math.prod(s) for s in shapes)
            ds: dict = {"names": list(names), "shapes": shapes, "d": d}
            if self.m <= d:
                k = d // self.m
                src = self._src
                perm = torch.argsort(src.uniform(d), stable=True)[: self.m * k]
                signs = torch.where(R.bernoulli_mask(src, self.m * k, 0.5), 1.0, -1.0)
                ds.update(mode="disjoint", k=k, perm=perm.reshape(self.m, k))
                ds["signs"] = signs.reshape(self.m, k).double() / math.sqrt(k)
            else:
                if self.m * d > 4e8:
                    raise UsageError(
                        f"--canary-clients {self.m} over {d} clipped coordinates: more canaries "
                        "than coordinates need stored isotropic directions (M·d > 4e8); lower "
                        "M or raise --rank"
                    )
                dirs = torch.empty((self.m, d), dtype=torch.float32)
                for j, sd in enumerate(self.seeds.tolist()):
                    v = torch.randn(d, generator=torch.Generator().manual_seed(int(sd)))
                    dirs[j] = (v.double() / v.double().norm()).float()
                ds.update(mode="isotropic", dirs=dirs)
            self._dense_set = ds
        elif list(names) != self._dense_set["names"]:
            raise RuntimeError("canary clients: the clipped parameters changed between rounds")
        return self._dense_set

    def dense_update_chunks(self, names, shapes, ids, chunk: int = 512):
        """The norm-C updates of the canaries in ``ids`` (one list of float32 tensors,
        shaped like ``names``, per canary), ``chunk`` canaries at a time."""
        ds = self.dense(list(names), list(shapes))
        ids = np.asarray(ids, dtype=np.int64)
        for s0 in range(0, ids.size, chunk):
            part = []
            for j in ids[s0 : s0 + chunk].tolist():
                if ds["mode"] == "disjoint":
                    flat = torch.zeros(ds["d"], dtype=torch.float64)
                    flat[ds["perm"][j]] = ds["signs"][j]
                else:
                    flat = ds["dirs"][j].double()
                flat = (flat * self.clip).float()
                parts, at = [], 0
                for sh in ds["shapes"]:
                    n = math.prod(sh)
                    parts.append(flat[at : at + n].reshape(sh))
                    at += n
                part.append(parts)
            yield part

    def _dense_cosines(self, ds: dict, v: torch.Tensor) -> torch.Tensor:
        nv = float(v.norm())
        if nv == 0 or not math.isfinite(nv):
            return torch.zeros(self.m, dtype=torch.float64)
        if ds["mode"] == "disjoint":
            return (v[ds["perm"]] * ds["signs"]).sum(1) / nv
        return (ds["dirs"].double() @ v) / nv

    def _dense_inner(self, ds: dict, v: torch.Tensor) -> torch.Tensor:
        """(M,) inner products of the canaries' unit directions with ``v`` (float64)."""
        if ds["mode"] == "disjoint":
            return (v[ds["perm"]] * ds["signs"]).sum(1)
        return ds["dirs"].double() @ v

    def observe_dense(
        self,
        r: int,
        names,
        base: list[torch.Tensor],
        new: list[torch.Tensor],
        privatized: list[torch.Tensor] | None = None,
    ):
        """Record round ``r``: cosines with the released update ``new − base``, and with
        the final-model delta ``new − initial``; with ``privatized`` (the server's noisy
        clipped sum, shaped like ``names``, before the division by m), its projection on
        each canary's unit direction in units of C (``proj_rounds``)."""
        ds = self.dense(list(names), [tuple(t.shape) for t in base])
        b = torch.cat([t.double().reshape(-1) for t in base])
        n = torch.cat([t.double().reshape(-1) for t in new])
        if "dense" not in self._initial:
            self._initial["dense"] = b.numpy().copy()
        init = torch.from_numpy(self._initial["dense"])
        if privatized is not None and self.proj_rounds is not None and 0 <= int(r) < self.rounds:
            s = torch.cat([t.detach().double().reshape(-1) for t in privatized])
            if s.numel() != ds["d"]:
                raise RuntimeError("canary clients: the privatized sum has the wrong size")
            self.proj_rounds[int(r)] = (self._dense_inner(ds, s) / self.clip).numpy()
        self._record(r, self._dense_cosines(ds, n - b), self._dense_cosines(ds, n - init))

    # ------------------------------------------------------------------ factored space
    def _factored(self, global_state: dict, scaling: float) -> dict:
        if self._fac is None:
            layers = list(global_state["factors"])
            heads = list(global_state.get("head", {}))
            Bs = {ly: [] for ly in layers}
            As = {ly: [] for ly in layers}
            H = []
            for s in self.seeds.tolist():
                g = torch.Generator().manual_seed(int(s))
                sq = 0.0
                bj, aj = {}, {}
                for ly in layers:
                    B0, A0 = global_state["factors"][ly]["B"], global_state["factors"][ly]["A"]
                    bj[ly] = torch.randn(tuple(B0.shape), generator=g, dtype=torch.float64)
                    aj[ly] = torch.randn(tuple(A0.shape), generator=g, dtype=torch.float64)
                    sq += float((bj[ly] @ aj[ly]).pow(2).sum())
                f = 1.0 / math.sqrt(sq)
                for ly in layers:
                    Bs[ly].append(bj[ly] * f)  # ΔW^ℓ = B A, jointly of norm 1
                    As[ly].append(aj[ly])
                if heads:
                    h = [
                        torch.randn(
                            tuple(global_state["head"][k].shape), generator=g, dtype=torch.float64
                        ).reshape(-1)
                        for k in heads
                    ]
                    v = torch.cat(h)
                    H.append(v / v.norm())
            self._fac = {
                "layers": layers,
                "heads": heads,
                "B": {ly: torch.stack(Bs[ly]) for ly in layers},
                "A": {ly: torch.stack(As[ly]) for ly in layers},
                "H": torch.stack(H) if heads else None,
                "norm": math.sqrt(2.0 if heads else 1.0),  # of a unit canary (ΔW, head)
            }
        return self._fac

    def factored_states(
        self, global_state: dict, scaling: float, ids, clip: float | None = None
    ) -> list[dict]:
        """Client states (raw factors: B = C·ΔW-factor / s) of the canaries in ``ids``, to
        append to FedPower's ``server_aggregate`` inputs: ‖ΔW‖ = C and head update C, C
        the method's server clip (``clip``, default the run's)."""
        if clip is not None:
            self.clip = float(clip)
        fac = self._factored(global_state, scaling)
        c = self.clip
        out = []
        for j in np.asarray(ids, dtype=np.int64).tolist():
            st = {"factors": {}, "head": {}}
            for ly in fac["layers"]:
                like = global_state["factors"][ly]
                st["factors"][ly] = {
                    "B": (fac["B"][ly][j] * (c / scaling)).to(like["B"].dtype),
                    "A": fac["A"][ly][j].to(like["A"].dtype),
                }
            if fac["heads"]:
                at = 0
                for k in fac["heads"]:
                    t = global_state["head"][k]
                    n = t.numel()
                    piece = c * fac["H"][j, at : at + n].reshape(t.shape)
                    st["head"][k] = (t.double() + piece).to(t.dtype)
                    at += n
            out.append(st)
        return out

    def _factored_inner(self, fac, Bx: dict, Ax: dict, hx: torch.Tensor | None):
        """(M,) inner products of the canaries with (Σ_ℓ B_x^ℓ A_x^ℓ, h_x), and the norm of
        the latter, never forming a dense product."""
        ip = torch.zeros(self.m, dtype=torch.float64)
        sq = 0.0
        for ly in fac["layers"]:
            B, A = Bx[ly].double(), Ax[ly].double()
            ip += torch.sum((fac["B"][ly].mT @ B) * (fac["A"][ly] @ A.mT), dim=(1, 2))
            sq += float(torch.sum((B.mT @ B) * (A @ A.mT)))
        if fac["H"] is not None and hx is not None:
            ip += fac["H"] @ hx
            sq += float(hx.pow(2).sum())
        return ip, math.sqrt(max(sq, 0.0))

    def observe_factored(self, r: int, prev: dict, new: dict, scaling: float) -> None:
        """Record round ``r`` of FedPower: cosines with (s·B A of the released factors, the
        head's released change) and with the final-model delta (s·B A − s·B₀A₀, head −
        head₀)."""
        fac = self._factored(prev, scaling)
        layers, heads = fac["layers"], fac["heads"]

        def head_vec(st):
            if not heads:
                return None
            return torch.cat([st["head"][k].double().reshape(-1) for k in heads])

        if "fp_head" not in self._initial:
            for ly in layers:
                self._initial[f"fp_B/{ly}"] = (scaling * prev["factors"][ly]["B"].double()).numpy()
                self._initial[f"fp_A/{ly}"] = prev["factors"][ly]["A"].double().numpy()
            hv = head_vec(prev)
            self._initial["fp_head"] = hv.numpy() if hv is not None else np.zeros(0)
        sB = {ly: scaling * new["factors"][ly]["B"].double() for ly in layers}
        A = {ly: new["factors"][ly]["A"].double() for ly in layers}
        hn, hp = head_vec(new), head_vec(prev)
        ip, nrm = self._factored_inner(fac, sB, A, None if hn is None else hn - hp)
        per_round = (
            ip / (fac["norm"] * nrm) if nrm > 0 else torch.zeros(self.m, dtype=torch.float64)
        )
        # final minus initial: [sB, −sB₀] [A; A₀]
        fB = {
            ly: torch.cat([sB[ly], -torch.from_numpy(self._initial[f"fp_B/{ly}"])], dim=1)
            for ly in layers
        }
        fA = {
            ly: torch.cat([A[ly], torch.from_numpy(self._initial[f"fp_A/{ly}"])], dim=0)
            for ly in layers
        }
        h0 = torch.from_numpy(self._initial["fp_head"])
        ipf, nf = self._factored_inner(fac, fB, fA, None if hn is None else hn - h0)
        final = ipf / (fac["norm"] * nf) if nf > 0 else torch.zeros(self.m, dtype=torch.float64)
        self._record(r, per_round, final)

    # ------------------------------------------------------------------ the file
    def _record(self, r: int, per_round: torch.Tensor, final: torch.Tensor) -> None:
        r = int(r)
        if r < self.rounds:
            self.cos_rounds[r] = per_round.numpy()
            self.observed[r] = True
            if r in self._coins:
                self.participated[r] = self._coins[r] & self.included
        self.cos_final = final.numpy().copy()
        self.write()

    def meta(self) -> dict:
        return {
            "kind": "canary_clients",
            "method": self.method,
            "space": self.space,
            "space_note": SPACE_NOTES[self.space],
            "m": self.m,
            "clip": self.clip,
            "scheme": self.scheme,
            "rate": self.rate,
            "rounds": self.rounds,
            "noise_multiplier": self.sigma,
            "delta": self.delta,
            "canary_norm": self.clip * (self._fac["norm"] if self._fac else 1.0),
            "directions": self._directions_note(),
            "projection": "proj_rounds: the privatized clipped sum (before the division by "
            "m) projected on each canary's unit direction, in units of C"
            if self.proj_rounds is not None
            else "",
            "conformance_note": CONFORMANCE_NOTES[self.space],
        }

    def _directions_note(self) -> str:
        if self.space == "factored":
            return (
                "canary j: torch.Generator().manual_seed(seeds[j]) draws, per layer, B then A "
                "(standard normals), then the head's standard normals; ΔW scaled to norm C "
                "jointly over layers, the head update to norm C"
            )
        if self._dense_set is not None and self._dense_set["mode"] == "disjoint":
            return (
                "disjoint supports: canary j is support[j] (coordinates of the clipped "
                "parameters laid end to end) with entries signs[j]·C (signs ±1/√k)"
            )
        return (
            "isotropic: canary j is torch.Generator().manual_seed(seeds[j]) standard normals "
            "over the clipped parameters laid end to end, normalized to C"
        )

    def path(self) -> Path | None:
        return None if self.out is None else self.out / R.PRIVATE_DIR / FILE

    def write(self) -> Path | None:
        p = self.path()
        if p is None:
            return None
        p.parent.mkdir(mode=0o700, exist_ok=True)
        os.chmod(p.parent, 0o700)
        _atomic_savez(
            p,
            meta=np.asarray(json.dumps(self.meta()), dtype=np.str_),
            seeds=self.seeds,
            included=self.included,
            participated=self.participated,
            observed=self.observed,
            cos_rounds=self.cos_rounds,
            cos_final=self.cos_final,
            coin_attempts=self.coin_attempts,
            **({} if self.proj_rounds is None else {"proj_rounds": self.proj_rounds}),
            **{f"initial/{k}": v for k, v in self._initial.items()},
            **self._support_arrays(),
        )
        os.chmod(p, 0o600)
        return p

    def _support_arrays(self) -> dict:
        ds = self._dense_set
        if ds is None or ds["mode"] != "disjoint":
            return {}
        return {"support": ds["perm"].numpy(), "signs": ds["signs"].numpy()}

    def _load(self) -> None:
        """A resumed run: the rounds already observed (same key, same seeds)."""
        p = self.path()
        if p is None or not p.exists():
            return
        z = read(p.parent.parent)
        if z is None or not np.array_equal(z["seeds"], self.seeds) or z["m"] != self.m:
            return
        n = min(self.rounds, z["cos_rounds"].shape[0])
        self.cos_rounds[:n] = z["cos_rounds"][:n]
        self.participated[:n] = z["participated"][:n]
        self.observed[:n] = z["observed"][:n]
        self.cos_final = z["cos_final"]
        self._initial = dict(z["initial"])
        if self.proj_rounds is not None and "proj_rounds" in z:
            self.proj_rounds[:n] = z["proj_rounds"][:n]
        if "coin_attempts" in z:
            self.coin_attempts[:n] = z["coin_attempts"][:n]


def read(run_dir: str | Path) -> dict | None:
    """The operator file of a run's canary clients (None when absent): ``meta`` (dict) and
    the arrays ``seeds``, ``included``, ``participated`` (rounds × M), ``observed``
    (rounds), ``cos_rounds`` (rounds × M), ``cos_final`` (M), ``initial`` (dict), and in
    files that have them ``coin_attempts`` (rounds) and, dense space, ``proj_rounds``
    (rounds × M)."""
    p = Path(run_dir) / R.PRIVATE_DIR / FILE
    if not p.exists():
        return None
    with np.load(p, allow_pickle=False) as z:
        d = {k: z[k] for k in z.files}
    meta = json.loads(str(d.pop("meta")))
    init = {k[len("initial/") :]: d.pop(k) for k in list(d) if k.startswith("initial/")}
    return {**d, "meta": meta, "m": int(meta["m"]), "initial": init}


__all__ = [
    "CONFORMANCE_NOTES",
    "CanaryClients",
    "check_supported",
    "read",
    "FILE",
    "SPACES",
    "SPACE_NOTES",
]

"""The observation file of a training done elsewhere (``fedlora-canary-observations/1``): what
a hook (:mod:`audit.canaries.hooks`, :mod:`audit.canaries.client_hook`) writes and the outside
audit (:mod:`audit.canaries.outside`) reads — one ``.npz`` of named arrays, loaded without
pickle — and what the file records of the run checked against the claim: a C, q, sampling,
count of steps or clients per round that differs from the claim's is a finding naming both
values (an error: exit 1), never a usage error (:func:`gradient_run`,
:func:`client_round_findings`, :func:`clip_findings`, :func:`stated_sigma`); and the
per-step tensors a hook is given, checked against the parameters' shapes
(:func:`step_tensors`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from fl.errors import UsageError

__all__ = [
    "CLIENTS_PER_ROUND_DIFFERS",
    "CLIP_DIFFERS",
    "OBS_FORMAT",
    "RUN_DIFFERS",
    "SAMPLE_RATE_DIFFERS",
    "SAMPLING_DIFFERS",
    "STATED_SIGMA_DIFFERS",
    "STEPS_DIFFERS",
    "ENTERED",
    "canaries_entered",
    "client_round_findings",
    "clip_findings",
    "gradient_run",
    "read_observations",
    "same",
    "scalar",
    "stated_sigma",
    "step_tensors",
    "write_observations",
]

OBS_FORMAT = "fedlora-canary-observations/1"


def write_observations(path, fields: dict) -> Path:
    """Write an observation file (``.npz``; ``.json`` also accepted by the reader)."""
    p = Path(path)
    arrays = {k: np.asarray(v) for k, v in {"format": OBS_FORMAT, **fields}.items()}
    if p.suffix == ".json":
        doc = {k: (v.tolist() if v.ndim else v.item()) for k, v in arrays.items()}
        from fl.io import atomic_write_json

        atomic_write_json(p, doc)
        return p
    if p.suffix != ".npz":
        p = p.with_suffix(p.suffix + ".npz") if p.suffix else p.with_suffix(".npz")
    tmp = p.with_name(f".{p.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, p)
    return p


def read_observations(path) -> dict:
    """An observation file as a dict of numpy arrays / Python scalars (``.npz`` or JSON)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--observations: file not found: {p}")
    try:
        if p.suffix == ".json":
            raw = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(raw, dict):
                raise ValueError("not an object")
            doc = {k: np.asarray(v) for k, v in raw.items()}
        else:
            with np.load(p, allow_pickle=False) as z:
                doc = {k: z[k] for k in z.files}
    except Exception as exc:  # any unreadable file (bad zip, pickle, JSON, encoding)
        raise UsageError(f"--observations: cannot read {p} ({type(exc).__name__}: {exc})") from None
    if str(doc.get("format", "")) != OBS_FORMAT:
        raise UsageError(f"--observations: {p} is not an observation file ({OBS_FORMAT})")
    return doc


# --------------------------------------------------------------------------- the run vs the claim


def scalar(obs: dict, key: str, where: str) -> float:
    """Field ``key`` of an observation file: one finite number, else a usage error."""
    if key not in obs or np.asarray(obs[key]).ndim != 0:
        raise UsageError(f"{where}: field {key!r} missing or not a number")
    try:
        v = float(obs[key])
    except (TypeError, ValueError):
        raise UsageError(f"{where}: field {key!r} is not a number") from None
    if not math.isfinite(v):
        raise UsageError(f"{where}: field {key!r} is not finite ({v})")
    return v


def same(a: float, b: float, rel: float = 1e-6) -> bool:
    """``a`` and ``b`` equal to a relative 1e-6 (a run's field against its claim's)."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


#: the findings of a run that differs from its claim (each an error: exit 1): the field the
#: observation file records for the run against the claim's (σ: :data:`STATED_SIGMA_DIFFERS`)
CLIP_DIFFERS = "clip_differs"
SAMPLE_RATE_DIFFERS = "sample_rate_differs"
SAMPLING_DIFFERS = "sampling_differs"
STEPS_DIFFERS = "steps_differs"
CLIENTS_PER_ROUND_DIFFERS = "clients_per_round_differs"
RUN_DIFFERS = (
    CLIP_DIFFERS,
    SAMPLE_RATE_DIFFERS,
    SAMPLING_DIFFERS,
    STEPS_DIFFERS,
    CLIENTS_PER_ROUND_DIFFERS,
)


def differs(code: str, where: str, text: str) -> dict:
    return {
        "code": code,
        "severity": "error",
        "message": f"{where}: {text} The run is not the mechanism its claim describes; the "
        "claim's ε is no statement about it.",
    }


def clip_findings(clip: float, claim, spec: dict, where: str) -> list[dict]:
    """The run's C (the observation file's) against the canary set's and the claim's: a
    finding each that differs (``clip_differs``)."""
    out = []
    if not same(clip, float(spec["clip"])):
        out.append(
            differs(
                CLIP_DIFFERS,
                where,
                f"the run clipped at C = {clip:g}, the canary set (made for the claim) at "
                f"C = {spec['clip']:g}.",
            )
        )
    if claim.clipping_norm is not None and not same(clip, claim.clipping_norm):
        out.append(
            differs(
                CLIP_DIFFERS,
                where,
                f"the run clipped at C = {clip:g}, the claim says clipping_norm = "
                f"{claim.clipping_norm:g}.",
            )
        )
    return out


#: the finding of an observation file whose σ is not the claim's (the trainer's own word:
#: reported, never used by a test)
STATED_SIGMA_DIFFERS = "stated_sigma_differs"


def stated_sigma(sigma: float, claim, where: str) -> dict | None:
    """A finding when the σ the observation file states differs from the claim's: an error
    when it is below (the training's own record says it added less noise than claimed), a
    warning when above. The tests use the claim's σ either way."""
    if same(sigma, claim.noise_multiplier):
        return None
    below = sigma < claim.noise_multiplier
    return {
        "code": STATED_SIGMA_DIFFERS,
        "severity": "error" if below else "warning",
        "message": f"{where}: the observation file states σ = {sigma:g}, the claim "
        f"noise_multiplier = {claim.noise_multiplier:g}. "
        + (
            "The training's own record says it added less noise than the claim accounts for. "
            if below
            else "The training's own record says it added more noise than claimed. "
        )
        + "The file's σ is the trainer's word: the conformance tests and the scores use the "
        "claim's σ, and test what the observations show.",
    }


def sampling_of(obs: dict, where: str) -> str | None:
    """The run's sampling as the hook recorded it (``poisson`` / ``shuffle``), or None."""
    if "sampling" not in obs:
        return None
    v = str(np.asarray(obs["sampling"]))
    if v not in ("poisson", "shuffle", "fixed_batch", "all", "unknown"):
        raise UsageError(f"{where}: field 'sampling' is {v!r}, not poisson / shuffle / unknown")
    return None if v == "unknown" else v


#: how a gradient hook's canaries entered the steps (field ``canaries_entered``):
#: ``per_example``, as per-example rows K·C·e_j before the training's own clip
#: (``GradientCanaryHook.canary_rows``, ``attach_opacus``), or ``clipped_sum``, as C·e_j
#: added to the clipped sum (``add_clipped``: the training's clip never sees them)
ENTERED = ("per_example", "clipped_sum")


def canaries_entered(obs: dict, where: str) -> str:
    """The field ``canaries_entered`` (:data:`ENTERED`); files of hooks that do not record
    it hold per-example rows (before ``add_clipped`` was told apart, a file of its canaries
    reads as per-example: its two-sided clip test still holds, the clip itself was not
    exercised)."""
    if "canaries_entered" not in obs:
        return "per_example"
    v = str(np.asarray(obs["canaries_entered"]))
    if v not in ENTERED:
        raise UsageError(f"{where}: field 'canaries_entered' is {v!r}, not {' / '.join(ENTERED)}")
    return v


def gradient_run(obs: dict, steps: int, claim, spec: dict, where: str, notes: list) -> dict:
    """What a gradient hook's file says of the run (σ, C, q, sampling) and, in
    ``findings``, each way the run differs from the claim: its C (:func:`clip_findings`),
    its sampling (``sampling_differs``: Opacus's shuffled batches under a Poisson claim), its
    q (``sample_rate_differs``; Opacus's 1/ceil(n/B) is read as the claim's rate when that
    explains it), more steps than claimed (``steps_differs``); fewer is a note."""
    from audit.claims.mistakes import opacus_sample_rate

    sigma = scalar(obs, "sigma", where)
    clip = scalar(obs, "clip", where)
    q = scalar(obs, "q", where)
    if not 0 < q <= 1:
        raise UsageError(f"{where}: field 'q' is {q:g}, not a sampling rate in (0, 1]")
    own = clip_findings(clip, claim, spec, where)
    sampling = sampling_of(obs, where)
    if sampling is not None and sampling != claim.sampling:
        own.append(
            differs(
                SAMPLING_DIFFERS,
                where,
                f"the run drew {sampling!r} batches, the claim's sampling is "
                f"{claim.sampling!r}"
                + (
                    " (Opacus with poisson_sampling=False shuffles, and its accountant "
                    "counts the shuffled batches as Poisson at q = 1/len(loader): the "
                    "amplification by Poisson sampling the claim takes does not hold)."
                    if sampling == "shuffle" and claim.sampling == "poisson"
                    else "."
                ),
            )
        )
    if claim.sampling == "poisson":
        rates = [claim.record_rate] + [r for r in [opacus_sample_rate(claim)] if r is not None]
        if not any(same(q, r) for r in rates):
            own.append(
                differs(
                    SAMPLE_RATE_DIFFERS,
                    where,
                    f"the run sampled at q = {q:g}, the claim's rate is "
                    + " or ".join(f"{r:g}" for r in rates)
                    + ".",
                )
            )
    elif not same(q, 1.0):
        if sampling is not None and sampling == claim.sampling:
            notes.append(
                f"the canaries entered each step with probability q = {q:g} (the hook's "
                f"coins), the claim's {claim.sampling!r} batches every record once an epoch: "
                "a weaker test than canaries in every step"
            )
        else:
            own.append(
                differs(
                    SAMPLE_RATE_DIFFERS,
                    where,
                    f"the canaries were sampled at q = {q:g}, but the claim's sampling is "
                    f"{claim.sampling!r}, which accounts every step at full sensitivity: a "
                    "canary must then take part in every step (sample_rate=1 to the hook).",
                )
            )
    claimed_steps = claim.rounds * claim.steps_per_round
    if steps > claimed_steps:
        own.append(
            differs(
                STEPS_DIFFERS,
                where,
                f"the run took {steps} DP-SGD steps, the claim accounts {claimed_steps} "
                "(rounds × steps_per_round).",
            )
        )
    if steps < claimed_steps:
        notes.append(
            f"{steps} of the claim's {claimed_steps} steps observed: the bound concerns "
            "the observed steps"
        )
    entered = canaries_entered(obs, where)
    return {
        "sigma": sigma,
        "clip": clip,
        "q": q,
        "sampling": sampling,
        "entered": entered,
        "findings": own,
    }


def client_round_findings(per_round: int, t: int, claim, where: str, notes: list) -> list[dict]:
    """A canary-client hook's run against the claim: the server's denominator m
    (``clients_per_round_differs``) and more rounds than claimed (``steps_differs``)."""
    own = []
    if per_round != claim.clients_per_round:
        own.append(
            differs(
                CLIENTS_PER_ROUND_DIFFERS,
                where,
                f"the server divided by {per_round} clients per round, the claim says "
                f"clients_per_round = {claim.clients_per_round}.",
            )
        )
    releases = claim.rounds * claim.steps_per_round
    if t > releases:
        own.append(
            differs(
                STEPS_DIFFERS,
                where,
                f"the run released {t} rounds, the claim accounts {releases} "
                "(rounds × steps_per_round).",
            )
        )
    if t < releases:
        notes.append(f"{t} of the claim's {releases} releases observed")
    return own


# --------------------------------------------------------------------------- a step's tensors


def step_tensors(xs, names: list[str], params: list, what: str) -> list:
    """A hook's per-step tensors ``xs`` (a list in bound order, or a dict by name; numpy
    arrays accepted) checked against the bound parameters: one per parameter, each of its
    parameter's shape or that parameter flattened. A slip (per-sample values, another
    parameter's tensor, a missing one, one tensor for all) is named, expected against
    given (:class:`fl.errors.UsageError`)."""
    import torch

    if isinstance(xs, dict):
        missing = [n for n in names if n not in xs]
        if missing:
            more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
            raise UsageError(
                f"{what}: no tensor for parameter(s) {missing[:3]}{more}; expected one per "
                f"bound parameter ({len(names)})"
            )
        xs = [xs[n] for n in names]
    elif isinstance(xs, torch.Tensor | np.ndarray):
        raise UsageError(
            f"{what}: expected a list of {len(names)} tensors (one per bound parameter, in "
            f"bind() order) or a dict by name, got one {type(xs).__name__} of shape "
            f"{tuple(xs.shape)}"
        )
    xs = list(xs)
    if len(xs) != len(params):
        raise UsageError(
            f"{what}: expected {len(params)} tensors (one per bound parameter), got {len(xs)}"
        )
    out = []
    for n, p, t in zip(names, params, xs):
        t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{what}: parameter {n!r}: expected a tensor, got {type(t).__name__}")
        if tuple(t.shape) not in (tuple(p.shape), (p.numel(),)):
            per_sample = t.dim() == p.dim() + 1 and tuple(t.shape[1:]) == tuple(p.shape)
            raise UsageError(
                f"{what}: parameter {n!r} has shape {tuple(p.shape)}, the tensor given for it "
                f"{tuple(t.shape)}"
                + (
                    " (a leading dimension of per-sample values: give the noisy SUM over the batch)"
                    if per_sample
                    else ""
                )
            )
        out.append(t)
    return out

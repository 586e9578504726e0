"""Neighbour replay of a pfl training at user level, pfl patched at import (#47).

:func:`replay_pfl` runs a pfl training (a callable that simulates once, in this process) on
its users' data D with every release recorded, then once per neighbour D′ in which one user's
statistics are changed, with every random draw frozen, and compares what entered each noise
call (:class:`audit.replay.record.Recorder`), with the driver of :mod:`audit.replay.flower`.

**The noise primitive.** pfl's central mechanisms add their noise in ``add_noise(statistics,
cohort_size, ...)`` (``GaussianMechanism``: pfl/privacy/gaussian_mechanism.py;
``LaplaceMechanism``; any class of ``pfl.privacy`` that defines it, except ``NoPrivacy``);
``CentrallyAppliedPrivacyMechanism.postprocess_server`` calls it on the aggregate of the
cohort's clipped statistics. Each class's ``add_noise`` is wrapped: the statistics entering
it (``get_weights()``) are q(D), the statistics it returns minus q(D) are its noise; one
release per call (every array a part), scoped by the central iteration (read from the
``central_context`` of the caller). On D′ pfl still draws its noise (its generators advance
as on D) and the returned statistics are D's recorded output, so both runs follow one
trajectory.

**The bound.** A user's data changed (replace-one-user) moves the sum of clipped statistics by
up to 2C; pfl's noise is calibrated to C (Gaussian std = σ·C, Laplace scale C/ε), so the
bound is **2·C·σ_mech/σ** (σ_mech: ``relative_noise_stddev``, or 1/ε for Laplace; σ the
larger of the claim's noise multiplier and σ_mech): a mechanism built with less noise than claimed,
or a weighting applied after the clip (``WeightByDatapoints`` after the mechanism multiplies
a clipped update by its user's row count), exceeds it. Laplace's sensitivity is ℓ1; the
replay measures ℓ2 (≤ ℓ1): a violation is certain, a pass is for ℓ2.

**Neighbours** (:data:`PFL_KINDS`), applied to the statistics the algorithm's
``simulate_one_user`` returns for one user, the real user the sampler drew most often on D:
replaced (the opposite update), an update of norm 10³·C, no data (a zero update), NaN.

**Frozen.** numpy's, Python's and torch's global generators are reset to one snapshot before
each run (pfl seeds its sampler and noise from numpy's global state).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable

import numpy as np

from audit.replay.flower import ClientReplayState, claim_value, parse_client_kinds, replay_clients

__all__ = ["PFL_KINDS", "DEFAULT_PFL", "replay_pfl"]

#: kind -> what the neighbour user does
PFL_KINDS = {
    "replace": "one user's data changed: its update replaced by the opposite update",
    "huge": "one user's update replaced by one of norm 10³·C (the opposite direction)",
    "empty": "one user with no data: a zero update",
    "nan": "one user's update NaN",
}
DEFAULT_PFL = ("replace", "huge")
HUGE = 1e3

_P = ClientReplayState()
_DEPTH = [0]


def _to_np(t) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().cpu().numpy()
    return np.asarray(t, dtype=np.float64)


def _like(arr: np.ndarray, ref):
    """``arr`` in the type of ``ref`` (a torch tensor or a numpy array)."""
    if hasattr(ref, "detach"):
        import torch

        return torch.as_tensor(arr, dtype=ref.dtype, device=ref.device)
    return np.asarray(arr, dtype=np.asarray(ref).dtype)


def _change(kind: str, stats, clip: float):
    meta, weights = stats.get_weights()
    arrs = [_to_np(w) for w in weights]
    norm = math.sqrt(sum(float(np.sum(a * a)) for a in arrs))
    if kind == "nan":
        new = [np.full_like(a, np.nan) for a in arrs]
    elif kind == "empty":
        new = [np.zeros_like(a) for a in arrs]
    else:
        if norm == 0 or not math.isfinite(norm):
            arrs = [np.zeros_like(a) for a in arrs]
            arrs[0].flat[0], norm = 1.0, 1.0
        scale = -1.0 if kind == "replace" else -HUGE * clip / norm
        new = [a * scale for a in arrs]
    return stats.from_weights(meta, [_like(a, w) for a, w in zip(new, weights, strict=True)])


def _wrap_user(orig):
    def simulate_one_user(self, model, user_dataset, central_context, *a, **kw):
        _DEPTH[0] += 1  # an override calling super(): only the outermost call changes it
        try:
            stats, metrics = orig(self, model, user_dataset, central_context, *a, **kw)
        finally:
            _DEPTH[0] -= 1
        if _DEPTH[0]:
            return stats, metrics
        kind = _P.neighbour_of(getattr(user_dataset, "user_id", None))
        if kind is not None and stats is not None:
            stats = _change(kind, stats, _P.clip)
        return stats, metrics

    simulate_one_user.__wrapped__ = orig
    return simulate_one_user


def _mechanism_sigma(mech) -> tuple[float, float]:
    """(C, σ_mech) of a pfl mechanism: its clip and its noise in units of the clip."""
    from pfl.hyperparam.base import get_param_value

    c = float(get_param_value(getattr(mech, "_clipping_bound", 1.0)))
    if hasattr(mech, "relative_noise_stddev"):
        return c, float(mech.relative_noise_stddev)
    eps = getattr(mech, "_epsilon", None)
    return c, (1.0 / float(eps) if eps else math.nan)


def _wrap_noise(orig):
    import torch

    from fl.privacy import tap as taps

    def add_noise(self, statistics, cohort_size, *a, **kw):
        out, metrics = orig(self, statistics, cohort_size, *a, **kw)
        tap = taps.active()
        if tap is None or not _P.active:
            return out, metrics
        c, s_mech = _mechanism_sigma(self)
        s = max(_P.sigma or 0.0, s_mech) if math.isfinite(s_mech) else 0.0
        sens = 2.0 * c * s_mech / s if s > 0 else 2.0 * c
        labels = {}
        f = sys._getframe(1)
        for _ in range(8):
            cc = f.f_locals.get("central_context") if f else None
            if cc is not None and hasattr(cc, "current_central_iteration"):
                labels = {"round": int(cc.current_central_iteration)}
                break
            f = f.f_back if f else None
        _, before = statistics.get_weights()
        meta, after = out.get_weights()
        released = []
        with taps.scope(**labels):
            for i, (b, o) in enumerate(zip(before, after, strict=True)):
                v = torch.from_numpy(_to_np(b))
                noise = torch.from_numpy(_to_np(o)) - v
                r = taps.release("pfl", v, noise, sens, part=str(i))
                released.append(_like(r.numpy(), o))
        return out.from_weights(meta, released), metrics

    add_noise.__wrapped__ = orig
    return add_noise


@contextlib.contextmanager
def _patched_pfl():
    """Wrap ``add_noise`` of every ``pfl.privacy`` mechanism class that defines it (not
    ``NoPrivacy``) and ``simulate_one_user`` of every ``pfl.algorithm`` class that defines
    it; undone after the block."""
    import importlib
    import inspect

    undo = []

    def patch(cls, name, wrap):
        old = cls.__dict__[name]
        setattr(cls, name, wrap(old))
        undo.append((cls, name, old))

    seen = set()
    for modname in (
        "pfl.privacy.gaussian_mechanism",
        "pfl.privacy.laplace_mechanism",
        "pfl.privacy.privacy_mechanism",
        "pfl.privacy.approximate_mechanism",
        "pfl.privacy.ftrl_mechanism",
    ):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls in seen or not cls.__module__.startswith("pfl.privacy"):
                continue
            seen.add(cls)
            fn = cls.__dict__.get("add_noise")
            if fn is None or cls.__name__ == "NoPrivacy" or getattr(fn, "__isabstractmethod__", 0):
                continue
            patch(cls, "add_noise", _wrap_noise)
    base = importlib.import_module("pfl.algorithm.base")
    for _, cls in inspect.getmembers(base, inspect.isclass):
        fn = cls.__dict__.get("simulate_one_user")
        if fn is not None and not getattr(fn, "__isabstractmethod__", False) and cls not in seen:
            seen.add(cls)
            patch(cls, "simulate_one_user", _wrap_user)
    try:
        yield len(undo)
    finally:
        for cls, name, old in reversed(undo):
            setattr(cls, name, old)


def replay_pfl(
    simulate: Callable[[], object],
    *,
    claim=None,
    neighbours=None,
    eligible: Callable[[object], bool] | None = None,
    clip: float | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Replay a pfl training on user-level neighbours (module doc). ``simulate()`` trains
    once in this process (called once on D and once per neighbour); ``eligible(user_id)``:
    which users may be the neighbour (default all); ``claim`` (dict or Claim): its σ derives
    the bound and its C sizes the huge update (else ``clip``, default 1). Returns
    :func:`audit.replay.flower.replay_clients`'s dict."""
    kinds = parse_client_kinds(neighbours, PFL_KINDS, DEFAULT_PFL)
    global _P
    _P = ClientReplayState()
    _P.sigma = claim_value(claim, "noise_multiplier")
    _P.clip = claim_value(claim, "clipping_norm") or (clip if clip else 1.0)
    return replay_clients(
        simulate,
        library="pfl",
        state=_P,
        patches=_patched_pfl(),
        kinds=PFL_KINDS,
        neighbours=kinds,
        eligible=eligible,
        relation="replace-one-user: 2·C·σ_mech/σ (σ the larger of the claim's and σ_mech)",
        held_fixed={
            "generators": "numpy (pfl's sampler and noise seeds), random and torch reset to one "
            "snapshot before every run; every release's output is D's on D′",
            "neighbour": "the real user the sampler drew most often on D, changed in every "
            "round it is drawn",
        },
        log=log,
    )

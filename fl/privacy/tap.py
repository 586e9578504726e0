"""The release tap: the one place where the engine's noise meets the data.

Every DP release of the engine adds Gaussian noise to a data-dependent value q(D) (a
clipped sum): DP-SGD's step (:func:`fl.privacy.dpsgd.clip_and_noise`) and the server's
client-level aggregate (:class:`fl.methods.base`). Each calls :func:`release` with the
value, the noise and the sensitivity its accounting assumes; each local training's
Poisson batches pass through :func:`batches`. Without a tap (every ordinary run) both
return what they would have computed anyway (``value + noise``; the masks as drawn).

A *tap* (:class:`Tap`, installed with :func:`tapped`) sees every release: the neighbour
replay (:mod:`audit.replay`) records q(D) and the noisy output in a run on D, then runs
the same training on a neighbour D′ and, at each release, hands back the recorded output
(so both runs follow one trajectory) while it keeps q(D′) to compare. ``scope`` labels
each release with where it happened (round, client, stage), so a replay can tell a
missing or extra release from a changed one. This module holds no audit logic: it is the
seam (``fl`` imports no ``audit``).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

__all__ = [
    "Tap",
    "active",
    "tapped",
    "scope",
    "release",
    "batches",
    "deliver",
    "current_scope",
]

_TAP: ContextVar[Tap | None] = ContextVar("fedlora_release_tap", default=None)
_SCOPE: ContextVar[tuple] = ContextVar("fedlora_release_scope", default=())


class Tap:
    """What a tap may change. The base class changes nothing (a tap that only watches
    overrides the methods and calls ``super()``)."""

    def release(
        self,
        kind: str,
        value: torch.Tensor,
        noise: torch.Tensor,
        sensitivity: float,
        part: str = "",
        released: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The released tensor for ``value`` (q(D), flat or shaped) and ``noise``.
        ``sensitivity``: the ℓ2 bound on ‖q(D) − q(D′)‖ the release's accounting assumes
        (over all parts of one release together); ``part``: the name of this tensor when
        one release is made of several (a client-level aggregate, one per state key).
        ``released``: what is actually released when it is a public map of value + noise
        computed by the caller (FedASK's B-sum from the W-space sum); default value + noise."""
        return value + noise.to(value.dtype) if released is None else released

    def batches(self, masks: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        """The Poisson batches of one local training: ``masks`` (one bool vector per step
        over the rows: the ``n`` examples first, then any sampler-canary rows)."""
        return masks

    def deliver(self, cid: str, stage: str, run):
        """One client's handling of one stage in process: ``run()`` computes it (the
        transport's ``Delivery``). A replay may hand back a recorded one instead of
        retraining a client whose data the neighbour does not change."""
        return run()


def active() -> Tap | None:
    """The installed tap, or None (every ordinary run)."""
    return _TAP.get()


@contextlib.contextmanager
def tapped(tap: Tap):
    """Install ``tap`` for the duration of the block (this thread / context only)."""
    token = _TAP.set(tap)
    try:
        yield tap
    finally:
        _TAP.reset(token)


@contextlib.contextmanager
def scope(**labels):
    """Label the releases made inside the block (nested scopes add labels)."""
    token = _SCOPE.set(_SCOPE.get() + tuple(sorted(labels.items())))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def current_scope() -> dict:
    """The labels of the releases made now (``{"round": 0, "client": "3", ...}``)."""
    return dict(_SCOPE.get())


def release(
    kind: str,
    value: torch.Tensor,
    noise: torch.Tensor,
    sensitivity: float,
    part: str = "",
    released: torch.Tensor | None = None,
) -> torch.Tensor:
    """``value + noise`` (or ``released``), through the installed tap if there is one (see
    :class:`Tap`). The result is a new tensor unless no tap is installed and ``value``
    may be reused (callers treat ``value`` as consumed)."""
    tap = _TAP.get()
    if tap is None:
        return value.add_(noise.to(value.dtype)) if released is None else released
    return tap.release(kind, value, noise, sensitivity, part, released)


def batches(masks: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The local training's Poisson masks, through the installed tap if there is one."""
    tap = _TAP.get()
    return masks if tap is None else tap.batches(masks, n)


def deliver(cid: str, stage: str, run):
    """One client's in-process handling of a stage, through the installed tap if any."""
    tap = _TAP.get()
    return run() if tap is None else tap.deliver(cid, stage, run)

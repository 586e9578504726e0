"""Which opacus releases the Opacus audit supports, and what each of them has.

Supported: opacus :data:`OLDEST` (2023) up to, not including, :data:`BEYOND` (1.4.0 …
1.6.x: 1.4.0 May 2023, 1.5 2024, 1.6.0 2025). What differs between them and matters here:

* ghost (fast gradient) clipping — ``opacus.optimizers.optimizer_fast_gradient_clipping``
  exists from 1.5 on (1.5: the user calls ``double_backward`` on per-sample losses; 1.6:
  ``make_private(..., criterion=...)`` returns ``DPLossFastGradientClipping``); on 1.4 the
  mode does not exist and is not looked for (:func:`ghost_optimizer_class` is None);
* adaptive clipping (``AdaClipDPOptimizer``) — up to 1.5 its ``__init__`` overwrites
  ``noise_multiplier`` with the adjusted σ_eff = (σ⁻² − (2σ_u)⁻²)^(−1/2) of the gradient
  noise, which Opacus's accountant then reads; from 1.6 ``noise_multiplier`` keeps the σ
  the user passed and σ_eff is computed in ``add_noise``. :func:`adaclip_overwrites_sigma`
  asks the installed class (a probe, not a version number).

:func:`check_version` is called on first use: a release outside the range is one clear
error naming the installed version and the supported range.
"""

from __future__ import annotations

import re

__all__ = [
    "BEYOND",
    "OLDEST",
    "SUPPORTED",
    "adaclip_overwrites_sigma",
    "check_version",
    "ghost_optimizer_class",
    "installed_version",
]

#: the oldest release supported (May 2023)
OLDEST = (1, 4, 0)
#: the first release not supported (not yet tried)
BEYOND = (1, 7, 0)
#: the range in words
SUPPORTED = "opacus >= 1.4.0, < 1.7 (1.4.0 … 1.6.x)"


def _parse(v: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", v.split("+")[0])[:3]
    return tuple(int(x) for x in nums) + (0,) * (3 - len(nums))


def installed_version() -> str:
    import opacus

    return str(getattr(opacus, "__version__", "unknown"))


def check_version(version: str | None = None) -> str:
    """The installed opacus version (or ``version``), or a ``RuntimeError`` in one line
    naming it and the supported range."""
    v = installed_version() if version is None else version
    try:
        t = _parse(v)
    except ValueError:
        t = ()
    if len(t) != 3 or not OLDEST <= t < BEYOND:
        raise RuntimeError(
            f"audit.libraries.opacus supports {SUPPORTED}; the installed opacus is {v}"
        )
    return v


def ghost_optimizer_class():
    """Opacus's ghost-clipping optimizer class, or None on a release without it (< 1.5)."""
    try:
        from opacus.optimizers.optimizer_fast_gradient_clipping import (
            DPOptimizerFastGradientClipping,
        )
    except ImportError:
        return None
    return DPOptimizerFastGradientClipping


def adaclip_optimizer_class():
    try:
        from opacus.optimizers.adaclipoptimizer import AdaClipDPOptimizer
    except ImportError:
        return None
    return AdaClipDPOptimizer


def _probe(cls) -> bool:
    import torch

    p = torch.nn.Parameter(torch.zeros(1))
    opt = cls(
        torch.optim.SGD([p], lr=0.1),
        noise_multiplier=1.0,
        target_unclipped_quantile=0.5,
        clipbound_learning_rate=0.2,
        max_clipbound=10.0,
        min_clipbound=0.1,
        unclipped_num_std=1.0,
        max_grad_norm=1.0,
        expected_batch_size=1,
    )
    return abs(float(opt.noise_multiplier) - 1.0) > 1e-12


def adaclip_overwrites_sigma(cls=None) -> bool:
    """Does ``AdaClipDPOptimizer`` (or ``cls``) keep the adjusted σ_eff in
    ``noise_multiplier`` (opacus ≤ 1.5) instead of the σ the user passed (1.6)? Asked of
    the class itself: built on one dummy parameter at σ = σ_u = 1."""
    cls = cls or adaclip_optimizer_class()
    return False if cls is None else _probe(cls)

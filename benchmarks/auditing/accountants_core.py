"""The accountant comparison's reference and harness (:mod:`benchmarks.auditing.accountants`):
dp-accounting's PLD built pessimistic and optimistic around each cell, the verdict of a
library's ε against it, and the one-line message when an extra is missing."""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType

SIGMAS = (0.5, 0.8, 1.0, 2.0, 5.0, 10.0)
QS = (1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0)
STEPS = (1, 10, 100, 1_000, 10_000, 100_000)
DELTAS = (1e-5, 1e-7, 1e-9)
GRIDS = {
    "full": dict(sigmas=SIGMAS, qs=QS, steps=STEPS, deltas=DELTAS),
    "quick": dict(sigmas=(0.8, 2.0), qs=(1e-3, 0.1, 1.0), steps=(1, 100), deltas=(1e-5, 1e-9)),
}

#: an understatement is a library ε below the optimistic PLD ε by more than this · max(1, ε)
REL_TOL = 1e-3
#: the reference's value discretisation (dp_accounting's default, the toolkit's headline)
H_REF = 1e-4
#: the optimistic PLD drifts down by ≈ steps·h/2: it is built at h = min(H_REF, this / steps)
OPT_DRIFT = 0.05
#: the largest composed PLD (points) and PRV domain (points) this benchmark lets a library build
PLD_MAX_POINTS = 4_000_000
PRV_MAX_POINTS = 4_000_000
#: the discretisation of the cheap PLD that sizes the real ones
_H_PROBE = 1e-2
#: Flower's PrivacyConfig population (q = sample_size / population)
FLWR_POPULATION = 10_000


#: the optional extras a library audit needs: extra -> (module, what ./scripts/setup.sh installs)
EXTRAS = {
    "pfl": (
        "pfl",
        ("pfl==0.6.0", "prv-accountant==0.2.0", "multiprocess==0.70.19", "dill==0.4.1")
        + ("wheel==0.45.1",),
    ),
}


class MissingExtra(ImportError):
    """An optional library is not installed; the message names the extra to install."""


def missing_extra_message(extra: str) -> str:
    """One line naming the extra (and the exact install) for a missing optional library."""
    module, pins = EXTRAS[extra]
    return (
        f"{module} is not installed: install the fedlora-audit extra [{extra}] with "
        f"./scripts/setup.sh (it runs: pip install --no-deps -c constraints.txt {' '.join(pins)})"
    )


def require_extra(extra: str, module: str | None = None) -> ModuleType:
    """Import ``module`` (default: the extra's library) or raise :class:`MissingExtra`."""
    name = module or EXTRAS[extra][0]
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise MissingExtra(missing_extra_message(extra)) from exc


# ---------------------------------------------------------------- the reference (dp-accounting)


def _pld(sigma: float, q: float, steps: int, h: float, pessimistic: bool):
    from dp_accounting.pld import privacy_loss_distribution as pld

    one = pld.from_gaussian_mechanism(
        sigma,
        sampling_prob=q,
        pessimistic_estimate=pessimistic,
        # connect-the-dots is pessimistic only; the optimistic bound uses privacy buckets
        use_connect_dots=pessimistic,
        value_discretization_interval=h,
    )
    return one if steps == 1 else one.self_compose(steps)


def pld_width(sigma: float, q: float, steps: int) -> float:
    """The width (in privacy loss) of the composed PLD, from a cheap one at h = 1e-2."""
    p = _pld(sigma, q, steps, _H_PROBE, True)
    # the size of each direction's pmf (PrivacyLossDistribution has no public accessor)
    return max(p._pmf_remove.size, p._pmf_add.size) * _H_PROBE  # noqa: SLF001


@dataclasses.dataclass
class Reference:
    """dp-accounting's ε of one (σ, q, steps) at each δ: an upper and a lower bound."""

    method: str  # "exact" (q = 1) or "pld"
    pessimistic: dict[float, float]
    optimistic: dict[float, float]
    h_pessimistic: float | None = None
    h_optimistic: float | None = None
    width: float | None = None  # privacy-loss width of the composed PLD
    seconds: float = 0.0


def reference(sigma: float, q: float, steps: int, deltas: Iterable[float]) -> Reference:
    """The reference bracket of ε at every δ (see the module docstring)."""
    import dp_accounting

    t0 = time.perf_counter()
    deltas = tuple(deltas)
    if q == 1.0:
        exact = {
            d: float(dp_accounting.get_epsilon_gaussian(sigma / math.sqrt(steps), d))
            for d in deltas
        }
        return Reference("exact", exact, dict(exact), seconds=time.perf_counter() - t0)
    width = pld_width(sigma, q, steps)
    floor = width / PLD_MAX_POINTS
    h_p = max(H_REF, floor)
    h_o = max(floor, min(H_REF, OPT_DRIFT / steps))
    pess = _pld(sigma, q, steps, h_p, True)
    opt = _pld(sigma, q, steps, h_o, False)
    return Reference(
        "pld",
        {d: max(0.0, float(pess.get_epsilon_for_delta(d))) for d in deltas},
        {d: max(0.0, float(opt.get_epsilon_for_delta(d))) for d in deltas},
        h_p,
        h_o,
        width,
        time.perf_counter() - t0,
    )


def verdict(eps: float, pessimistic: float, optimistic: float) -> dict:
    """The recorded criterion: ratio to the PLD upper estimate; finding = below the lower bound."""
    tol = REL_TOL * max(1.0, optimistic)
    finding = eps < optimistic - tol
    unresolved = not finding and eps < pessimistic - REL_TOL * max(1.0, pessimistic)
    if pessimistic > 0:
        ratio = eps / pessimistic
    else:  # the reference is ε = 0 (δ already covers the whole loss): no ratio
        ratio = None
    ratio_lower = eps / optimistic if optimistic > 0 else None
    return {
        "ratio": ratio,
        "ratio_to_lower": ratio_lower,
        "finding": finding,
        "unresolved": unresolved,
    }


# ---------------------------------------------------------------- outcomes


def short_text(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _notes(caught: list[warnings.WarningMessage]) -> list[str]:
    seen: list[str] = []
    for w in caught:
        s = short_text(f"{w.category.__name__}: {w.message}", 120)
        if s not in seen:
            seen.append(s)
    return seen


def attempt(fn: Callable[[], float]) -> dict:
    """Run one library call: ``ok`` with its ε, or ``refused`` with the reason it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        try:
            eps = float(fn())
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            out = {"status": "refused", "reason": short_text(f"{type(exc).__name__}: {exc}")}
        else:
            if math.isnan(eps):
                out = {"status": "refused", "reason": "returned NaN"}
            else:
                out = {"status": "ok", "epsilon": eps}
        out["seconds"] = round(time.perf_counter() - t0, 4)
    if caught:
        out["notes"] = _notes(caught)
    return out


def attempt_build(fn: Callable[[], object]) -> object:
    """Build a library object; on an exception, the ``refused`` outcome instead."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a refusal is a result
            return {"status": "refused", "reason": short_text(f"{type(exc).__name__}: {exc}")}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def not_applicable(reason: str) -> dict:
    return {"status": "n/a", "reason": reason}


def points_cap(kind: str, points: float, cap: int) -> str:
    return (
        f"{kind} of {points:.2g} points exceeds this benchmark's cap of {cap:.0e} "
        f"(~{points * 8 * 6 / 2**30:.1f} GiB of arrays)"
    )


# ---------------------------------------------------------------- the accountants

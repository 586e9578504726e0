"""The DP libraries' own accountants checked against dp-accounting's PLD (issue 43, item 3).

``python -m benchmarks.auditing.accountants [--quick] [--out benchmarks/results/accountants]``

For every cell of a grid (σ, q, steps, δ) — the Poisson-subsampled Gaussian mechanism (the plain
Gaussian at q = 1) composed ``steps`` times, add/remove-one neighbours — each library accountant
is asked for its ε through the library's public API, exactly as a user would get it:

- Opacus 1.6 (``opacus.accountants``): ``RDPAccountant``, ``PRVAccountant`` and
  ``GaussianAccountant`` ("gdp", Poisson), each fed ``steps`` calls of ``step()``;
- Flower 1.42: ``flwr.serverapp.RdpAccountant`` (a ``PrivacyConfig`` over a population of
  10 000, ``POISSON`` sampling at q < 1, ``NO_AMPLIFICATION`` at q = 1 — the only sampling its
  accounted DP strategies accept), and the ε that ``LocalDpMod`` takes for its noise
  (σ = Δ·√(2 ln(1.25/δ))/ε, one release: the cells q = 1, steps = 1 only);
- pfl 0.6 (``pfl.privacy``, the optional ``pfl`` extra): ``PLDPrivacyAccountant``,
  ``PRVPrivacyAccountant``, ``RDPPrivacyAccountant`` with ``noise_parameter=σ, delta=δ``;
- the toolkit itself (``fl.privacy.accounting.epsilon``: the PLD headline and RDP).

The reference is dp-accounting's privacy loss distribution of the same mechanism, built twice:
pessimistic (connect-the-dots; an upper bound on the true ε) and optimistic (privacy buckets,
``pessimistic_estimate=False``; a lower bound), at a value discretisation of 1e-4 or finer (the
optimistic one drifts down by about steps·h/2, so it is built at h = min(1e-4, 0.05/steps) where
memory allows), coarser only where the composed PLD would exceed 4 million points (recorded per
cell). At q = 1 the composition is exactly one Gaussian of multiplier σ/√steps and the
reference is its exact ε(δ) (Balle & Wang's analytic Gaussian, ``dp_accounting.get_epsilon_gaussian``).

Criterion (:func:`verdict`): a library ε is an **understatement** (a finding) when it lies below
the optimistic PLD ε — a lower bound on the true ε — by more than ``REL_TOL`` · max(1, ε_opt)
(the tolerance covers the 1e-15 tail mass the PLD composition adds and float error). A library ε
below the pessimistic PLD ε by more than that tolerance but not below the lower bound is
"unresolved" (the bracket is too wide to tell). The ratio is ε_lib / ε_PLD-pessimistic: above 1
the library is loose but safe (an overstatement, by that ratio).

A cell a library will not compute (it raises or returns NaN) is recorded as ``refused`` with its
reason; a cell whose PRV domain or PLD would exceed this benchmark's memory cap is ``skipped``
(the library would try to allocate it); a cell an accountant does not model is ``n/a``.

Writes ``results.json`` (every cell) and ``table.md`` (per accountant: cells compared, refused,
skipped, the largest ratio each way, findings and a minimal reproduction of the worst one) in
``--out``. One process; set ``OMP_NUM_THREADS=1`` for the timings to mean one thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
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


def _short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _notes(caught: list[warnings.WarningMessage]) -> list[str]:
    seen: list[str] = []
    for w in caught:
        s = _short(f"{w.category.__name__}: {w.message}", 120)
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
            out = {"status": "refused", "reason": _short(f"{type(exc).__name__}: {exc}")}
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
            return {"status": "refused", "reason": _short(f"{type(exc).__name__}: {exc}")}


def skipped(reason: str) -> dict:
    return {"status": "skipped", "reason": reason}


def not_applicable(reason: str) -> dict:
    return {"status": "n/a", "reason": reason}


def _cap(kind: str, points: float, cap: int) -> str:
    return (
        f"{kind} of {points:.2g} points exceeds this benchmark's cap of {cap:.0e} "
        f"(~{points * 8 * 6 / 2**30:.1f} GiB of arrays)"
    )


# ---------------------------------------------------------------- the accountants


@dataclasses.dataclass(frozen=True)
class Accountant:
    library: str
    name: str
    #: (σ, q, steps, deltas, reference) -> one outcome per δ
    run: Callable[[float, float, int, tuple[float, ...], Reference], list[dict]]
    version: Callable[[], str]
    extra: str | None = None

    @property
    def key(self) -> str:
        return f"{self.library}/{self.name}"


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _opacus_stepped(cls, sigma: float, q: float, steps: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GaussianAccountant warns that it is experimental
        acc = cls()
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    return acc


def opacus_rdp(sigma, q, steps, deltas, ref):
    from opacus.accountants import RDPAccountant

    acc = _opacus_stepped(RDPAccountant, sigma, q, steps)
    return [attempt(lambda d=d: acc.get_epsilon(delta=d)) for d in deltas]


def opacus_prv_points(sigma: float, q: float, steps: int, delta: float) -> float:
    """The domain PRVAccountant.get_epsilon(δ) builds (its defaults: eps_error 0.01, δ/1000)."""
    from opacus.accountants.analysis.prv import (
        PoissonSubsampledGaussianPRV,
        compute_safe_domain_size,
    )

    eps_error, delta_error = 0.01, delta / 1000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half = compute_safe_domain_size(
            prvs=[PoissonSubsampledGaussianPRV(q, sigma)],
            max_self_compositions=[steps],
            eps_error=eps_error,
            delta_error=delta_error,
        )
    mesh = eps_error / math.sqrt(steps * math.log(12 / delta_error) / 2)
    return 2 * half / mesh


def opacus_prv(sigma, q, steps, deltas, ref):
    from opacus.accountants import PRVAccountant

    acc = _opacus_stepped(PRVAccountant, sigma, q, steps)
    out = []
    for d in deltas:
        try:
            n = opacus_prv_points(sigma, q, steps, d)
        except Exception:  # noqa: BLE001 - let the library say why
            n = 0.0
        if n > PRV_MAX_POINTS:
            out.append(skipped(_cap("PRV domain", n, PRV_MAX_POINTS)))
        else:
            out.append(attempt(lambda d=d: acc.get_epsilon(delta=d)))
    return out


def opacus_gdp(sigma, q, steps, deltas, ref):
    from opacus.accountants import GaussianAccountant

    acc = _opacus_stepped(GaussianAccountant, sigma, q, steps)
    return [attempt(lambda d=d: acc.get_epsilon(delta=d, poisson=True)) for d in deltas]


def flwr_rdp(sigma, q, steps, deltas, ref):
    from flwr.serverapp import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )

    m = round(q * FLWR_POPULATION)
    sampling = SamplingMethod.POISSON if q < 1.0 else SamplingMethod.NO_AMPLIFICATION
    config = PrivacyConfig(
        target_delta=deltas[0],
        population_size=FLWR_POPULATION,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=sampling,
    )
    acc = RdpAccountant(config)
    acc.compose(GaussianPrivacyEvent(sigma, m, FLWR_POPULATION), count=steps)
    return [attempt(lambda d=d: acc.get_epsilon(d)) for d in deltas]


def localdp_claimed_epsilon(sigma: float, delta: float) -> float:
    """The ε for which Flower's LocalDpMod adds noise of std σ·Δ (clientapp/mod/localdp_mod.py:
    ``std_dev = sensitivity * sqrt(2 ln(1.25/δ)) / ε``): the classical Gaussian mechanism."""
    return math.sqrt(2 * math.log(1.25 / delta)) / sigma


def flwr_localdp(sigma, q, steps, deltas, ref):
    if q != 1.0 or steps != 1:
        why = "one Gaussian release per call: no sampling, no composition (q = 1, steps = 1 only)"
        return [not_applicable(why) for _ in deltas]
    return [attempt(lambda d=d: localdp_claimed_epsilon(sigma, d)) for d in deltas]


def _pfl_privacy():
    return require_extra("pfl", "pfl.privacy")


def _field_default(cls, name: str):
    return {f.name: f.default for f in dataclasses.fields(cls)}[name]


def pfl_pld(sigma, q, steps, deltas, ref):
    """pfl's PLDPrivacyAccountant(steps, q, "gaussian", noise_parameter=σ, delta=δ).epsilon, built
    once for all δ: ``get_composed_accountant`` with the class defaults, then
    ``get_epsilon_for_delta`` — the calls its ``__post_init__`` makes (the test holds the
    constructor to the same figures)."""
    cls = _pfl_privacy().PLDPrivacyAccountant
    h = _field_default(cls, "value_discretization_interval")
    n = (ref.width if ref.width is not None else pld_width(sigma, q, steps)) / h
    if n > PLD_MAX_POINTS:
        return [skipped(_cap(f"PLD at h = {h:g}", n, PLD_MAX_POINTS)) for _ in deltas]
    built = attempt_build(
        lambda: cls.get_composed_accountant(
            "gaussian",
            sigma,
            _field_default(cls, "pessimistic_estimate"),
            q,
            _field_default(cls, "use_connect_dots"),
            h,
            steps,
        )
    )
    if isinstance(built, dict):
        return [built for _ in deltas]
    return [attempt(lambda d=d: built.get_epsilon_for_delta(d)) for d in deltas]


def pfl_prv_points(sigma: float, q: float, steps: int) -> float:
    """The domain pfl's PRVPrivacyAccountant builds (its eps_error 0.07, delta_error 1e-10)."""
    from prv_accountant import PoissonSubsampledGaussianMechanism
    from prv_accountant.accountant import compute_safe_domain_size

    cls = _pfl_privacy().PRVPrivacyAccountant
    eps_error = _field_default(cls, "eps_error")
    delta_error = _field_default(cls, "delta_error")
    half = compute_safe_domain_size(
        [PoissonSubsampledGaussianMechanism(q, sigma)], [steps], eps_error, delta_error
    )
    mesh = eps_error / math.sqrt(steps / 2 * math.log(12 / delta_error))
    return 2 * half / mesh


def pfl_prv(sigma, q, steps, deltas, ref):
    """pfl's PRVPrivacyAccountant(...).epsilon — the PRV *estimate*, not its upper bound (pfl
    privacy_accountant.py, ``compute_epsilon(...)[1]``) — built once: the domain does not depend
    on δ (its delta_error is a fixed 1e-10)."""
    cls = _pfl_privacy().PRVPrivacyAccountant
    try:
        n = pfl_prv_points(sigma, q, steps)
    except Exception:  # noqa: BLE001 - let the library say why
        n = 0.0
    if n > PRV_MAX_POINTS:
        return [skipped(_cap("PRV domain", n, PRV_MAX_POINTS)) for _ in deltas]
    built = attempt_build(
        lambda: cls.get_composed_accountant(
            "gaussian",
            sigma,
            q,
            steps,
            _field_default(cls, "eps_error"),
            _field_default(cls, "delta_error"),
        )
    )
    if isinstance(built, dict):
        return [built for _ in deltas]
    return [attempt(lambda d=d: built.compute_epsilon(d, steps)[1]) for d in deltas]


def pfl_rdp(sigma, q, steps, deltas, ref):
    cls = _pfl_privacy().RDPPrivacyAccountant

    def eps(d: float) -> float:
        return cls(steps, q, "gaussian", noise_parameter=sigma, delta=d).epsilon

    return [attempt(lambda d=d: eps(d)) for d in deltas]


def toolkit(accountant: str):
    def run(sigma, q, steps, deltas, ref):
        from fl.privacy.accounting import epsilon

        if accountant == "pld":
            # q < 1: the PLD of the reference's pessimistic build; q = 1: one Gaussian σ/√steps
            # q = 1: PLDAccountant builds one Gaussian of multiplier σ/√steps, whose loss
            # (x − 1/2)/σ'² spans ±~10σ' of noise (mass truncation e^-50): 20/σ' wide
            width = ref.width if q < 1.0 else 20 * math.sqrt(steps) / sigma
            n = width / H_REF
            if n > PLD_MAX_POINTS:
                return [skipped(_cap(f"PLD at h = {H_REF:g}", n, PLD_MAX_POINTS)) for _ in deltas]
        return [attempt(lambda d=d: epsilon(sigma, q, steps, d, accountant)) for d in deltas]

    return run


ACCOUNTANTS: tuple[Accountant, ...] = (
    Accountant("opacus", "rdp", opacus_rdp, lambda: _dist_version("opacus")),
    Accountant("opacus", "prv", opacus_prv, lambda: _dist_version("opacus")),
    Accountant("opacus", "gdp", opacus_gdp, lambda: _dist_version("opacus")),
    Accountant("flwr", "rdp", flwr_rdp, lambda: _dist_version("flwr")),
    Accountant("flwr", "localdp", flwr_localdp, lambda: _dist_version("flwr")),
    Accountant("pfl", "pld", pfl_pld, lambda: _dist_version("pfl"), extra="pfl"),
    Accountant(
        "pfl",
        "prv",
        pfl_prv,
        lambda: f"{_dist_version('pfl')} (prv-accountant {_dist_version('prv-accountant')})",
        extra="pfl",
    ),
    Accountant("pfl", "rdp", pfl_rdp, lambda: _dist_version("pfl"), extra="pfl"),
    Accountant("fedlora-audit", "pld", toolkit("pld"), lambda: "this checkout"),
    Accountant("fedlora-audit", "rdp", toolkit("rdp"), lambda: "this checkout"),
)


# ---------------------------------------------------------------- the grid


def cells(grid: dict) -> list[tuple[float, float, int]]:
    return [(s, q, t) for s in grid["sigmas"] for q in grid["qs"] for t in grid["steps"]]


def compare(
    sigma: float,
    q: float,
    steps: int,
    deltas: tuple[float, ...],
    accountants: Iterable[Accountant] = ACCOUNTANTS,
    ref: Reference | None = None,
) -> list[dict]:
    """Every accountant's outcome on (σ, q, steps) at each δ, with the reference and verdict."""
    ref = ref or reference(sigma, q, steps, deltas)
    rows = []
    for acc in accountants:
        t0 = time.perf_counter()
        try:
            outcomes = acc.run(sigma, q, steps, deltas, ref)
        except MissingExtra as exc:
            outcomes = [skipped(str(exc)) for _ in deltas]
        except Exception as exc:  # noqa: BLE001 - building the accountant failed
            why = _short(f"{type(exc).__name__}: {exc}")
            outcomes = [{"status": "refused", "reason": why} for _ in deltas]
        seconds = time.perf_counter() - t0
        for d, out in zip(deltas, outcomes, strict=True):
            row = {
                "library": acc.library,
                "accountant": acc.name,
                "sigma": sigma,
                "q": q,
                "steps": steps,
                "delta": d,
                **out,
                "reference": ref.method,
                "pld_pessimistic": ref.pessimistic[d],
                "pld_optimistic": ref.optimistic[d],
                "h_pessimistic": ref.h_pessimistic,
                "h_optimistic": ref.h_optimistic,
            }
            if out["status"] == "ok":
                row.update(verdict(out["epsilon"], ref.pessimistic[d], ref.optimistic[d]))
            row.setdefault("seconds", round(seconds / len(deltas), 4))
            rows.append(row)
    return rows


# ---------------------------------------------------------------- summary and table


def _cell_text(r: dict) -> str:
    return f"σ={r['sigma']:g}, q={r['q']:g}, steps={r['steps']}, δ={r['delta']:g}"


def _fmt(x: float | None, digits: int = 4) -> str:
    if x is None:
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}g}"


#: the overstatement ratio is also reported over cells whose PLD ε is at least this (near ε = 0
#: any additive slack, e.g. a PRV's eps_error, gives an unbounded ratio)
EPS_MEANINGFUL = 1.0


def _finding_text(r: dict) -> dict:
    return {
        "cell": _cell_text(r),
        "epsilon": r["epsilon"],
        "pld_optimistic": r["pld_optimistic"],
        "pld_pessimistic": r["pld_pessimistic"],
        "ratio_to_lower": r["ratio_to_lower"],
        "gap": r["pld_optimistic"] - r["epsilon"],
        "reproduction": reproduction(r),
    }


def summarize(rows: list[dict]) -> list[dict]:
    """Per accountant: counts, the largest ratio each way (with its cell), the findings."""
    out = []
    keys = list(dict.fromkeys((r["library"], r["accountant"]) for r in rows))
    for lib, name in keys:
        rs = [r for r in rows if (r["library"], r["accountant"]) == (lib, name)]
        ok = [r for r in rs if r["status"] == "ok"]
        with_ratio = [r for r in ok if r.get("ratio") is not None]
        finite = [r for r in with_ratio if math.isfinite(r["ratio"])]
        big = [r for r in finite if r["pld_pessimistic"] >= EPS_MEANINGFUL]
        lo = min(with_ratio, key=lambda r: r["ratio"], default=None)
        hi = max(finite, key=lambda r: r["ratio"], default=None)
        hi_big = max(big, key=lambda r: r["ratio"], default=None)
        findings = [r for r in ok if r.get("finding")]
        worst = min(findings, key=lambda r: r["ratio_to_lower"] or 0.0, default=None)
        widest = max(findings, key=lambda r: r["pld_optimistic"] - r["epsilon"], default=None)
        reasons: dict[str, int] = {}
        for r in rs:
            if r["status"] in ("refused", "skipped"):
                k = f"{r['status']}: {_reason_kind(r['reason'])}"
                reasons[k] = reasons.get(k, 0) + 1
        out.append(
            {
                "library": lib,
                "accountant": name,
                "cells": len(rs),
                "compared": len(ok),
                "refused": sum(r["status"] == "refused" for r in rs),
                "skipped": sum(r["status"] == "skipped" for r in rs),
                "not_applicable": sum(r["status"] == "n/a" for r in rs),
                "infinite": sum(math.isinf(r["epsilon"]) for r in ok),
                "min_ratio": lo and lo["ratio"],
                "min_ratio_cell": lo and _cell_text(lo),
                "max_ratio": hi and hi["ratio"],
                "max_ratio_cell": hi and _cell_text(hi),
                "max_ratio_eps_ge_1": hi_big and hi_big["ratio"],
                "max_ratio_eps_ge_1_cell": hi_big and _cell_text(hi_big),
                "findings": len(findings),
                "unresolved": sum(bool(r.get("unresolved")) for r in ok),
                "worst_finding": worst and _finding_text(worst),
                "widest_finding": widest and _finding_text(widest),
                "reasons": reasons,
            }
        )
    return out


def _reason_kind(reason: str) -> str:
    """A refusal's reason without its numbers, so that like refusals count together."""
    if "exceeds this benchmark's cap" in reason:
        return reason.split(" of ")[0] + " over the benchmark's memory cap"
    if "is not installed" in reason:
        return "extra not installed"
    return _short(reason.split(":")[0] + ": " + reason.split(":", 1)[-1].split(".")[0], 90)


_LOWER = {
    "exact": "import math, dp_accounting\n"
    "print(dp_accounting.get_epsilon_gaussian({sigma} / math.sqrt({steps}), {delta}))"
    "  # exact ε (q = 1)",
    "pld": "from dp_accounting.pld import privacy_loss_distribution as pld\n"
    "low = pld.from_gaussian_mechanism({sigma}, sampling_prob={q}, pessimistic_estimate=False,\n"
    "    use_connect_dots=False, value_discretization_interval={h})"
    "{compose}\n"
    "print(low.get_epsilon_for_delta({delta}))  # a lower bound on the true ε",
}
_LIBRARY = {
    ("opacus", "rdp"): "from opacus.accountants import RDPAccountant\nacc = RDPAccountant()\n"
    "for _ in range({steps}): acc.step(noise_multiplier={sigma}, sample_rate={q})\n"
    "print(acc.get_epsilon(delta={delta}))",
    ("opacus", "prv"): "from opacus.accountants import PRVAccountant\nacc = PRVAccountant()\n"
    "for _ in range({steps}): acc.step(noise_multiplier={sigma}, sample_rate={q})\n"
    "print(acc.get_epsilon(delta={delta}))",
    ("opacus", "gdp"): "from opacus.accountants import GaussianAccountant\n"
    "acc = GaussianAccountant()\n"
    "for _ in range({steps}): acc.step(noise_multiplier={sigma}, sample_rate={q})\n"
    "print(acc.get_epsilon(delta={delta}, poisson=True))",
    ("flwr", "rdp"): "from flwr.serverapp import (GaussianPrivacyEvent, NeighboringRelation,\n"
    "    PrivacyConfig, RdpAccountant, SamplingMethod)\n"
    "cfg = PrivacyConfig({delta}, {pop}, NeighboringRelation.ADD_OR_REMOVE_ONE,\n"
    "    SamplingMethod.{sampling})\n"
    "acc = RdpAccountant(cfg)\nacc.compose(GaussianPrivacyEvent({sigma}, {m}, {pop}), count={steps})\n"
    "print(acc.get_epsilon({delta}))",
    ("flwr", "localdp"): "import math  # flwr LocalDpMod(clipping_norm, sensitivity=1, epsilon, "
    "delta={delta}) adds\n"
    "# noise of std sqrt(2 ln(1.25/δ))/ε (flwr/clientapp/mod/localdp_mod.py): std {sigma} is "
    "claimed as\n"
    "print(math.sqrt(2 * math.log(1.25 / {delta})) / {sigma})",
    ("pfl", "pld"): "from pfl.privacy import PLDPrivacyAccountant\n"
    "print(PLDPrivacyAccountant({steps}, {q}, 'gaussian', noise_parameter={sigma}, "
    "delta={delta}).epsilon)",
    ("pfl", "prv"): "from pfl.privacy import PRVPrivacyAccountant\n"
    "print(PRVPrivacyAccountant({steps}, {q}, 'gaussian', noise_parameter={sigma}, "
    "delta={delta}).epsilon)",
    ("pfl", "rdp"): "from pfl.privacy import RDPPrivacyAccountant\n"
    "print(RDPPrivacyAccountant({steps}, {q}, 'gaussian', noise_parameter={sigma}, "
    "delta={delta}).epsilon)",
    ("fedlora-audit", "pld"): "from fl.privacy.accounting import epsilon\n"
    "print(epsilon({sigma}, {q}, {steps}, {delta}, 'pld'))",
    ("fedlora-audit", "rdp"): "from fl.privacy.accounting import epsilon\n"
    "print(epsilon({sigma}, {q}, {steps}, {delta}, 'rdp'))",
}


def reproduction(r: dict) -> str:
    """A few lines of Python that print the library's ε and the reference lower bound."""
    v = dict(
        sigma=r["sigma"],
        q=r["q"],
        steps=r["steps"],
        delta=r["delta"],
        h=r.get("h_optimistic"),
        pop=FLWR_POPULATION,
        m=round(r["q"] * FLWR_POPULATION),
        sampling="POISSON" if r["q"] < 1 else "NO_AMPLIFICATION",
        compose="" if r["steps"] == 1 else f".self_compose({r['steps']})",
    )
    lib = _LIBRARY[(r["library"], r["accountant"])].format(**v)
    low = _LOWER[r["reference"]].format(**v)
    return f"{lib}  # library: {r['epsilon']:.6g}\n{low}  # {r['pld_optimistic']:.6g}"


def table(meta: dict, summary: list[dict]) -> str:
    lines = [
        "# Library accountants checked against dp-accounting's PLD",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {meta['machine']}",
        f"- date: {meta['date']}",
        f"- commit: {meta['commit']}{' (with uncommitted changes)' if meta.get('dirty') else ''}",
        f"- versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items())}",
        f"- grid: σ ∈ {list(meta['grid']['sigmas'])}, q ∈ {list(meta['grid']['qs'])}, "
        f"steps ∈ {list(meta['grid']['steps'])}, δ ∈ {list(meta['grid']['deltas'])} "
        f"({meta['cells_per_accountant']} cells per accountant)",
        f"- wall time: {meta['wall_s']:.0f} s",
        "",
        f"Criterion: **finding** = library ε < PLD optimistic ε (a lower bound on the true ε) − "
        f"{REL_TOL:g}·max(1, ε_opt). ratio = library ε / PLD pessimistic ε (an upper bound; h = "
        f"{H_REF:g} or finer, coarser only above {PLD_MAX_POINTS:.0e} points); q = 1 is "
        "referenced to the exact Gaussian ε(δ) of σ/√steps. 'unresolved': below the upper "
        "bound, above the lower bound. 'skipped': the library would build a PRV domain or PLD "
        "over this benchmark's memory cap. min/max ratio leave out cells whose reference ε is 0; "
        f"near ε = 0 an additive slack gives any ratio, hence the column at ε_PLD ≥ "
        f"{EPS_MEANINGFUL:g}.",
        "",
        "| library | accountant | version | compared | refused | skipped | n/a | min ratio "
        "(cell) | max ratio (cell) | max ratio where ε_PLD ≥ 1 (cell) | ε = ∞ | findings "
        "| unresolved |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['library']} | {s['accountant']} | {meta['accountant_versions'][s['library'] + '/' + s['accountant']]} "
            f"| {s['compared']} | {s['refused']} | {s['skipped']} | {s['not_applicable']} "
            f"| {_fmt(s['min_ratio'])} ({s['min_ratio_cell'] or '–'}) "
            f"| {_fmt(s['max_ratio'])} ({s['max_ratio_cell'] or '–'}) "
            f"| {_fmt(s['max_ratio_eps_ge_1'])} ({s['max_ratio_eps_ge_1_cell'] or '–'}) "
            f"| {s['infinite']} "
            f"| **{s['findings']}** | {s['unresolved']} |"
        )
    lines += ["", "## Refused and skipped cells", ""]
    for s in summary:
        for k, n in s["reasons"].items():
            lines.append(f"- {s['library']}/{s['accountant']}: {n} × {k}")
    lines += ["", "## Findings (understatements), the worst of each accountant", ""]
    any_finding = False
    for s in summary:
        w = s["worst_finding"]
        if not w:
            continue
        any_finding = True
        v = s["widest_finding"]
        lines += [
            f"### {s['library']}/{s['accountant']}: {s['findings']} cells",
            "",
            f"Worst by ratio, at {w['cell']}: library ε = {w['epsilon']:.6g}, PLD lower bound "
            f"{w['pld_optimistic']:.6g}, upper bound {w['pld_pessimistic']:.6g} (library / "
            f"lower = {_fmt(w['ratio_to_lower'])}). Largest gap, at {v['cell']}: library ε = "
            f"{v['epsilon']:.6g} against a lower bound of {v['pld_optimistic']:.6g} "
            f"({v['gap']:.4g} below).",
            "",
            "```python",
            w["reproduction"],
            "```",
            "",
        ]
    if not any_finding:
        lines.append("None.")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def _meta(argv: list[str], grid: dict, accountants: Iterable[Accountant]) -> dict:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout
        except Exception:  # noqa: BLE001 - not a checkout
            return ""

    return {
        "command": " ".join(["OMP_NUM_THREADS=1 python -m benchmarks.auditing.accountants", *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git("rev-parse", "HEAD").strip() or "?",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs "
        f"(one process, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
        f"Python {platform.python_version()}, load average at start "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}",
        "versions": {
            n: _dist_version(n)
            for n in ("dp-accounting", "opacus", "flwr", "pfl", "prv-accountant", "numpy", "scipy")
        },
        "accountant_versions": {a.key: a.version() for a in accountants},
        "grid": grid,
        "cells_per_accountant": len(cells(grid)) * len(grid["deltas"]),
        "criterion": {
            "finding": "library ε < PLD optimistic ε − REL_TOL·max(1, PLD optimistic ε)",
            "rel_tol": REL_TOL,
            "ratio": "library ε / PLD pessimistic ε",
            "h_reference": H_REF,
            "opt_drift": OPT_DRIFT,
            "pld_max_points": PLD_MAX_POINTS,
            "prv_max_points": PRV_MAX_POINTS,
        },
    }


def _write(out: Path, meta: dict, rows: list[dict]) -> None:
    summary = summarize(rows)
    head = json.dumps({**meta, "summary": summary}, indent=1, allow_nan=True)
    # one line per cell: a readable diff when a rerun changes some
    cells_text = ",\n".join("  " + json.dumps(r, allow_nan=True) for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(f'{head[:-2]},\n "cells": [\n{cells_text}\n ]\n}}\n')
    (out / "table.md").write_text(table(meta, summary))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.auditing.accountants", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="a 12-cell grid (seconds)")
    ap.add_argument("--out", default="benchmarks/results/accountants")
    ap.add_argument(
        "--only", default="", help="comma-separated library/accountant keys (default: all)"
    )
    ap.add_argument(
        "--render",
        action="store_true",
        help="rewrite table.md (and the summary) from --out's results.json; compute nothing",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        doc = json.loads((out / "results.json").read_text())
        rows = doc.pop("cells")
        doc.pop("summary", None)
        _write(out, doc, rows)
        return 0
    logging.getLogger("absl").setLevel(logging.ERROR)
    grid = GRIDS["quick" if args.quick else "full"]
    wanted = {k for k in args.only.split(",") if k}
    accountants = [a for a in ACCOUNTANTS if not wanted or a.key in wanted]
    for a in accountants:
        if a.extra:
            try:
                require_extra(a.extra)
            except MissingExtra as exc:
                print(exc, file=sys.stderr)
    meta = _meta(argv, grid, accountants)
    deltas = tuple(grid["deltas"])
    rows: list[dict] = []
    t0 = time.perf_counter()
    todo = cells(grid)
    for i, (s, q, t) in enumerate(todo, 1):
        ref = reference(s, q, t, deltas)
        got = compare(s, q, t, deltas, accountants, ref)
        rows += got
        slow = sorted(
            {(r["library"] + "/" + r["accountant"], r.get("seconds", 0)) for r in got},
            key=lambda x: -x[1],
        )[:2]
        print(
            f"[{i}/{len(todo)}] σ={s:g} q={q:g} steps={t}: reference {ref.seconds:.1f} s "
            f"(h {ref.h_pessimistic}, {ref.h_optimistic}); slowest "
            + ", ".join(f"{k} {v:.1f} s" for k, v in slow)
            + f"; total {time.perf_counter() - t0:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        if i % 25 == 0 or i == len(todo):
            meta["wall_s"] = time.perf_counter() - t0
            _write(out, meta, rows)
    meta["wall_s"] = time.perf_counter() - t0
    _write(out, meta, rows)
    findings = sum(bool(r.get("finding")) for r in rows)
    print(f"{len(rows)} rows, {findings} findings; {out}/results.json, {out}/table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

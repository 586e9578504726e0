"""Each library's accountant asked through its public API (:mod:`benchmarks.auditing.accountants`):
Opacus (RDP, PRV, GDP), Flower (RdpAccountant, LocalDpMod's calibration), pfl (PLD, PRV, RDP)
and the toolkit's own."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable

from benchmarks.auditing.accountants_core import (
    FLWR_POPULATION,
    H_REF,
    PLD_MAX_POINTS,
    PRV_MAX_POINTS,
    Reference,
    attempt,
    attempt_build,
    not_applicable,
    pld_width,
    points_cap,
    require_extra,
    skipped,
)


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


def dist_version(name: str) -> str:
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
            out.append(skipped(points_cap("PRV domain", n, PRV_MAX_POINTS)))
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
        return [skipped(points_cap(f"PLD at h = {h:g}", n, PLD_MAX_POINTS)) for _ in deltas]
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
        return [skipped(points_cap("PRV domain", n, PRV_MAX_POINTS)) for _ in deltas]
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
                return [
                    skipped(points_cap(f"PLD at h = {H_REF:g}", n, PLD_MAX_POINTS)) for _ in deltas
                ]
        return [attempt(lambda d=d: epsilon(sigma, q, steps, d, accountant)) for d in deltas]

    return run


ACCOUNTANTS: tuple[Accountant, ...] = (
    Accountant("opacus", "rdp", opacus_rdp, lambda: dist_version("opacus")),
    Accountant("opacus", "prv", opacus_prv, lambda: dist_version("opacus")),
    Accountant("opacus", "gdp", opacus_gdp, lambda: dist_version("opacus")),
    Accountant("flwr", "rdp", flwr_rdp, lambda: dist_version("flwr")),
    Accountant("flwr", "localdp", flwr_localdp, lambda: dist_version("flwr")),
    Accountant("pfl", "pld", pfl_pld, lambda: dist_version("pfl"), extra="pfl"),
    Accountant(
        "pfl",
        "prv",
        pfl_prv,
        lambda: f"{dist_version('pfl')} (prv-accountant {dist_version('prv-accountant')})",
        extra="pfl",
    ),
    Accountant("pfl", "rdp", pfl_rdp, lambda: dist_version("pfl"), extra="pfl"),
    Accountant("fedlora-audit", "pld", toolkit("pld"), lambda: "this checkout"),
    Accountant("fedlora-audit", "rdp", toolkit("rdp"), lambda: "this checkout"),
)


# ---------------------------------------------------------------- the grid

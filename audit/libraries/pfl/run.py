"""What a pfl simulation really ran, against its claim and pfl's accountant: the cohort
sampling read from the observer's rounds, the claim field by field, the accountant's
assumptions (:mod:`audit.libraries.pfl`'s docstring says why each matters). Split from
:mod:`audit.libraries.pfl.checks` by responsibility.
"""

from __future__ import annotations

import math

from audit.claims.schema import Claim

__all__ = [
    "REL_TOL",
    "accountant_claim",
    "accountant_of",
    "claim_findings",
    "finding",
    "sampling_of",
]

#: relative tolerance for "the claim's field equals the run's"
REL_TOL = 1e-6


def finding(code: str, message: str, severity: str = "error") -> dict:
    """A finding (an error unless ``severity`` says otherwise: a warning is reported and
    does not fail the verdict)."""
    f = {"code": code, "message": message}
    if severity != "error":
        f["severity"] = severity
    return f


def sampling_of(rounds: list[dict], user_ids: list) -> dict:
    """How pfl drew the cohorts, read from the observer's rounds (the module doc of
    :mod:`audit.libraries.pfl`): with_replacement | all | fixed_batch | variable."""
    pop = set(user_ids)
    sizes = [len(r["users"]) for r in rounds]
    dups = sum(len(r["users"]) - len(set(r["users"])) for r in rounds)
    unknown = sorted({str(u) for r in rounds for u in r["users"] if u not in pop})[:5]
    every = all(set(r["users"]) == pop and len(r["users"]) == len(pop) for r in rounds)
    # a fixed cycle (pfl's 'minimize_reuse': itertools.cycle over the users, never
    # reshuffled): the concatenated cohorts repeat with the period of the users seen; a
    # neighbour's cycle is shifted by one more place each pass, so round t's cohort differs
    # in up to 2·min(pass + 1, B) users, not 2 (only visible after one pass)
    seq = [u for r in rounds for u in r["users"]]
    period = len(set(seq))
    cyclic = (
        not dups
        and len(seq) > period
        and all(seq[i] == seq[i - period] for i in range(period, len(seq)))
    )
    if dups:
        kind = "with_replacement"
    elif every:
        kind = "all"
    elif len(set(sizes)) == 1:
        kind = "fixed_batch"
    else:
        kind = "variable"
    return {
        "sampling": kind,
        "cyclic": bool(cyclic and kind != "all"),
        "cycle_length": period if cyclic else None,
        "cohort_sizes": sorted(set(sizes)),
        "duplicate_draws": int(dups),
        "unknown_users": unknown,
    }


def accountant_of(mechanism, c: Claim, run: dict) -> tuple[float | None, dict | None]:
    """(ε at the claim's δ, its assumptions against the run) of the pfl accountant the
    mechanism was built from (``from_privacy_accountant``); (None, None) without one."""
    acc = getattr(mechanism, "privacy_accountant", None)
    if acc is None:
        return None, None
    info = {
        "kind": type(acc).__name__,
        "mechanism": acc.mechanism,
        "epsilon": acc.epsilon,
        "delta": acc.delta,
        "noise_parameter": acc.noise_parameter,
        "noise_scale": acc.noise_scale,
        "cohort_noise_parameter": acc.cohort_noise_parameter,
        "sampling_probability": acc.sampling_probability,
        "num_compositions": acc.num_compositions,
        "assumes": "Poisson sampling at sampling_probability, add/remove",
    }
    eps = float(acc.epsilon)
    if not math.isclose(float(acc.delta), c.delta, rel_tol=1e-9):
        try:
            eps = float(
                type(acc)(
                    num_compositions=acc.num_compositions,
                    sampling_probability=acc.sampling_probability,
                    mechanism=acc.mechanism,
                    delta=c.delta,
                    noise_parameter=acc.noise_parameter,
                ).epsilon
            )
        except Exception as exc:  # the accountant's own limits
            info["error"] = f"no ε at the claim's δ ({exc})"
            eps = None
    mism = []
    if acc.noise_scale != 1.0:
        mism.append(
            f"noise_scale = {acc.noise_scale:g}: the accountant's ε is for σ = "
            f"{acc.noise_parameter:.4g}, the mechanism adds σ = "
            f"{acc.cohort_noise_parameter:.4g}"
        )
    if isinstance(run["noise_multiplier"], float) and not math.isclose(
        run["noise_multiplier"], acc.noise_parameter, rel_tol=1e-6
    ):
        mism.append(
            f"the mechanism's σ = {run['noise_multiplier']:.4g} is not the accountant's "
            f"{acc.noise_parameter:.4g}"
        )
    q_run = run["cohort_size"] / run["population"] if isinstance(run["cohort_size"], int) else None
    if q_run is not None and not math.isclose(q_run, acc.sampling_probability, rel_tol=1e-6):
        mism.append(
            f"sampling_probability = {acc.sampling_probability:.4g}, the run's cohort / "
            f"population = {q_run:.4g}"
        )
    if acc.num_compositions < run["steps"]:
        mism.append(f"num_compositions = {acc.num_compositions} < the run's {run['steps']} rounds")
    if acc.sampling_probability < 1 and run["sampling"] != "all":
        mism.append(f"the accountant assumes Poisson sampling; pfl drew {run['sampling']} cohorts")
    info["mismatches"] = mism
    return eps, info


def claim_findings(kind: str, c: Claim, run: dict, sigma: float, clip: float) -> list[dict]:
    """The claim against the run, field by field (each mismatch a finding)."""
    out = []
    if c.level != "client":
        out.append(
            finding(
                "level_mismatch",
                f"the claim is {c.level}-level; pfl's central mechanism protects users "
                "(client level: one user's whole update is clipped to C)",
            )
        )
    what = "b/C (Laplace scale over the clip)" if kind == "laplace" else "σ"
    checks = [
        ("noise_multiplier", c.noise_multiplier, sigma, what),
        ("rounds", c.rounds * c.steps_per_round, run["steps"], "rounds"),
        ("total_clients", c.total_clients, run["population"], "users in the population"),
    ]
    if isinstance(run["cohort_size"], int):
        checks.append(("clients_per_round", c.clients_per_round, run["cohort_size"], "cohort"))
    if c.clipping_norm is not None:
        checks.append(("clipping_norm", c.clipping_norm, clip, "C"))
    for name, claimed, ran, label in checks:
        if name == "rounds" and claimed is not None and ran < claimed:
            # the claim covers every release the run made (a run stopped early)
            out.append(
                finding(
                    "fewer_rounds_than_claimed",
                    f"the run released {ran} of the claim's {claimed} rounds: the claimed ε "
                    "covers them; the recomputed ε is for the rounds released",
                    severity="warning",
                )
            )
            continue
        if claimed is None or abs(claimed - ran) > REL_TOL * max(abs(ran), 1e-300):
            out.append(
                finding(
                    f"{name}_mismatch",
                    f"the claim's {name} ({label}) = {claimed if claimed is None else f'{claimed:.6g}'}"
                    f" but the run used {ran:.6g}",
                )
            )
    ok = {
        "all": c.sampling == "all" or c.clients_per_round == c.total_clients,
        "fixed_batch": c.sampling in ("fixed_batch", "shuffle"),
    }.get(run["sampling"], False)
    if not ok:
        why = {
            "with_replacement": f"pfl drew cohorts WITH replacement ({run['duplicate_draws']} "
            "repeated draws: get_user_sampler('random') calls np.random.randint per draw), "
            "so a user can enter a round more than once; no claim sampling describes it",
            "variable": f"pfl's cohorts varied in size ({run['cohort_sizes']}: "
            "max_overshoot_fraction > 0 or a custom dataset) without the Poisson law",
            "fixed_batch": "pfl drew a fixed-size cohort without replacement "
            f"({run['cohort_sizes']} users per round)",
            "all": "every user took part in every round",
        }[run["sampling"]]
        out.append(
            finding(
                "sampling_mismatch",
                f"the claim's sampling is {c.sampling!r} but {why}; pfl's accountants "
                "assume Poisson sampling at cohort/population",
            )
        )
    biggest = max(run["cohort_sizes"], default=0)
    if c.clients_per_round is not None and biggest > c.clients_per_round:
        out.append(
            finding(
                "cohort_exceeds_claim",
                f"a round's cohort held {biggest} users but the claim's clients_per_round is "
                f"{c.clients_per_round} (SimulatedBackend's max_overshoot_fraction draws up to "
                "cohort_size × (1 + fraction) users; pfl's accountant is not told)",
            )
        )
    if run["unknown_users"]:
        out.append(
            finding(
                "population_mismatch",
                f"the sampler drew users outside PflCanaries.users(...)'s data "
                f"({run['unknown_users']}): build the FederatedDataset on it",
            )
        )
    if not run["weights_are_user_counts"]:
        out.append(
            finding(
                "data_weighted_average",
                "the total weight of a round is not its user count (a weighting "
                "strategy such as WeightByDatapoints): FederatedAveraging divides the "
                "noised sum by this data-dependent weight, released without noise",
            )
        )
    if c.noise_source in ("keyed_csprng", "csprng"):
        out.append(
            finding(
                "noise_source_mismatch",
                f"the claim's noise_source is {c.noise_source!r} but pfl draws its noise "
                "from torch/numpy generators seeded from its algorithm's RandomState "
                "(internal/ops/pytorch_ops.py:345-346, algorithm/base.py:77-83)",
            )
        )
    return out


def accountant_claim(accountant, clipping_norm: float, cohort_size: int, population: int):
    """The claim a pfl user makes from pfl's accountant (client level): σ its
    ``noise_parameter``, ε and δ its own, the cohort over the population, and the sampling
    its accountants assume (Poisson; ``all`` when the cohort is everyone)."""
    q = cohort_size / population
    if not math.isclose(q, accountant.sampling_probability, rel_tol=1e-9):
        raise ValueError(
            f"cohort_size / population = {q:.6g} but the accountant's sampling_probability is "
            f"{accountant.sampling_probability:.6g}"
        )
    return {
        "level": "client",
        "noise_multiplier": float(accountant.noise_parameter),
        "clipping_norm": float(clipping_norm),
        "sampling": "all" if cohort_size >= population else "poisson",
        "rounds": int(accountant.num_compositions),
        "clients_per_round": int(cohort_size),
        "total_clients": int(population),
        "claimed_epsilon": float(accountant.epsilon),
        "delta": float(accountant.delta),
        "accounting": "composed",
        "noise_source": "seeded",
        "source": f"pfl {type(accountant).__name__}",
    }

"""The audit of one instrumented pfl simulation (:class:`PflAudit`): the run's mechanism
read from pfl's objects and the observer's records, the claim check, the tests, the bounds
and the verdict (:mod:`audit.libraries.pfl`'s docstring says what each part means).
"""

from __future__ import annotations

import math
import time

import numpy as np

from audit.claims.schema import Claim, validate_claim
from audit.coverage import Coverage, decide
from audit.libraries.common import one_run_lower_bound
from audit.libraries.pfl.canaries import PflCanaries
from audit.libraries.pfl.canary_tests import (
    finite_rounds,
    implied_epsilon,
    noise_absent,
    run_tests,
)
from audit.libraries.pfl.compat import (
    PFL_VERSION,
    CentrallyAppliedPrivacyMechanism,
    GaussianMechanism,
    LaplaceMechanism,
    LocalPrivacyMechanism,
    check_version,
)
from audit.libraries.pfl.epsilon import epsilon_of_run
from audit.libraries.pfl.run import accountant_of, claim_findings, finding, sampling_of
from audit.libraries.results import conformance_warnings

__all__ = ["ALPHA", "LB_ALPHA", "PflAudit", "attach"]

#: the family-wise level of the verdict's tests (Holm): a correct run is called broken at
#: most once in a thousand runs; the misuses here are flagged at p < 1e-6
ALPHA = 0.001
#: the one-run ε lower bound's confidence level (1 − LB_ALPHA): a correct claim is below it
#: with probability at least 0.95 (at ALPHA the bound of a few dozen canaries is 0)
LB_ALPHA = 0.05


class PflAudit:
    """The instrumented simulation (:func:`attach`); :meth:`audit` after ``algorithm.run``."""

    def __init__(self, canaries: PflCanaries, model, postprocessors) -> None:
        check_version()  # a pfl newer than the range: one warning line
        if canaries._module is None:
            raise ValueError("call PflCanaries.model(module) and build pfl's model on it")
        if not canaries.user_ids:
            raise ValueError("call PflCanaries.users(data) and build the FederatedDataset on it")
        vmap = getattr(model, "variable_map", None)
        if vmap is None:
            raise ValueError(
                f"model must be pfl's PyTorchModel (with variable_map), got {type(model).__name__}"
            )
        keys = [k for k, v in vmap.items() if v is canaries._module.block]
        if not keys:
            raise ValueError(
                "the canary block is not among the pfl model's variables: build "
                "PyTorchModel on the module PflCanaries.model(...) returned"
            )
        pps = list(postprocessors)
        obs = canaries.postprocessor
        if not any(p is obs for p in pps):
            raise ValueError(
                "canaries.postprocessor is not in the postprocessors: put it first in "
                "SimulatedBackend(postprocessors=[canaries.postprocessor, ...])"
            )
        central = [p for p in pps if isinstance(p, CentrallyAppliedPrivacyMechanism)]
        local = [p for p in pps if isinstance(p, LocalPrivacyMechanism)]
        if local:
            raise ValueError(
                f"{type(local[0]).__name__} is used as a local mechanism (each user noised "
                "apart); this audit covers central mechanisms: wrap it in "
                "CentrallyAppliedPrivacyMechanism"
            )
        if len(central) != 1:
            raise ValueError(
                f"need exactly one CentrallyAppliedPrivacyMechanism in the postprocessors, "
                f"found {len(central)}"
            )
        under = central[0].underlying_mechanism
        if not isinstance(under, (GaussianMechanism, LaplaceMechanism)):
            raise ValueError(
                f"the central mechanism wraps {type(under).__name__}; supported: "
                "GaussianMechanism, LaplaceMechanism"
            )
        self.canaries, self.model, self.observer = canaries, model, obs
        self.mechanism = under
        self.kind = "gaussian" if isinstance(under, GaussianMechanism) else "laplace"
        self.positions = {
            "observer": next(i for i, p in enumerate(pps) if p is obs),
            "mechanism": next(i for i, p in enumerate(pps) if p is central[0]),
            "postprocessors": [type(p).__name__ for p in pps],
        }
        obs.key, obs.mechanism = keys[0], under
        obs.rounds.clear()
        obs._users, obs._raw = [], []
        obs.real_on_block = 0.0

    # --- what the run used

    def run_mechanism(self) -> dict:
        """σ (Laplace: b/C), C, rounds, cohort, population and sampling as the run used them."""
        rounds = self.observer.rounds
        noises = sorted({r["noise"] for r in rounds}) or [math.nan]
        clips = sorted({r["clip"] for r in rounds}) or [math.nan]
        requested = sorted({r["cohort_size"] for r in rounds})
        samp = sampling_of(rounds, self.canaries.user_ids)
        weights_match = all(
            math.isclose(r["weight"], len(r["users"]), rel_tol=1e-9) for r in rounds
        )
        return {
            "mechanism": self.kind,
            "noise_multiplier": noises[0] if len(noises) == 1 else noises,
            "clipping_norm": clips[0] if len(clips) == 1 else clips,
            "steps": len(rounds),
            "cohort_size": requested[0] if len(requested) == 1 else requested,
            "population": self.canaries.population,
            **samp,
            "weights_are_user_counts": bool(weights_match),
            "canaries": self.canaries.m,
            "included": int(self.canaries.included.sum()),
            "positions": self.positions,
            "read_point": "the mechanism's output (noised sum), before FederatedAveraging's "
            "division by the total weight",
            "noise_source": "seeded (pfl draws from torch/numpy generators seeded from its "
            "algorithm's RandomState)",
        }

    def observations(self) -> dict:
        """(T, M) arrays: the canary block of the noised sums (``obs``) and the count of
        each canary user in each round's cohort (``counts``)."""
        rounds = self.observer.rounds
        m = self.canaries.m
        obs = np.array([r["obs"] for r in rounds]).reshape(-1, m)
        counts = np.zeros((len(rounds), m))
        for t, r in enumerate(rounds):
            for uid in r["users"]:
                j = self.canaries.canary_of(uid)
                if j is not None:
                    counts[t, j] += 1
        raw = [x for r in rounds for x in r["raw"]]
        return {"obs": obs, "counts": counts, "raw": raw}

    # --- the audit

    def _released(self, obs: np.ndarray) -> dict | None:
        """The released model's canary block (the callback's reads) against the observed
        noised sums: per round, Δθ = λ_t · sum_t / W_t (FederatedAveraging's average, then a
        stateless central SGD step of rate λ_t), up to float32 rounding; None without reads."""
        blocks = self.canaries.callback.blocks
        rounds = self.observer.rounds
        if len(blocks) != len(rounds) + 1 or not rounds:
            return None
        delta = np.diff(np.array(blocks), axis=0)
        avg = obs / np.array([r["weight"] for r in rounds])[:, None]
        lam, res = [], []
        for d, s in zip(delta, avg):
            ss = float(s @ s)
            lt = float(d @ s) / ss if ss > 0 else 0.0
            lam.append(lt)
            res.append(float(np.linalg.norm(d - lt * s)) / max(float(np.linalg.norm(d)), 1e-30))
        worst = max(res)
        return {
            "rounds": len(rounds),
            "step_factor": [min(lam), max(lam)],
            "max_rel_residual": worst,
            "consistent": worst < 1e-4,
        }

    def _lower_bound(self, u: np.ndarray, c: Claim, alpha: float) -> dict | None:
        can = self.canaries
        return one_run_lower_bound(u.sum(axis=0), can.included, can.p_include, c.delta, alpha)

    def audit(
        self,
        claim: dict | Claim,
        *,
        alpha: float = ALPHA,
        lb_alpha: float = LB_ALPHA,
        permutations: int = 19_999,
        seed: int | None = None,
    ) -> dict:
        """The claim check, the tests and the implied ε of this run against ``claim``
        (client-level fields, :mod:`audit.claims.schema`; for Laplace ``noise_multiplier``
        is the scale over the clip, b/C). ``alpha``: the tests' family-wise level;
        ``lb_alpha``: the one-run bound's. ``verdict`` "fail" (exit 1) on a finding,
        "incomplete" (exit 4) while a part of the mechanism is untested (``coverage``),
        else "pass" (:func:`audit.coverage.decide`); a release holding NaN or Inf
        (``release_nonfinite``) and one without noise (``noise_absent``) are findings with
        the implied ε ∞, never an exception."""
        t0 = time.time()
        c = validate_claim(claim)
        run = self.run_mechanism()
        T = run["steps"]
        if T < 2:
            raise ValueError(
                f"the run released {T} noised round(s); the audit needs at least 2 (was "
                "canaries.postprocessor in the backend's postprocessors during the run?)"
            )
        findings: list[dict] = []
        untested: list[str] = []
        if not all(isinstance(run[k], float) for k in ("noise_multiplier", "clipping_norm")):
            findings.append(
                finding(
                    "run_not_constant",
                    f"σ or C changed during the run: σ {run['noise_multiplier']}, C "
                    f"{run['clipping_norm']} (adaptive clipping or a schedule)",
                )
            )
        sigma = float(np.min(run["noise_multiplier"]))
        clip = float(np.max(run["clipping_norm"]))
        if not (math.isfinite(sigma) and math.isfinite(clip)):
            raise ValueError(
                f"the mechanism's noise or clip could not be read (σ {sigma}, C {clip}): this "
                f"audit reads pfl {PFL_VERSION}'s GaussianMechanism / LaplaceMechanism fields"
            )
        findings += claim_findings(self.kind, c, run, sigma, clip)
        eps_run, rec, run_claim, at_least = epsilon_of_run(self.kind, run, c, sigma, clip, T)
        # 0.1 %: the two PLDs' discretisations (pfl's accountant and dp-accounting's here)
        # differ by about 1e-5 relative; an understatement beyond that is a finding
        if eps_run > c.claimed_epsilon * (1 + 1e-3):
            findings.append(
                finding(
                    "epsilon_understated",
                    f"the claimed ε = {c.claimed_epsilon:.4g} is below the ε = "
                    f"{'≥ ' if at_least else ''}{eps_run:.4g} of the mechanism the run used "
                    f"({rec['mechanism']})",
                )
            )
        eps_acc, acc_info = accountant_of(self.mechanism, c, run)
        if acc_info is None:
            untested.append(
                "pfl's accountant (the mechanism was not built with from_privacy_accountant)"
            )
        elif eps_acc is not None:
            # pfl's figure against the ε of what ran (reported; the claim is what is judged)
            acc_info["recomputed_epsilon"] = eps_run
            acc_info["understates_run"] = bool(eps_acc < eps_run / 1.01)
            if acc_info["understates_run"]:
                acc_info["why"] = (
                    f"pfl's accountant gives ε = {eps_acc:.4g} for the run whose mechanism has "
                    f"ε = {'≥ ' if at_least else ''}{eps_run:.4g}: "
                    + ("; ".join(acc_info["mismatches"]) or "its assumptions match the run")
                )
        # --- the observations, in units of the claimed C (finite rounds only)
        cov = Coverage().add("accounting", "claim check (ε recomputed for the mechanism that ran)")
        if run["sampling"] == "all":
            cov.inapplicable("sampling", "every user took part in every round")
        else:
            cov.add("sampling", "claim check (the sampler's draws read from pfl)")
        ob = self.observations()
        fin = finite_rounds(ob["obs"], findings)
        unit = c.clipping_norm if c.clipping_norm is not None else clip
        u = ob["obs"][fin] / unit
        k = ob["counts"][fin]
        inc = self.canaries.included
        raw = ob["raw"]
        if raw:
            raw_min = min(x[1] for x in raw)
            leak = max(max(x[2] for x in raw), max(math.sqrt(x[3]) for x in raw))
            if raw_min < clip or leak > 1e-6 * clip:
                untested.append(
                    f"clipping: a canary user's update before pfl's clipping was "
                    f"{raw_min:.3g} on its coordinate (C = {clip:.3g}) with {leak:.3g} "
                    "elsewhere, so pfl's clip did not scale it to exactly C (raise gain)"
                )
        if self.observer.real_on_block > 0:
            untested.append(
                f"isolation: a real user's update reached the canary block "
                f"({self.observer.real_on_block:.3g}; a local optimizer's weight decay?)"
            )
        if k[:, inc].sum() == 0 and inc.any():
            findings.append(
                finding(
                    "canaries_never_drawn",
                    f"no canary user was drawn in {T} rounds: build the FederatedDataset on "
                    "PflCanaries.users(...)'s data and its sampler on all its user ids",
                )
            )
        if c.noise_multiplier <= 0:
            raise ValueError("the claim's noise_multiplier is 0: nothing to test the noise against")
        absent = noise_absent(u - k, c.noise_multiplier, self.positions, sigma)
        if absent is not None:
            findings.append(absent)
        conf = samp = contrib = lb = f = group = None
        eps_implied, imp_at_least = math.inf, False
        if len(u) >= 2:
            conf, samp, contrib = run_tests(
                self, u, k, c, kind=self.kind, alpha=alpha, permutations=permutations,
                seed=seed, cov=cov, notes=untested,
            )  # fmt: skip
            infinite = absent is not None or not fin.all()
            f, group, eps_implied, imp_at_least = implied_epsilon(
                self.kind, conf, run_claim, c, len(u), rec["sensitivity"], infinite
            )
            for t in conf.rejected:
                extra_txt = f", observed/claimed noise {t.ratio:.3f}" if t.ratio else ""
                if t.test == "contribution" and contrib:
                    extra_txt = (
                        f", a canary draw added {contrib['contribution']:.3g} × the claimed C"
                    )
                findings.append(
                    finding(
                        "conformance_rejected",
                        f"{t.group}:{t.test} rejected (p = {10**t.log10_p:.3g}{extra_txt})",
                    )
                )
            lb = self._lower_bound(u, c, lb_alpha)
        else:
            for part in ("clipping", "noise"):
                cov.skip(part, f"{len(u)} finite round(s) released; the tests need 2")
        imp_at_least = imp_at_least or at_least
        if lb is None:
            untested.append("ε lower bound (needs included and excluded canaries, p = 1/2)")
        elif lb["epsilon_lb"] > c.claimed_epsilon:
            findings.append(
                finding(
                    "empirical_exceeds_claim",
                    f"the one-run ε lower bound {lb['epsilon_lb']:.4g} exceeds the claimed "
                    f"ε = {c.claimed_epsilon:g}",
                )
            )
        released = self._released(ob["obs"]) if fin.all() else None
        if released is None:
            untested.append(
                "the step from the noised sum to the released model (FederatedAveraging's "
                "division by the total weight, the central optimizer): the block is read at "
                "the mechanism's output (pass canaries.callback to run() to check it)"
            )
        elif not released["consistent"]:
            untested.append(
                "the step from the noised sum to the released model: the released block's "
                "change is not a per-round multiple of the noised average (max relative "
                f"residual {released['max_rel_residual']:.3g}: a central optimizer with state, "
                "e.g. momentum or Adam, post-processes several rounds' sums); not checked"
            )
        untested.append(
            "the noise's unpredictability: pfl seeds its noise generators; the tests see the "
            "scale and freshness, not whether the seed can be guessed"
        )
        errors = sum(f.get("severity", "error") == "error" for f in findings)
        verdict, code = decide(errors, cov)
        if conf is not None:
            findings = findings + conformance_warnings(conf)  # reported, not in the verdict
        return {
            "library": "pfl",
            "version": PFL_VERSION,
            "mode": self.kind,
            "run": run,
            "claim": c.to_dict(),
            "claimed_epsilon": c.claimed_epsilon,
            "delta": c.delta,
            "recomputed_epsilon": eps_run,
            "recomputed_epsilon_at_least": at_least,
            "recomputed": rec,
            "accountant_epsilon": eps_acc,
            "accountant": acc_info,
            "epsilon_lower_bound": lb["epsilon_lb"] if lb else None,
            "lower_bound": lb,
            "implied_epsilon": eps_implied,
            "implied_epsilon_at_least": imp_at_least,
            "noise_factor": f,
            "noise_factor_group": group,
            "conformance": conf.to_dict() if conf is not None else NO_TESTS,
            "conformance_rejected": [f"{t.group}:{t.test}" for t in conf.rejected] if conf else [],
            "sampling": samp.to_dict() if samp else None,
            "canary_contribution": contrib,
            "released_model": released,
            "canary_clip_error": abs(contrib["contribution"] - clip / unit) if contrib else None,
            "coverage": cov.to_dict(),
            "untested": cov.describe() + untested,
            "findings": findings,
            "verdict": verdict,
            "exit_code": code,
            "audit_seconds": time.time() - t0,
        }


#: the ``conformance`` entry when no test could run (fewer than two finite rounds)
NO_TESTS = {"alpha": None, "passed": True, "tests": [], "rejected": [], "weak": [],
            "skipped": ["every test (fewer than two rounds with a finite canary block)"]}  # fmt: skip


def attach(canaries: PflCanaries, model, postprocessors) -> PflAudit:
    """Instrument a pfl simulation: ``model`` the pfl ``PyTorchModel`` built on
    ``canaries.model(...)``, ``postprocessors`` the list given to ``SimulatedBackend``
    (``canaries.postprocessor`` first, one ``CentrallyAppliedPrivacyMechanism``)."""
    return PflAudit(canaries, model, postprocessors)

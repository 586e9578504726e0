"""The audit of one instrumented pfl simulation (:class:`PflAudit`): the run's mechanism
read from pfl's objects and the observer's records, the claim check, the tests, the bounds
and the verdict (:mod:`audit.libraries.pfl`'s docstring says what each part means).
"""

from __future__ import annotations

import math
import time

import numpy as np

from audit.bounds.conformance import (
    ALPHA_WARN,
    Block,
    GroupTest,
    conformance,
    implied_noise_factor,
)
from audit.bounds.hypothesis import gdp_epsilon
from audit.claims.check import check_claim
from audit.claims.implied import epsilon_of_scaled_claim
from audit.claims.mistakes import reference
from audit.claims.schema import Claim, validate_claim
from audit.libraries.common import one_run_lower_bound, sampling_group_tests
from audit.libraries.pfl.canaries import PflCanaries
from audit.libraries.pfl.compat import (
    PFL_VERSION,
    CentrallyAppliedPrivacyMechanism,
    GaussianMechanism,
    LaplaceMechanism,
    LocalPrivacyMechanism,
)
from audit.libraries.pfl.run import accountant_of, claim_findings, finding, sampling_of
from audit.libraries.pfl.stats import contribution_test, laplace_epsilon, laplace_tests
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
        ``lb_alpha``: the one-run bound's. ``verdict`` "pass"/"fail", ``exit_code`` 0/1."""
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
        # --- ε of the mechanism that ran
        at_least = run["sampling"] == "with_replacement"
        n_pop = run["population"]
        cohort = min(int(np.max(run["cohort_size"])), n_pop)
        schema = "all" if run["sampling"] == "all" or cohort >= n_pop else "fixed_batch"
        run_claim = Claim(
            level="client",
            noise_multiplier=sigma,
            sampling=schema,
            rounds=T,
            clients_per_round=n_pop if schema == "all" else cohort,
            total_clients=n_pop,
            clipping_norm=clip,
            claimed_epsilon=c.claimed_epsilon,
            delta=c.delta,
            accounting="composed",
        )
        sens = 1 if schema == "all" else 2
        cyclic = bool(run.get("cyclic"))
        if cyclic:
            # a fixed cycle of P users, B per round: in pass p a neighbour's cohort differs in
            # up to 2·min(p + 1, B) users (pfl_run.sampling_of); per round sensitivity s_t·C
            P, B = int(run["cycle_length"]), cohort
            s_t = np.array([min(2 * (t * B // P + 1), 2 * B) for t in range(T)], dtype=float)
            sens = float(s_t.max())
        if self.kind == "gaussian" and cyclic:
            mu = float(np.sqrt(np.sum((s_t / sigma) ** 2))) if sigma > 0 else math.inf
            eps_run = gdp_epsilon(mu, c.delta) if math.isfinite(mu) else math.inf
            rec = {
                "epsilon_pld": eps_run,
                "mechanism": f"{T} Gaussian release(s) at σ = {sigma:.4g} of a fixed cycle of "
                f"{P} users, {B} per round (pfl's 'minimize_reuse'): a neighbour's cohort "
                f"differs in {int(s_t.min())}…{int(s_t.max())} users per round, μ-GDP",
            }
        elif self.kind == "gaussian":
            rec = dict(check_claim(run_claim))
            eps_run = rec["epsilon_pld"]
        else:
            eps_run = laplace_epsilon(sigma, T, c.delta, sens=sens)
            rec = {
                "epsilon_pld": eps_run,
                "mechanism": f"{T} Laplace release(s) at b/C = {sigma:.4g}, ℓ1 sensitivity "
                f"{sens}C (dp-accounting PLD)",
                "epsilon_pure": T * sens / sigma if sigma > 0 else math.inf,
            }
        if at_least:
            rec["note"] = (
                "with replacement a user drawn k times adds kC: the fixed-cohort figure is a "
                "lower bound on the run's ε"
            )
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
        # --- the observations, in units of the claimed C
        ob = self.observations()
        if not np.isfinite(ob["obs"]).all():
            raise ValueError(
                "the released canary block holds NaN or Inf (a diverged model or a broken "
                "mechanism): nothing to test; check the training's updates"
            )
        unit = c.clipping_norm if c.clipping_norm is not None else clip
        u = ob["obs"] / unit
        k = ob["counts"]
        r = u - k
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
        claimed_noise = c.noise_multiplier
        if claimed_noise <= 0:
            raise ValueError("the claim's noise_multiplier is 0: nothing to test the noise against")
        # no noise at all: the observer read the sum before the noise (or there was none)
        if float(np.sqrt(np.mean(r**2))) < 1e-3 * claimed_noise:
            if self.positions["observer"] > self.positions["mechanism"]:
                msg = (
                    f"canaries.postprocessor is at position {self.positions['observer']}, "
                    f"after the mechanism ({self.positions['mechanism']}): pfl runs the "
                    "server steps in reverse order, so it read the sum BEFORE the noise; "
                    "put it first"
                )
            else:
                msg = "the mechanism added no noise to the canary block"
            findings.append(finding("no_noise_observed", msg))
        extra: list[GroupTest] = []
        ctest, contrib = contribution_test(
            u, k, alpha=alpha, symmetric_exact=self.kind == "laplace"
        )
        if ctest is not None:
            extra.append(ctest)
        else:
            untested.append("clipping (no canary user was drawn)")
        samp = None
        q_claim = (
            c.clients_per_round / c.total_clients if c.clients_per_round and c.total_clients else 1
        )
        if c.sampling == "poisson" and q_claim < 1 and inc.any():
            sd = claimed_noise * (math.sqrt(2) if self.kind == "laplace" else 1.0)
            samp, tests, _ = sampling_group_tests(
                u,
                k,
                inc,
                sd,
                q_claim,
                permutations=permutations,
                seed=seed,
                note="Poisson draws are exchangeable over rounds",
            )
            extra += tests
        m = self.canaries.m
        if self.kind == "gaussian":
            block = Block(
                u=r,
                tracks=np.arange(m),
                groups=np.array(["canary"] * m),
                sigma=claimed_noise,
                included=inc.copy(),
                coins=None,
                q=1.0,
                p_include=self.canaries.p_include,
            )
            conf = conformance([block], alpha=alpha, extra=tuple(extra), warn_alpha=ALPHA_WARN)
        else:
            lap = laplace_tests(r, claimed_noise, alpha=alpha)
            conf = conformance([], alpha=alpha, extra=tuple(lap + extra), warn_alpha=ALPHA_WARN)
            untested.append(
                "the Gaussian conformance tests (Laplace noise: the Anderson scale and "
                "freshness tests and the contribution t-test, asymptotic under Laplace noise, "
                "stand in)"
            )
        f, group = implied_noise_factor(conf)
        if self.kind == "gaussian":
            eps_implied, imp_at_least = epsilon_of_scaled_claim(
                reference(run_claim), claimed_noise, f, c.delta
            )
        else:
            eps_implied, imp_at_least = laplace_epsilon(claimed_noise * f, T, c.delta, sens), False
        imp_at_least = imp_at_least or at_least
        rejected = [f"{t.group}:{t.test}" for t in conf.rejected]
        for t in conf.rejected:
            extra_txt = f", observed/claimed noise {t.ratio:.3f}" if t.ratio else ""
            if t.test == "contribution" and contrib:
                extra_txt = f", a canary draw added {contrib['contribution']:.3g} × the claimed C"
            findings.append(
                finding(
                    "conformance_rejected",
                    f"{t.group}:{t.test} rejected (p = {10**t.log10_p:.3g}{extra_txt})",
                )
            )
        lb = self._lower_bound(u, c, lb_alpha)
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
        released = self._released(ob["obs"])
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
        verdict = "fail" if findings else "pass"
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
            "conformance": conf.to_dict(),
            "conformance_rejected": rejected,
            "sampling": samp.to_dict() if samp else None,
            "canary_contribution": contrib,
            "released_model": released,
            "canary_clip_error": abs(contrib["contribution"] - clip / unit) if contrib else None,
            "untested": untested,
            "findings": findings,
            "verdict": verdict,
            "exit_code": 0 if verdict == "pass" else 1,
            "audit_seconds": time.time() - t0,
        }


def attach(canaries: PflCanaries, model, postprocessors) -> PflAudit:
    """Instrument a pfl simulation: ``model`` the pfl ``PyTorchModel`` built on
    ``canaries.model(...)``, ``postprocessors`` the list given to ``SimulatedBackend``
    (``canaries.postprocessor`` first, one ``CentrallyAppliedPrivacyMechanism``)."""
    return PflAudit(canaries, model, postprocessors)

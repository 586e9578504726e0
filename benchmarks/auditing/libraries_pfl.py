"""pfl's central DP mechanisms audited end to end (#43, pfl): one small simulation per case.

    python -m benchmarks.auditing.libraries_pfl [--quick] [--case NAME ...]

A linear model (4 → 1, MSE) over 20 synthetic users of 5 rows each plus M = 64 canary users
(about 32 included), trained by pfl's own ``FederatedAveraging`` on its ``SimulatedBackend``
for 20 central iterations with pfl's central ``GaussianMechanism`` or ``LaplaceMechanism``,
CPU; every run is audited with :mod:`audit.libraries.pfl`. Each case is a few seconds on one
core. The benchmark table (``benchmarks/auditing/libraries.py``) takes its rows from
:func:`run_case` (keys of :func:`audit.libraries.pfl.PflAudit.audit` plus ``case``,
``wall_s``, ``version``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

#: real users, rows per user, canary users, central iterations, δ, claimed C
USERS, ROWS, M, ROUNDS, DELTA, CLIP = 20, 5, 64, 20, 1e-5, 1.0
#: the partial cohort (of about USERS + M/2 users)
COHORT = 10
#: target ε of pfl's accountant; Laplace ε per round
EPS, LAPLACE_EPS0 = 8.0, 0.5

#: (mode, kind, what)
CASES = [
    (
        "full_accountant",
        "correct",
        "every user every round (minimize_reuse, cohort = population); σ from pfl's "
        "PLDPrivacyAccountant at sampling_probability 1; the claim is its ε",
    ),
    (
        "cohort_fixed_claim",
        "misuse",
        "cohort 10 with minimize_reuse, a fixed cycle never reshuffled, claimed as a freshly "
        "drawn fixed cohort (σ/2 per round): a neighbour's cycle shifts one more place each "
        "pass",
    ),
    (
        "laplace_full",
        "correct",
        "LaplaceMechanism(C, ε = 0.5 per round), every user every round; the claim is b/C "
        "and the PLD ε of the 20 Laplace releases",
    ),
    (
        "accountant_poisson",
        "misuse",
        "cohort 10 (minimize_reuse) claimed with pfl's PLD accountant's ε, which assumes "
        "Poisson sampling at cohort/population",
    ),
    (
        "random_sampler",
        "misuse",
        "get_user_sampler('random') (draws with replacement) claimed with pfl's accountant's ε",
    ),
    (
        "overshoot",
        "misuse",
        "SimulatedBackend(max_overshoot_fraction=0.5): cohorts of 10 to 14 users while pfl's "
        "accountant and the claim say 10",
    ),
    (
        "low_sigma",
        "misuse",
        "GaussianMechanism(C, 0.5 × the accountant's σ) built by hand, claiming the accountant's ε",
    ),
    (
        "noise_scale",
        "misuse",
        "PLDPrivacyAccountant(noise_scale=0.5): the mechanism adds half the σ whose ε the "
        "accountant reports",
    ),
    ("clip_mismatch", "misuse", "clipping_bound = 2 while the claim says C = 1"),
    (
        "weight_after_clip",
        "misuse",
        "WeightByDatapoints after the mechanism in the postprocessors: each clipped update "
        "is multiplied by its user's row count",
    ),
    (
        "laplace_low_scale",
        "misuse",
        "LaplaceMechanism with twice the claimed per-round ε (half the claimed scale)",
    ),
    (
        "observer_after_mechanism",
        "misuse",
        "hook slip: canaries.postprocessor after the mechanism (it reads the sum before the noise)",
    ),
]

#: misuses no audit of the release can see, with the reason
UNDETECTABLE = [
    (
        "noise seeded from a guessable seed",
        "pfl seeds its noise generators from its algorithm's RandomState (itself seeded from "
        "numpy's global state); the noise is Laplace/Gaussian and fresh to any test that does "
        "not know the seed — declare noise_source in the claim",
    ),
    (
        "data-dependent denominator with WeightByDatapoints before the mechanism",
        "the released average divides the noised sum by the cohort's total data count, "
        "unnoised; the canary block is read at the mechanism's output, so the audit sees "
        "the weights (finding data_weighted_average) but no test measures what the "
        "denominator leaks",
    ),
]


def small_net():
    import torch
    from pfl.metrics import Weighted

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.lin(x).squeeze(-1)

        def loss(self, x, y, eval=False):  # noqa: A002 (pfl's keyword)
            return torch.nn.functional.mse_loss(self(x), y)

        def metrics(self, x, y, eval=False):  # noqa: A002
            return {"loss": Weighted(float(self.loss(x, y).detach()) * len(x), len(x))}

    return Net()


def _data(rng) -> dict:
    w = rng.normal(size=4)
    out = {}
    for u in range(USERS):
        x = rng.normal(size=(ROWS, 4)).astype(np.float32)
        y = (x @ w + 0.1 * rng.normal(size=ROWS)).astype(np.float32)
        out[u] = [x, y]
    return out


def simulate(
    mode: str,
    seed: int = 0,
    rounds: int = ROUNDS,
    sigma: float | None = None,
    central_optimizer: str = "sgd",
):
    """Build and run one case; returns (audit, claim). ``sigma``: build pfl's accountant
    from this noise parameter (it computes the ε) instead of calibrating σ to ε = EPS (a
    binary search of PLD compositions: seconds at q = 1, 10-20 s below).
    ``central_optimizer``: "sgd" (lr 1) or "adam" (a central optimizer with state)."""
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import (
        CentrallyAppliedPrivacyMechanism,
        GaussianMechanism,
        LaplaceMechanism,
        PLDPrivacyAccountant,
    )

    from audit.claims.check import check_claim
    from audit.libraries.pfl import PflCanaries, accountant_claim, attach
    from audit.libraries.pfl_stats import laplace_epsilon

    names = [c[0] for c in CASES]
    if mode not in names:
        raise ValueError(f"unknown case {mode!r}; known: {names}")
    np.random.seed(seed)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    canaries = PflCanaries(m=M, seed=seed)
    data = canaries.users(_data(rng))
    n_pop = canaries.population
    ids = list(data)
    # the sampling cases draw a partial cohort; the others every user every round, so that
    # their misuse is the only thing wrong
    full = mode not in ("cohort_fixed_claim", "accountant_poisson", "random_sampler", "overshoot")
    cohort = n_pop if full else COHORT
    sampler = get_user_sampler("random" if mode == "random_sampler" else "minimize_reuse", ids)
    fed = FederatedDataset.from_slices(data, sampler)
    module = canaries.model(small_net())
    model = PyTorchModel(
        module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=(
            torch.optim.Adam(module.parameters(), lr=0.1)
            if central_optimizer == "adam"
            else torch.optim.SGD(module.parameters(), lr=1.0)
        ),
    )
    claim = None
    if mode.startswith("laplace"):
        eps0 = LAPLACE_EPS0 * (2 if mode == "laplace_low_scale" else 1)
        mech = LaplaceMechanism(CLIP, eps0)
        scale = 1 / LAPLACE_EPS0
        claim = {
            "level": "client",
            "noise_multiplier": scale,
            "clipping_norm": CLIP,
            "sampling": "all",
            "rounds": rounds,
            "clients_per_round": n_pop,
            "total_clients": n_pop,
            "claimed_epsilon": laplace_epsilon(scale, rounds, DELTA),
            "delta": DELTA,
            "noise_source": "seeded",
        }
    else:
        acc = PLDPrivacyAccountant(
            num_compositions=rounds,
            sampling_probability=cohort / n_pop,
            mechanism="gaussian",
            epsilon=EPS if sigma is None else None,
            noise_parameter=sigma,
            delta=DELTA,
            noise_scale=0.5 if mode == "noise_scale" else 1.0,
        )
        clip = 2 * CLIP if mode == "clip_mismatch" else CLIP
        if mode == "low_sigma":
            mech = GaussianMechanism(clip, 0.5 * acc.noise_parameter)
        else:
            mech = GaussianMechanism.from_privacy_accountant(acc, clip)
        claim = accountant_claim(acc, CLIP, cohort, n_pop)
        if mode in ("cohort_fixed_claim", "overshoot"):
            claim = {**claim, "sampling": "fixed_batch", "source": "the fixed cohort, honestly"}
            claim["claimed_epsilon"] = check_claim(claim)["epsilon_pld"]
    central = CentrallyAppliedPrivacyMechanism(mech)
    if mode == "weight_after_clip":
        pps = [canaries.postprocessor, central, WeightByDatapoints()]
    elif mode == "observer_after_mechanism":
        pps = [central, canaries.postprocessor]
    else:
        pps = [canaries.postprocessor, central]
    backend = SimulatedBackend(
        training_data=fed,
        val_data=fed,
        postprocessors=pps,
        max_overshoot_fraction=0.5 if mode == "overshoot" else 0.0,
    )
    audit = attach(canaries, model, pps)
    params = NNAlgorithmParams(
        central_num_iterations=rounds,
        evaluation_frequency=rounds + 1,
        train_cohort_size=cohort,
        val_cohort_size=0,
    )
    FederatedAveraging().run(
        algorithm_params=params,
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_num_epochs=1, local_learning_rate=0.1, local_batch_size=None
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=None),
        callbacks=[canaries.callback],
        send_metrics_to_platform=False,
    )
    return audit, claim


def run_case(mode: str, seed: int = 0, quick: bool = False, permutations: int = 19_999) -> dict:
    """Run and audit one case (:data:`CASES`); the audit dict plus case, wall_s, version.
    ``quick``: 12 rounds instead of 20."""
    from audit.libraries.pfl import PFL_VERSION

    t0 = time.time()
    audit, claim = simulate(mode, seed=seed, rounds=12 if quick else ROUNDS)
    res = audit.audit(claim, permutations=permutations, seed=seed)
    res.update(case=mode, wall_s=time.time() - t0, version=PFL_VERSION)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--case", action="append", help="run only these cases")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for mode, kind, _what in CASES:
        if args.case and mode not in args.case:
            continue
        res = run_case(mode, seed=args.seed, quick=args.quick)
        ok = (res["verdict"] == "pass") == (kind == "correct")
        rows.append(res)
        print(
            f"{mode:26s} {kind:8s} {res['verdict']:4s} {'ok ' if ok else 'BAD'} "
            f"claimed {res['claimed_epsilon']:.3g} recomputed "
            f"{'≥' if res['recomputed_epsilon_at_least'] else ''}{res['recomputed_epsilon']:.3g} "
            f"acc {res['accountant_epsilon']} lb {res['epsilon_lower_bound']} "
            f"{[f['code'] for f in res['findings']]} {res['wall_s']:.1f}s"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

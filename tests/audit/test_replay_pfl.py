"""audit.replay.pfl: neighbour replay of pfl trainings at user level (#47).

A tiny pfl simulation (linear 4 → 1, 6 users of 5 rows, every user every round, 3 central
iterations, pfl's FederatedAveraging on its SimulatedBackend with its central
GaussianMechanism): well under a second per run, a replay of two neighbours in a few."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("pfl")

from audit.replay.pfl import DEFAULT_PFL, replay_pfl  # noqa: E402

logging.getLogger("pfl").setLevel(logging.ERROR)

USERS, ROUNDS, CLIP, SIGMA = 6, 3, 0.05, 1.0


def _train(sigma=SIGMA, weight_after_clip=False, clip=CLIP, laplace_eps=None):
    """One pfl training (fresh objects, seeded): a callable for the replay."""

    def run():
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
        )

        from benchmarks.auditing.libraries_pfl import small_net

        np.random.seed(0)
        torch.manual_seed(0)
        rng = np.random.default_rng(0)
        w = rng.normal(size=4)
        data = {}
        for u in range(USERS):
            x = rng.normal(size=(5, 4)).astype(np.float32)
            data[u] = [x, (x @ w).astype(np.float32)]
        fed = FederatedDataset.from_slices(data, get_user_sampler("minimize_reuse", list(data)))
        module = small_net()
        model = PyTorchModel(
            module,
            local_optimizer_create=torch.optim.SGD,
            central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),
        )
        mech = (
            GaussianMechanism(clip, sigma)
            if laplace_eps is None
            else LaplaceMechanism(clip, laplace_eps)
        )
        central = CentrallyAppliedPrivacyMechanism(mech)
        pps = [central, WeightByDatapoints()] if weight_after_clip else [central]
        backend = SimulatedBackend(training_data=fed, val_data=fed, postprocessors=pps)
        FederatedAveraging().run(
            algorithm_params=NNAlgorithmParams(
                central_num_iterations=ROUNDS,
                evaluation_frequency=ROUNDS + 1,
                train_cohort_size=USERS,
                val_cohort_size=0,
            ),
            backend=backend,
            model=model,
            model_train_params=NNTrainHyperParams(
                local_num_epochs=1, local_learning_rate=0.1, local_batch_size=None
            ),
            model_eval_params=NNEvalHyperParams(local_batch_size=None),
            send_metrics_to_platform=False,
        )

    return run


CLAIM = {"noise_multiplier": SIGMA, "clipping_norm": CLIP}


def _codes(res):
    return {f["code"] for f in res["findings"]}


def test_correct_gaussian_mechanism_passes_within_2C():
    res = replay_pfl(_train(), claim=CLAIM)
    assert res["verdict"] == "pass", res["findings"]
    assert res["releases"] == ROUNDS and [n["neighbour"] for n in res["neighbours"]] == list(
        DEFAULT_PFL
    )
    # every update is clipped (C = 0.05): the opposite update moves the sum by exactly 2C
    ratios = {n["neighbour"]: n["comparison"]["max_ratio"] for n in res["neighbours"]}
    assert ratios["replace"] == pytest.approx(1.0, abs=1e-4)
    assert ratios["huge"] == pytest.approx(1.0, abs=1e-4)


def test_weighting_after_the_clip_is_sensitivity_exceeded():
    """WeightByDatapoints after the mechanism: a clipped update multiplied by its user's 5
    rows before the sum, so a replaced user moves it by 10C."""
    res = replay_pfl(_train(weight_after_clip=True), claim=CLAIM, neighbours="replace")
    assert res["verdict"] == "fail" and "sensitivity_exceeded" in _codes(res)
    assert res["max_ratio"] == pytest.approx(5.0, rel=1e-3)


def test_planted_unclipped_sum_and_low_sigma_are_caught(monkeypatch):
    from pfl.metrics import Metrics
    from pfl.privacy.privacy_mechanism import NormClipping

    monkeypatch.setattr(
        NormClipping,
        "constrain_sensitivity",
        lambda self, statistics, *a, **k: (statistics, Metrics()),
    )
    res = replay_pfl(_train(), claim=CLAIM, neighbours="huge")
    assert res["verdict"] == "fail" and res["max_ratio"] > 100
    monkeypatch.undo()
    low = replay_pfl(_train(sigma=SIGMA / 2), claim=CLAIM, neighbours="replace")
    assert low["verdict"] == "fail" and low["max_ratio"] == pytest.approx(2.0, rel=1e-3)


def test_nan_user_is_a_violation_not_a_crash():
    res = replay_pfl(_train(), claim=CLAIM, neighbours="nan")
    assert res["verdict"] == "fail"
    assert res["neighbours"][0]["comparison"]["violations"][0]["nonfinite"]


def test_no_mechanism_is_never_a_pass():
    def plain():
        pass

    res = replay_pfl(plain, claim=CLAIM)
    assert res["verdict"] == "not run" and "replay_empty" in _codes(res)


def test_laplace_mechanism_passes_and_pfl_is_unpatched_after():
    """LaplaceMechanism(C, ε): noise scale C/ε, the claim's multiplier 1/ε; its ℓ1 clip
    keeps the ℓ2 distance of a replaced user within 2C."""
    from pfl.privacy import GaussianMechanism, LaplaceMechanism

    import audit.replay.pfl as rp

    res = rp.replay_pfl(
        _train(laplace_eps=1.0), claim={"noise_multiplier": 1.0, "clipping_norm": CLIP}
    )
    assert res["verdict"] == "pass" and res["releases"] == ROUNDS, res["findings"]
    # ε doubled (half the scale the claim says): the noise protects C only
    low = rp.replay_pfl(
        _train(laplace_eps=2.0), claim={"noise_multiplier": 1.0, "clipping_norm": CLIP}
    )
    assert low["verdict"] == "fail" and low["max_ratio"] > 1
    assert not hasattr(GaussianMechanism.add_noise, "__wrapped__")
    assert not hasattr(LaplaceMechanism.add_noise, "__wrapped__")

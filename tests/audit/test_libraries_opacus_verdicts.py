"""audit.libraries.opacus (#47): no pass without a test, and never a crash on a bad release.

Small Opacus trainings (an MLP on synthetic data, CPU, about a second each): a correct run
passes with every part of the mechanism tested (coverage); a loop that clips the batch SUM
(the canary shares the clip, adds < C) is flagged by the two-sided contribution test; a
non-finite release, a run without noise and a closure that re-reads the batch are findings
of their own; adaptive clipping is tested at each step's own C and its ε at the σ passed."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus")

from opacus import PrivacyEngine  # noqa: E402
from opacus.optimizers.optimizer import DPOptimizer, _mark_as_processed  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from audit.bounds.contribution import contribution_test  # noqa: E402
from audit.libraries.opacus import SamplerCanaries  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

N, B, M, DELTA = 360, 40, 32, 1e-5


def _train(
    steps=50,
    sigma=1.0,
    clip=1.0,
    seed=0,
    poisson=True,
    nan_record=False,
    closure=False,
    zero_in_closure=False,
    m=M,
    **private,
):
    """(audit, privacy engine, q): an MLP trained through make_private for ``steps`` noised
    steps, with M sampler canaries."""
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(N, 6, generator=g)
    y = (x[:, 0] > 0).long()
    if nan_record:
        x[5, 0] = float("nan")  # a non-finite feature: its gradient, and the clipped sum, NaN
    torch.manual_seed(seed)
    can = SamplerCanaries(m=m, seed=seed)
    model = can.model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    pe = PrivacyEngine(accountant="rdp")
    loader = DataLoader(can.dataset(TensorDataset(x, y)), batch_size=B, shuffle=not poisson)
    model, opt, dl = pe.make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
        max_grad_norm=clip, poisson_sampling=poisson, **private,
    )  # fmt: skip
    audit = can.attach(pe, opt, dl)
    crit = nn.CrossEntropyLoss()
    while len(audit.obs) < steps:
        for xb, yb, cid in dl:
            opt.zero_grad()
            crit(model(xb, cid), yb).backward()
            if closure:  # re-runs forward and backward on the same batch, no zero_grad

                def again(xb=xb, yb=yb, cid=cid):
                    if zero_in_closure:
                        opt.zero_grad()
                    loss = crit(model(xb, cid), yb)
                    loss.backward()
                    return loss

                opt.step(again)
            else:
                opt.step()
            if len(audit.obs) >= steps:
                break
    return audit, pe, 1 / len(dl)


def _claim(audit, q, sigma=1.0, clip=1.0, eps=50.0, sampling="poisson") -> dict:
    return dict(
        level="sample", noise_multiplier=sigma, sampling=sampling, rounds=1,
        steps_per_round=len(audit.obs), sample_rate=q, claimed_epsilon=eps, delta=DELTA,
        clipping_norm=clip, accounting="composed",
    )  # fmt: skip


def _codes(res: dict) -> set[str]:
    return {f["code"] for f in res["findings"] if f.get("severity", "error") == "error"}


def test_correct_run_passes_with_every_part_tested():
    audit, pe, q = _train()
    res = audit.audit(_claim(audit, q, eps=pe.get_epsilon(DELTA)), permutations=199, seed=0)
    assert res["verdict"] == "pass" and res["exit_code"] == 0, res["findings"]
    cov = res["coverage"]
    assert cov["untested"] == [] and all(cov["tested"][p] for p in cov["tested"])
    assert "canary:contribution" in {
        f"{t['group']}:{t['test']}" for t in res["conformance"]["tests"]
    }
    assert res["canary_clip_error"] < 1e-5


def test_clipping_the_batch_sum_instead_of_each_example_is_flagged(monkeypatch):
    """The planted loop clips the SUM of the batch's per-sample gradients to C: a canary
    shares that clip with the other canaries of its batch and adds about C/sqrt(k) < C.
    "At most C" holds; "exactly C" does not."""

    def clip_the_sum(self):
        total = [g.sum(dim=0) for g in self.grad_samples]
        norm = torch.sqrt(sum((t.double() ** 2).sum() for t in total))
        f = min(1.0, self.max_grad_norm / (float(norm) + 1e-6))
        for p, t in zip(self.params, total):
            p.summed_grad = (f * t).to(p.dtype) if p.summed_grad is None else p.summed_grad + f * t
            _mark_as_processed(p.grad_sample)

    monkeypatch.setattr(DPOptimizer, "clip_and_accumulate", clip_the_sum)
    audit, pe, q = _train(steps=80, m=64)
    res = audit.audit(_claim(audit, q, eps=pe.get_epsilon(DELTA)), permutations=199, seed=0)
    assert res["verdict"] == "fail" and res["exit_code"] == 1
    assert "canary:contribution" in res["conformance_rejected"]
    assert "canary:clip" not in res["conformance_rejected"]  # the one-sided test cannot see it
    t = next(t for t in res["conformance"]["tests"] if t["test"] == "contribution")
    assert 0.3 < t["statistic"] < 0.8  # about E[1/sqrt(1 + K)], K ~ Poisson(64/2 · q)


def test_contribution_test_against_its_closed_form():
    rng = np.random.default_rng(0)
    drawn = rng.random((60, 40)) < 0.1
    # under H0 the p-values are uniform whatever the noise scale (estimated, not claimed)
    ps = [contribution_test(rng.normal(0, 1.7, drawn.shape) + drawn, drawn).p_value
          for _ in range(400)]  # fmt: skip
    assert 0.02 < np.mean(np.array(ps) < 0.1) < 0.2
    # a contribution of 0.6 C or 2 C: rejected
    for a in (0.6, 2.0):
        t = contribution_test(rng.normal(0, 1, drawn.shape) + a * drawn, drawn)
        assert t.p_value < 1e-6 and abs(t.statistic - a) < 0.25
    # the statistic is the difference of the two means, exactly
    u = rng.normal(0, 1, drawn.shape) + drawn
    t = contribution_test(u, drawn)
    assert t.statistic == pytest.approx(u[drawn].mean() - u[~drawn].mean())
    assert contribution_test(u, np.zeros_like(drawn)) is None


def test_a_nonfinite_release_is_a_finding_not_a_crash(tmp_path):
    audit, pe, q = _train(steps=30, nan_record=True)
    assert not np.isfinite(audit.observations()["obs"]).all()
    res = audit.audit(_claim(audit, q), permutations=99, seed=0)
    assert res["verdict"] == "fail" and "release_nonfinite" in _codes(res)
    assert res["implied_epsilon"] == math.inf
    from audit.libraries.results import load_library_audits, save_result

    save_result(res, tmp_path / "nan.json")  # strict JSON: ε = ∞ written as "inf"
    (row,) = load_library_audits(tmp_path)
    assert row["verdict"] == "fail" and row["implied_epsilon"] == math.inf


def test_zero_noise_multiplier_is_noise_absent_with_infinite_epsilon():
    audit, pe, q = _train(steps=20, sigma=0.0)
    res = audit.audit(_claim(audit, q, eps=5.0), permutations=99, seed=0)
    assert res["verdict"] == "fail" and "noise_absent" in _codes(res)
    assert res["recomputed_epsilon"] == math.inf and res["implied_epsilon"] == math.inf


def test_noise_never_added_is_noise_absent(monkeypatch):
    def no_noise(self):
        for p in self.params:
            p.grad = p.summed_grad.view_as(p).clone()

    monkeypatch.setattr(DPOptimizer, "add_noise", no_noise)
    audit, pe, q = _train(steps=20)
    res = audit.audit(_claim(audit, q, eps=pe.get_epsilon(DELTA)), permutations=99, seed=0)
    assert res["verdict"] == "fail" and "noise_absent" in _codes(res)
    assert res["implied_epsilon"] == math.inf


def test_a_closure_that_runs_the_forward_twice_is_named():
    audit, pe, q = _train(steps=24, poisson=False, closure=True)
    assert max(audit.iterations) == 2  # Opacus counted the re-read batch as an iteration
    res = audit.audit(_claim(audit, q, sampling="shuffle"), permutations=99, seed=0)
    codes = _codes(res)
    assert "forward_run_twice" in codes and "sample_rate_mismatch" not in codes
    assert res["verdict"] == "fail"
    # the canary was summed twice: the contribution test sees 2·C
    t = next(t for t in res["conformance"]["tests"] if t["test"] == "contribution")
    assert t["statistic"] == pytest.approx(2.0, abs=0.4)


def test_a_closure_that_zeroes_the_gradients_first_is_named_but_harmless():
    audit, pe, q = _train(steps=20, closure=True, zero_in_closure=True)
    assert max(audit.iterations) == 1 and max(audit.repeats) == 1
    res = audit.audit(_claim(audit, q, eps=pe.get_epsilon(DELTA)), permutations=99, seed=0)
    assert res["verdict"] == "pass", res["findings"]
    warned = [f for f in res["findings"] if f["code"] == "forward_run_twice"]
    assert warned and warned[0]["severity"] == "warning"


def test_a_release_nan_at_every_step_is_a_finding_with_nothing_else_claimed(monkeypatch):
    def nan_noise(self):
        for p in self.params:
            p.grad = torch.full_like(p.summed_grad, float("nan")).view_as(p)

    monkeypatch.setattr(DPOptimizer, "add_noise", nan_noise)
    audit, pe, q = _train(steps=6)
    res = audit.audit(_claim(audit, q), permutations=99, seed=0)
    assert res["verdict"] == "fail" and _codes(res) == {"release_nonfinite"}
    assert res["implied_epsilon"] == math.inf
    # no finite step: no test ran, and the coverage says why
    assert res["conformance"]["tests"] == [] and "noise" in res["coverage"]["untested"]
    assert any(u.startswith("noise untested: 0 finite") for u in res["untested"])

"""audit.libraries.opacus, ghost (fast gradient) clipping (#47 item 2): the canaries travel
through a term of the loss, so Opacus's second, reweighted backward pass clips them like
records, and sampling, clipping and the lower bound are tested as in flat mode. Opacus
1.6's own DPLossFastGradientClipping path, an MLP on synthetic data (CPU, ~1 s each)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("opacus.utils.fast_gradient_clipping_utils")

from opacus import PrivacyEngine  # noqa: E402
from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (  # noqa: E402
    GradSampleModuleFastGradientClipping as GhostModule,
)
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from audit.libraries.opacus import SamplerCanaries  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

N, B, M, DELTA = 360, 40, 48, 1e-5


def _ghost(steps=50, sigma=1.0, clip=1.0, seed=0):
    g = torch.Generator().manual_seed(200 + seed)
    x = torch.randn(N, 6, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(seed)
    can = SamplerCanaries(m=M, seed=seed)
    model = can.model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    pe = PrivacyEngine(accountant="rdp")
    model, opt, crit, dl = pe.make_private(
        module=model, optimizer=opt, criterion=can.criterion(nn.CrossEntropyLoss()),
        data_loader=DataLoader(can.dataset(TensorDataset(x, y)), batch_size=B),
        noise_multiplier=sigma, max_grad_norm=clip, grad_sample_mode="ghost",
    )  # fmt: skip
    audit = can.attach(pe, opt, dl)
    while len(audit.obs) < steps:
        for xb, yb, cid in dl:
            opt.zero_grad()
            crit(model(xb, cid), yb).backward()
            opt.step()
            if len(audit.obs) >= steps:
                break
    claim = dict(
        level="sample", noise_multiplier=sigma, sampling="poisson", rounds=1,
        steps_per_round=len(audit.obs), sample_rate=1 / len(dl), clipping_norm=clip,
        claimed_epsilon=float(pe.get_epsilon(DELTA)), delta=DELTA, accounting="composed",
    )  # fmt: skip
    return audit, claim


def test_correct_ghost_run_passes_with_sampling_clipping_and_lower_bound_tested():
    audit, claim = _ghost()
    res = audit.audit(claim, permutations=199, seed=0)
    assert res["mode"] == "ghost"
    assert res["verdict"] == "pass" and res["exit_code"] == 0, res["findings"]
    assert res["coverage"]["untested"] == []
    tests = {f"{t['group']}:{t['test']}" for t in res["conformance"]["tests"]}
    assert {"canary:clip", "canary:contribution", "sampling:release:exchangeable"} <= tests
    assert res["sampling"] is not None and res["lower_bound"] is not None
    # Opacus's second pass clipped each drawn canary to exactly C on its coordinate
    assert res["canary_clip_error"] < 1e-5
    assert audit.model.terms_used == audit.model.terms_made > 0


def test_ghost_clip_factor_that_ignores_max_grad_norm_fails_the_clip_tests(monkeypatch):
    """The planted release: the per-sample clip factor ignores max_grad_norm (1 for every
    record: nothing is clipped), the ε of what ran is unbounded."""
    monkeypatch.setattr(GhostModule, "get_clipping_coef", lambda self: torch.ones_like(
        self.get_norm_sample()))  # fmt: skip
    audit, claim = _ghost(steps=30)
    res = audit.audit(claim, permutations=99, seed=0)
    assert res["verdict"] == "fail" and res["exit_code"] == 1
    assert {"canary:clip", "canary:contribution"} <= set(res["conformance_rejected"])
    assert res["canary_clip_error"] > 10  # a canary added its raw gain (100·C), not C


def test_ghost_release_equals_a_slow_per_sample_clip_reference():
    """One step, the whole dataset in one batch: the block's clipped sum is C per included
    canary, and the user's parameters get the sum of each real record's gradient clipped
    to C (computed record by record with plain autograd), as without canaries."""
    torch.manual_seed(0)
    x = torch.randn(30, 5)
    y = (x[:, 0] > 0).long()
    can = SamplerCanaries(m=6, seed=3)
    inc = can.included
    assert 0 < inc.sum() < 6
    model = can.model(nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2)))
    plain = copy.deepcopy(model.model)
    clip = 0.3
    pe = PrivacyEngine(accountant="rdp")
    gm, opt, crit, dl = pe.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        criterion=can.criterion(nn.CrossEntropyLoss()),
        data_loader=DataLoader(can.dataset(TensorDataset(x, y)), batch_size=64),
        noise_multiplier=1.0, max_grad_norm=clip, grad_sample_mode="ghost",
        poisson_sampling=False,
    )  # fmt: skip
    audit = can.attach(pe, opt, dl)
    xb, yb, cid = next(iter(dl))
    opt.zero_grad()
    crit(gm(xb, cid), yb).backward()
    opt.step()
    ob = audit.observations()
    np.testing.assert_allclose(ob["sums"][0], clip * inc, atol=1e-6)
    ref = [torch.zeros_like(p) for p in plain.parameters()]
    for i in range(len(x)):
        plain.zero_grad()
        nn.functional.cross_entropy(plain(x[i : i + 1]), y[i : i + 1]).backward()
        g = [p.grad.detach().clone() for p in plain.parameters()]
        f = min(1.0, clip / (float(torch.sqrt(sum((t**2).sum() for t in g))) + 1e-6))
        ref = [r + f * t for r, t in zip(ref, g)]
    for p, r in zip(list(model.model.parameters()), ref):
        torch.testing.assert_close(p.summed_grad, r, atol=1e-5, rtol=1e-4)


def test_batch_memory_manager_keeping_the_last_physical_batch_twice_is_flagged(monkeypatch):
    """The planted release: BatchMemoryManager's splitter yields the last physical batch
    of each logical batch twice (the second time closing the step), so its records add 2·C
    to a step whose noise is for C. Ghost clipping, where the canaries now travel."""
    import math

    from opacus.utils.batch_memory_manager import BatchMemoryManager, BatchSplittingSampler

    def twice_the_last(self):
        for idxs in self.sampler:
            parts = np.array_split(idxs, max(1, math.ceil(len(idxs) / self.max_batch_size)))
            parts = [p.tolist() for p in parts]
            for part in parts:
                self.optimizer.signal_skip_step(do_skip=True)
                yield part
            self.optimizer.signal_skip_step(do_skip=False)
            yield parts[-1]

    monkeypatch.setattr(BatchSplittingSampler, "__iter__", twice_the_last)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(N, 6, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)
    can = SamplerCanaries(m=M, seed=1)
    model = can.model(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)))
    pe = PrivacyEngine(accountant="rdp")
    model, opt, crit, dl = pe.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2),
        criterion=can.criterion(nn.CrossEntropyLoss()),
        data_loader=DataLoader(can.dataset(TensorDataset(x, y)), batch_size=B),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode="ghost",
    )  # fmt: skip
    audit = can.attach(pe, opt, dl)
    while len(audit.obs) < 16:
        with BatchMemoryManager(data_loader=dl, max_physical_batch_size=16, optimizer=opt) as mem:
            for xb, yb, cid in mem:
                opt.zero_grad()
                crit(model(xb, cid), yb).backward()
                opt.step()
                if len(audit.obs) >= 16:
                    break
    claim = dict(
        level="sample", noise_multiplier=1.0, sampling="poisson", rounds=1,
        steps_per_round=len(audit.obs), sample_rate=1 / len(dl), clipping_norm=1.0,
        claimed_epsilon=float(pe.get_epsilon(DELTA)), delta=DELTA,
    )  # fmt: skip
    res = audit.audit(claim, permutations=99, seed=0)
    assert res["verdict"] == "fail"
    codes = {f["code"] for f in res["findings"] if f.get("severity", "error") == "error"}
    # the forward read the last physical batch again and its canaries added 2·C
    assert "forward_run_twice" in codes
    assert audit.observations()["sums"].max() == pytest.approx(2.0, abs=1e-5)

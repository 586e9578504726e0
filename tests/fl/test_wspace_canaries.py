"""Gradient (Dirac) canaries under FedASK's W-space privatizer (fl/privacy/wspace.py):
the slot basis, the engine against a slow reference that materializes the W-space sum,
bit-exactness when no canary is included, and the one-run audit of real runs (a correct
one and a planted ×¼ noise fault)."""

import numpy as np
import pytest
import torch

from fl.errors import UsageError
from fl.models import factors as F
from fl.privacy import gradient_canaries as G
from fl.privacy import rng as R
from fl.privacy.dpsgd import DpSgdParams, gaussian_noise
from fl.privacy.wspace import WSpaceClipper, slot_basis
from fl.testing import tiny_config

FIXED_KEY = R.NoiseKey(bytes(range(32)))  # tests only: a fixed key makes runs repeatable


def test_slot_basis_is_the_thin_svd_with_fixed_signs():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(5, 17, generator=g)
    U, S, V = slot_basis(A)
    assert U.dtype == S.dtype == V.dtype == torch.float64
    assert U.shape == (5, 5) and S.shape == (5,) and V.shape == (17, 5)
    torch.testing.assert_close(U @ torch.diag(S) @ V.mT, A.double(), rtol=0, atol=1e-12)
    torch.testing.assert_close(V.mT @ V, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(U.mT @ U, torch.eye(5, dtype=torch.float64), rtol=0, atol=1e-12)
    top = U.abs().argmax(dim=0)
    assert bool((U[top, torch.arange(5)] > 0).all())
    # the signs are fixed by U: -A = U S (-V)ᵀ whatever the SVD routine returns
    U2, _, V2 = slot_basis(-A)
    torch.testing.assert_close(U2, U, rtol=0, atol=1e-12)
    torch.testing.assert_close(V2, -V, rtol=0, atol=1e-12)
    # not of full row rank: refused
    low = torch.randn(5, 2, generator=g) @ torch.randn(2, 17, generator=g)
    with pytest.raises(ValueError, match="full row rank"):
        slot_basis(low)
    with pytest.raises(ValueError, match="rank r <= n"):
        slot_basis(torch.randn(6, 4, generator=g))


# ------------------------------------------- the engine against a materialized reference


@pytest.fixture(scope="module")
def engine(small_engine):
    return small_engine("wsc", method="fedask", optimizer="sgd", rank=4)


def _random_start(tr, seed):
    st = tr.initial_state()
    g = torch.Generator().manual_seed(seed)
    for ab in st["factors"].values():
        ab["B"] = 0.1 * torch.randn(ab["B"].shape, generator=g)
    return st


def _canaries(flat, included, coins, clip):
    return G.ClientCanaries(
        ids=np.arange(len(flat)),
        flat=torch.as_tensor(flat, dtype=torch.long),
        included=np.asarray(included, dtype=bool),
        coins=[np.asarray(c, dtype=bool) for c in coins],
        clip=clip,
        meta={"round": 0, "client": "0", "stage": "train", "attempt": 0},
    )


def test_engine_matches_the_materialized_w_space_sum(engine):
    """One W-space DP-SGD step with canaries on two B factors (two on one row) and the
    head, against a slow reference: per-example ∂l_i/∂W (the frozen base weight's
    gradient, example by example), the joint clip, the canaries as W-space vectors
    C·(e_a ⊗ V[:,k]), the noise Z_W from the same generator draws, then the projection
    s·Σ_W Aᵀ/(q·n). The released B and head gradients and the observed c = (Σ_W row a)·V[:,k]
    must match."""
    tr = engine.trainer
    s = tr.scaling
    F.set_state(tr.model, _random_start(tr, 1))
    tr._ensure_hooks({"B", "head"})
    params = tr._set_trainable({"B", "head"})
    names = tr._flat_names(params)
    batch = engine.members_data.batch(torch.arange(6), tr.device)
    labels = batch.pop("labels")
    sigma, C, E = 0.3, 0.05, 3.0
    dp = DpSgdParams(sigma, C, 0.5, E)

    # canaries: slots of the first two B factors (rows/cols) and two head coordinates
    starts = np.cumsum([0] + [p.numel() for p in params])
    bidx = [i for i, nm in enumerate(names) if nm.endswith("/B")][:2]
    hidx = next(i for i, nm in enumerate(names) if nm.startswith("head/"))
    r = params[bidx[0]].shape[1]
    slots = [(bidx[0], 2, 1), (bidx[0], 2, 3), (bidx[0], 5, 0), (bidx[1], 0, 2), (bidx[1], 7, 1)]
    flat = [int(starts[i]) + a * r + k for i, a, k in slots]
    flat += [int(starts[hidx]) + 3, int(starts[hidx]) + 11]
    included = [True, True, False, True, True, True, False]
    coins = [[True, True, True, False, True, True, True]]
    cc = _canaries(flat, included, coins, C)

    tr.model.eval()
    for m in tr.model.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            m.train()
    try:
        with WSpaceClipper.from_model(tr.model, s) as gt:
            tr.gsm.enable_hooks()
            try:
                logits = tr.gsm(**batch).logits
                loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
                loss.backward()
                gt(params, dp, torch.Generator().manual_seed(5), len(labels), canaries=cc)
            finally:
                tr.gsm.disable_hooks()
                for p in params:
                    p.grad_sample = None
        got = {nm: p.grad.detach().double().clone() for p, nm in zip(params, names)}
        for p in params:
            p.grad = None
        seen = cc.result()["obs"]
        assert seen.shape == (1, len(flat)) and cc.step == 1

        # ---- the reference: per-example W-space and head gradients, materialized
        bkeys = {i: nm.split("/")[1] for i, nm in enumerate(names) if nm.endswith("/B")}
        bases = {
            i: tr.model.get_submodule(f"base_model.model.{k}").base_layer.weight
            for i, k in bkeys.items()
        }
        heads = {i: p for i, p in enumerate(params) if i not in bkeys}
        for w in bases.values():
            w.requires_grad_(True)
        per = []  # per example: {param index: gradient in its space (W or head), float64}
        try:
            for e in range(len(labels)):
                one = {k: v[e : e + 1] for k, v in batch.items()}
                out = tr.model(**one).logits
                le = torch.nn.functional.cross_entropy(
                    out.float(), labels[e : e + 1], reduction="sum"
                )
                order = list(bases) + list(heads)
                gs = torch.autograd.grad(le, [bases[i] for i in bases] + list(heads.values()))
                per.append({i: g.double() for i, g in zip(order, gs)})
        finally:
            for w in bases.values():
                w.requires_grad_(False)
    finally:
        tr.model.train()
    norms = torch.tensor([sum(float(g.pow(2).sum()) for g in d.values()) ** 0.5 for d in per])
    assert bool((norms > C).any())  # the clip matters
    factor = torch.clamp(C / (norms.double() + 1e-6), max=1.0)
    gen = torch.Generator().manual_seed(5)
    std = sigma * C
    sigma_sum, bases_of, errs = {}, {}, []
    for i, p in enumerate(params):
        tot = sum(float(factor[e]) * per[e][i] for e in range(len(per)))
        if i in bkeys:
            A = tr.lora[bkeys[i]]["A"].detach().double()
            U, S, V = slot_basis(A)
            bases_of[i] = V
            for (pi, a, k), inc, coin in zip(slots, included, coins[0]):
                if pi == i and inc and coin:  # the canary: C·(e_a ⊗ V[:,k]) in W-space
                    w = torch.zeros_like(tot)
                    w[a] = V[:, k]
                    assert abs(float(w.norm()) - 1.0) < 1e-12
                    tot = tot + C * w
            z = gaussian_noise((p.shape[0], A.shape[1]), std, gen, torch.float32).double()
            sigma_sum[i] = tot + z  # Σ_W
            want = s * sigma_sum[i] @ A.mT / E
        else:
            tot = tot.reshape(-1)
            for f, inc, coin in zip(flat[5:], included[5:], coins[0][5:]):
                if i == hidx and inc and coin:
                    tot[f - int(starts[i])] += C
            z = gaussian_noise(tuple(p.shape), std, gen, p.dtype).double().reshape(-1)
            sigma_sum[i] = (tot + z).reshape(p.shape)
            want = sigma_sum[i] / E
        scale = float(want.abs().max())
        errs.append(float((got[names[i]] - want).abs().max()) / scale)
        torch.testing.assert_close(got[names[i]], want, rtol=0, atol=1e-5 * scale)
    # the observations: c = (Σ_W row a)·V[:,k] on B, Σ_h at the head's coordinates
    ref = [float(sigma_sum[i][a] @ bases_of[i][:, k]) for i, a, k in slots]
    ref += [float(sigma_sum[hidx].reshape(-1)[f - int(starts[hidx])]) for f in flat[5:]]
    top = max(abs(x) for x in ref)
    np.testing.assert_allclose(seen[0], ref, rtol=0, atol=1e-5 * top)
    print(
        f"W-space reference: released gradients max rel. error {max(errs):.2e}, "
        f"observed c {float(np.abs(seen[0] - ref).max()) / top:.2e}"
    )


def test_included_canary_adds_exactly_c_in_slot_coordinates(engine):
    """With no data (empty batch), the same noise, one sampled included canary on a B slot:
    every observed c is that of the run without it, except the canary's own, which is C
    more; and the B gradient moves by s·C·S_k·U[:,k]ᵀ/(q·n) on row a only."""
    tr = engine.trainer
    F.set_state(tr.model, _random_start(tr, 2))
    params = tr._set_trainable({"B", "head"})
    names = tr._flat_names(params)
    bi = next(i for i, nm in enumerate(names) if nm.endswith("/B"))
    key = names[bi].split("/")[1]
    r = params[bi].shape[1]
    start = int(sum(p.numel() for p in params[:bi]))
    flat = [start + 1 * r + 2, start + 1 * r + 0, start + 4 * r + 3]
    C, E = 0.7, 2.0
    dp = DpSgdParams(1.1, C, 0.5, E)

    def step(included):
        cc = _canaries(flat, included, [[True, True, True]], C)
        gt = WSpaceClipper.from_model(tr.model, tr.scaling)
        gt(params, dp, torch.Generator().manual_seed(9), 0, canaries=cc)
        grads = [p.grad.detach().clone() for p in params]
        for p in params:
            p.grad = None
        return grads, cc.result()["obs"][0]

    g0, c0 = step([False, False, False])
    g1, c1 = step([True, False, False])
    np.testing.assert_allclose(c1 - c0, [C, 0.0, 0.0], rtol=0, atol=1e-5)
    for i in range(len(params)):
        if i != bi:
            assert torch.equal(g0[i], g1[i])
    U, S, _ = slot_basis(tr.lora[key]["A"])
    d = (g1[bi] - g0[bi]).double()
    want = torch.zeros_like(d)
    want[1] = tr.scaling * C * S[2] * U[:, 2] / E
    torch.testing.assert_close(d, want, rtol=0, atol=1e-5 * float(want.abs().max()))


# ------------------------------------------------------------ real runs through the engine


# the run with every canary excluded is bit-exact: tests/fl/test_gradient_canaries.py
# (test_non_included_canaries_leave_a_run_bit_exact[fedask])


def test_other_own_space_privatizers_are_still_refused():
    from fl.run.local_step import SpaceDpSgd
    from fl.run.trainer import LocalTrainer

    class Plain:  # a transform that does not say where canaries would live
        def __call__(self, *a, **k):
            return {}

    holder = type("T", (), {"gradient_canaries": object()})()
    priv = SpaceDpSgd(DpSgdParams(1.0, 1.0, 0.5, 2.0), None, Plain())
    with pytest.raises(UsageError, match="input canaries"):
        LocalTrainer._begin_canaries(holder, priv, [], [], 0.5, 1)


@pytest.fixture(scope="module")
def audited_pair(tmp_path_factory):
    """A correct FedASK run (its default W-space clipping, q = 1, ε = 1, rank 16,
    M = 4 000: benchmarks/auditing/faults.py's "fedask" setting without clip_space=b) and the same
    run with the planted ×¼ noise fault, both audited one-run. (At ε = 8 the correct run
    gives ε_lb ≈ 2.9, but 4 000 canaries cannot certify above ≈ 5.5, so a ×¼ fault there
    stays below the claim: faults are looked for at ε = 1, as in the fault suite.)"""
    from audit.bundle.audit import audit_run
    from fl.run.engine import train

    base = dict(
        method="fedask",
        epsilon=1.0,
        delta=1e-5,
        batch_size=80,
        rank=16,
        canaries=4000,
        canary_kind="gradient",
    )
    out = {}
    for name, fault in (("correct", ""), ("quarter", "noise_scale=0.25")):
        run = tmp_path_factory.mktemp("wsa") / name
        train(tiny_config(**base, inject_fault=fault), run, quiet=True, noise_key=FIXED_KEY)
        out[name] = audit_run(run, one_run=True)
    return out


def test_audit_of_a_correct_fedask_run_is_sound_and_not_vacuous(audited_pair):
    res = audited_pair["correct"]
    one, eps = res["one_run"], res["epsilon_pld"]
    assert eps == pytest.approx(1.0, abs=0.02)
    assert one["kind"] == "gradient" and one["m"] == 4000
    assert one["observations"]["space"] == ["w"]
    assert 0.0 < one["epsilon_lb"] <= eps
    assert not one["claim_check"]["exceeds"]
    assert "empirical_exceeds_claim" not in {f["code"] for f in res["findings"]}
    noise = one["observations"]["noise"]
    assert set(noise) == {"B", "head"}
    assert all(0.8 < v["observed_over_claimed"] < 1.2 for v in noise.values())
    print(f"W-space gradient canaries, ε = {eps:.3f}: one-run ε_lb = {one['epsilon_lb']:.3f}")


def test_quarter_noise_fault_is_detected_in_w_space(audited_pair):
    res = audited_pair["quarter"]
    one = res["one_run"]
    assert one["claim_check"]["exceeds"]
    assert "empirical_exceeds_claim" in {f["code"] for f in res["findings"]}
    assert one["observations"]["noise"]["B"]["observed_over_claimed"] < 0.35
    print(f"×¼ noise: one-run ε_lb = {one['epsilon_lb']:.3f} (claim ε = {res['epsilon_pld']:.3f})")

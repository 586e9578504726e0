"""W-space per-sample clipping (fl/privacy/wspace.py) against slow references."""

import math

import pytest
import torch

from fl.models import factors as F
from fl.privacy.dpsgd import DpSgdParams
from fl.privacy.wspace import WSpaceClipper, wspace_sq_norms, wspace_sq_norms_reference


@pytest.mark.parametrize("shape", [(5, 7, 6, 9), (4, 1, 3, 11), (3, 13, 8, 2)])
def test_gram_norm_matches_materialized(shape):
    b, T, n, m = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(b, T, n, generator=g, dtype=torch.float64)
    go = torch.randn(b, T, m, generator=g, dtype=torch.float64)
    fast = wspace_sq_norms(x, go)
    # Independent reference: explicit loop over examples and positions.
    ref = torch.stack(
        [sum(torch.outer(go[i, t], x[i, t]) for t in range(T)).pow(2).sum() for i in range(b)]
    )
    assert torch.allclose(fast, ref, rtol=1e-12, atol=0)
    assert torch.allclose(wspace_sq_norms_reference(x, go), ref, rtol=1e-12, atol=0)
    # 2-D inputs are length-1 sequences
    one = torch.stack([torch.outer(go[i, 0], x[i, 0]).pow(2).sum() for i in range(b)])
    assert torch.allclose(wspace_sq_norms(x[:, 0], go[:, 0]), one, rtol=1e-12, atol=0)


@pytest.fixture(scope="module")
def engine(small_engine):
    return small_engine("ws", optimizer="sgd")


def _random_start(tr, seed):
    st = tr.initial_state()
    g = torch.Generator().manual_seed(seed)
    for ab in st["factors"].values():
        ab["B"] = 0.1 * torch.randn(ab["B"].shape, generator=g)
    return st


def test_joint_norm_on_tiny_model_matches_base_weight_gradients(engine):
    """Per-example joint norm ‖[∂l_i/∂W per layer, ∂l_i/∂head]‖ from the Gram trick vs
    an independent reference: with dropout 0, ∂l/∂W equals the gradient of the frozen
    base weight W0 of the same layer (y = W0 x + s·BAx), computed example by example."""
    tr = engine.trainer
    s = tr.scaling
    F.set_state(tr.model, _random_start(tr, 1))
    tr._ensure_hooks({"B", "head"})
    params = tr._set_trainable({"B", "head"})
    batch = engine.members_data.batch(torch.arange(6), tr.device)
    labels = batch.pop("labels")
    clip = DpSgdParams(0.0, 1e9, 0.5, 3.0)
    # No dropout anywhere (incl. attention): both passes must see the same network.
    # Opacus only captures activations of modules in training mode: keep those.
    tr.model.eval()
    for m in tr.model.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            m.train()
    with WSpaceClipper.from_model(tr.model, s) as gt:
        tr.gsm.enable_hooks()
        try:
            logits = tr.gsm(**batch).logits
            torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").backward()
            gt(params, clip, torch.Generator().manual_seed(0), len(labels))
        finally:
            tr.gsm.disable_hooks()
            for p in params:
                p.grad_sample = None
        got = gt.last_norms
    # reference
    bases = {k: tr.model.get_submodule(f"base_model.model.{k}").base_layer.weight for k in tr.lora}
    heads = list(tr.head.values())
    for w in bases.values():
        w.requires_grad_(True)
    ref = []
    try:
        for i in range(len(labels)):
            one = {k: v[i : i + 1] for k, v in batch.items()}
            tr.model.zero_grad(set_to_none=True)
            out = tr.model(**one).logits
            loss = torch.nn.functional.cross_entropy(
                out.float(), labels[i : i + 1], reduction="sum"
            )
            gw = torch.autograd.grad(loss, list(bases.values()) + heads)
            ref.append(math.sqrt(sum(float(t.double().pow(2).sum()) for t in gw)))
    finally:
        for w in bases.values():
            w.requires_grad_(False)
        tr.model.train()
    assert torch.allclose(got, torch.tensor(ref, dtype=torch.float64), rtol=2e-4)


def test_sigma0_huge_clip_equals_nonprivate_B_step(engine):
    """σ = 0, C = ∞: W-space DP-SGD equals the non-private B+head training (same Poisson
    batches), i.e. s·(Σ_i ∂l_i/∂W) Aᵀ is B's true gradient."""
    tr = engine.trainer
    start = _random_start(tr, 2)
    pos = engine.client_positions["0"]
    n = len(pos)
    q = min(1.0, 16 / n)
    dp = DpSgdParams(0.0, 1e9, q, q * n)

    def streams():  # the same Poisson batches for both trainings
        return engine.rand.stream("noise", 0), engine.rand.stream("batches", 0)

    data = engine.members_data
    plain, _ = tr.train(start, data, pos, 3, {"B", "head"}, None, streams(), 7)
    with WSpaceClipper.from_model(tr.model, tr.scaling) as gt:
        wsp, _ = tr.train(start, data, pos, 3, {"B", "head"}, dp, streams(), 7, grad_transform=gt)
    a, b = F.flatten_state(plain.state), F.flatten_state(wsp.state)
    moved = max(float((a[k] - F.flatten_state(start)[k]).abs().max()) for k in a)
    assert moved > 1e-3  # training did something
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert wsp.dp_stats["frac_clipped"] == 0.0


def test_trainable_A_rejected(engine):
    tr = engine.trainer
    gt = WSpaceClipper.from_model(tr.model, tr.scaling)
    A = next(iter(tr.lora.values()))["A"]
    with pytest.raises(ValueError, match="A fixed"):
        gt([A], DpSgdParams(1.0, 1.0, 0.5, 2.0), None, 0)


def test_wspace_noise_scale_and_shape(engine):
    """Zero-gradient step (empty batch): B.grad = s·Z Aᵀ/(q n) with Z ~ N(0, σ²C² I_{m×n}),
    so each row of B.grad ~ N(0, s²σ²C² AAᵀ/(qn)²) (correlated through AAᵀ); the head
    gets isotropic N(0, σ²C²/(qn)²)."""
    tr = engine.trainer
    key = next(iter(tr.lora))
    B = tr.lora[key]["B"]
    head = next(p for p in tr.head.values() if p.dim() == 2)
    A = tr.lora[key]["A"].detach().double()
    s, sigma, C, E = tr.scaling, 1.3, 0.7, 4.0
    dp = DpSgdParams(sigma, C, 0.5, E)
    gt = WSpaceClipper.from_model(tr.model, s, keep_noise=True)
    gen = torch.Generator().manual_seed(3)
    rows, hs, zs = [], [], []
    for _ in range(400):
        gt([B, head], dp, gen, 0)
        rows.append(B.grad.detach().double())
        hs.append(head.grad.detach().double())
        zs.append(gt.last_noise[key].double())
    B.grad = None
    head.grad = None
    R = torch.cat(rows)  # (400·m)×r
    cov = R.mT @ R / R.shape[0]
    expect = (s * sigma * C / E) ** 2 * (A @ A.mT)
    assert torch.allclose(cov, expect, rtol=0, atol=0.03 * float(expect.diagonal().max()))
    # the W-space draw itself has std σC, and the head noise σC/E
    assert float(torch.cat(zs).std()) == pytest.approx(sigma * C, rel=0.02)
    assert float(torch.cat(hs).std()) == pytest.approx(sigma * C / E, rel=0.05)
    # B.grad is exactly s·Z Aᵀ/E for the recorded Z
    assert torch.allclose(rows[-1], s * zs[-1] @ A.mT / E, rtol=1e-4, atol=1e-7)

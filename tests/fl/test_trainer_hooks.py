"""The local step (fl/run/trainer.py): privatizer + post-privacy hooks.

Each hook against a slow obvious reference, and the whole ``LocalTrainer.train``
against the monolithic loop it replaced (kept below verbatim as the reference):
bit-identical (``torch.equal``) for W-space / no DP with every combination of mask,
FedProx and SCAFFOLD terms; for DP-SGD equal to 1e-6 with the same noise and batches
(the fused step of :func:`fl.privacy.dpsgd.clip_and_noise` sums over examples and
parameters in another order than the per-parameter loop it replaced).
"""

import numpy as np
import pytest
import torch

from fl.models import factors as F
from fl.privacy.dpsgd import DpSgdParams, clip_and_noise, gaussian_noise
from fl.privacy.wspace import WSpaceClipper
from fl.run.batches import poisson_masks
from fl.run.local_step import (
    Correction,
    DpSgd,
    GradMask,
    NoPrivacy,
    Prox,
    SpaceDpSgd,
    local_step,
)
from fl.run.trainer import TrainResult

# ---- unit tests of each hook against element-by-element references ----------------


def _params(seed, shapes=((3, 4), (5,))):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
        p.grad_sample = torch.randn((6, *p.shape), generator=g)
    return ps, g


def _mask_for(ps, g):
    return {"a": (torch.rand(ps[0].shape, generator=g) < 0.5).float()}


def test_grad_mask_pre_post_after_step():
    ps, g = _params(0)
    mask = _mask_for(ps, g)
    grad0 = [p.grad.clone() for p in ps]
    gs0 = [p.grad_sample.clone() for p in ps]
    vals0 = [p.detach().clone() for p in ps]
    h = GradMask(mask)
    h.start(ps, ["a", "b"])
    h.pre(ps)
    m = mask["a"]
    for idx in np.ndindex(*ps[0].shape):
        keep = bool(m[idx])
        assert ps[0].grad[idx] == (grad0[0][idx] if keep else 0)
        for i in range(6):
            assert ps[0].grad_sample[(i, *idx)] == (gs0[0][(i, *idx)] if keep else 0)
    assert torch.equal(ps[1].grad, grad0[1]) and torch.equal(ps[1].grad_sample, gs0[1])
    # post: the released gradient is zeroed where masked
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    released = [p.grad.clone() for p in ps]
    h.post(ps)
    for idx in np.ndindex(*ps[0].shape):
        assert ps[0].grad[idx] == (released[0][idx] if m[idx] else 0)
    assert torch.equal(ps[1].grad, released[1])
    # after_step: frozen coordinates go back to their start values (e.g. after AdamW's
    # decoupled weight decay), the others keep the step
    with torch.no_grad():
        for p in ps:
            p.add_(1.0)
    moved = [p.detach().clone() for p in ps]
    h.after_step(ps)
    for idx in np.ndindex(*ps[0].shape):
        assert ps[0][idx] == (moved[0][idx] if m[idx] else vals0[0][idx])
    assert torch.equal(ps[1].detach(), moved[1])
    # again(): only the gradient mask
    ps[0].grad = torch.ones(ps[0].shape)
    h.again().post(ps)
    assert torch.equal(ps[0].grad, m)


def test_prox_adds_mu_times_drift():
    ps, g = _params(1)
    h = Prox(0.3)
    h.start(ps, ["a", "b"])
    start = [p.detach().clone() for p in ps]
    with torch.no_grad():
        for p in ps:
            p.add_(torch.randn(p.shape, generator=g))
    grad0 = [p.grad.clone() for p in ps]
    h.post(ps)
    for p, p0, g0 in zip(ps, start, grad0):
        for idx in np.ndindex(*p.shape):
            ref = float(g0[idx]) + 0.3 * (float(p.detach()[idx]) - float(p0[idx]))
            assert abs(float(p.grad[idx]) - ref) < 1e-6


def test_correction_adds_by_name():
    ps, g = _params(2)
    corr = {"b": torch.randn(5, generator=g), "not-trained": torch.ones(7)}
    h = Correction(corr)
    h.start(ps, ["a", "b"])
    grad0 = [p.grad.clone() for p in ps]
    h.post(ps)
    assert torch.equal(ps[0].grad, grad0[0])
    for i in range(5):
        assert abs(float(ps[1].grad[i]) - (float(grad0[1][i]) + float(corr["b"][i]))) < 1e-6


def test_no_privacy_fills_missing_grads():
    ps, _ = _params(3)
    ps[1].grad = None
    g0 = ps[0].grad.clone()
    assert NoPrivacy()(ps, 0) is None
    assert torch.equal(ps[0].grad, g0) and torch.equal(ps[1].grad, torch.zeros(5))


def test_dpsgd_privatizer_matches_reference():
    """Flat clipping + noise vs an example-by-example reference with the same noise."""
    ps, _ = _params(4)
    ps[0].grad_sample[2] = float("nan")  # a non-finite example contributes 0
    gs = [p.grad_sample.clone() for p in ps]
    dp = DpSgdParams(noise_multiplier=0.7, clip=1.5, sample_rate=0.5, expected_batch=4.0)
    st = DpSgd(dp, torch.Generator().manual_seed(9))(ps, 6)
    gen = torch.Generator().manual_seed(9)
    for p, s in zip(ps, gs):
        ref = torch.zeros(p.shape)
        for i in range(6):
            sq = sum(float(x[i].double().pow(2).sum()) for x in gs)
            if not np.isfinite(sq):
                continue
            ref += min(1.0, 1.5 / (sq**0.5 + 1e-6)) * s[i]
        ref += gaussian_noise(tuple(p.shape), 0.7 * 1.5, gen)
        assert torch.allclose(p.grad, ref / 4.0, atol=1e-5)
        assert p.grad_sample is None
    assert st["nonfinite"] == 1
    # an empty batch: noise only, and stale per-sample gradients are ignored
    ps, _ = _params(5)
    DpSgd(dp, torch.Generator().manual_seed(9))(ps, 0)
    gen = torch.Generator().manual_seed(9)
    for p in ps:
        assert torch.equal(p.grad, gaussian_noise(tuple(p.shape), 1.05, gen) / 4.0)


def test_local_step_order():
    dp = DpSgdParams(1.0, 1.0, 0.5, 2.0)
    mk = {"a": torch.ones(1)}
    priv, hooks = local_step(None, None)
    assert isinstance(priv, NoPrivacy) and hooks == []
    priv, hooks = local_step(dp, "gen", grad_transform=lambda *a: {})
    assert isinstance(priv, SpaceDpSgd) and priv.noise == "gen"
    priv, hooks = local_step(dp, "gen", prox_mu=0.1, correction={}, grad_mask=mk)
    assert isinstance(priv, DpSgd)
    kinds = [type(h).__name__ for h in hooks]
    assert kinds == ["GradMask", "Prox", "Correction", "_Remask"]
    assert [type(h).__name__ for h in local_step(dp, 0, grad_mask=mk)[1]] == ["GradMask"]
    assert [type(h).__name__ for h in local_step(dp, 0, prox_mu=0.0)[1]] == []


# ---- the whole local training against the monolithic loop it replaced ----------------


def _legacy_clip_and_noise(params, dp, generator, batch_size):
    stats = {"mean_norm": 0.0, "frac_clipped": 0.0, "nonfinite": 0}
    if batch_size > 0:
        sq = None
        for p in params:
            gs = p.grad_sample
            v = gs.reshape(gs.shape[0], -1).float().pow(2).sum(dim=1)
            sq = v if sq is None else sq + v
        norms = sq.sqrt()
        finite = torch.isfinite(norms)
        factor = torch.where(
            finite, torch.clamp(dp.clip / (norms + 1e-6), max=1.0), torch.zeros_like(norms)
        )
        stats["nonfinite"] = int((~finite).sum())
        stats["mean_norm"] = float(norms[finite].mean()) if finite.any() else float("nan")
        stats["frac_clipped"] = (
            float((norms[finite] > dp.clip).float().mean()) if finite.any() else 0.0
        )
    std = dp.noise_multiplier * dp.clip
    for p in params:
        if batch_size > 0:
            gs = p.grad_sample
            gs = torch.where(torch.isfinite(gs), gs, torch.zeros_like(gs))
            summed = torch.einsum("i,i...->...", factor.to(gs.dtype), gs)
        else:
            summed = torch.zeros_like(p)
        noise = gaussian_noise(tuple(p.shape), std, generator, p.dtype, p.device)
        p.grad = ((summed + noise) / dp.expected_batch).to(p.dtype)
        p.grad_sample = None
    return stats


def _monolithic_train(
    tr,
    start,
    data,
    positions,
    steps,
    trainable,
    dp,
    streams,
    dropout_seed,
    prox_mu=0.0,
    correction=None,
    opt_state=None,
    grad_transform=None,
    grad_mask=None,
):
    """LocalTrainer.train before the privatizer/hooks split (verbatim)."""
    cfg = tr.cfg
    F.set_state(tr.model, start)
    tr._ensure_hooks(trainable)
    params = tr._set_trainable(trainable)
    flat_names = tr._flat_names(params)
    tr.model.train()
    torch.manual_seed(dropout_seed)
    noise_gen, batch_src = streams
    n = len(positions)
    q = min(1.0, cfg.batch_size / n)
    expected = q * n
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    start_vals = [p.detach().clone() for p in params] if prox_mu > 0 else None
    # Frozen (masked) coordinates must not move at all — not even by AdamW's
    # decoupled weight decay, which ignores gradients: they are restored each step.
    frozen_vals = [p.detach().clone() for p in params] if grad_mask else None
    pos_t = torch.as_tensor(positions, dtype=torch.long)
    use_hooks = dp is not None
    if use_hooks:
        tr.gsm.enable_hooks()
    losses, examples, dp_stats = [], 0, {"mean_norm": [], "frac_clipped": [], "nonfinite": 0}
    masks = poisson_masks(batch_src, n, q, steps)
    try:
        for mask in masks:
            idx = pos_t[mask]
            b = len(idx)
            examples += b
            opt.zero_grad(set_to_none=True)
            if b > 0:
                batch = data.batch(idx, tr.device)
                labels = batch.pop("labels")
                net = tr.gsm if use_hooks else tr.model
                logits = net(**batch).logits
                loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")
                (loss / (1.0 if use_hooks else expected)).backward()
                losses.append(loss.item() / b)
            masks = None
            if grad_mask:
                masks = [grad_mask.get(nm) for nm in flat_names]
                for p, mk in zip(params, masks):
                    if mk is None:
                        continue
                    mk = mk.to(p.device, p.dtype)
                    if getattr(p, "grad_sample", None) is not None:
                        p.grad_sample = p.grad_sample * mk
                    if p.grad is not None:
                        p.grad.mul_(mk)
            if dp is not None:
                if grad_transform is not None:
                    st = grad_transform(params, dp, noise_gen, b)
                else:
                    for p in params:
                        if b == 0:
                            p.grad_sample = None
                    st = _legacy_clip_and_noise(params, dp, noise_gen, b)
                if b > 0:
                    dp_stats["mean_norm"].append(st["mean_norm"])
                    dp_stats["frac_clipped"].append(st["frac_clipped"])
                dp_stats["nonfinite"] += st["nonfinite"]
            else:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
            if masks is not None:
                for p, mk in zip(params, masks):
                    if mk is not None and p.grad is not None:
                        p.grad.mul_(mk.to(p.device, p.dtype))
            if prox_mu > 0:
                for p, p0 in zip(params, start_vals):
                    p.grad.add_(p.detach() - p0, alpha=prox_mu)
            if correction is not None:
                for p, nm in zip(params, flat_names):
                    if nm in correction:
                        p.grad.add_(correction[nm].to(p.device, p.dtype))
            if masks is not None and (prox_mu > 0 or correction is not None):
                for p, mk in zip(params, masks):
                    if mk is not None:
                        p.grad.mul_(mk.to(p.device, p.dtype))
            opt.step()
            if frozen_vals is not None and masks is not None:
                with torch.no_grad():
                    for p, mk, p0 in zip(params, masks, frozen_vals):
                        if mk is not None:
                            m = mk.to(p.device, p.dtype)
                            p.copy_(m * p + (1 - m) * p0)
    finally:
        if use_hooks:
            tr.gsm.disable_hooks()
            for p in params:
                p.grad_sample = None
    # (the result's assembly, unchanged, written in fewer lines)
    stats = {k: float(np.mean(v)) if isinstance(v, list) and v else v for k, v in dp_stats.items()}
    loss = float(np.mean(losses)) if losses else float("nan")
    return TrainResult(F.get_state(tr.model), loss, steps, examples, stats), opt.state_dict()


@pytest.fixture(scope="module")
def engine(small_engine):
    return small_engine("hooks", optimizer="adamw", weight_decay=0.1)


CASES = {
    "none": {},
    "prox": dict(prox_mu=0.5),
    "correction": dict(correction=True),
    "mask": dict(grad_mask=True),
    "mask+prox+correction": dict(prox_mu=0.5, correction=True, grad_mask=True),
}


@pytest.mark.parametrize("privacy", ["none", "dpsgd", "wspace"])
@pytest.mark.parametrize("case", list(CASES))
def test_bit_identical_to_monolithic_loop(engine, privacy, case):
    tr = engine.trainer
    start = tr.initial_state()
    g = torch.Generator().manual_seed(3)
    for ab in start["factors"].values():
        ab["B"] = 0.1 * torch.randn(ab["B"].shape, generator=g)
    flat = F.flatten_state(start)
    trainable = {"B", "head"} if privacy == "wspace" else {"A", "B", "head"}
    kw = dict(CASES[case])
    if kw.get("correction"):
        kw["correction"] = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in flat.items()}
    if kw.get("grad_mask"):
        kw["grad_mask"] = {
            k: (torch.rand(v.shape, generator=g) < 0.5).float()
            for k, v in flat.items()
            if k.startswith("factors/")
        }
    pos = np.arange(60)
    dp = None if privacy == "none" else DpSgdParams(1.0, 0.5, 16 / 60, 16.0)

    def streams():
        return engine.rand.stream("noise", 0), engine.rand.stream("batches", 0)

    def run(fn):
        args = (start, engine.members_data, pos, 3, trainable, dp, streams(), 7)
        if privacy == "wspace":
            with WSpaceClipper.from_model(tr.model, tr.scaling) as gt:
                return fn(*args, grad_transform=gt, **kw)
        return fn(*args, **kw)

    new, new_opt = run(tr.train)
    old, old_opt = run(lambda *a, **k: _monolithic_train(tr, *a, **k))
    a, b = F.flatten_state(new.state), F.flatten_state(old.state)
    assert a.keys() == b.keys()
    if privacy == "dpsgd":  # the fused step: same noise and batches, other summation order

        def same(x, y):
            return torch.allclose(x, y, rtol=0, atol=1e-6)

    else:
        same = torch.equal
    assert all(same(a[k], b[k]) for k in a)
    assert max(float((a[k] - flat[k]).abs().max()) for k in a) > 1e-4  # it trained
    if privacy == "dpsgd":
        assert new.dp_stats == pytest.approx(old.dp_stats, rel=1e-5)
    else:
        assert new.dp_stats == old.dp_stats
    assert new.examples == old.examples
    loss_ok = new.loss == (pytest.approx(old.loss, rel=1e-6) if privacy == "dpsgd" else old.loss)
    assert loss_ok or (np.isnan(new.loss) and np.isnan(old.loss))
    for k, v in old_opt["state"].items():
        for name, t in v.items():
            assert same(new_opt["state"][k][name], t)
    if kw.get("grad_mask"):  # frozen coordinates did not move
        for k, mk in kw["grad_mask"].items():
            assert torch.equal(a[k][mk == 0], flat[k][mk == 0])


def test_clip_and_noise_unchanged():
    """The fused clip_and_noise gives the old one's update (same noise) to 1e-6, and
    its stats; an empty batch gives the old update bit for bit (noise only)."""
    for b in (0, 6):
        ps, _ = _params(6)
        qs, _ = _params(6)
        dp = DpSgdParams(1.3, 0.8, 0.5, 4.0)
        st = clip_and_noise(ps, dp, torch.Generator().manual_seed(1), b)
        st_old = _legacy_clip_and_noise(qs, dp, torch.Generator().manual_seed(1), b)
        assert {k: float(v) for k, v in st.items()} == pytest.approx(st_old, rel=1e-6)
        assert all(torch.allclose(p.grad, q.grad, rtol=0, atol=1e-6) for p, q in zip(ps, qs))
        if b == 0:
            assert all(torch.equal(p.grad, q.grad) for p, q in zip(ps, qs))


def test_head_clip_share_is_wired_through_local_training(engine, monkeypatch):
    """With head_share s the trainer's DP-SGD step marks exactly the head's coordinates
    (from the flat names) and every step clips with (C·√s, C·√(1−s)); the trained state
    differs from the joint clip's; a grad transform (W-space) refuses the split."""
    import fl.run.local_step as T
    from fl.errors import UsageError
    from fl.privacy import dpsgd

    tr = engine.trainer
    start = tr.initial_state()
    g = torch.Generator().manual_seed(4)
    for ab in start["factors"].values():
        ab["B"] = 0.1 * torch.randn(ab["B"].shape, generator=g)
    n_head = sum(v.numel() for v in start["head"].values())
    n_all = sum(v.numel() for v in F.flatten_state(start).values())
    seen = []
    real = dpsgd.clip_and_noise

    def spy(params, dp, gen, b, head_cols=None):
        seen.append((dp.head_share, None if head_cols is None else head_cols.clone()))
        return real(params, dp, gen, b, head_cols)

    monkeypatch.setattr(T, "clip_and_noise", spy)

    def run(share):
        dp = DpSgdParams(0.0, 0.05, 16 / 60, 16.0, head_share=share)
        streams = (engine.rand.stream("noise", 0), engine.rand.stream("batches", 0))
        args = (start, engine.members_data, np.arange(60), 3, {"A", "B", "head"}, dp, streams, 7)
        return F.flatten_state(tr.train(*args)[0].state)

    split = run(0.5)
    assert len(seen) == 3 and all(s == 0.5 for s, _ in seen)
    cols = seen[0][1]
    assert cols.numel() == n_all and int(cols.sum()) == n_head
    seen.clear()
    joint = run(0.0)
    assert all(c is None for _, c in seen)
    assert any(not torch.allclose(split[k], joint[k]) for k in split)
    with pytest.raises(UsageError, match="head_clip_share"):
        T.local_step(DpSgdParams(1.0, 1.0, 0.5, 2.0, head_share=0.5), None, grad_transform=object())

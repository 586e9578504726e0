"""One implementation of each method's pure math: the method, ``analysis`` and the tests
call the same functions. Here, on the same random inputs:

* client-level clipping (``fl.privacy.clipping``): against a slow per-client reference,
  the non-finite policy (contributes zero, counted, never raises), and the three call
  sites (powerdp, fedpower's joint clip, ``Method.client_level_dp_average``) give the
  same clipped sum;
* the heterogeneous-rank methods and FedASK: the analysis path (``analysis.hetero``'s
  client start and server step, ``fl.methods.fedask.fedask_layer``) equals the method
  path (the Method's ``server_round`` driven by a fake server).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from analysis import hetero
from fl import linalg as L
from fl.methods.base import Method, Options, Replies, RoundInfo, parse_options
from fl.methods.fedask import FedASK, FedASKOptions, fedask_layer, omega_seed
from fl.methods.fedpower import joint_clip
from fl.methods.flexlora import FlexLoRA, FlexLoRAOptions
from fl.methods.flora import FLoRA, FLoRAOptions
from fl.methods.hetlora import HetLoRA, HetLoRAOptions, truncated_start
from fl.methods.plora import PLoRA, PLoRAOptions
from fl.privacy import clipping
from fl.privacy import powerdp as P

DT = torch.float64


# ------------------------------------------------------------------------- clipping


def _slow_clip(updates, C):
    """Per-client loop reference: dense norm of each update, factor min(1, C/norm),
    0 (and a zero update) when the norm is not finite."""
    out, norms, facs = [], [], []
    for u in updates:
        nrm = math.sqrt(sum(float((t.double() ** 2).sum()) for t in u))
        norms.append(nrm)
        if not math.isfinite(nrm):
            f = 0.0
        elif math.isinf(C) or nrm <= C:
            f = 1.0
        else:
            f = C / nrm
        facs.append(f)
        out.append([torch.zeros_like(t) if f == 0.0 else t.double() * f for t in u])
    return out, norms, facs


def _clients(K=5, m=9, n=7, r=3, seed=0, bad=None):
    g = torch.Generator().manual_seed(seed)
    Bs = [torch.randn(m, r, generator=g, dtype=DT) * (0.5 + k) for k in range(K)]
    As = [torch.randn(r, n, generator=g, dtype=DT) / 2 for _ in range(K)]
    if bad == "nan":
        Bs[1][0, 0] = math.nan
    elif bad == "inf":
        As[2][1, 1] = math.inf
    return Bs, As


@pytest.mark.parametrize("C", [0.3, 2.0, math.inf])
@pytest.mark.parametrize("bad", [None, "nan", "inf"])
def test_clip_matches_slow_reference(C, bad):
    Bs, As = _clients(bad=bad)
    Bs[3] = torch.zeros_like(Bs[3])  # a zero update: factor 1, no division by zero
    dense = [[B @ A] for B, A in zip(Bs, As)]
    ref, ref_norms, ref_f = _slow_clip(dense, C)
    out, norms, f = clipping.clip_dense_clients(dense, C)
    (Bc, Ac), fnorms, ff = (lambda r: (r[0][0], r[1], r[2]))(
        clipping.clip_factored_clients([(Bs, As)], C)
    )
    for k in range(len(Bs)):
        for got in (f[k], ff[k]):
            assert float(got) == pytest.approx(ref_f[k], rel=1e-12, abs=0)
        if math.isfinite(ref_norms[k]):
            assert float(norms[k]) == pytest.approx(ref_norms[k], rel=1e-12)
            assert float(fnorms[k]) == pytest.approx(ref_norms[k], rel=1e-10)
        else:
            assert not math.isfinite(float(norms[k])) and not math.isfinite(float(fnorms[k]))
        assert torch.allclose(out[k][0], ref[k][0], rtol=1e-12, atol=1e-14)
        assert torch.allclose(Bc[k] @ Ac[k], ref[k][0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nonfinite_policy_contributes_zero_and_is_counted(bad):
    Bs, As = _clients(bad=bad)
    k = 1 if bad == "nan" else 2
    (clipped,), norms, f = clipping.clip_factored_clients([(Bs, As)], 1.0)
    Bc, Ac = clipped
    assert float(f[k]) == 0.0 and not math.isfinite(float(norms[k]))
    assert float(Bc[k].abs().sum()) == 0.0 and float(Ac[k].abs().sum()) == 0.0
    assert all(bool(torch.isfinite(B).all()) for B in Bc)
    st = clipping.stats(norms, 1.0)
    assert st["nonfinite_updates"] == 1
    assert math.isfinite(st["update_norm_mean"]) and 0.0 <= st["frac_clipped"] <= 1.0
    # dense path: same policy
    dense = [[B @ A] for B, A in zip(Bs, As)]
    out, dn, df = clipping.clip_dense_clients(dense, 1.0)
    assert float(df[k]) == 0.0 and float(out[k][0].abs().sum()) == 0.0
    assert clipping.stats(dn, 1.0)["nonfinite_updates"] == 1
    with pytest.raises(ValueError):
        clipping.clip_factors(norms, math.nan)
    with pytest.raises(ValueError):
        clipping.clip_factors(norms, 0.0)


class _DPServer:
    """What Method.client_level_dp_average uses; σ = 0 and m = 1, so the new global is
    the global plus the clipped sum."""

    canary_clients = None  # no --canary-clients

    def __init__(self, clip):
        self.clip, self.noise_multiplier, self.expected_clients_per_round = clip, 0.0, 1.0
        self.releases = 0

    def noise_generator(self, rnd, purpose):
        return None

    def noise(self, shape, std, gen):
        return torch.zeros(shape)

    def record_client_level_release(self, rnd, stage, count=1):
        self.releases += count


@pytest.mark.parametrize("C", [0.7, 3.0])
@pytest.mark.parametrize("bad", [None, "nan"])
def test_three_call_sites_give_the_same_clipped_sum(C, bad):
    """The update of client k is u_k = B_k A with A having orthonormal rows, so
    ‖B_k A‖_F = ‖B_k‖_F: powerdp and fedpower clip the product B_k A, the base
    method clips the parameter difference B_k − 0 — the same norms."""
    K, m, n, r = 5, 9, 7, 3
    Bs, _ = _clients(K, m, n, r, seed=4, bad=bad)
    g = torch.Generator().manual_seed(9)
    A = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=DT))[0].mT.contiguous()
    As = [A.clone() for _ in range(K)]
    # 1. fl.privacy.powerdp
    Bc, Ac, _ = P.clip_clients(Bs, As, C)
    s1 = L.dense_sum(Bc, Ac, [1.0] * K)
    # 2. fl.methods.fedpower.joint_clip
    Bj, _, _ = joint_clip({"l": list(Bs)}, {"l": [a.clone() for a in As]}, C)
    s2 = sum(B for B in Bj["l"]) @ A
    # 3. Method.client_level_dp_average (float32 parameters, as the engine keeps them)
    srv = _DPServer(C)
    meth = Method(srv, Options())
    meth.global_state = {"factors": {"l": {"A": A.float(), "B": torch.zeros(m, r)}}, "head": {}}
    replies = Replies(
        ok={str(k): {"state": {"factors": {"l": {"A": A.float(), "B": B.float()}}, "head": {}}}
            for k, B in enumerate(Bs)}
    )  # fmt: skip
    new, st = meth.client_level_dp_average(RoundInfo(0, 1, list(replies.ok)), replies, keys=("B",))
    s3 = new["factors"]["l"]["B"].double() @ A
    assert torch.allclose(s1, s2, rtol=1e-12, atol=1e-12)
    assert torch.allclose(s1, s3, rtol=1e-5, atol=1e-5)
    assert bool(torch.isfinite(s1).all())
    assert st["nonfinite_updates"] == (1 if bad else 0) and srv.releases == 1
    # 4. inside powerdp (σ = 0, full rank): the refactorized clipped average
    B, A_out, _ = P.powerdp(Bs, As, [1.0] * K, r, 6, 0.0, C)
    assert torch.allclose(B @ A_out, s1, atol=1e-9)


class _NoisyServer(_DPServer):
    """The real keyed noise (fl.privacy.rng.draw_normal on a key stream), σ > 0, m > 1."""

    def __init__(self, clip, sigma, m):
        super().__init__(clip)
        self.noise_multiplier, self.expected_clients_per_round = sigma, m

    def noise_generator(self, rnd, purpose):
        from fl.privacy.rng import NoiseKey

        return NoiseKey(bytes(range(32))).stream(purpose, rnd.index)

    def noise(self, shape, std, gen):
        from fl.privacy.rng import draw_normal

        return draw_normal(gen, shape, std)


def test_client_level_average_adds_noise_of_std_sigma_c_over_m():
    """Clients that send back the global state unchanged (zero updates): the new global
    minus the old is the server's noise alone, N(0, (σC/m)²) in every released
    coordinate (A, B and the head), and nothing is added to what is not released."""
    C, sigma, m = 0.8, 1.5, 4.0
    srv = _NoisyServer(C, sigma, m)
    meth = Method(srv, Options())
    g = torch.Generator().manual_seed(3)
    glob = {
        "factors": {"l": {"A": torch.randn(40, 300, generator=g), "B": torch.randn(300, 40, generator=g)}},
        "head": {"w": torch.randn(2, 300, generator=g)},
    }  # fmt: skip
    meth.global_state = glob
    replies = Replies(ok={str(k): {"state": glob} for k in range(3)})
    new, st = meth.client_level_dp_average(RoundInfo(0, 1, list(replies.ok)), replies)
    assert st["nonfinite_updates"] == 0 and srv.releases == 1
    want = sigma * C / m  # 0.3
    pairs = {
        "A": (new["factors"]["l"]["A"], glob["factors"]["l"]["A"]),
        "B": (new["factors"]["l"]["B"], glob["factors"]["l"]["B"]),
        "head": (new["head"]["w"], glob["head"]["w"]),
    }
    for key, (after, before) in pairs.items():
        d = (after - before).double().flatten()
        n = d.numel()
        # std of a sample std ≈ want/√(2n): 5 of those is far beyond chance
        assert abs(float(d.std()) - want) < 5 * want / math.sqrt(2 * n), (key, float(d.std()))
        assert abs(float(d.mean())) < 5 * want / math.sqrt(n), key
    # B-only release (FFA-style keys): A is left exactly as it was
    meth.global_state = glob
    new_b, _ = meth.client_level_dp_average(
        RoundInfo(1, 1, list(replies.ok)), replies, keys=("B",), head=False
    )
    assert torch.equal(new_b["factors"]["l"]["A"], glob["factors"]["l"]["A"])
    assert torch.equal(new_b["head"]["w"], glob["head"]["w"])
    assert float((new_b["factors"]["l"]["B"] - glob["factors"]["l"]["B"]).std()) > 0.25


# ------------------------------------------------------------------ hetero methods


def _server(rank, s=1.0, ranks=None):
    ranks = ranks or {}
    return SimpleNamespace(
        scaling=s,
        cfg=SimpleNamespace(rank=rank, rounds=2, eval_every=1, eval_batch_size=8),
        client_rank=lambda cid: ranks.get(cid, rank),
    )


M_, N_, R_ = 8, 7, 4
RANKS = {"0": 1, "1": 2, "2": 4}
NS = {"0": 10.0, "1": 25.0, "2": 15.0}
P_ = [NS[c] / sum(NS.values()) for c in RANKS]


def _trained(seed=3):
    g = torch.Generator().manual_seed(seed)
    return {
        c: (torch.randn(M_, r, generator=g, dtype=DT), torch.randn(r, N_, generator=g, dtype=DT))
        for c, r in RANKS.items()
    }


def _head():
    return {"w": torch.zeros(2, dtype=DT)}


def _state0():
    g = torch.Generator().manual_seed(11)
    A0 = torch.randn(R_, N_, generator=g, dtype=DT)
    return {"Bg": torch.zeros(M_, R_, dtype=DT), "Ag": A0, "A0": A0, "merged": None}


def _factor_replies(tr, extra=None):
    return Replies(
        ok={
            c: {"factors": {"q": {"B": B, "A": A}}, "head": _head(), "loss": 0.1, "n": NS[c],
                "rank": RANKS[c], "init_noise": 0.0, **(extra or {})}
            for c, (B, A) in tr.items()
        }
    )  # fmt: skip


def test_flora_analysis_equals_method():
    meth = FLoRA(_server(R_), parse_options(FLoRAOptions, {"eval_merged": False}))
    meth.init_state({"factors": {"q": {"B": torch.zeros(M_, R_, dtype=DT),
                                       "A": torch.zeros(R_, N_, dtype=DT)}}, "head": _head()})  # fmt: skip
    state = _state0()
    for rnd in range(2):
        tr = _trained(seed=3 + rnd)
        rep = _factor_replies(tr)
        meth.server_round(RoundInfo(rnd, rnd, list(RANKS)), list(RANKS), lambda *a, _r=rep, **k: _r)
        state = hetero._server_step("flora", state, list(tr.values()), P_, R_)
        Bm, Am = meth.merged["q"]
        assert torch.allclose(Bm @ Am, hetero._global_update("flora", state), atol=1e-12)


def test_flexlora_analysis_equals_method():
    ranks = RANKS
    meth = FlexLoRA(_server(R_, ranks=ranks), FlexLoRAOptions())
    state = _state0()
    meth.init_state(
        {"factors": {"q": {"B": state["Bg"].clone(), "A": state["A0"].clone()}}, "head": _head()}
    )
    for rnd in range(3):
        sent = {}
        tr = _trained(seed=20 + rnd)

        def send(clients, stage, payload, per_client=False, _tr=tr, _sent=sent):
            _sent.update(payload)
            return _factor_replies(_tr)

        meth.server_round(RoundInfo(rnd, rnd, list(ranks)), list(ranks), send)
        # the client starts the method sent == the analysis's client start (round 0
        # included: every rank dead, B = 0 and the initial A rows)
        for k, (c, r) in enumerate(ranks.items()):
            _, B, A, _, cf = hetero._client_start("flexlora", state, r, 0, None, rnd, k)
            f = sent[c]["state"]["factors"]["q"]
            assert torch.allclose(f["B"][:, :r], B, atol=1e-12)
            assert torch.allclose(f["A"][:r], A, atol=1e-12)
        state = hetero._server_step("flexlora", state, list(tr.values()), P_, R_)
        Bg, Ag = meth.stack["q"]
        assert torch.allclose(Bg @ Ag, hetero._global_update("flexlora", state), atol=1e-12)


def test_hetlora_analysis_equals_method():
    meth = HetLoRA(_server(R_), HetLoRAOptions())
    g = torch.Generator().manual_seed(5)
    state = _state0()
    state["Bg"] = torch.randn(M_, R_, generator=g, dtype=DT)
    meth.init_state({"factors": {"q": {"B": state["Bg"].clone(), "A": state["Ag"].clone()}},
                     "head": _head()})  # fmt: skip
    for k, r in enumerate(RANKS.values()):  # client start
        _, B, A, _, _ = hetero._client_start("hetlora", state, r, 0, None, 0, k)
        st = truncated_start(meth.global_state, r)["factors"]["q"]
        assert torch.equal(st["B"][:, :r], B) and torch.equal(st["A"][:r], A)
    tr = _trained(seed=8)
    rep = _factor_replies(tr)
    meth.server_round(RoundInfo(0, 0, list(RANKS)), list(RANKS), lambda *a, **k: rep)
    state = hetero._server_step("hetlora", state, list(tr.values()), P_, R_)
    glob = meth.global_state["factors"]["q"]
    assert torch.allclose(glob["B"], state["Bg"], atol=1e-12)
    assert torch.allclose(glob["A"], state["Ag"], atol=1e-12)
    # the method's weights are norms only (not p_k·norm): check against a hand reference
    norms = [float(torch.linalg.matrix_norm(B @ A)) for B, A in tr.values()]
    w = [x / sum(norms) for x in norms]
    refB = sum(wk * L.hetlora_pad(B, A, R_)[0] for wk, (B, A) in zip(w, tr.values()))
    assert torch.allclose(glob["B"], refB, atol=1e-12)


def test_plora_analysis_equals_method():
    meth = PLoRA(_server(R_), PLoRAOptions())
    g = torch.Generator().manual_seed(6)
    state = _state0()
    state["Bg"] = torch.randn(M_, R_, generator=g, dtype=DT)
    meth.init_state({"factors": {"q": {"B": state["Bg"].clone(), "A": state["Ag"].clone()}},
                     "head": _head()})  # fmt: skip
    mods, ok = [], {}
    rnd = RoundInfo(0, 77, list(RANKS))
    for k, (c, r) in enumerate(RANKS.items()):
        sel = rnd.derive(f"select/{c}")
        base, B, A, idx, _ = hetero._client_start("plora", state, r, sel, None, 0, k)
        # the method's client start (selection policy + fold) on the same seed
        start, midx = meth.client_start(SimpleNamespace(id=c, rank=r, round=rnd),
                                        meth.global_state)  # fmt: skip
        assert midx == idx
        assert torch.allclose(start["factors"]["q"]["B"][:, idx], B, atol=0)
        assert torch.allclose(base + B @ A, state["Bg"] @ state["Ag"], atol=1e-12)
        Bt, At = B + 0.1 * (k + 1), A - 0.05 * (k + 1)  # "trained"
        mods.append((idx, Bt, At))
        ok[c] = {"idx": torch.tensor(idx), "modules": {"q": {"B": Bt, "A": At}},
                 "head": _head(), "loss": 0.1, "n": NS[c], "init_noise": 0.0}  # fmt: skip
    rep = Replies(ok=ok)
    meth.server_round(RoundInfo(0, 0, list(RANKS)), list(RANKS), lambda *a, **k: rep)
    state = hetero._server_step("plora", state, mods, P_, R_)
    glob = meth.global_state["factors"]["q"]
    assert torch.allclose(glob["B"], state["Bg"], atol=1e-12)
    assert torch.allclose(glob["A"], state["Ag"], atol=1e-12)


def test_simulation_uses_the_method_steps():
    """The whole simulation inherits the methods' server steps: FlexLoRA exact, HETLoRA not."""
    rows = hetero.simulate("flexlora", m=10, n=9, ranks=(1, 3), rounds=3, steps=2)
    assert all(r["agg_noise"] < 1e-12 for r in rows)  # the exact server G
    rows = hetero.simulate("hetlora", m=10, n=9, ranks=(1, 3), rounds=3, steps=2)
    assert all(r["agg_noise"] > 1e-6 for r in rows)


# ----------------------------------------------------------------------------- FedASK


class _Client:
    def __init__(self, cid, n, factors, rnd):
        self.id, self.n, self.round, self.state, self._f = cid, n, rnd, {}, factors
        self.scaling = 1.0

    def dp_params(self):
        return None

    def train(self, start, trainable=("A", "B", "head"), **kw):
        return SimpleNamespace(state={"factors": self._f, "head": _head()}, loss=0.5)


@pytest.mark.parametrize("oversketch", [0, 2, 7])
def test_fedask_analysis_equals_method(oversketch):
    K, r, m, n = 3, 2, 12, 10
    g = torch.Generator().manual_seed(2)
    layers = ["l1", "l2"]
    init = {
        "factors": {
            k: {"A": torch.randn(r, n, generator=g, dtype=DT), "B": torch.zeros(m, r, dtype=DT)}
            for k in layers
        },
        "head": _head(),
    }
    server = SimpleNamespace(
        cfg=SimpleNamespace(rank=r, seed=0, head_clip_share=0.0), scaling=1.0, dp_level="none",
        expected_clients_per_round=float(K), log=lambda *a: None,
    )  # fmt: skip
    meth = FedASK(server, parse_options(FedASKOptions, {"oversketch": oversketch}))
    meth.init_state(init)
    cids = [str(i) for i in range(K)]
    sizes = {c: 10.0 + 7 * i for i, c in enumerate(cids)}
    facs = {
        c: {
            k: {"A": torch.randn(r, n, generator=g, dtype=DT),
                "B": torch.randn(m, r, generator=g, dtype=DT)}
            for k in layers
        }
        for c in cids
    }  # fmt: skip
    rnd = RoundInfo(0, 123, cids)
    clients = {c: _Client(c, sizes[c], facs[c], rnd) for c in cids}

    def send(cl, stage, payload, per_client=False):
        rep = Replies()
        for c in cl:
            rep.ok[c] = dict(getattr(meth, f"on_{stage}")(clients[c], payload))
        return rep

    meth.server_round(rnd, cids, send)
    for k in layers:
        B, A = fedask_layer(
            [facs[c][k]["B"] for c in cids],
            [facs[c][k]["A"] for c in cids],
            [sizes[c] for c in cids],
            r,
            oversketch,
            omega_seed(meth.omega_base(rnd), k),
        )
        glob = meth.global_state["factors"][k]
        assert torch.allclose(glob["B"] @ glob["A"], B @ A, atol=1e-10)
        assert torch.allclose(glob["B"], B, atol=1e-10) and torch.allclose(glob["A"], A, atol=1e-10)


def test_fedask_layer_uniform_weights_and_dtype():
    Bs, As = _clients(K=3, m=8, n=6, r=2, seed=1)
    B, A = fedask_layer(Bs, As, None, 2, 4, seed=3)
    B2, A2 = fedask_layer(Bs, As, [2.0, 2.0, 2.0], 2, 4, seed=3)
    assert torch.equal(B, B2) and torch.equal(A, A2)
    Bf, Af = fedask_layer([b.float() for b in Bs], [a.float() for a in As], None, 2, 4, seed=3)
    assert Bf.dtype == torch.float32 and Af.dtype == torch.float32

"""Heterogeneous client ranks: Fed-PLoRA (Select-N-Fold), FLoRA, FlexLoRA, HETLoRA.

Pure checks compare against dense (m×n) float64 references; engine checks use the tiny
tiny-bert/synthetic model (one shared engine per module to keep the file fast)."""

import json
from types import SimpleNamespace

import pytest
import torch

from fl.errors import UsageError
from fl.linalg import fold_modules, unfold_modules
from fl.linalg.noise import state_distance
from fl.methods.base import Replies, RoundInfo, parse_options
from fl.methods.flexlora import FlexLoRA, FlexLoRAOptions
from fl.methods.flora import FLoRA, FLoRAOptions, fresh_factors, merged_base
from fl.methods.hetlora import HetLoRA, HetLoRAOptions, prune_decision, tail_norm, truncated_start
from fl.methods.plora import (
    PLoRA,
    PLoRAOptions,
    rank_mask,
    select_random,
    select_roundrobin,
)
from fl.models import factors as F
from fl.run.engine import ClientContext, Engine, train
from fl.testing import tiny_config

R = 4


def _cfg(**kw):
    small = dict(members=90, nonmembers=20, test=40, max_length=16, local_steps=2, lr=0.05)
    return tiny_config(**{**small, "rank": R, "client_ranks": "2,4", **kw})


# ----------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    e = Engine(_cfg(), tmp_path_factory.mktemp("eng"), quiet=True)
    e.setup()
    return e


@pytest.fixture(scope="module")
def dp_eng(tmp_path_factory):
    e = Engine(
        _cfg(dp_level="sample", noise_multiplier=1.0), tmp_path_factory.mktemp("dp"), quiet=True
    )
    e.setup()
    return e


def _random_global(e, seed=0, scale=0.5):
    """The engine's initial state with every B (and A) random — a trained-looking adapter."""
    g = torch.Generator().manual_seed(seed)
    st = F.clone_state(e.trainer.initial_state())
    for ab in st["factors"].values():
        ab["B"] = torch.randn(ab["B"].shape, generator=g) * scale
        ab["A"] = torch.randn(ab["A"].shape, generator=g) * scale
    return st


def _logits(e, state, merged=None):
    model = e.trainer.model
    F.set_state(model, state)
    batch = e.members_data.batch(torch.arange(16), e.device)
    batch.pop("labels")
    model.eval()
    try:
        with torch.no_grad(), merged_base(model, merged or {}):
            return model(**batch).logits.double()
    finally:
        model.train()


def _dense(state, s):
    return {m: s * (ab["B"].double() @ ab["A"].double()) for m, ab in state["factors"].items()}


def _fro(d):
    return sum(float(v.pow(2).sum()) for v in d.values()) ** 0.5


def _rand_state(mods, m, n, r, seed, head=True):
    g = torch.Generator().manual_seed(seed)
    st = {
        "factors": {
            k: {
                "B": torch.randn(m, r, generator=g, dtype=torch.float64),
                "A": torch.randn(r, n, generator=g, dtype=torch.float64),
            }
            for k in mods
        },
        "head": {"w": torch.randn(2, 3, generator=g, dtype=torch.float64)} if head else {},
    }
    return st


def _fake_server(rank=R, s=2.0, ranks=None):
    ranks = ranks or {}
    return SimpleNamespace(
        scaling=s,
        cfg=SimpleNamespace(rank=rank, rounds=2, eval_every=1, eval_batch_size=8),
        client_rank=lambda cid: ranks.get(cid, rank),
    )


# ----------------------------------------------------------------------- pure


def test_fold_then_unfold_restores_factors_and_weights():
    g = torch.Generator().manual_seed(1)
    B = torch.randn(7, 5, generator=g, dtype=torch.float64)
    A = torch.randn(5, 6, generator=g, dtype=torch.float64)
    W0 = torch.randn(7, 6, generator=g, dtype=torch.float64)
    s = 8.0 / 5
    for idx in ([3, 0], [4], [0, 1, 2, 3, 4], [2, 4, 1]):
        (Bf, Af), Bk, Ak = fold_modules(B, A, idx)
        B2, A2 = unfold_modules(Bk, Ak, idx, Bf, Af)
        assert torch.equal(B2, B) and torch.equal(A2, A)
        fold = fold_modules(B, A, idx, dense=True)[0]
        # W_i = W0 + s·fold + s·B_keep A_keep is the global W0 + s·B A
        Wi = W0 + s * fold + s * (Bk @ Ak)
        assert torch.allclose(Wi, W0 + s * (B @ A), atol=1e-12)
        drop = [j for j in range(5) if j not in idx]
        assert torch.allclose(fold, B[:, drop] @ A[drop, :], atol=1e-12)


def test_selection_policies():
    R_, r = 6, 2
    counts = torch.zeros(R_)
    for seed in range(3000):
        idx = select_random(R_, r, seed, 0, "0")
        assert len(set(idx)) == r and idx == sorted(idx) and all(0 <= j < R_ for j in idx)
        counts[idx] += 1
    assert select_random(R_, r, 5, 0, "0") == select_random(R_, r, 5, 0, "0")
    # uniform: each module chosen with probability r/R (3000·1/3 = 1000 ± ~26 s.d.)
    assert float((counts - 1000).abs().max()) < 150
    cover = set()
    for t in range(3):
        cover |= set(select_roundrobin(R_, r, 0, t, "7"))
    assert cover == set(range(R_))
    with pytest.raises(UsageError, match="selection"):
        parse_options(PLoRAOptions, {"selection": "bogus"})
    with pytest.raises(UsageError, match="prune_gamma"):
        parse_options(HetLoRAOptions, {"prune_gamma": 1.5})


def test_plora_server_averages_each_module_over_its_trainers():
    mods, m, n = ["q", "v"], 5, 4
    glob = _rand_state(mods, m, n, R, 0)
    srv = _fake_server()
    meth = PLoRA(srv, PLoRAOptions())
    meth.init_state(glob)
    # client 0 trained modules {0, 2}, client 1 {2}: modules 1 and 3 untrained
    sel = {"0": [0, 2], "1": [2]}
    ns = {"0": 10, "1": 30}
    trained = {c: _rand_state(mods, m, n, len(i), 10 + int(c)) for c, i in sel.items()}
    replies = Replies(
        ok={
            c: {
                "idx": torch.tensor(sel[c]),
                "modules": trained[c]["factors"],
                "head": trained[c]["head"],
                "loss": 0.5,
                "n": ns[c],
                "init_noise": 0.0,
            }
            for c in sel
        }
    )
    metrics = meth.server_round(
        RoundInfo(0, 1, ["0", "1"]), ["0", "1"], lambda *a, _r=replies, **k: _r
    )
    full = {}
    for k in mods:
        gB, gA = glob["factors"][k]["B"], glob["factors"][k]["A"]
        new = meth.global_state["factors"][k]
        for j in range(R):
            who = [c for c in sel if j in sel[c]]
            if not who:  # untrained: keeps its value
                assert torch.equal(new["B"][:, j], gB[:, j]) and torch.equal(new["A"][j], gA[j])
                continue
            tot = sum(ns[c] for c in who)
            refB = sum(ns[c] / tot * trained[c]["factors"][k]["B"][:, sel[c].index(j)] for c in who)
            refA = sum(ns[c] / tot * trained[c]["factors"][k]["A"][sel[c].index(j)] for c in who)
            assert torch.allclose(new["B"][:, j], refB, atol=1e-12)
            assert torch.allclose(new["A"][j], refA, atol=1e-12)
        for c in sel:  # each client's full adapter after training, for the dense ideal
            B, A = gB.clone(), gA.clone()
            B[:, sel[c]] = trained[c]["factors"][k]["B"]
            A[sel[c]] = trained[c]["factors"][k]["A"]
            full.setdefault(c, {})[k] = srv.scaling * B @ A
    assert metrics["modules_untrained"] == 2
    # agg_noise = ‖ΔW_server − Σ p_k ΔW_k‖ against a dense reference
    ideal = {k: sum(ns[c] / 40 * full[c][k] for c in sel) for k in mods}
    got = _dense(meth.global_state, srv.scaling)
    ref = _fro({k: got[k] - ideal[k] for k in mods})
    assert metrics["agg_noise"] == pytest.approx(ref, rel=1e-9) and ref > 1e-3
    head_ref = (10 * trained["0"]["head"]["w"] + 30 * trained["1"]["head"]["w"]) / 40
    assert torch.allclose(meth.global_state["head"]["w"], head_ref, atol=1e-12)


def test_flora_server_stacks_exactly_and_reports_release_error():
    mods, m, n = ["q"], 6, 5
    srv = _fake_server(s=2.0)
    meth = FLoRA(srv, parse_options(FLoRAOptions, {"eval_merged": False}))
    meth.init_state(_rand_state(mods, m, n, R, 0))
    ns = {"0": 10, "1": 30, "2": 20}
    rk = {"0": 2, "1": 4, "2": 3}
    D = torch.zeros(m, n, dtype=torch.float64)
    for t in range(3):  # width 9 per round > min(m, n) = 5 from round 1: exact re-factoring
        st = {c: _rand_state(mods, m, n, rk[c], 100 * t + int(c)) for c in ns}
        replies = Replies(
            ok={
                c: {"factors": st[c]["factors"], "head": st[c]["head"], "loss": 0.1, "n": ns[c],
                    "init_noise": 0.0}
                for c in ns
            }
        )  # fmt: skip
        met = meth.server_round(RoundInfo(t, t, list(ns)), list(ns), lambda *a, _r=replies, **k: _r)
        D += sum(ns[c] / 60 * srv.scaling * _dense(st[c], 1.0)["q"] for c in ns)
        Bm, Am = meth.merged["q"]
        assert Bm.shape[1] <= min(m, n)
        assert torch.allclose(Bm @ Am, D, atol=1e-10)  # D_t = Σ_rounds s Σ p_k B_k A_k
        assert met["agg_noise"] < 1e-12 * max(1.0, float(D.norm()))
        sv = torch.linalg.svdvals(D)
        assert met["release_rel_error"] == pytest.approx(float(sv[R:].norm() / sv.norm()), rel=1e-8)
        rel = meth.released_state()["factors"]["q"]
        U, S, Vh = torch.linalg.svd(D)
        best = (U[:, :R] * S[:R]) @ Vh[:R]
        assert torch.allclose(srv.scaling * rel["B"] @ rel["A"], best, atol=1e-9)
    # checkpoint round trip keeps the exact merged update and the release
    tensors, meta = meth.state_dict()
    again = FLoRA(srv, parse_options(FLoRAOptions, {"eval_merged": False}))
    again.init_state(_rand_state(mods, m, n, R, 0))
    again.load_state_dict(tensors, meta)
    assert all(torch.equal(a, b) for a, b in zip(again.merged["q"], meth.merged["q"]))
    assert torch.equal(again.released_state()["factors"]["q"]["B"], rel["B"])
    # the next round starts from a fresh LoRA: B = 0
    meth.server_round(RoundInfo(3, 3, []), [], lambda *a, **k: Replies())
    assert all(float(ab["B"].abs().sum()) == 0 for ab in meth.global_state["factors"].values())


def test_flexlora_server_redistributes_top_r_svd_with_closed_form_init_noise():
    mods, m, n = ["q"], 6, 5
    ranks = {"0": 2, "1": 4}
    srv = _fake_server(s=0.5, ranks=ranks)
    meth = FlexLoRA(srv, FlexLoRAOptions())
    init = _rand_state(mods, m, n, R, 0)
    init["factors"]["q"]["B"].zero_()
    meth.init_state(init)
    ns = {"0": 10, "1": 30}
    sent = {}

    def send_round(st):
        def send(clients, stage, payload, per_client=False):
            assert per_client
            sent.update(payload)
            return Replies(
                ok={
                    c: {"factors": st[c]["factors"], "head": st[c]["head"], "loss": 0.1, "n": ns[c]}
                    for c in clients
                }
            )

        return send

    st1 = {c: _rand_state(mods, m, n, ranks[c], 7 + int(c)) for c in ns}
    met = meth.server_round(RoundInfo(0, 0, list(ns)), list(ns), send_round(st1))
    # round 1: G = B_0 A_0 = 0 → every rank is fresh: A = initial A rows, B = 0; no init noise
    for c, r in ranks.items():
        start = sent[c]["state"]["factors"]["q"]
        assert float(start["B"].abs().sum()) == 0
        assert torch.equal(start["A"][:r], init["factors"]["q"]["A"][:r])
        assert float(start["A"][r:].abs().sum()) == 0
    assert met["init_noise"] == 0 and met["agg_noise"] < 1e-12
    G = sum(ns[c] / 40 * _dense(st1[c], 1.0)["q"] for c in ns)  # rank ≤ 6, > R
    st2 = {c: _rand_state(mods, m, n, ranks[c], 20 + int(c)) for c in ns}
    met = meth.server_round(RoundInfo(1, 1, list(ns)), list(ns), send_round(st2))
    U, S, Vh = torch.linalg.svd(G)
    inits = []
    for c, r in ranks.items():
        f = sent[c]["state"]["factors"]["q"]
        assert torch.allclose(f["B"] @ f["A"], (U[:, :r] * S[:r]) @ Vh[:r], atol=1e-10)
        assert float(f["B"][:, r:].abs().sum()) == 0 and float(f["A"][r:].abs().sum()) == 0
        inits.append(srv.scaling * float(S[r:].norm()))
    assert met["init_noise"] == pytest.approx(sum(inits) / 2, rel=1e-8) and met["init_noise"] > 0
    tensors, meta = meth.state_dict()
    again = FlexLoRA(srv, FlexLoRAOptions())
    again.init_state(init)
    again.load_state_dict(tensors, meta)
    assert all(torch.equal(a, b) for a, b in zip(again.stack["q"], meth.stack["q"]))


def test_hetlora_server_and_init_noise():
    mods, m, n = ["q", "v"], 5, 4
    srv = _fake_server(s=2.0)
    meth = HetLoRA(srv, HetLoRAOptions())
    glob = _rand_state(mods, m, n, R, 0)
    meth.init_state(glob)
    # init noise: the dropped tail, > 0 for r < R with a non-zero tail, 0 at r = R
    for r in (1, 2, 3):
        start = truncated_start(glob, r)
        d = state_distance(start, glob, srv.scaling)
        tail = {k: srv.scaling * ab["B"][:, r:] @ ab["A"][r:] for k, ab in glob["factors"].items()}
        assert d == pytest.approx(_fro(tail), rel=1e-9) and d > 0
        assert d == pytest.approx(tail_norm(glob, r, srv.scaling), rel=1e-9)
    assert state_distance(truncated_start(glob, R), glob, srv.scaling) < 1e-12
    ns, rk = {"0": 10, "1": 30}, {"0": 2, "1": 4}
    st = {c: _rand_state(mods, m, n, rk[c], 5 + int(c)) for c in ns}
    replies = Replies(
        ok={
            c: {"factors": st[c]["factors"], "head": st[c]["head"], "loss": 0.1, "n": ns[c],
                "rank": rk[c], "init_noise": 0.0}
            for c in ns
        }
    )  # fmt: skip
    meth.server_round(RoundInfo(0, 0, list(ns)), list(ns), lambda *a, _r=replies, **k: _r)
    for k in mods:
        norms = {c: float(torch.linalg.matrix_norm(_dense(st[c], 1.0)[k])) for c in ns}
        w = {c: norms[c] / sum(norms.values()) for c in ns}
        refB = torch.zeros(m, R, dtype=torch.float64)
        refA = torch.zeros(R, n, dtype=torch.float64)
        for c in ns:
            refB[:, : rk[c]] += w[c] * st[c]["factors"][k]["B"]
            refA[: rk[c]] += w[c] * st[c]["factors"][k]["A"]
        assert torch.allclose(meth.global_state["factors"][k]["B"], refB, atol=1e-12)
        assert torch.allclose(meth.global_state["factors"][k]["A"], refA, atol=1e-12)


def test_hetlora_prune_rule():
    g = torch.Generator().manual_seed(0)
    B = torch.randn(6, 10, generator=g, dtype=torch.float64)
    A = torch.randn(10, 5, generator=g, dtype=torch.float64)
    assert prune_decision({"q": {"B": B, "A": A}}, 10, 0.9, 0.05) == 10  # big tail: keep
    B2 = B.clone()
    B2[:, 9] *= 1e-4  # last rank (t = 10 − ⌊0.9·10⌋ = 1) is negligible: prune to 9
    assert prune_decision({"q": {"B": B2, "A": A}}, 10, 0.9, 0.05) == 9
    assert prune_decision({"q": {"B": B2[:, :1], "A": A[:1]}}, 1, 0.9, 0.05) == 1


# ----------------------------------------------------------------------- on the model


def test_scaling_is_alpha_over_R_for_every_client(eng):
    """α/R convention: a rank-2 client's truncated adapter on the rank-R model computes
    W0 + (α/R)·B[:, :2]A[:2] (not α/2), checked against the update merged into W0."""
    s = eng.cfg.alpha / eng.cfg.rank
    assert eng.trainer.scaling == s == eng.server.scaling
    for ab in F.lora_param_map(eng.trainer.model).values():
        assert ab["A"].shape[0] == R
    scal = {
        float(mod.scaling["default"])
        for mod in eng.trainer.model.modules()
        if hasattr(mod, "scaling") and isinstance(mod.scaling, dict)
    }
    assert scal == {s}
    glob = _random_global(eng, 3)
    start = truncated_start(glob, 2)
    zero = F.clone_state(glob)
    for ab in zero["factors"].values():
        ab["B"].zero_()
    merged = {
        k: (s * ab["B"][:, :2].double(), ab["A"][:2].double()) for k, ab in glob["factors"].items()
    }
    a, b = _logits(eng, start), _logits(eng, zero, merged)
    assert float((a - b).abs().max()) < 1e-5
    wrong = {k: (v[0] * R / 2, v[1]) for k, v in merged.items()}  # α/r_i would differ
    assert float((a - _logits(eng, zero, wrong)).abs().max()) > 1e-3


def test_plora_client_starts_at_the_global_function_and_fold_equals_freeze(eng):
    s = eng.trainer.scaling
    glob = _random_global(eng, 1)
    meth = PLoRA(eng.server, PLoRAOptions())
    cid = next(c for c, r in eng.client_ranks.items() if r < R)
    ctx = ClientContext(eng, cid, RoundInfo(0, 1234, [cid]))
    start, idx = meth.client_start(ctx, glob)
    assert len(idx) == eng.client_ranks[cid] < R
    assert state_distance(start, glob, s) < 1e-6
    ref = _logits(eng, glob)
    assert float((_logits(eng, start) - ref).abs().max()) < 1e-6
    # Fold (pure): W0 + s·B_fold A_fold in the base, only the selected modules as LoRA.
    folded, merged = F.clone_state(glob), {}
    for k, ab in glob["factors"].items():
        (Bf, Af), _, _ = fold_modules(ab["B"], ab["A"], idx)
        merged[k] = (s * Bf.double(), Af.double())
        drop = [j for j in range(R) if j not in idx]
        folded["factors"][k]["B"][:, drop] = 0.0
        folded["factors"][k]["A"][drop] = 0.0
    assert float((_logits(eng, folded, merged) - ref).abs().max()) < 1e-5
    assert float((_logits(eng, folded) - ref).abs().max()) > 1e-3  # the fold matters


def test_flora_client_starts_at_the_global_function(eng):
    s = eng.trainer.scaling
    glob = F.clone_state(eng.trainer.initial_state())
    glob["factors"] = fresh_factors(glob["factors"], 99)
    g = torch.Generator().manual_seed(2)
    payload = {"state": glob, "merged": {}}
    for k, ab in glob["factors"].items():
        m, n = ab["B"].shape[0], ab["A"].shape[1]
        payload["merged"][k] = {
            "B": s * torch.randn(m, 6, generator=g, dtype=torch.float64) * 0.3,
            "A": torch.randn(6, n, generator=g, dtype=torch.float64) * 0.3,
        }
    glob_merged = {k: (v["B"], v["A"]) for k, v in payload["merged"].items()}
    ref = _logits(eng, glob, glob_merged)
    start, merged = FLoRA.client_start(glob, payload, 2)
    assert state_distance(start, glob, s) == 0.0
    assert float((_logits(eng, start, merged) - ref).abs().max()) < 1e-6
    assert float((_logits(eng, start) - ref).abs().max()) > 1e-3  # without the merged base


def test_masked_coordinates_stay_unchanged_under_dp_noise(dp_eng):
    glob = _random_global(dp_eng, 4)
    ctx = ClientContext(dp_eng, "0", RoundInfo(0, 77, ["0"]))
    keep = [1, 3]
    res = ctx.train(glob, grad_mask=rank_mask(glob, keep))
    assert len(ctx.events) == 1 and ctx.events[0].noise_multiplier == 1.0
    for k, ab in res.state["factors"].items():
        g0 = glob["factors"][k]
        assert torch.equal(ab["A"][[0, 2]], g0["A"][[0, 2]])
        assert torch.equal(ab["B"][:, [0, 2]], g0["B"][:, [0, 2]])
        assert float((ab["A"][keep] - g0["A"][keep]).abs().min()) > 0  # noise moved them
    # zero-padded ranks (HETLoRA / FlexLoRA / FLoRA clients) stay exactly zero
    start = truncated_start(glob, 2)
    res = ClientContext(dp_eng, "1", RoundInfo(0, 78, ["1"])).train(
        start, grad_mask=rank_mask(start, range(2))
    )
    for ab in res.state["factors"].values():
        assert float(ab["A"][2:].abs().sum()) == 0 and float(ab["B"][:, 2:].abs().sum()) == 0


# ----------------------------------------------------------------------- end to end


@pytest.mark.parametrize("method", ["plora", "flora", "flexlora", "hetlora"])
def test_method_runs_non_dp_and_dp(tmp_path, method):
    from peft import PeftModel

    from fl.models.base import load_base_model

    # 2 clients; seed 1 draws ranks {2, 4} from --client-ranks 2,4 (seed 0 draws 4, 4)
    small = dict(clients=2, seed=1, members=60, test=30)
    # σ = 3, not 1: smaller PLDs for the rounds' ε; nothing below depends on σ
    for tag, kw in (("plain", {}), ("dp", dict(dp_level="sample", noise_multiplier=3.0))):
        out = tmp_path / tag
        man = train(_cfg(method=method, **small, **kw), out, quiet=True)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 2
        for row in rows:
            assert row["init_noise"] >= 0 and row["agg_noise"] >= 0
        ranks = json.loads((out / "splits.json").read_text())["client_ranks"]
        assert ranks == man["client_ranks"] and set(ranks.values()) <= {2, 4}
        assert sorted(ranks.values()) == [2, 4]
        if method == "plora":
            assert all(r["init_noise"] < 1e-6 for r in rows)
        if method in ("flora", "flexlora"):
            assert all(r["agg_noise"] < 1e-9 for r in rows)
        if method == "flora":
            assert all(r["init_noise"] == 0 for r in rows)
        if method == "hetlora":  # round 2 truncates a non-zero tail for the rank-2 client
            assert rows[1]["init_noise"] > 0
        if tag == "dp":
            assert rows[1]["epsilon"] > rows[0]["epsilon"] > 0
            assert len(man["privacy"]["ledger"]["events"]) == 4  # 2 clients × 2 rounds
        base = load_base_model("tiny-bert", 2, seed=1)
        model = PeftModel.from_pretrained(base, str(out / "adapter"))
        n_a = [p.shape[0] for nm, p in model.named_parameters() if "lora_A" in nm]
        assert n_a and set(n_a) == {R}


def test_hetlora_client_self_prunes_and_keeps_the_smaller_rank(eng):
    opts = parse_options(HetLoRAOptions, {"prune": True, "prune_gamma": 0.5, "prune_tol": 1e9})
    meth = HetLoRA(eng.server, opts)
    glob = _random_global(eng, 5)
    cid = next(c for c, r in eng.client_ranks.items() if r == R)
    eng.client_states.pop(cid, None)
    reply = meth.on_train(ClientContext(eng, cid, RoundInfo(0, 5, [cid])), {"state": glob})
    assert reply["rank"] == R and reply["init_noise"] < 1e-9  # r = R: nothing truncated
    for ab in reply["factors"].values():  # tol huge: always prunes R=4 → ⌊0.5·4⌋ = 2
        assert float(ab["B"][:, 2:].abs().sum()) == 0 and float(ab["A"][2:].abs().sum()) == 0
        assert float(ab["B"][:, :2].abs().sum()) > 0
    reply = meth.on_train(ClientContext(eng, cid, RoundInfo(1, 6, [cid])), {"state": glob})
    assert reply["rank"] == 2 and reply["init_noise"] > 0  # now truncates the global tail
    eng.client_states.pop(cid, None)

"""The noise of a default run cannot be regenerated from public information; the
engine's one send path charges what a lost reply may have released; canaries are
added, not substituted."""

import json

import torch

from fl.methods.base import RoundInfo
from fl.models import factors as F
from fl.privacy.rng import SeededSource
from fl.run.engine import Engine
from fl.run.transport import Delivery, Dispatcher

SIGMA, LR = 1.0, 0.5


def _one_step_cfg(tiny_cfg, **kw):
    """One client, one round, one SGD step: the released model is θ_{σ=0} − lr·z/(qn)
    exactly, so subtracting the right noise gives back the σ = 0 model."""
    base = dict(
        clients=1,
        rounds=1,
        local_steps=1,
        optimizer="sgd",
        lr=LR,
        dp_level="sample",
        noise_multiplier=SIGMA,
        clip=1.0,
        seed=0,
    )
    base.update(kw)
    return tiny_cfg(**base)


def _released(eng: Engine) -> dict:
    return {k: v.double() for k, v in F.flatten_state(eng.method.released_state()).items()}


def _denoise_distances(eng: Engine, released: dict, clean: dict, seeds) -> list[float]:
    """For each candidate seed: regenerate the DP-SGD noise as the seeded generator
    draws it (parameter order of the trainer), add lr·z/(qn) back, and measure the
    largest distance to the σ = 0 model."""
    tr = eng.trainer
    params = tr._set_trainable({"A", "B", "head"})
    names = tr._flat_names(params)
    n = len(eng.client_positions["0"])
    expected = min(1.0, eng.cfg.batch_size / n) * n
    out = []
    for s in seeds:
        src = SeededSource(s, ("dpsgd-noise", 0, "0", "train"))
        worst = 0.0
        for p, nm in zip(params, names):
            z = src.normal(tuple(p.shape), SIGMA * eng.cfg.clip).double()
            cand = released[nm] + LR * z / expected
            worst = max(worst, float((cand - clean[nm]).abs().max()))
        out.append(worst)
    return out


def _run(cfg, out, key=None, allow_key_reuse=False) -> Engine:
    eng = Engine(cfg, out, quiet=True, noise_key=key, allow_key_reuse=allow_key_reuse)
    eng.run()
    return eng


def test_denoising_attack_fails_on_default_run_and_works_on_insecure_run(tmp_path, tiny_cfg):
    seeds = range(0, 1001)
    # --insecure-deterministic-noise: the noise is a function of the public seed.
    ins = _run(_one_step_cfg(tiny_cfg, insecure_deterministic_noise=True), tmp_path / "ins")
    ins0 = _run(
        _one_step_cfg(tiny_cfg, insecure_deterministic_noise=True, noise_multiplier=0.0),
        tmp_path / "ins0",
    )
    d_ins = _denoise_distances(ins, _released(ins), _released(ins0), seeds)
    assert d_ins[0] < 1e-5  # the published seed gives the noise back
    # Default: the attacker is even handed the true σ = 0 model (same secret batches,
    # from the run's key), and still no seed in 0..1000 regenerates the noise.
    key = tmp_path / "dflt" / "private" / "noise.key"
    dflt = _run(_one_step_cfg(tiny_cfg), tmp_path / "dflt")
    # (the same key on another configuration: refused unless allowed, and then not private)
    dflt0 = _run(_one_step_cfg(tiny_cfg, noise_multiplier=0.0), tmp_path / "dflt0", key, True)
    d_dflt = _denoise_distances(dflt, _released(dflt), _released(dflt0), seeds)
    noise_scale = LR * SIGMA / (16 * 1.0)  # lr·σC/(qn): one noise std on a coordinate
    assert min(d_dflt) > 0.5 * noise_scale > 100 * d_ins[0]
    m = json.loads((tmp_path / "ins" / "manifest.json").read_text())
    assert m["privacy"]["noise"]["source"] == "seeded" and not m["privacy"]["noise"]["private"]
    m = json.loads((tmp_path / "dflt" / "manifest.json").read_text())
    assert m["privacy"]["noise"]["source"] == "keyed_csprng" and m["privacy"]["noise"]["private"]


def test_two_default_runs_with_the_same_seed_release_different_adapters(tmp_path, tiny_cfg):
    # σ = 3, not 1: its PLD (the ledger's ε) is a third of the size; the noise's source
    # is what is tested, at any σ
    cfg = tiny_cfg(dp_level="sample", noise_multiplier=3.0, rounds=1, clients_per_round=2)
    a, b = _run(cfg, tmp_path / "a"), _run(cfg, tmp_path / "b")
    ra, rb = _released(a), _released(b)
    assert max(float((ra[k] - rb[k]).abs().max()) for k in ra) > 1e-3
    # ... and a third given a's key replays a bit for bit
    c = _run(cfg, tmp_path / "c", tmp_path / "a" / "private" / "noise.key")
    assert all(torch.equal(ra[k], v) for k, v in _released(c).items())
    assert (
        "replays that run's noise streams (same configuration); publish at most one"
        in (tmp_path / "c/run.log").read_text()
    )
    ka = (tmp_path / "a/private/noise.key").read_text()
    assert ka != (tmp_path / "b/private/noise.key").read_text()
    assert ka == (tmp_path / "c/private/noise.key").read_text()


class _LosingTransport:
    """Client "1" trains (its DP steps happen) but its reply never arrives."""

    name = "test"

    def __init__(self, eng):
        self.eng = eng

    def deliver(self, method, rnd, stage, payloads, faults):
        out = {}
        for cid, _p in payloads:
            if cid == "1":
                continue  # lost
            ev = self.eng.planned_client_event(rnd, cid, stage)
            out[cid] = Delivery({"n": 5}, [ev])
        return out


def test_lost_reply_in_a_training_stage_is_charged(tmp_path, tiny_cfg):
    eng = Engine(tiny_cfg(dp_level="sample", noise_multiplier=1.0), tmp_path / "x", quiet=True)
    (tmp_path / "x").mkdir()
    eng.setup()
    disp = Dispatcher(eng, _LosingTransport(eng))
    rnd = RoundInfo(0, 1, ["0", "1"])

    class M:
        name = "m"
        train_stages = ("train",)

        def on_train(self, client, payload):  # pragma: no cover - never called here
            raise AssertionError

        def on_project(self, client, payload):  # pragma: no cover
            raise AssertionError

    before = len(eng.ledger.events)
    replies = disp.send(M(), rnd, ["0", "1"], "train", {})
    assert list(replies.ok) == ["0"] and "1" in replies.failed
    units = [e.unit for e in eng.ledger.events[before:]]
    assert units == ["client:0", "client:1"]  # the lost client's planned event is charged
    assert eng.ledger.events[-1] == eng.planned_client_event(rnd, "1", "train")
    # a non-training stage charges nothing for a lost reply
    before = len(eng.ledger.events)
    disp.send(M(), rnd, ["1"], "project", {})
    assert len(eng.ledger.events) == before
    assert "its planned DP-SGD event is charged" in "\n".join(eng._log_lines)


def test_failed_client_state_is_rolled_back(tmp_path, tiny_cfg, monkeypatch):
    """SCAFFOLD keeps c_k per client: a client that fails AFTER training (its c_k
    already updated) must not keep the control variate of a round the server never
    used; its DP steps still count."""
    from fl.errors import ClientFailure
    from fl.methods.scaffold import Scaffold

    orig = Scaffold.on_train

    def fails_after_training(self, client, payload):
        reply = orig(self, client, payload)
        if (client.round.index, client.id) == (1, "1"):
            raise ClientFailure("crashed after training")
        return reply

    monkeypatch.setattr(Scaffold, "on_train", fails_after_training)
    # σ = 3, not 1 (a smaller PLD for each round's ε); the roll-back does not depend on σ
    cfg = tiny_cfg(method="scaffold", rounds=2, clients=2, dp_level="sample", noise_multiplier=3.0)
    eng = Engine(cfg, tmp_path / "r", quiet=True)
    seen = {}
    orig_save = eng._save_checkpoint

    def save(completed):
        seen[completed] = {k: v.clone() for k, v in eng.client_states["1"]["c"].items()}
        orig_save(completed)

    eng._save_checkpoint = save
    man = eng.run()
    assert seen[1] and all(torch.equal(seen[1][k], seen[2][k]) for k in seen[1])
    assert any(float(v.abs().max()) > 0 for v in seen[1].values())  # c_1 did move in round 1
    units = [(e["unit"], e["round"]) for e in man["privacy"]["ledger"]["events"]]
    assert ("client:1", 1) in units  # the failed client's DP steps are in the ledger


def test_canaries_are_added_not_substituted(tmp_path, tiny_cfg):
    cfg = tiny_cfg(canaries=24, nonmembers=60, dp_level="sample", noise_multiplier=1.0)
    eng = Engine(cfg, tmp_path / "c", quiet=True)
    eng.setup()
    can = eng._canaries["canaries"]
    inc = [c for c in can if c["included"]]
    assert 0 < len(inc) < len(can)
    n_members = len(eng.split.members)
    assert len(eng.members_data) == n_members + len(inc)
    # every member example is still where it was, with its own text's tokens
    plain = Engine(tiny_cfg(), tmp_path / "p", quiet=True)
    plain.setup()
    assert torch.equal(
        eng.members_data.input_ids[:n_members], plain.members_data.input_ids[:n_members]
    )
    held = {c: set(p.tolist()) for c, p in eng.client_positions.items()}
    for j, c in enumerate(inc):
        pos = n_members + j
        assert pos in held[c["client"]]
        assert eng.position_ids[pos] == c["id"]
        assert int(eng.members_data.labels[pos]) == c["label"]
    sizes = sum(len(p) for p in eng.client_positions.values())
    assert sizes == n_members + len(inc)
    # inclusion comes from the secret key: another run (fresh key) includes others
    other = Engine(cfg, tmp_path / "c2", quiet=True)
    other.setup()
    bits = [c["included"] for c in can]
    assert bits != [c["included"] for c in other._canaries["canaries"]]


def test_canaries_change_neither_weights_nor_sampling_rate(tmp_path, tiny_cfg, monkeypatch):
    """Secret canaries are added to a client's positions, but the client's weight (its
    reply's n) and its executed Poisson rate stay those of its public size: otherwise the
    aggregate and every other example's inclusion would depend on the canary count,
    outside the mechanism the ledger accounts for."""
    import fl.run.trainer as T
    from fl.methods.rounds import RoundInfo
    from fl.run.contexts import ClientContext

    cfg = tiny_cfg(canaries=24, nonmembers=60, dp_level="sample", noise_multiplier=1.0, rounds=1)
    eng = Engine(cfg, tmp_path / "c", quiet=True)
    eng.setup()
    got = {c for c in eng.client_ids() if len(eng.client_positions[c]) > eng.public_size(c)}
    assert got, "no client received a canary"
    rates = []
    real = T.poisson_masks
    monkeypatch.setattr(
        T, "poisson_masks", lambda src, n, q, steps: rates.append((n, q)) or real(src, n, q, steps)
    )
    for cid in eng.client_ids():
        ctx = ClientContext(eng, cid, RoundInfo(0, 0, eng.client_ids()))
        assert ctx.n == eng.public_size(cid)
        rates.clear()
        ctx.train(eng.method.released_state())
        (n_drawn, q), *_ = rates
        assert n_drawn == len(eng.client_positions[cid])  # every position, canaries too
        assert q == min(1.0, cfg.batch_size / eng.public_size(cid))
        assert q == eng.dp_params_for(eng.public_size(cid)).sample_rate

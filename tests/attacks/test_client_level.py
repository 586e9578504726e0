"""Client-level membership inference: the population (participants and their twins), the
aggregation and the calibrated threshold against slow references; end to end on a tiny-bert
run with --client-level."""

import json
from collections import Counter

import numpy as np
import pytest

from attacks import client_level as cl
from attacks.metrics import roc_metrics
from fl.errors import UsageError


def _synthetic(seed=0, n_clients=12, shift=0.8):
    """Members split into clients of random sizes, and a non-member pool; member scores
    are shifted up by ``shift``."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 9, n_clients)
    n_mem = int(sizes.sum())
    n_non = n_mem + 7
    is_member = np.r_[np.ones(n_mem, bool), np.zeros(n_non, bool)]
    labels = rng.integers(0, 3, n_mem + n_non)
    ids = [f"d:{i}" for i in range(n_mem + n_non)]
    cuts = np.cumsum(sizes)[:-1]
    clients = {str(c): [ids[i] for i in p] for c, p in enumerate(np.split(np.arange(n_mem), cuts))}
    scores = rng.normal(size=n_mem + n_non) + shift * is_member
    return ids, labels, is_member, clients, scores


def test_population_twins_match_each_participant():
    ids, labels, is_member, clients, _ = _synthetic()
    pop = cl.population(ids, labels, is_member, clients, seed=3)
    part = [g for g, p in zip(pop.groups, pop.participated) if p]
    twins = {n: g for n, g, p in zip(pop.names, pop.groups, pop.participated) if not p}
    assert len(part) == len(clients) and twins
    for name, g in twins.items():
        src = pop.groups[pop.names.index(name.removeprefix("twin:"))]
        assert not is_member[g].any()  # drawn from the non-members
        assert Counter(labels[g].tolist()) == Counter(labels[src].tolist())  # same histogram
    flat = np.concatenate(pop.groups)
    assert len(np.unique(flat)) == len(flat)  # nobody in two clients
    # the member shards are exactly the run's clients
    for name, g in zip(pop.names, pop.groups):
        if not name.startswith("twin:"):
            assert sorted(ids[i] for i in g) == sorted(clients[name])


def test_twins_stop_when_the_pool_runs_out():
    shard_labels = [np.array([0, 0, 1]), np.array([1, 1]), np.array([0])]
    pool = np.array([0, 1, 1, 0])  # two 0s, two 1s: cannot twin all three clients
    got = cl.twin_clients(shard_labels, pool, seed=0)
    used = np.concatenate([t for _, t in got])
    assert len(np.unique(used)) == len(used)
    for j, t in got:
        assert sorted(pool[t]) == sorted(shard_labels[j])
    assert 1 <= len(got) < 3


def test_aggregate_is_the_mean_over_each_client():
    rng = np.random.default_rng(1)
    s = rng.normal(size=30)
    groups = [np.array([0, 5, 7]), np.array([29]), np.arange(10, 20)]
    slow = [sum(s[i] for i in g) / len(g) for g in groups]
    np.testing.assert_allclose(cl.aggregate(s, groups), slow, rtol=1e-12)
    with pytest.raises(ValueError, match="finite"):
        cl.aggregate(np.r_[s[:-1], np.nan], groups)


@pytest.mark.parametrize("fpr", [0.0, 0.01, 0.1, 0.25, 0.5])
def test_calibrated_threshold_against_brute_force(fpr):
    rng = np.random.default_rng(2)
    s = np.round(rng.normal(size=37), 1)  # ties
    tau = cl.calibrated_threshold(s, fpr)
    # brute force: the smallest candidate threshold whose exceedance rate is <= fpr
    ok = [t for t in sorted(set(s)) if np.mean(s > t) <= fpr]
    assert tau == min(ok)


def test_client_level_roc_equals_roc_of_the_slow_means():
    ids, labels, is_member, clients, scores = _synthetic(seed=4, n_clients=30)
    pop = cl.population(ids, labels, is_member, clients, seed=0)
    res, cs = cl.client_level({"loss": scores}, pop, fpr=0.1, n_bootstrap=50, seed=0)
    slow = np.array([np.mean([scores[i] for i in g]) for g in pop.groups])
    np.testing.assert_allclose(cs["loss"], slow, rtol=1e-12)
    ref = roc_metrics(slow, pop.participated, n_bootstrap=50, seed=0)
    assert res["loss"]["auc"] == ref["auc"] and res["loss"]["ci"] == ref["ci"]
    assert res["loss"]["auc"] > 0.8  # a shift of 0.8 per example is plain at client level
    op = res["loss"]["calibrated"]
    tau = op["threshold"]
    non = np.flatnonzero(~pop.participated)
    assert op["n_calibration"] + op["n_held_out"] == len(non)
    assert op["tpr"] == pytest.approx(np.mean(slow[pop.participated] > tau))
    # τ is calibrated on one seeded half of the non-participants only: the smallest of
    # their scores with at most 10% of them above it; the FPR is that of the other half
    perm = np.random.default_rng([0, 0xCA1]).permutation(non)
    cal, held = slow[perm[: len(non) // 2]], slow[perm[len(non) // 2 :]]
    assert op["n_calibration"] == len(cal) and tau in cal
    assert np.mean(cal > tau) <= 0.1 < np.mean(cal >= tau)
    assert op["fpr_held_out"] == pytest.approx(np.mean(held > tau), rel=1e-12)


def test_population_errors_are_named():
    ids, labels, is_member, clients, _ = _synthetic()
    bad = {"0": [ids[-1]]}  # a non-member in a client shard
    with pytest.raises(UsageError, match="not members"):
        cl.population(ids, labels, is_member, bad, seed=0)
    no_pool = ~np.zeros(len(ids), bool)
    with pytest.raises(UsageError, match="non-members"):
        cl.population(ids, labels, no_pool, {"0": ids[:3]}, seed=0)


def test_cli_client_level_on_a_tiny_run(train_target, tmp_path, capsys):
    from pipeline.cli import main

    run_dir, _ = train_target("clients", clients=6, members=48, nonmembers=48, test=8, seed=2)
    out = tmp_path / "out"
    rc = main(["attack", str(run_dir), "--attacks", "loss", "--client-level", "--json",
               "--out", str(out), "--device", "cpu", "--bootstrap", "20"])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    c = json.loads((out / "clients.json").read_text())
    assert c == doc["client_level"]
    # every client but one or two gets its label-matched twin from the 48 non-members
    assert c["n_participating"] == 6 and 4 <= c["n_nonparticipating"] <= 6
    z = np.load(out / "client_scores.npz")
    splits = json.loads((run_dir / "splits.json").read_text())
    ex = np.load(out / "scores.npz")
    pos = {str(i): k for k, i in enumerate(ex["ids"])}
    for name, s in zip(z["clients"], z["loss"]):  # a participant's score: the mean loss score
        if not str(name).startswith("twin:"):
            want = np.mean([ex["loss"][pos[i]] for i in splits["clients"][str(name)]])
            assert s == pytest.approx(want, rel=1e-12)
    assert (
        c["attacks"]["loss"]["auc"]
        == roc_metrics(z["loss"], z["participated"], n_bootstrap=0)["auc"]
    )
    assert (out / "roc_clients.png").is_file() and (out / "client_hist.png").is_file()

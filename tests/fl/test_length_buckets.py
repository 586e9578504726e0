"""Length buckets: a training batch run as sub-batches of similar length
(``fl.data.tokenized.length_chunks``, ``LocalTrainer._chunks``) gives the single pass's
per-example gradients and DP-SGD step."""

from __future__ import annotations

import contextlib
import itertools

import numpy as np
import pytest
import torch

from fl.data.tokenized import TokenizedData, length_chunks
from fl.models import factors as F
from fl.privacy.dpsgd import DpSgdParams
from fl.privacy.rng import SeededSource
from fl.privacy.wspace import WSpaceClipper
from fl.run.config import TrainConfig
from fl.run.local_step import DpSgd, NoPrivacy, SpaceDpSgd
from fl.run.trainer import LocalTrainer


def _brute_force_cost(lengths: np.ndarray, overhead: float) -> float:
    """The cheapest split by enumerating every partition of the sorted distinct lengths
    into contiguous runs (the slow obvious reference)."""
    vals, counts = np.unique(lengths, return_counts=True)
    m = len(vals)
    best = np.inf
    for k in range(m):  # k cut points between the m groups
        for cuts in itertools.combinations(range(1, m), k):
            bounds = (0, *cuts, m)
            cost = sum(
                counts[a:b].sum() * vals[b - 1] + overhead for a, b in itertools.pairwise(bounds)
            )
            best = min(best, cost)
    return float(best)


def _cost(lengths: np.ndarray, parts: list[np.ndarray], overhead: float) -> float:
    return float(sum(len(p) * lengths[p].max() + overhead for p in parts))


@pytest.mark.parametrize("overhead", [0.0, 3.0, 40.0, 1e9])
def test_length_chunks_is_an_optimal_permutation(overhead):
    rng = np.random.default_rng(7)
    for _ in range(25):
        lengths = rng.integers(1, 12, size=rng.integers(1, 30))
        parts = length_chunks(lengths, overhead)
        joined = np.concatenate(parts)
        assert sorted(joined.tolist()) == list(range(len(lengths)))  # a permutation
        # shortest first, and no two sub-batches share a length range
        maxes = [lengths[p].max() for p in parts]
        mins = [lengths[p].min() for p in parts]
        assert all(a < b for a, b in zip(maxes[:-1], mins[1:], strict=True))
        assert _cost(lengths, parts, overhead) == pytest.approx(
            _brute_force_cost(lengths, overhead)
        )


def test_length_chunks_edge_cases():
    assert length_chunks(np.array([], dtype=int), 10.0) == []
    (only,) = length_chunks(np.array([5, 5, 5]), 0.0)
    assert only.tolist() == [0, 1, 2]
    assert len(length_chunks(np.array([1, 40, 2, 39]), float("inf"))) == 1
    # no overhead: one sub-batch per distinct length
    assert len(length_chunks(np.array([3, 1, 2, 3, 1]), 0.0)) == 3


TEXTS = [
    "short",
    "yes",
    "the cat sat on the mat",
    "a much longer sentence that goes on and on about nothing in particular at all today",
    "federated learning with differential privacy",
    "another example of moderate length here",
    "ok then",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen",
]


def _trainer(buckets: bool, lora_layers: int) -> LocalTrainer:
    cfg = TrainConfig(
        method="fedavg",
        model="tiny-bert",
        dataset="synthetic",
        max_length=24,
        lora_layers=lora_layers,
        head_init="random",
        rank=4,
        alpha=8.0,
        batch_size=12,
        lr=0.05,
        optimizer="sgd",  # Adam would magnify float rounding of near-zero gradients
        length_buckets=buckets,
        seed=3,
    )
    tr = LocalTrainer(cfg, 2, torch.device("cpu"))
    for m in tr.model.modules():  # dropout draws differ with the split: off to compare
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # non-zero B (the same in every trainer): the factors learn
        for _, ab in sorted(F.lora_param_map(tr.model).items()):
            ab["B"].copy_(0.1 * torch.randn(ab["B"].shape, generator=gen))
    return tr


@pytest.mark.parametrize("lora_layers", [0, 1])  # uncached, and over the prefix cache
@pytest.mark.parametrize("private", [True, False, "wspace"])
def test_buckets_give_the_single_pass_training(monkeypatch, lora_layers, private):
    """Whole local trainings: DP-SGD in parameter space, FedASK's W-space clipping (its
    per-example norms come from its own activation hooks, per pass) and no DP."""
    texts = TEXTS * 3
    labels = np.arange(len(texts)) % 2
    out, passes, starts = {}, {}, {}
    for buckets in (False, True):
        tr = _trainer(buckets, lora_layers)
        # no fixed cost per pass: every distinct length its own sub-batch
        monkeypatch.setattr(tr, "BUCKET_OVERHEAD_TOKENS", 0.0)
        seen = []
        orig = tr._chunks

        def spy(data, idx, _orig=orig, _seen=seen):
            parts = _orig(data, idx)
            _seen.append(len(parts))
            return parts

        monkeypatch.setattr(tr, "_chunks", spy)
        from fl.models.base import load_tokenizer

        data = TokenizedData(texts, labels, load_tokenizer("tiny-bert"), 24)
        start = F.clone_state(tr.initial_state())
        dp = DpSgdParams(noise_multiplier=0.7, clip=0.5, sample_rate=0.5, expected_batch=12.0)
        trainable = {"A", "B", "head"}
        clipper = contextlib.nullcontext()
        if private == "wspace":
            clipper = WSpaceClipper.from_model(tr.model, tr.scaling)
            privatizer = SpaceDpSgd(dp, SeededSource(1, ("noise",)), clipper)
            trainable = {"B", "head"}  # W-space clipping keeps A fixed
        elif private:
            privatizer = DpSgd(dp, SeededSource(1, ("noise",)))
        else:
            privatizer = NoPrivacy()
        with clipper:
            res, _ = tr.run(
                start,
                data,
                np.arange(len(texts)),
                steps=4,
                trainable=trainable,
                privatizer=privatizer,
                hooks=[],
                batch_source=SeededSource(2, ("batches",)),
                dropout_seed=0,
            )
        out[buckets], passes[buckets], starts[buckets] = res, seen, start
    assert max(passes[False]) == 1
    assert max(passes[True]) > 1  # the buckets did split the batches
    a, b = out[False], out[True]
    assert a.examples == b.examples and a.steps == b.steps
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    sa, sb = F.flatten_state(a.state), F.flatten_state(b.state)
    assert sa.keys() == sb.keys() and sa
    moved = F.state_sub(a.state, starts[False])
    assert any(float(v.abs().max()) > 1e-3 for v in moved.values())  # training happened
    for k in sa:
        assert torch.allclose(sa[k], sb[k], atol=1e-5), k
    if private:
        for k in ("mean_norm", "frac_clipped"):
            assert a.dp_stats[k] == pytest.approx(b.dp_stats[k], rel=1e-5), k


def test_buckets_are_off_on_request_and_for_pooled_features():
    tr = _trainer(False, 1)
    from fl.models.base import load_tokenizer

    data = TokenizedData(TEXTS, np.zeros(len(TEXTS)), load_tokenizer("tiny-bert"), 24)
    idx = torch.arange(len(TEXTS))
    assert len(tr._chunks(data, idx)) == 1
    tr.cfg = TrainConfig(**{**tr.cfg.to_dict(), "length_buckets": True})
    tr.BUCKET_OVERHEAD_TOKENS = 0.0
    assert len(tr._chunks(data, idx)) > 1
    data.attach_cache("features", ("k",), torch.zeros(len(TEXTS), 4))
    assert len(tr._chunks(data, idx)) == 1

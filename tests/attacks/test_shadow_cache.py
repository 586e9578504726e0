"""Shadows over the shared frozen-prefix pool: one encode for all shadows, the same
adapters (to 1e-5) as shadows without any prefix cache, and the sequential task path."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from attacks.reference import train_shadows
from fl.data.datasets import make_synthetic
from fl.data.tokenized import TokenizedData
from fl.models import heads
from fl.models.base import load_tokenizer
from fl.run.config import TrainConfig

POOL = 60


def _pool():
    ds = make_synthetic()
    return ds.ids[:POOL], ds.texts[:POOL], np.asarray(ds.labels[:POOL]), ds.num_classes


def _count_encodes(monkeypatch) -> list[int]:
    """A fresh process cache and a list that records the size of every prefix encode."""
    monkeypatch.setattr(heads, "_ENCODED", OrderedDict())
    sizes: list[int] = []
    real = heads.FrozenPrefix.encode

    def counting(self, data):
        sizes.append(len(data))
        return real(self, data)

    monkeypatch.setattr(heads.FrozenPrefix, "encode", counting)
    return sizes


def _adapter(shadows, j) -> dict:
    return load_file(str(shadows.adapter_dirs[j] / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def cfg():
    from fl.testing import tiny_config

    # LoRA on the top layer of tiny-bert's two: a frozen prefix of one layer
    return tiny_config(members=40, nonmembers=0, test=20, clients=2, rounds=2, local_steps=3,
                       lora_layers=1, prefix_cache=True)  # fmt: skip


def test_shadows_encode_the_pool_once_and_match_the_uncached_path(cfg, tmp_path, monkeypatch):
    ids, texts, labels, c = _pool()
    sizes = _count_encodes(monkeypatch)
    kw = dict(seed=3, device="cpu", progress=False, num_labels=c, workers=1, ray_address="none")
    shared = train_shadows(cfg, ids, texts, labels, 3, tmp_path / "shared", **kw)
    # one encode of the whole pool serves the members and test halves of all 3 shadows
    assert sizes == [POOL]

    sizes.clear()
    own = train_shadows(cfg, ids, texts, labels, 3, tmp_path / "own", share_prefix=False, **kw)
    # each shadow encodes its own halves, except that shadow 1 (the complement of shadow
    # 0) trains on shadow 0's test half and tests on its members: the process cache
    # already holds both; the unpaired shadow 2 encodes two more
    assert sizes == [POOL // 2] * 4

    sizes.clear()
    plain = TrainConfig.from_dict({**cfg.to_dict(), "prefix_cache": False})
    uncached = train_shadows(plain, ids, texts, labels, 3, tmp_path / "uncached", **kw)
    assert sizes == []  # no prefix cache at all: every step runs the whole encoder

    np.testing.assert_array_equal(shared.in_mask, uncached.in_mask)
    for j in range(3):
        a, b, o = _adapter(shared, j), _adapter(uncached, j), _adapter(own, j)
        assert a.keys() == b.keys() == o.keys() and len(a) > 0
        moved = 0
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)
            torch.testing.assert_close(a[name], o[name], rtol=0, atol=1e-5)
            moved += int(a[name].abs().max() > 0)
        assert moved > 0  # the comparison is not between untrained zeros


def test_gathered_rows_equal_an_own_encode(cfg):
    """FrozenPrefix level: a subset's rows gathered from the pool equal its own encode."""
    from fl.run.trainer import LocalTrainer

    tr = LocalTrainer(cfg, 2, torch.device("cpu"))
    prefix = tr.prefix
    assert prefix.enabled and prefix.depth == 1
    _, texts, labels, _ = _pool()
    tok = load_tokenizer(cfg.model)
    pool = TokenizedData(texts, labels, tok, cfg.max_length)
    pick = [5, 0, 17, 33, 2, 59]
    sub = TokenizedData([texts[i] for i in pick], labels[pick], tok, cfg.max_length)
    own = prefix.encode(sub)
    with heads.shared_rows(pool):
        got = prefix.encode_cached(sub)
        assert got.shape == own.shape
        torch.testing.assert_close(got, own, rtol=0, atol=1e-5)
        torch.testing.assert_close(got, prefix.encode(pool)[pick], rtol=0, atol=0)
    # a data set with an example outside the pool is encoded itself
    other = TokenizedData(["a text the pool does not hold"], np.asarray([0]), tok, cfg.max_length)
    with heads.shared_rows(sub):
        assert prefix._from_pool(prefix.fingerprint(), other) is None

"""LocalTrainer.run switches the model to train mode only when needed and seeds dropout
from the public seed: a local training after an evaluation, or after someone put the
model in eval mode, equals the same training in a fresh trainer (dropout on)."""

from __future__ import annotations

import numpy as np
import torch

from fl.data.tokenized import TokenizedData
from fl.models import factors as F
from fl.models.base import load_tokenizer
from fl.privacy.rng import SeededSource
from fl.run.config import TrainConfig
from fl.run.local_step import NoPrivacy
from fl.run.trainer import LocalTrainer

TEXTS = ["short", "the cat sat on the mat", "ok then", "federated learning with privacy"] * 4


def _setup():
    cfg = TrainConfig(
        method="fedavg",
        model="tiny-bert",
        dataset="synthetic",
        max_length=16,
        head_init="random",
        rank=4,
        alpha=8.0,
        batch_size=8,
        lr=0.05,
        optimizer="sgd",
        seed=3,
    )
    tr = LocalTrainer(cfg, 2, torch.device("cpu"))
    data = TokenizedData(TEXTS, np.arange(len(TEXTS)) % 2, load_tokenizer("tiny-bert"), 16)
    return tr, data


def _train(tr, data, start, dropout_seed=11):
    res, _ = tr.run(
        start,
        data,
        np.arange(len(data)),
        3,
        {"A", "B", "head"},
        NoPrivacy(),
        [],
        SeededSource(2, ("batches",)),
        dropout_seed,
    )
    return F.flatten_state(res.state)


def test_training_after_eval_or_external_eval_equals_a_fresh_trainer():
    tr0, data = _setup()
    start = F.clone_state(tr0.initial_state())
    ref = _train(tr0, data, start)
    assert any(m.training for m in tr0.model.modules() if isinstance(m, torch.nn.Dropout))

    tr, data = _setup()
    _train(tr, data, start)  # the trainer is now in train mode
    tr.evaluate(start, data, 8)  # evaluation switches to eval and back
    again = _train(tr, data, start)
    tr.model.eval()  # someone else switches the whole model to eval
    after_external = _train(tr, data, start)
    other_seed = _train(tr, data, start, dropout_seed=12)
    for k in ref:
        torch.testing.assert_close(again[k], ref[k], rtol=0, atol=0)
        torch.testing.assert_close(after_external[k], ref[k], rtol=0, atol=0)
    # dropout is on in these trainings: another public dropout seed changes the result
    assert any(not torch.equal(other_seed[k], ref[k]) for k in ref)
    assert all(m.training for m in tr.model.modules() if isinstance(m, torch.nn.Dropout))


def test_cpu_local_training_hands_freed_memory_back(monkeypatch):
    """Each CPU local training ends with one malloc_trim (fl.run.batches.release_freed_memory),
    which changes no result: the same training with the trim disabled is bit-identical."""
    import platform

    import fl.run.trainer as T

    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert T.release_freed_memory() is True
    tr, data = _setup()
    start = tr.initial_state()
    calls = []
    real = T.release_freed_memory
    monkeypatch.setattr(T, "release_freed_memory", lambda: calls.append(1) or real())
    trimmed = _train(tr, data, start)
    assert calls == [1]
    monkeypatch.setattr(T, "release_freed_memory", lambda: False)
    plain = _train(tr, data, start)
    assert trimmed.keys() == plain.keys()
    for k in trimmed:
        assert torch.equal(trimmed[k], plain[k]), k

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Tests run two workers on two cores: one torch thread each (more threads on busy
# cores made tiny-model training 10-25x slower).
torch.set_num_threads(1)


@pytest.fixture
def tiny_cfg():
    """A factory for tiny, fast training configs (tiny-bert on synthetic text)."""
    from fl.config import TrainConfig

    def make(**kw):
        base = dict(
            model="tiny-bert",
            dataset="synthetic",
            members=240,
            nonmembers=60,
            test=100,
            max_length=24,
            clients=3,
            rounds=2,
            local_steps=4,
            batch_size=16,
            lr=0.02,
            rank=4,
            alpha=8.0,
            progress=False,
            device="cpu",
        )
        base.update(kw)
        return TrainConfig(**base)

    return make

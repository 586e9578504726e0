"""Shared by the attack tests: one torch thread, and tiny trained targets."""

import pytest
import torch

#: a tiny target run: tiny-bert on synthetic text (fl.testing.TINY), one client, one round
TARGET = dict(members=16, nonmembers=8, test=8, max_length=16, clients=1, rounds=1,
              batch_size=8, lr=0.02)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # On shared, busy cores a second intra-op thread slows tiny models down several times.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def train_target(tmp_path_factory):
    """``train_target(name, **overrides)`` → (run directory, manifest) of a freshly trained
    tiny run (:data:`TARGET` updated with ``overrides``), in its own temporary folder."""
    from fl.run.engine import train
    from fl.testing import tiny_config

    def make(name: str, **overrides):
        d = tmp_path_factory.mktemp(name) / "run"
        return d, train(tiny_config(**{**TARGET, **overrides}), d, quiet=True)

    return make

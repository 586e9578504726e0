import pytest


@pytest.fixture(scope="session")
def small_engine(tmp_path_factory):
    """A factory of set-up Engines on a small tiny-bert federation (2 clients, 120
    members, one round of 3 local steps, FFA) for tests that drive the trainer
    directly: ``small_engine("name", optimizer="sgd")``; keywords override the config."""
    from fl.run.engine import Engine
    from fl.testing import tiny_config

    def make(name: str, **overrides):
        small = dict(members=120, nonmembers=20, test=20, max_length=16, clients=2, rounds=1)
        cfg = tiny_config(**{**small, "local_steps": 3, "lr": 0.05, "method": "ffa", **overrides})
        eng = Engine(cfg, tmp_path_factory.mktemp(name) / "run", quiet=True)
        eng.prepare_out()
        eng.setup()
        return eng

    return make

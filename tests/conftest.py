import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Shadows train in this process unless a test asks for Ray (tests/benchmarks/test_ray.py
# starts it once): the default of `fedlora attack --ray-address`.
os.environ.setdefault("FEDLORA_RAY_ADDRESS", "none")
# Tests run two workers on two cores: one torch thread each (more threads on busy
# cores made tiny-model training 10-25x slower).
torch.set_num_threads(1)


@pytest.fixture
def tiny_cfg():
    """A factory for tiny, fast training configs (tiny-bert on synthetic text):
    ``fl.testing.tiny_config``, which module-scoped fixtures call directly."""
    from fl.testing import tiny_config

    return tiny_config

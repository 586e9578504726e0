"""The tests' tiny training configuration, in one place (tiny-bert on synthetic text, CPU,
no progress bars: a run takes seconds).

A plain module rather than a fixture: module-scoped fixtures (one shared engine or run
per test file) cannot use the function-scoped ``tiny_cfg`` fixture, and with pytest's
``--import-mode=importlib`` the test files cannot import ``conftest`` or each other.
``tests/conftest.py``'s ``tiny_cfg`` fixture is :func:`tiny_config`.
"""

from __future__ import annotations

from fl.run.config import TrainConfig

#: the tiny settings; a test overrides what it needs (``tiny_config(rounds=3)``)
TINY: dict = dict(
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
    head_lr=0.0,  # the same as lr
    lora_layers=0,  # LoRA on every layer
    rank=4,
    alpha=8.0,
    # A random head, so that the LoRA factors get gradients from the first step (the
    # tests of the methods' math need them to move in a few steps); the zero head of
    # the defaults is tested in tests/fl/test_heads.py and test_learning_setup.py.
    head_init="random",
    progress=False,
    device="cpu",
)


def tiny_config(**overrides) -> TrainConfig:
    """A TrainConfig with :data:`TINY`'s settings, updated with ``overrides``."""
    return TrainConfig(**{**TINY, **overrides})


def tiny_flags(**overrides) -> list[str]:
    """:data:`TINY` (updated with ``overrides``) as ``fedlora train`` flags."""
    args: list[str] = []
    for k, v in {**TINY, **overrides}.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            args.append(flag if v else "--no-" + flag[2:])
        else:
            args += [flag, str(v)]
    return args


#: the tiny causal-LM settings (tiny-gpt2 on synthetic text as plain text)
TINY_LM: dict = dict(
    TINY,
    task="causal-lm",
    model="tiny-gpt2",
    members=60,
    nonmembers=20,
    test=20,
    max_length=16,
    clients=2,
    rounds=1,
    local_steps=2,
    batch_size=8,
)


def tiny_lm_config(**overrides) -> TrainConfig:
    """A causal-LM TrainConfig with :data:`TINY_LM`'s settings, updated with ``overrides``."""
    return TrainConfig(**{**TINY_LM, **overrides})


def write_instruction_jsonl(path, n: int = 120, seed: int = 0) -> None:
    """A learnable toy instruction set: ``{"id", "prompt", "response"}`` per line; the
    response repeats the prompt's key word (so the response loss can fall)."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            key = f"k{int(rng.integers(30))}"
            filler = " ".join(f"w{int(w)}" for w in rng.integers(50, size=int(rng.integers(2, 6))))
            row = {"id": f"ins:{i}", "prompt": f"repeat {key} {filler}", "response": f"{key} {key}"}
            fh.write(json.dumps(row) + "\n")


__all__ = [
    "TINY",
    "TINY_LM",
    "tiny_config",
    "tiny_flags",
    "tiny_lm_config",
    "write_instruction_jsonl",
]

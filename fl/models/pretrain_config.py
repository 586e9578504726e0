"""What `fedlora base pretrain` is configured with (:class:`PretrainConfig`), apart from
:mod:`fl.models.pretrain` so that building the command line imports neither torch nor numpy."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fl.errors import UsageError

CORPORA = ("bbc",)


@dataclass
class PretrainConfig:
    corpus: str = "bbc"
    vocab_size: int = 4096
    n_embd: int = 128
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 64
    batch_size: int = 32
    steps: int = 500
    lr: float = 3e-3
    warmup: float = 0.05
    weight_decay: float = 0.01
    test_frac: float = 0.05
    max_docs: int = 0  # 0 = every article (tests use a slice)
    seed: int = 0
    log_every: int = 25

    def validate(self) -> PretrainConfig:
        if self.corpus not in CORPORA:
            raise UsageError(f"unknown corpus {self.corpus!r}; choose one of {list(CORPORA)}")
        limits = {
            "vocab_size": 1_000_000,
            "n_embd": 65_536,
            "n_layer": 1024,
            "n_head": 1024,
            "seq_len": 65_536,
            "batch_size": 65_536,
            "steps": 100_000_000,
            "log_every": 100_000_000,
        }
        for k, hi in limits.items():
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise UsageError(f"{k} must be a whole number in [1, {hi}], got {v!r}")
        if not (isinstance(self.seed, int) and 0 <= self.seed < 2**32):
            raise UsageError(f"seed must be in [0, 2^32 - 1], got {self.seed!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise UsageError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.vocab_size < 300:
            raise UsageError(
                f"vocab_size must be >= 300 (256 bytes + merges), got {self.vocab_size}"
            )
        if self.n_embd % self.n_head:
            raise UsageError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not (self.lr > 0 and math.isfinite(self.lr) and self.lr <= 10):
            raise UsageError(f"lr must be in (0, 10], got {self.lr}")
        if not 0 < self.test_frac < 0.5:
            raise UsageError(f"test_frac must be in (0, 0.5), got {self.test_frac}")
        if not 0 <= self.warmup < 1:
            raise UsageError(f"warmup must be in [0, 1), got {self.warmup}")
        if not (isinstance(self.max_docs, int) and 0 <= self.max_docs <= 10**9):
            raise UsageError(f"max_docs must be in [0, 1e9], got {self.max_docs}")
        return self

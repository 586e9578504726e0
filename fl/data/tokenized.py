"""Data on the device: all texts tokenized once, batches cut from them.

A :class:`TokenizedData` may also hold the *prefix cache* of a model whose bottom layers
are frozen (:mod:`fl.models.heads`): the hidden states after the frozen layers (``hidden``) or,
when the whole encoder is frozen, the pooled features (``features``), one row per
example. Batches then carry those instead of the token ids.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenizedData:
    """All texts tokenized once (padded to max_length); batches trimmed to their
    longest sequence."""

    def __init__(self, texts: list[str], labels: np.ndarray, tokenizer, max_length: int):
        enc = tokenizer(
            texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
        )
        self.input_ids = enc["input_ids"]
        self.attention_mask = enc["attention_mask"]
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.lengths = self.attention_mask.sum(dim=1)
        self.cache_kind: str | None = None  # None, "hidden" or "features"
        self.cache_key: tuple | None = None
        self.cache: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def attach_cache(self, kind: str, key: tuple, values: torch.Tensor) -> None:
        """Attach a prefix cache: ``kind`` "hidden" (n × max_length × H) or "features"
        (n × H); ``key`` names the model and cut it belongs to."""
        if kind not in ("hidden", "features"):
            raise ValueError(f"unknown cache kind {kind!r}")
        if values.shape[0] != len(self):
            raise ValueError(f"cache has {values.shape[0]} rows for {len(self)} examples")
        self.cache_kind, self.cache_key, self.cache = kind, key, values

    def batch(self, idx: torch.Tensor | np.ndarray, device) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        L = int(self.lengths[idx].max()) if len(idx) else 1
        out = {
            "attention_mask": self.attention_mask[idx, :L].to(device),
            "labels": self.labels[idx].to(device),
        }
        if self.cache_kind == "features":
            out["features"] = self.cache[idx].to(device)
        elif self.cache_kind == "hidden":
            out["prefix_hidden"] = self.cache[idx, :L].to(device)
        else:
            out["input_ids"] = self.input_ids[idx, :L].to(device)
        return out


def length_chunks(lengths: np.ndarray, overhead_tokens: float) -> list[np.ndarray]:
    """Split a batch into sub-batches of similar length, each padded only to its own
    longest sequence: positions into ``lengths`` (shortest first), one array per
    sub-batch, together a permutation of ``range(len(lengths))``.

    The split minimizes Σ_chunks (examples × longest length) + ``overhead_tokens`` ×
    chunks, the padded tokens computed plus a fixed cost per forward/backward pass
    expressed in tokens (exact dynamic programme over the distinct lengths, O(m²) for
    m ≤ max_length of them). ``overhead_tokens`` = inf gives one chunk.
    """
    lengths = np.asarray(lengths)
    n = len(lengths)
    if n == 0:
        return []
    order = np.argsort(lengths, kind="stable")
    vals, starts = np.unique(lengths[order], return_index=True)
    ends = np.r_[starts[1:], n]
    m = len(vals)
    if m == 1 or not np.isfinite(overhead_tokens):
        return [order]
    best = np.full(m + 1, np.inf)
    best[0] = 0.0
    first = np.zeros(m + 1, dtype=np.int64)  # first group (1-based) of the last chunk
    for j in range(1, m + 1):
        # a last chunk of groups i..j (1-based) holds ends[j-1] - starts[i-1] examples
        cost = best[:j] + (ends[j - 1] - starts[:j]) * float(vals[j - 1]) + overhead_tokens
        i = int(np.argmin(cost))
        best[j], first[j] = cost[i], i + 1
    cuts = []
    j = m
    while j > 0:
        i = first[j]
        cuts.append((starts[i - 1], ends[j - 1]))
        j = i - 1
    return [order[a:b] for a, b in reversed(cuts)]

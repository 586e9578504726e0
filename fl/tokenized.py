"""Data on the device: all texts tokenized once, batches cut from them."""

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

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, idx: torch.Tensor | np.ndarray, device) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        L = int(self.lengths[idx].max()) if len(idx) else 1
        return {
            "input_ids": self.input_ids[idx, :L].to(device),
            "attention_mask": self.attention_mask[idx, :L].to(device),
            "labels": self.labels[idx].to(device),
        }

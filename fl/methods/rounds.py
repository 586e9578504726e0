"""What travels in a round: the round's public description, the replies a stage
collects, and the size of a payload. Shared by the methods (the contract) and the
transports (the send path), which import nothing of each other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Replies:
    ok: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def senders(self) -> list[str]:
        return list(self.ok)


@dataclass
class RoundInfo:
    index: int  # 0-based round number
    seed: int  # round seed (derived from the run seed)
    clients: list[str]

    def derive(self, purpose: str) -> int:
        from fl.privacy.rng import derive_seed

        return derive_seed(self.seed, purpose)


def payload_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(payload_bytes(v) for v in obj)
    if isinstance(obj, str):
        return len(obj.encode())
    return 8


__all__ = ["Replies", "RoundInfo", "payload_bytes"]

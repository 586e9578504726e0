"""What a method may see of the engine: :class:`ClientView` (a client handler's view of
its client) and :class:`ServerView` (the server program's view of the run), as typed
protocols.

They list exactly what the methods use and nothing more: a method never reaches the
engine, its trainer, its data or the full configuration. ``fl.run.contexts.ClientContext``
and ``fl.run.contexts.ServerContext`` implement them in process (the Flower client app
builds the same ClientContext); tests/fl/test_method_contexts.py checks statically
that every method's code touches only these members, and runs every registered
method against fakes that implement nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from fl.methods.rounds import RoundInfo
from fl.privacy.rng import NoiseSource

if TYPE_CHECKING:
    from fl.privacy.canary_clients import CanaryClients
    from fl.privacy.dpsgd import DpSgdParams


class RunSettings(Protocol):
    """The run's public settings a method reads (``fl.run.config.TrainConfig`` has them)."""

    @property
    def rank(self) -> int:
        """The global LoRA rank R."""
        ...

    @property
    def seed(self) -> int:
        """The public seed (FedASK's fixed Ω is derived from it)."""
        ...

    @property
    def clients(self) -> int:
        """N, the number of clients in the federation (SCAFFOLD's |S|/N)."""
        ...

    @property
    def head_clip_share(self) -> float:
        """s: the share of C² kept for the head by sample-level DP-SGD (0 = joint)."""
        ...


class TrainOutcome(Protocol):
    """What ``ClientView.train`` returns (``fl.run.trainer.TrainResult`` has it; named here
    so that methods do not import the trainer, which imports the configuration)."""

    #: the trained {"factors": {module: {"A", "B"}}, "head": {...}}
    state: dict
    #: mean training loss over the local steps
    loss: float
    #: local steps taken
    steps: int
    #: examples seen
    examples: int


class ClientView(Protocol):
    """What ``on_<stage>(client, payload)`` sees: one client, this round."""

    #: the client's id
    id: str
    #: n_k, the number of its training examples
    n: int
    #: the round being run (index, seed, cohort)
    round: RoundInfo
    #: persists between this client's stages and rounds (rolled back on a failure)
    state: dict

    @property
    def rank(self) -> int:
        """This client's LoRA rank r_i (R when ranks are homogeneous)."""
        ...

    @property
    def lr(self) -> float:
        """η, the local learning rate."""
        ...

    def lr_of(self, key: str) -> float:
        """The learning rate of a flat state key (``head/...``: the head's, else the
        factors')."""
        ...

    @property
    def scaling(self) -> float:
        """s = alpha/r of the LoRA update ΔW = s·B A."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """The model the client trains in, for a base-weight overlay (FLoRA's merged
        update) or a gradient transform (FedASK's W-space clipper) around ``train``."""
        ...

    def dp_params(self) -> DpSgdParams | None:
        """The client's DP-SGD parameters (None without sample-level DP)."""
        ...

    def train(
        self,
        start: dict,
        trainable: set[str] | tuple[str, ...] = ("A", "B", "head"),
        prox_mu: float = 0.0,
        correction: dict[str, torch.Tensor] | None = None,
        grad_transform: Any = None,
        grad_mask: dict[str, torch.Tensor] | None = None,
        stage: str = "train",
    ) -> TrainOutcome:
        """Local (DP-)SGD from ``start`` ({"factors", "head"}); records its DP event."""
        ...


class ServerView(Protocol):
    """What a method's server program (``server_round`` and the rest) sees of the run."""

    @property
    def cfg(self) -> RunSettings: ...

    @property
    def dp_level(self) -> str:
        """ "none", "sample" or "client"."""
        ...

    @property
    def scaling(self) -> float:
        """s = alpha/R of the global LoRA update."""
        ...

    @property
    def noise_multiplier(self) -> float:
        """σ of the run's client-level Gaussian release (calibrated by the engine)."""
        ...

    @property
    def clip(self) -> float:
        """C, the clipping bound."""
        ...

    @property
    def expected_clients_per_round(self) -> float:
        """m, the fixed denominator of a client-level DP average."""
        ...

    @property
    def model(self) -> torch.nn.Module:
        """The model :meth:`evaluate` runs, for a base-weight overlay around it."""
        ...

    def client_rank(self, cid: str) -> int:
        """Client ``cid``'s LoRA rank r_i."""
        ...

    def is_eval_round(self, rnd: RoundInfo) -> bool:
        """Whether the engine evaluates after this round (every ``eval_every``, and the
        last)."""
        ...

    def evaluate(self, state: dict) -> dict:
        """{"accuracy", "loss"} of ``state`` on the test data, in :attr:`model`."""
        ...

    def noise_generator(self, rnd: RoundInfo, purpose: str) -> NoiseSource:
        """The run's secret noise stream for this round's server-side release."""
        ...

    def noise(self, shape: tuple[int, ...], std: float, gen: NoiseSource) -> torch.Tensor:
        """N(0, std²) of ``shape`` from ``gen``."""
        ...

    def record_client_level_release(
        self, rnd: RoundInfo, stage: str, count: int = 1, sigma: float | None = None
    ) -> None:
        """Enter ``count`` client-level Gaussian releases of this round into the ledger."""
        ...

    @property
    def canary_clients(self) -> CanaryClients | None:
        """The run's canary clients (``--canary-clients``), None without
        (``fl.privacy.canary_clients``)."""
        ...

    def log(self, msg: str) -> None: ...


__all__ = ["ClientView", "RunSettings", "ServerView", "TrainOutcome"]

"""The canary clients of the Flower audit (:mod:`audit.libraries.flower`): what a canary
is (:class:`FlowerCanaries`), the canary block's key, the modes the audit knows and what one
round released (:class:`RoundRecord`). numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "BLOCK_KEY",
    "COVERED_INNER",
    "EXCLUDED_GAIN",
    "FIRST_NODE",
    "MODES",
    "FAILURE_KINDS",
    "ClientFailure",
    "FlowerCanaries",
    "RoundRecord",
    "failures_of",
]

#: the inner strategies whose aggregation the audit's ε covers: a stateless mean of the
#: clipped updates weighted by the reported num_examples (FedProx only adds a client-side
#: proximal term); anything else is refused before training
COVERED_INNER = ("FedAvg", "FedProx")

#: the canary block's key in the model's ArrayRecord (Message API); last array in legacy
BLOCK_KEY = "fedlora_canary_block"
#: node ids: real clients from here, canaries after them (1 is Flower's SuperLink id)
FIRST_NODE = 1001
#: an excluded canary's update on its coordinate, in units of C (see FlowerRun.canary_update)
EXCLUDED_GAIN = 1e-9

#: what each mode carries (see docs/audit_flower.md)
MODES = {
    "server_fixed": "sampling, the wrapper's clipping, FedAvg's weighting, the noise (scale, freshness)",
    "client_fixed": "sampling, the client mod's clipping, FedAvg's weighting, the noise",
    "server_adaptive": (
        "sampling, clipping at C_t, weighting, the noise at σ·C_noise/m (C_t per round); "
        "not the clipped-count release (its noise is not observed)"
    ),
    "client_adaptive": "as server_adaptive, the clipping done by adaptiveclipping_mod",
    "local_dp": (
        "LocalDpMod's clipping and noise on each canary reply as the server receives it, "
        "against the (ε, δ) the mod is given; the central aggregate carries no DP claim"
    ),
}


@dataclass
class FlowerCanaries:
    """M canary clients. ``p_include``: each canary's probability of carrying its update
    (bits from the OS's entropy unless ``seed``); ``canary_examples``: what a canary
    reports as ``num_examples`` (None: the largest real client's report so far)."""

    m: int = 16
    p_include: float = 0.5
    gain_factor: float = 100.0
    canary_examples: int | None = None
    seed: int | None = None
    included: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.m, bool) or not isinstance(self.m, int) or self.m < 2:
            raise ValueError(f"FlowerCanaries.m must be an integer >= 2, got {self.m!r}")
        if not 0 < self.p_include <= 1:
            raise ValueError(f"p_include must be in (0, 1], got {self.p_include}")
        if not self.gain_factor > 1:
            raise ValueError(
                f"gain_factor must be > 1 (the canary is clipped), got {self.gain_factor}"
            )
        if self.canary_examples is not None and (
            isinstance(self.canary_examples, bool)
            or not isinstance(self.canary_examples, int)
            or self.canary_examples < 1
        ):
            raise ValueError(
                f"canary_examples must be a positive int or None, got {self.canary_examples!r}"
            )
        rng = np.random.default_rng(self.seed)
        self.included = (
            np.ones(self.m, dtype=bool)
            if self.p_include == 1
            else rng.random(self.m) < self.p_include
        )


#: what an injected client failure does (:class:`ClientFailure`)
FAILURE_KINDS = {
    "raise": "the client's code raises: its ClientApp replies with an error, as a SuperNode "
    "replies for a ClientApp that raised",
    "timeout": "the reply never arrives: the grid returns without it, as send_and_receive "
    "does when its timeout passes",
    "nan": "the client replies with NaN in its model (a diverged local training)",
}


@dataclass(frozen=True)
class ClientFailure:
    """A failure injected into one real client's reply: in round ``round`` (1-based), the
    real client ``client`` (its partition id, 0 … K − 1; None = the first real client the
    sampler drew that round) fails as ``kind`` says (:data:`FAILURE_KINDS`). A failure
    takes effect only when that client is drawn."""

    round: int
    client: int | None = None
    kind: str = "raise"

    def __post_init__(self) -> None:
        if isinstance(self.round, bool) or not isinstance(self.round, int) or self.round < 1:
            raise ValueError(f"ClientFailure.round must be an int >= 1, got {self.round!r}")
        if self.client is not None and (
            isinstance(self.client, bool) or not isinstance(self.client, int) or self.client < 0
        ):
            raise ValueError(
                f"ClientFailure.client must be a partition id >= 0 or None, got {self.client!r}"
            )
        if self.kind not in FAILURE_KINDS:
            raise ValueError(
                f"ClientFailure.kind must be one of {sorted(FAILURE_KINDS)}, got {self.kind!r}"
            )


def failures_of(spec, num_clients: int) -> tuple[ClientFailure, ...]:
    """The injected failures: ``ClientFailure``s or ``(round, client, kind)`` tuples."""
    out = []
    for f in spec or ():
        g = f if isinstance(f, ClientFailure) else ClientFailure(*f)
        if g.client is not None and g.client >= num_clients:
            raise ValueError(
                f"an injected failure names client {g.client}, but the run has {num_clients} "
                "real clients (partition ids 0 … K − 1; canaries cannot be made to fail)"
            )
        out.append(g)
    return tuple(out)


@dataclass
class RoundRecord:
    """What one round released and used (numpy; the audit reads these)."""

    round: int
    before: np.ndarray
    after: np.ndarray | None = None
    cohort: list = field(default_factory=list)
    clip: float = float("nan")
    noise_clip: float = float("nan")
    sigma: float = float("nan")
    weights: list = field(default_factory=list)  # (node id, weight) the aggregation read
    canary_replies: dict = field(default_factory=dict)  # canary index -> block as received
    failed: dict = field(default_factory=dict)  # node id -> "raise" | "timeout" | "error: …"
    nonfinite: int = 0  # NaN/Inf values in the released model (all its arrays)

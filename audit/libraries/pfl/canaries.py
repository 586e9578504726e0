"""The canary users, the canary block and the observing postprocessor of the pfl audit
(:mod:`audit.libraries.pfl`, whose docstring says what travels and where it is read).
Split from it by responsibility: what is put into pfl's simulation here, what is concluded
from it in :mod:`audit.libraries.pfl.checks`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from audit.libraries.pfl.compat import (
    PFL_VERSION,
    CentrallyAppliedPrivacyMechanism,
    GaussianMechanism,
    LaplaceMechanism,
    LocalPrivacyMechanism,
    Metrics,
    Population,
    Postprocessor,
    TrainingProcessCallback,
    nn,
    torch,
)

__all__ = [
    "BLOCK_NAME",
    "CentrallyAppliedPrivacyMechanism",
    "GaussianMechanism",
    "LaplaceMechanism",
    "LocalPrivacyMechanism",
    "CANARY_PREFIX",
    "PFL_VERSION",
    "CanaryCallback",
    "CanaryModule",
    "CanaryObserver",
    "PflCanaries",
]

#: the canary users' ids in the federated data: f"{CANARY_PREFIX}{j}"
CANARY_PREFIX = "fedlora-audit-canary:"
#: the canary block's parameter name in the wrapped module (pfl's variable_map key)
BLOCK_NAME = "fedlora_audit_canary_block"


def _np(v) -> np.ndarray:
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().double().numpy()
    return np.asarray(v, dtype=np.float64)


class _Inject(torch.autograd.Function):
    """Zero in the forward pass; a constant gradient ``gain`` in the backward pass."""

    @staticmethod
    def forward(ctx, z, gain):
        ctx.gain = gain
        return torch.zeros_like(z)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, ctx.gain), None


class CanaryModule(nn.Module):
    """The user's module (with pfl's ``loss(*batch)`` and ``metrics(*batch)``) and the canary
    block. Every batch carries one more array, the canary id of each row (−1 for a real
    user's row, j for canary j's): real rows go to the user's ``loss``, canary rows only to
    the block (their loss term is 0, their gradient ``gain`` on coordinate j); ``metrics``
    sees every row (a canary row holds a real user's features)."""

    def __init__(self, module: nn.Module, m: int, gain: float) -> None:
        super().__init__()
        for need in ("loss", "metrics"):
            if not callable(getattr(module, need, None)):
                raise ValueError(f"the module needs pfl's `{need}(*batch)` method")
        self.module = module
        self.m = int(m)
        self.gain = float(gain)
        self.register_parameter(BLOCK_NAME, nn.Parameter(torch.zeros(self.m)))

    @property
    def block(self) -> nn.Parameter:
        return getattr(self, BLOCK_NAME)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @staticmethod
    def _split(batch):
        *data, cid = batch
        cid = torch.as_tensor(cid).long().view(-1)
        return data, cid

    def _canary_term(self, cid: torch.Tensor) -> torch.Tensor:
        w = self.block
        hot = nn.functional.one_hot(cid.clamp(min=0), self.m).to(w.dtype)
        hot = hot * (cid >= 0).unsqueeze(-1).to(w.dtype)
        return _Inject.apply((hot * w).sum(-1), -self.gain).sum()

    def loss(self, *batch, **kwargs):
        data, cid = self._split(batch)
        real = cid < 0
        total = self._canary_term(cid.to(self.block.device))
        if bool(real.all()):
            total = total + self.module.loss(*data, **kwargs)
        elif bool(real.any()):
            total = total + self.module.loss(*[d[real] for d in data], **kwargs)
        return total

    def metrics(self, *batch, **kwargs):
        # every row, canary rows included (they hold a real user's features): pfl adds the
        # users' metrics and refuses two users whose metric names differ; metrics move no
        # parameter
        data, _ = self._split(batch)
        return self.module.metrics(*data, **kwargs)


class CanaryObserver(Postprocessor):
    """pfl postprocessor (put it FIRST): its user step records who the sampler drew and each
    canary user's update before pfl's clipping; its server step, which pfl runs last,
    records the canary block of the noised sum, the total weight and the mechanism's
    parameters of the round."""

    def __init__(self, canaries: PflCanaries) -> None:
        self.canaries = canaries
        self.key: str | None = None
        self.mechanism = None
        self.rounds: list[dict] = []
        self._users: list = []
        self._raw: list[tuple] = []
        self.real_on_block = 0.0

    def postprocess_one_user(self, *, stats, user_context):
        uid = user_context.user_id
        self._users.append(uid)
        if self.key is not None and self.key in stats.keys():
            blk = _np(stats[self.key])
            j = self.canaries.canary_of(uid)
            if j is None:
                self.real_on_block = max(self.real_on_block, float(np.max(np.abs(blk))))
            else:
                rest = float(
                    sum(float(np.sum(_np(stats[k]) ** 2)) for k in stats.keys() if k != self.key)
                )
                off = np.delete(blk, j)
                self._raw.append(
                    (j, float(blk[j]), float(np.max(np.abs(off))) if off.size else 0.0, rest)
                )
        return stats, Metrics()

    def postprocess_server(self, *, stats, central_context, aggregate_metrics):
        if central_context.population != Population.TRAIN or self.key is None:
            return stats, Metrics()
        mech = self.mechanism
        clip = float(_param(mech.clipping_bound)) if mech is not None else math.nan
        if isinstance(mech, GaussianMechanism):
            noise = float(mech.relative_noise_stddev)
        elif isinstance(mech, LaplaceMechanism):
            # b / C: LaplaceMechanism has no public ε (pfl 0.6.0); read without failing the
            # user's training if a later pfl renames it (the audit then says it is unknown)
            eps = getattr(mech, "_epsilon", None)
            noise = 1.0 / float(eps) if eps else math.nan
        else:
            noise = math.nan
        self.rounds.append(
            {
                "users": list(self._users),
                "obs": _np(stats[self.key]).copy(),
                "weight": float(getattr(stats, "weight", math.nan)),
                "cohort_size": int(central_context.cohort_size),
                "clip": clip,
                "noise": noise,
                "raw": list(self._raw),
            }
        )
        self._users, self._raw = [], []
        return stats, Metrics()


def _param(v):
    from pfl.hyperparam import get_param_value

    return get_param_value(v)


class CanaryCallback(TrainingProcessCallback):
    """pfl callback (optional, ``run(callbacks=[canaries.callback])``): the released
    model's canary block before training and after every central iteration, to check that
    the release is the observed noised sum post-processed (:class:`PflAudit`)."""

    def __init__(self, canaries: PflCanaries) -> None:
        self.canaries = canaries
        self.blocks: list[np.ndarray] = []

    def _read(self) -> np.ndarray:
        return _np(self.canaries._module.block).copy()

    def on_train_begin(self, *, model):
        self.blocks = [self._read()] if self.canaries._module is not None else []
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        if self.blocks:
            self.blocks.append(self._read())
        return False, Metrics()


@dataclass
class PflCanaries:
    """M canary users for one pfl simulation: :meth:`users` on the federated data before
    building pfl's ``FederatedDataset``, :meth:`model` on the torch module before building
    pfl's ``PyTorchModel``, :attr:`postprocessor` first in the backend's postprocessors, then
    :func:`audit.libraries.pfl.attach`."""

    m: int = 20
    p_include: float = 0.5
    seed: int | None = None
    #: the canary rows' gradient on their coordinate (a canary user's update is about
    #: gain × rows × local steps × local learning rate, far past any clipping bound)
    gain: float = 1e6
    _module: CanaryModule | None = field(default=None, repr=False)
    _observer: CanaryObserver | None = field(default=None, repr=False)
    _callback: CanaryCallback | None = field(default=None, repr=False)
    user_ids: list = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.m < 2:
            raise ValueError(f"need at least two canary users, got m = {self.m}")
        if not 0 < self.p_include <= 1:
            raise ValueError(f"p_include must be in (0, 1], got {self.p_include}")
        if not (math.isfinite(self.gain) and self.gain > 0):
            raise ValueError(f"gain must be a positive number, got {self.gain}")
        rng = np.random.default_rng(self.seed)
        self.included = (
            np.ones(self.m, dtype=bool)
            if self.p_include == 1
            else rng.random(self.m) < self.p_include
        )
        self._observer = CanaryObserver(self)
        self._callback = CanaryCallback(self)

    @property
    def postprocessor(self) -> CanaryObserver:
        return self._observer

    @property
    def callback(self) -> CanaryCallback:
        return self._callback

    @property
    def population(self) -> int:
        """Users in the federated data :meth:`users` returned (real + included canaries)."""
        if not self.user_ids:
            raise ValueError("call PflCanaries.users(data) first")
        return len(self.user_ids)

    @staticmethod
    def canary_id(j: int) -> str:
        return f"{CANARY_PREFIX}{j}"

    def canary_of(self, uid) -> int | None:
        if isinstance(uid, str) and uid.startswith(CANARY_PREFIX):
            return int(uid[len(CANARY_PREFIX) :])
        return None

    def users(self, data: dict, template=None) -> dict:
        """The federated data (``{user_id: [array, ...]}``, pfl's ``from_slices`` format) with
        a canary-id array appended to every user's arrays and the included canary users
        added (their rows: a copy of user ``template``'s, default the first user's)."""
        if not isinstance(data, dict) or not data:
            raise ValueError("data must be a non-empty dict {user_id: [array, ...]}")
        clash = [u for u in data if self.canary_of(u) is not None]
        if clash:
            raise ValueError(f"user ids {clash[:3]} use the canaries' prefix {CANARY_PREFIX!r}")
        out = {}
        for uid, arrays in data.items():
            arrays = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
            n = len(arrays[0])
            if n == 0 or any(len(a) != n for a in arrays):
                raise ValueError(f"user {uid!r}: arrays must be non-empty and of one length")
            out[uid] = [*arrays, np.full(n, -1, dtype=np.int64)]
        tmpl = next(iter(data)) if template is None else template
        if tmpl not in data:
            raise ValueError(f"template user {tmpl!r} is not in data")
        base = out[tmpl][:-1]
        for j in np.flatnonzero(self.included):
            n = len(base[0])
            out[self.canary_id(int(j))] = [*(np.copy(a) for a in base), np.full(n, j, np.int64)]
        # the users in a random order: a sampler that walks the dict in order (pfl's
        # 'minimize_reuse' cycles it) reaches the canaries as soon as any user, not after
        # every real one (appended last, they were never drawn in a run shorter than a pass)
        keys = list(out)
        order = np.random.default_rng(None if self.seed is None else self.seed + 1).permutation(
            len(keys)
        )
        out = {keys[i]: out[keys[i]] for i in order}
        self.user_ids = list(out)
        return out

    def model(self, module: nn.Module) -> CanaryModule:
        self._module = CanaryModule(module, self.m, self.gain)
        return self._module

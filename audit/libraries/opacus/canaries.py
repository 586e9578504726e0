"""The canaries' records, block, model wrapper and loss wrapper (what travels Opacus's path).

* :class:`CanaryDataset` — the user's dataset with the included canary records after it;
* :class:`CanaryBlock` — the canaries' coordinates, a bias-free ``nn.Linear(M, 1)`` over
  the one-hot of the record's canary id (all zeros for a real record);
* :class:`CanaryModel` — the user's model with the block. Two routes for the canary's
  gradient, chosen by the audit from Opacus's mode:

  - *output* (flat, per-layer, adaptive clipping): the block's output is added to the
    model's output, forced to 0 in the forward pass, and its backward puts in a constant
    ``gain`` (≫ C): canary j's per-sample gradient is ``gain·n·e_j`` (Opacus multiplies the
    backprops by the batch size n under ``loss_reduction="mean"``), clipped by Opacus to C;
  - *loss* (ghost clipping): the block's output y enters the per-sample loss as the term
    ``gain·y − stop_gradient(gain·y)`` (:class:`CanaryLoss`): its forward value is exactly
    0, its gradient w.r.t. the block is ``gain·e_j`` for canary j and 0 for a real record.
    Opacus's second (reweighted) backward multiplies each per-sample loss by its clip
    factor, this term included, so the canary is clipped like a record.

* :class:`CanaryLoss` — wraps the user's criterion (``reduction`` honoured, ``"none"``
  included, as ``DPLossFastGradientClipping`` and opacus 1.5's ``double_backward`` call it)
  and adds the block's term to each record's loss;
* :class:`SamplerCanaries` — M canaries, their inclusion bits, and the factories above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

__all__ = [
    "CanaryBlock",
    "CanaryDataset",
    "CanaryLoss",
    "CanaryModel",
    "SamplerCanaries",
]


class CanaryDataset(torch.utils.data.Dataset):
    """The user's dataset and the included canary records after it: item i < N is
    ``(*base[i], -1)``, item N + k is ``(*base[template], ids[k])`` (a real record's
    features, which the model reads but whose gradient the canary rows do not carry). The
    last field is the canary id; ``ids`` defaults to every canary 0 … m − 1."""

    def __init__(self, base, m: int, template: int = 0, ids=None) -> None:
        if m < 1:
            raise ValueError(f"need at least one canary, got m = {m}")
        self.base, self.m, self.n = base, int(m), len(base)
        self.template = template
        self.ids = list(range(self.m)) if ids is None else [int(j) for j in ids]

    def __len__(self) -> int:
        return self.n + len(self.ids)

    def __getitem__(self, i: int):
        if i < 0:
            i += len(self)
        real = i < self.n
        item = self.base[i if real else self.template]
        item = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        return (*item, torch.tensor(-1 if real else self.ids[i - self.n], dtype=torch.long))


class _Inject(torch.autograd.Function):
    """Zero in the forward pass; a constant gradient ``gain`` in the backward pass."""

    @staticmethod
    def forward(ctx, z, gain):
        ctx.gain = gain
        return torch.zeros_like(z)

    @staticmethod
    def backward(ctx, g):
        return torch.full_like(g, ctx.gain), None


class CanaryBlock(nn.Module):
    """The canaries' coordinates: ``weight`` (1, M). ``route`` is ``"output"`` or
    ``"loss"`` (module doc); ``gain`` is a number or set per forward by ``gain_of()`` (the
    audit makes it follow Opacus's current clip, e.g. adaptive clipping's C_t)."""

    def __init__(self, m: int) -> None:
        super().__init__()
        self.m = m
        self.linear = nn.Linear(m, 1, bias=False)
        nn.init.zeros_(self.linear.weight)
        self.gain = 0.0
        self.gain_of = None
        self.route = "output"
        #: the loss route's term of the last forward (consumed by CanaryLoss)
        self.term: torch.Tensor | None = None

    def current_gain(self) -> float:
        return float(self.gain_of()) if self.gain_of is not None else float(self.gain)

    def forward(self, cid: torch.Tensor) -> torch.Tensor:
        hot = nn.functional.one_hot(cid.clamp(min=0), self.m).to(self.linear.weight.dtype)
        hot = hot * (cid >= 0).unsqueeze(-1).to(hot.dtype)
        y = self.linear(hot)
        gain = self.current_gain()
        if self.route == "loss":
            self.term = (gain * y - (gain * y).detach()).view(-1)  # value 0, gradient gain
            return _Inject.apply(y, 0.0)
        self.term = None
        return _Inject.apply(y, gain)


class CanaryModel(nn.Module):
    """The user's model with the canary block: ``forward(x, cid, **kwargs)`` calls
    ``model(x, **kwargs)`` (a Hugging Face / PEFT model's output: its ``.logits``). Rows with
    ``cid >= 0`` are canaries: their outputs are detached (no gradient reaches the user's
    parameters) and the block adds exactly 0 to every output. Records, for every training
    forward, the canary ids (the sampler's decisions) and a fingerprint of the batch (a
    forward that reads the step's batch twice)."""

    def __init__(self, model: nn.Module, m: int) -> None:
        super().__init__()
        self.model = model
        self.canary = CanaryBlock(m)
        self._seen: list[torch.Tensor] = []
        self._prints: list[tuple] = []
        self.terms_made = 0
        self.terms_used = 0

    def forward(self, x, cid: torch.Tensor, **kwargs):
        out = self.model(x, **kwargs)
        if not isinstance(out, torch.Tensor) and hasattr(out, "logits"):
            out = out.logits  # a Hugging Face / PEFT model's output
        is_c = (cid >= 0).view(-1, *([1] * (out.dim() - 1)))
        out = torch.where(is_c, out.detach(), out)
        block = self.canary(cid)
        if self.training and torch.is_grad_enabled():
            ids = cid[cid >= 0].detach().cpu()
            self._seen.append(ids)
            self._prints.append(batch_fingerprint(x, cid))
            self.terms_made += self.canary.route == "loss"
        return out + block.view(-1, *([1] * (out.dim() - 1)))

    def take_term(self, n: int) -> torch.Tensor | None:
        """The loss route's term of the last forward when it has ``n`` rows (else None)."""
        t = self.canary.term
        if t is None or t.numel() != n:
            return None
        self.canary.term = None
        self.terms_used += bool(self.training and torch.is_grad_enabled())
        return t


def batch_fingerprint(x, cid: torch.Tensor) -> tuple:
    """(rows, shape, canary ids, a checksum of the inputs): equal for a batch read twice."""
    ids = tuple(int(c) for c in cid.detach().cpu().view(-1).tolist())
    if isinstance(x, torch.Tensor):
        xs = x.detach()
        s = float(xs.double().sum()) if xs.numel() else 0.0
        return (len(ids), tuple(xs.shape), ids, s)
    return (len(ids), None, ids, None)


class CanaryLoss(nn.Module):
    """The user's criterion with the canary block's term added to each record's loss
    (ghost clipping: module doc). ``reduction`` is the criterion's (``"mean"``, ``"sum"``
    or ``"none"``); ``DPLossFastGradientClipping`` sets it to ``"none"`` for the per-sample
    losses. A per-sample loss whose rows are not the batch's (a per-token loss) gets no
    term: the audit then says the canaries did not travel (clipping and sampling untested)."""

    def __init__(self, criterion: nn.Module, model: CanaryModel) -> None:
        super().__init__()
        self.criterion = criterion
        self.canaried = model
        self.reduction = getattr(criterion, "reduction", "mean")

    def forward(self, input, target, *args, **kwargs):
        old = getattr(self.criterion, "reduction", None)
        self.criterion.reduction = "none"
        try:
            per = self.criterion(input, target, *args, **kwargs)
        finally:
            if old is not None:
                self.criterion.reduction = old
        term = self.canaried.take_term(per.shape[0]) if per.dim() == 1 else None
        if term is not None:
            per = per + term.to(per.dtype)
        if self.reduction == "none":
            return per
        return per.sum() if self.reduction == "sum" else per.mean()


@dataclass
class SamplerCanaries:
    """M sampler canaries for one Opacus training. Use :meth:`dataset` and :meth:`model`
    before ``make_private`` (ghost clipping: :meth:`criterion` too), :meth:`max_grad_norms`
    for per-layer clipping, then :func:`attach` (or :meth:`attach`) on what
    ``make_private`` returned."""

    m: int = 64
    gain_factor: float = 100.0
    #: each canary's record enters the dataset with this probability (its inclusion bit,
    #: drawn from the OS's entropy unless ``seed`` is given; the excluded canaries'
    #: coordinates are observed too: the one-run ε lower bound compares the two); 1: all in
    p_include: float = 0.5
    seed: int | None = None
    _model: CanaryModel | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.p_include <= 1:
            raise ValueError(f"p_include must be in (0, 1], got {self.p_include}")
        rng = np.random.default_rng(self.seed)
        self.included = (
            np.ones(self.m, dtype=bool)
            if self.p_include == 1
            else rng.random(self.m) < self.p_include
        )

    def dataset(self, base, template: int = 0) -> CanaryDataset:
        return CanaryDataset(base, self.m, template, ids=np.flatnonzero(self.included))

    def model(self, model: nn.Module) -> CanaryModel:
        self._model = CanaryModel(model, self.m)
        return self._model

    def criterion(self, criterion: nn.Module | None = None) -> CanaryLoss:
        """The loss to hand ``make_private(..., criterion=...)`` in ghost clipping mode (or
        to call with ``reduction="none"`` for opacus 1.5's ``double_backward``): the user's
        criterion (default ``nn.CrossEntropyLoss()``) plus the canary block's term."""
        if self._model is None:
            raise ValueError("call SamplerCanaries.model(model) before criterion(...)")
        return CanaryLoss(
            criterion if criterion is not None else nn.CrossEntropyLoss(), self._model
        )

    def max_grad_norms(self, norms: list[float], canary_norm: float | None = None) -> list:
        """Per-layer clipping: the user's norms (one per user parameter, in
        ``model.parameters()`` order) and the canary block's (default: the largest)."""
        return [*map(float, norms), float(canary_norm if canary_norm else max(norms))]

    def attach(self, privacy_engine, optimizer, data_loader):
        from audit.libraries.opacus.recorder import OpacusAudit

        if self._model is None:
            raise ValueError("call SamplerCanaries.model(model) before make_private")
        return OpacusAudit(self, privacy_engine, optimizer, data_loader)

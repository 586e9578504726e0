"""The local step's parts: a *privatizer* (:class:`DpSgd`: flat clipping + noise,
:mod:`fl.privacy.dpsgd`; :class:`SpaceDpSgd`: a method's own space, e.g. FedASK's
W-space, :mod:`fl.privacy.wspace`; or :class:`NoPrivacy`), then the *post-privacy hooks*
(:class:`GradMask`, :class:`Prox`, :class:`Correction`) in order. :func:`local_step`
builds them from the arguments of ``ClientContext.train``; :class:`fl.run.trainer.LocalTrainer`
runs them around each optimizer step.

After each backward pass: hook.pre (on the raw per-sample gradients), the privatizer
(sets every trainable parameter's released ``.grad``), hook.post in list order
(post-processing of the released gradient: data-independent terms and masks), the
optimizer step, hook.after_step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fl.errors import UsageError
from fl.privacy.dpsgd import DpSgdParams, clip_and_noise


class NoPrivacy:
    """No DP: the plain (mean-reduced) gradient; an empty batch gives a zero gradient."""

    per_sample = False

    def __call__(self, params: list[torch.nn.Parameter], batch_size: int) -> dict | None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return None


@dataclass
class DpSgd:
    """Sample-level DP-SGD in the parameters' own space: joint flat clipping and
    Gaussian noise (:func:`fl.privacy.dpsgd.clip_and_noise`). ``noise``: the secret
    noise stream."""

    dp: DpSgdParams
    noise: object
    per_sample = True
    #: bool over the flattened coordinates of the trained parameters, True on the head's
    #: (set by :meth:`start`; used when ``dp.head_share`` > 0)
    head_cols: torch.Tensor | None = None
    #: this local training's gradient canaries (``--canary-kind gradient``:
    #: :class:`fl.privacy.gradient_canaries.ClientCanaries`, set by the trainer); None
    #: on every other run
    canaries: object | None = None
    #: a planted fault (``--inject-fault``, tests only:
    #: :class:`fl.privacy.dpsgd.StepFault`, set by the trainer); None on every real run
    fault: object | None = None

    def start(self, params: list[torch.nn.Parameter], names: list[str]) -> None:
        """Once per local training: which coordinates belong to the head."""
        if self.dp.head_share > 0:
            self.head_cols = torch.cat(
                [
                    torch.full((p.numel(),), nm.startswith("head/"), dtype=torch.bool)
                    for p, nm in zip(params, names)
                ]
            )

    def __call__(self, params: list[torch.nn.Parameter], batch_size: int) -> dict:
        if batch_size == 0:
            for p in params:
                p.grad_sample = None
        if self.fault is not None:  # a planted fault (tests only)
            return clip_and_noise(
                params, self.dp, self.noise, batch_size, self.head_cols, self.canaries, self.fault
            )
        if self.canaries is None:  # the default path: the call as it always was
            return clip_and_noise(params, self.dp, self.noise, batch_size, self.head_cols)
        return clip_and_noise(
            params, self.dp, self.noise, batch_size, self.head_cols, canaries=self.canaries
        )


@dataclass
class SpaceDpSgd:
    """Sample-level DP-SGD in a method's own space: ``transform(params, dp, noise, b)``
    (e.g. :class:`fl.privacy.wspace.WSpaceClipper`, FedASK's W-space clipping) sets
    the released ``.grad`` of every parameter and returns the step's stats."""

    dp: DpSgdParams
    noise: object
    transform: object
    per_sample = True
    #: a planted noise factor (``--inject-fault``, tests only: the transform's noise
    #: multiplier times this; set by the trainer); None on every real run
    fault_noise_scale: float | None = None
    #: this local training's gradient canaries (``--canary-kind gradient``, set by the
    #: trainer when the transform takes them: its ``canary_space``); None otherwise
    canaries: object | None = None

    def __call__(self, params: list[torch.nn.Parameter], batch_size: int) -> dict:
        if self.fault_noise_scale is not None:
            dp = replace(
                self.dp, noise_multiplier=self.dp.noise_multiplier * self.fault_noise_scale
            )
            if self.canaries is not None:
                return self.transform(params, dp, self.noise, batch_size, canaries=self.canaries)
            return self.transform(params, dp, self.noise, batch_size)
        if self.canaries is not None:
            return self.transform(params, self.dp, self.noise, batch_size, canaries=self.canaries)
        return self.transform(params, self.dp, self.noise, batch_size)

    def end_pass(self) -> None:
        """A forward/backward pass of the step ended (see :meth:`LocalTrainer.run`)."""
        end = getattr(self.transform, "end_pass", None)
        if end is not None:
            end()


class Hook:
    """A post-privacy hook; every method is optional. ``names``: the flat state keys
    of ``params`` (``factors/<layer>/<A|B>``, ``head/<name>``)."""

    def start(self, params: list[torch.nn.Parameter], names: list[str]) -> None:
        """Once, before the first step."""

    def pre(self, params: list[torch.nn.Parameter]) -> None:
        """After backward, before the privatizer."""

    def post(self, params: list[torch.nn.Parameter]) -> None:
        """After the privatizer (on the released ``.grad``)."""

    def after_step(self, params: list[torch.nn.Parameter]) -> None:
        """After the optimizer step."""


class GradMask(Hook):
    """Freeze the coordinates where ``mask`` (flat state key → 0/1 tensor of the
    parameter's shape) is 0: they are excluded from the per-sample norm (``pre``: so
    they cost no clipping budget), their released gradient is zeroed (``post``:
    post-processing) and, since AdamW's decoupled weight decay ignores gradients,
    they are restored after every optimizer step."""

    def __init__(self, mask: dict[str, torch.Tensor]):
        self.mask = mask
        self.masks: list[torch.Tensor | None] = []
        self.frozen: list[torch.Tensor] = []

    def start(self, params, names):
        self.masks = [
            None if (mk := self.mask.get(nm)) is None else mk.to(p.device, p.dtype)
            for p, nm in zip(params, names)
        ]
        self.frozen = [p.detach().clone() for p in params]

    def pre(self, params):
        for p, mk in zip(params, self.masks):
            if mk is None:
                continue
            if getattr(p, "grad_sample", None) is not None:
                p.grad_sample = p.grad_sample * mk
            if p.grad is not None:
                p.grad.mul_(mk)

    def post(self, params):
        for p, mk in zip(params, self.masks):
            if mk is not None and p.grad is not None:
                p.grad.mul_(mk)

    @torch.no_grad()
    def after_step(self, params):
        for p, mk, p0 in zip(params, self.masks, self.frozen):
            if mk is not None:
                p.copy_(mk * p + (1 - mk) * p0)

    def again(self) -> Hook:
        """A hook that only re-applies the mask to the gradient (after data-independent
        terms such as FedProx's or SCAFFOLD's, which would move frozen coordinates)."""
        outer = self

        class _Remask(Hook):
            def post(self, params):
                for p, mk in zip(params, outer.masks):
                    if mk is not None:
                        p.grad.mul_(mk)

        return _Remask()


class Prox(Hook):
    """FedProx: add μ(θ − θ_start), the gradient of μ/2‖θ − θ_start‖² (data-independent,
    so added after privatization)."""

    def __init__(self, mu: float):
        self.mu = mu
        self.start_vals: list[torch.Tensor] = []

    def start(self, params, names):
        self.start_vals = [p.detach().clone() for p in params]

    def post(self, params):
        for p, p0 in zip(params, self.start_vals):
            p.grad.add_(p.detach() - p0, alpha=self.mu)


class Correction(Hook):
    """SCAFFOLD: add the control-variate correction c − c_i (flat state key → tensor;
    keys not trained are ignored), after privatization."""

    def __init__(self, correction: dict[str, torch.Tensor]):
        self.correction = correction
        self.names: list[str] = []

    def start(self, params, names):
        self.names = list(names)

    def post(self, params):
        for p, nm in zip(params, self.names):
            if nm in self.correction:
                p.grad.add_(self.correction[nm].to(p.device, p.dtype))


def local_step(
    dp: DpSgdParams | None,
    noise,
    prox_mu: float = 0.0,
    correction: dict[str, torch.Tensor] | None = None,
    grad_transform=None,
    grad_mask: dict[str, torch.Tensor] | None = None,
) -> tuple[object, list[Hook]]:
    """(privatizer, hooks) for the arguments of ``ClientContext.train``: DP-SGD (flat,
    or in ``grad_transform``'s space) or none, then mask, prox, correction, and the mask
    again when a data-independent term was added."""
    if dp is None:
        privatizer = NoPrivacy()
    elif grad_transform is not None:
        if dp.head_share > 0:
            raise UsageError(
                "head_clip_share splits DP-SGD's flat per-example clip; this method clips "
                "in its own space (FedASK's W-space clipping) and cannot split it"
            )
        privatizer = SpaceDpSgd(dp, noise, grad_transform)
    else:
        privatizer = DpSgd(dp, noise)
    hooks: list[Hook] = []
    mask = GradMask(grad_mask) if grad_mask else None
    if mask is not None:
        hooks.append(mask)
    if prox_mu > 0:
        hooks.append(Prox(prox_mu))
    if correction is not None:
        hooks.append(Correction(correction))
    if mask is not None and (prox_mu > 0 or correction is not None):
        hooks.append(mask.again())
    return privatizer, hooks

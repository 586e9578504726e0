"""What the audit places in a local training: :class:`TrainerProbes`, a mixin of
:class:`fl.run.trainer.LocalTrainer`.

The run's gradient canaries handed to the DP-SGD privatizer
(:mod:`fl.privacy.gradient_canaries`), the sampler canaries drawn with the batches
(:mod:`fl.privacy.sampler_canaries`), and the planted faults of ``--inject-fault`` (tests
only: auditing the auditor) with the noise factor they apply.
"""

from __future__ import annotations

import torch

from fl.errors import UsageError
from fl.privacy.sampler_canaries import SamplerCanaries
from fl.run.local_step import DpSgd

__all__ = ["TrainerProbes", "noise_factor"]


def noise_factor(privatizer) -> float:
    """The planted noise factor of a privatizer (``--inject-fault noise_scale``, tests
    only; 1 on every real run), applied to the sampler canaries' noise as to the rest."""
    fault = getattr(privatizer, "fault", None)
    if fault is not None:
        return float(getattr(fault, "noise_scale", 1.0))
    return float(getattr(privatizer, "fault_noise_scale", None) or 1.0)


class TrainerProbes:
    """The local training's canaries and planted faults. A mixin: it uses the trainer's
    ``cfg``, ``gradient_canaries`` and ``sampler_out``."""

    def _begin_sampler(self, privatizer, q: float):
        """The sampler canaries of this local training (:mod:`fl.privacy.sampler_canaries`),
        or None (the default path, and every training without DP-SGD). Their coordinates
        sit beside the privatizer's own (flat or a method's space): they take its σ, C and
        noise stream."""
        m = int(getattr(self.cfg, "sampler_canaries", 0) or 0)
        if m <= 0 or self.sampler_out is None or not getattr(privatizer, "per_sample", False):
            return None
        parts = getattr(privatizer.noise, "parts", None) or ()
        if len(parts) < 4 or parts[0] != "dpsgd-noise":
            raise RuntimeError("sampler canaries need the run's DP-SGD noise stream")
        return SamplerCanaries(
            m=m,
            clip=float(privatizer.dp.clip),
            sigma=float(privatizer.dp.noise_multiplier),
            meta={
                "round": int(parts[1]),
                "client": str(parts[2]),
                "stage": str(parts[3]),
                "attempt": int(parts[5]) if len(parts) >= 6 and parts[4] == "attempt" else 0,
                "sigma": float(privatizer.dp.noise_multiplier),
                "clip": float(privatizer.dp.clip),
                "q": float(q),
            },
        )

    def _begin_canaries(self, privatizer, params, names, q: float, steps: int):
        """The gradient canaries of this local training, handed to the DP-SGD privatizer
        (:mod:`fl.privacy.gradient_canaries`); None without them (the default path) or
        without DP-SGD. A privatizer in a method's own space takes them when its transform
        says in which space they live (``canary_space``: FedASK's W-space clipping,
        :mod:`fl.privacy.wspace`); any other is refused."""
        gc = self.gradient_canaries
        if gc is None or not getattr(privatizer, "per_sample", False):
            return None
        space = None
        if not isinstance(privatizer, DpSgd):
            space = getattr(getattr(privatizer, "transform", None), "canary_space", None)
            if space is None:
                raise UsageError(
                    "gradient canaries enter DP-SGD's flat clipped sum or FedASK's W-space "
                    "sum; this method privatizes in another space of its own: use input "
                    "canaries"
                )
        dp = privatizer.dp
        cc = gc.begin(
            privatizer.noise, params, names, q, steps, dp.clip, dp.noise_multiplier, space=space
        )
        privatizer.canaries = cc
        return cc

    def _plant_fault(self, privatizer, params, names):
        """PLANTED FAULT (``--inject-fault``, tests only: auditing the auditor): hand this
        local training's fault to its DP-SGD privatizer (:class:`fl.privacy.dpsgd.
        StepFault`, or a noise factor for a method's own space). Returns what was planted
        (the fault's name for ``fixed_batches``, which :meth:`run` applies to the batches),
        or None when the fault is not a local-step fault or the training has no DP-SGD."""
        from fl.privacy.dpsgd import StepFault
        from fl.run.config import FAULT_SERVER, parse_fault
        from fl.run.local_step import SpaceDpSgd

        name, value = parse_fault(self.cfg.inject_fault, self.cfg.dp_level, self.cfg.method)
        if name == FAULT_SERVER or not getattr(privatizer, "per_sample", False):
            return None
        if name == "fixed_batches":
            return name
        scale = {"noise_scale": value, "fedask_stage1_unnoised": 0.0}.get(name)
        scale = None if scale is None else float(scale)
        if isinstance(privatizer, SpaceDpSgd):
            if scale is None:
                raise UsageError(
                    f"inject_fault {name} is planted in the flat DP-SGD step; this method "
                    "privatizes in its own space (FedASK: use --opt clip_space=b)"
                )
            privatizer.fault_noise_scale = scale
            return privatizer
        fault = StepFault(noise_scale=1.0 if scale is None else scale)
        fault.no_clip = name == "no_clip"
        fault.reuse = name == "noise_reuse"
        if name in ("head_unnoised", "factor_unnoised"):
            fault.unnoised = torch.cat(
                [
                    torch.full(
                        (p.numel(),),
                        nm.startswith("head/")
                        if name == "head_unnoised"
                        else nm.startswith("factors/") and nm.endswith("/" + value),
                        dtype=torch.bool,
                    )
                    for p, nm in zip(params, names)
                ]
            )
        privatizer.fault = fault
        return fault

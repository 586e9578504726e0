""":class:`OpacusAudit`: what the canaries saw at every noised step of an Opacus training.

Wraps the optimizer's ``add_noise`` (Opacus's own, whatever its class): right before it,
the canary block's clipped sum (``summed_grad``); right after it, the block's privatized
sum (before ``scale_grad`` divides by the expected batch size); with them the coins (the
canary ids the forwards since the last noised step read), whether one forward re-read the
step's batch, the σ the optimizer holds (what Opacus's accountant reads), the σ its noise
used (adaptive clipping: σ_eff), the canary's clip and the clip the noise is scaled by (C_t
at that step: adaptive clipping moves it) and Opacus's ``accumulated_iterations``. One row
per optimizer step that adds noise (a ``BatchMemoryManager`` virtual step or a skipped step
adds none). :meth:`OpacusAudit.audit` is :func:`audit.libraries.opacus.verdict.audit_run`.
"""

from __future__ import annotations

import numpy as np

from audit.libraries.opacus.versions import (
    adaclip_optimizer_class,
    adaclip_overwrites_sigma,
    check_version,
    ghost_optimizer_class,
)

__all__ = ["OpacusAudit", "adjusted_sigma"]


def adjusted_sigma(sigma: float, unclipped_num_std: float) -> float:
    """AdaClip's σ_eff = (σ⁻² − (2σ_u)⁻²)^(−1/2) of the gradient noise (Andrew et al. 2021,
    Theorem 1: with the clip count noised at σ_u the pair is as private as σ alone)."""
    if sigma <= 0:
        return 0.0
    return float((sigma**-2 - (2 * unclipped_num_std) ** -2) ** -0.5)


def _user_sigma(held: float, unclipped_num_std: float) -> float:
    """The σ the user passed, from the σ_eff an AdaClip optimizer of opacus ≤ 1.5 holds."""
    if held <= 0:
        return 0.0
    return float((held**-2 + (2 * unclipped_num_std) ** -2) ** -0.5)


class OpacusAudit:
    """Records the canary block's privatized sums after every ``add_noise`` and audits them
    (:meth:`audit`)."""

    def __init__(self, canaries, privacy_engine, optimizer, data_loader):
        self.version = check_version()
        from opacus.data_loader import DPDataLoader
        from opacus.optimizers.optimizer import DPOptimizer
        from opacus.optimizers.perlayeroptimizer import DPPerLayerOptimizer

        ghost_cls = ghost_optimizer_class()
        ada_cls = adaclip_optimizer_class()
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError(
                f"attach the optimizer make_private returned (a DPOptimizer), got "
                f"{type(optimizer).__name__}"
            )
        self.canaries, self.engine, self.optimizer = canaries, privacy_engine, optimizer
        self.model = canaries._model
        block = self.model.canary.linear.weight
        idx = [i for i, p in enumerate(optimizer.params) if p is block]
        if not idx:
            raise ValueError(
                "the canary block is not among the optimizer's parameters: build the "
                "optimizer on SamplerCanaries.model(...)'s parameters before make_private"
            )
        self._block = block
        factor = float(canaries.gain_factor)
        can = self.model.canary
        can.route = "output"
        self.sigma_user = None  # adaptive clipping: the σ the user passed
        self.adaclip_holds_adjusted = False
        if ghost_cls is not None and isinstance(optimizer, ghost_cls):
            self.mode = "ghost"
            can.route = "loss"
            can.gain_of = lambda: factor * float(optimizer.max_grad_norm)
        elif isinstance(optimizer, DPPerLayerOptimizer):
            self.mode = "per_layer"
            c_can = float(optimizer.max_grad_norms[idx[0]])
            can.gain_of = lambda: factor * c_can
        elif ada_cls is not None and isinstance(optimizer, ada_cls):
            self.mode = "adaptive"
            can.gain_of = lambda: factor * float(optimizer.max_grad_norm)
            self.adaclip_holds_adjusted = adaclip_overwrites_sigma(type(optimizer))
            held = float(optimizer.noise_multiplier)
            su = float(optimizer.unclipped_num_std)
            self.sigma_user = _user_sigma(held, su) if self.adaclip_holds_adjusted else held
        else:
            self.mode = "flat"
            can.gain_of = lambda: factor * float(optimizer.max_grad_norm)
        self._per_layer_clip = (
            float(optimizer.max_grad_norms[idx[0]]) if self.mode == "per_layer" else None
        )
        self.clip_c = self._canary_clip()
        self.poisson = isinstance(data_loader, DPDataLoader)
        self.dataset_size = len(data_loader.dataset)
        self.loader_len = len(data_loader)
        self.obs: list[np.ndarray] = []
        self.sums: list[np.ndarray] = []
        self.coins: list[np.ndarray] = []
        self.sigmas: list[float] = []
        self.noise_sigmas: list[float] = []
        self.noise_c: list[float] = []
        self.clips: list[float] = []
        self.repeats: list[int] = []
        self.iterations: list[int] = []
        self.model._seen.clear()
        self.model._prints.clear()
        orig = optimizer.add_noise

        def add_noise():
            summed = block.summed_grad.detach().reshape(-1).double().cpu().numpy().copy()
            c_t = self._canary_clip()
            c_noise = float(optimizer.max_grad_norm)
            orig()
            self.obs.append(block.grad.detach().reshape(-1).double().cpu().numpy().copy())
            self.sums.append(summed)
            row = np.zeros(self.canaries.m, dtype=bool)
            for c in self.model._seen:
                row[c.numpy()] = True
            prints = [p for p in self.model._prints if p[0] > 0]
            self.repeats.append(len(prints) - len(set(prints)))
            self.model._seen.clear()
            self.model._prints.clear()
            self.coins.append(row)
            self.sigmas.append(float(optimizer.noise_multiplier))
            self.noise_sigmas.append(self._noise_sigma())
            self.noise_c.append(c_noise)
            self.clips.append(c_t)
            self.iterations.append(int(getattr(optimizer, "accumulated_iterations", 1)))

        optimizer.add_noise = add_noise

    def _canary_clip(self) -> float:
        """The canary's clip now: the canary block's own norm (per-layer), else Opacus's C."""
        if self._per_layer_clip is not None:
            return self._per_layer_clip
        return float(self.optimizer.max_grad_norm)

    def _noise_sigma(self) -> float:
        """The σ Opacus's noise used at this step (adaptive clipping: σ_eff)."""
        o = self.optimizer
        if self.mode == "adaptive":
            held = float(o.noise_multiplier)
            return (
                held if self.adaclip_holds_adjusted else adjusted_sigma(held, o.unclipped_num_std)
            )
        return float(getattr(o, "_adjusted_noise_multiplier", o.noise_multiplier))

    # --- what the run used

    def run_mechanism(self) -> dict:
        """σ, C, q, steps and sampling as the run used them (the package doc)."""
        hist = list(getattr(self.engine.accountant, "history", []))
        rates = sorted({float(h[1]) for h in hist}) or [1.0 / self.loader_len]
        acc_sigmas = sorted({float(h[0]) for h in hist})
        held = sorted(set(self.sigmas)) or [float(self.optimizer.noise_multiplier)]
        if self.mode == "adaptive":
            sigmas = [float(self.sigma_user)]
        else:
            sigmas = held
        clips = self.clips or [self.clip_c]
        run = {
            "noise_multiplier": sigmas[0] if len(sigmas) == 1 else sigmas,
            "clipping_norm": float(
                self.noise_c[0]
                if self.mode == "adaptive" and self.noise_c
                else self.optimizer.max_grad_norm
            ),
            "sample_rate": rates[0] if len(rates) == 1 else rates,
            "steps": len(self.obs),
            "sampling": "poisson" if self.poisson else "shuffle",
            "dataset_size": self.dataset_size,
            "mode": self.mode,
            "canaries": self.canaries.m,
            "canary_clip": float(clips[0]) if len(set(clips)) == 1 else [min(clips), max(clips)],
            "optimizer_noise_multiplier": held[0] if len(held) == 1 else held,
            "accountant_noise_multiplier": (
                None if not acc_sigmas else acc_sigmas[0] if len(acc_sigmas) == 1 else acc_sigmas
            ),
            "noise_noise_multiplier": (
                float(np.min(self.noise_sigmas)) if self.noise_sigmas else None
            ),
            "opacus_version": self.version,
        }
        if self.mode == "adaptive":
            run["clip_per_step"] = [float(c) for c in self.noise_c]
            run["unclipped_num_std"] = float(self.optimizer.unclipped_num_std)
            run["adaclip_holds_adjusted_sigma"] = self.adaclip_holds_adjusted
        return run

    def observations(self) -> dict:
        """(T, M) arrays: the block's privatized sums (``obs``), its clipped sums before the
        noise (``sums``), the coins (``coins``, from the forwards); (T,) the canary's clip
        (``clips``) and the clip the noise was scaled by (``noise_c``) at each step."""
        m = self.canaries.m
        return {
            "obs": np.array(self.obs).reshape(-1, m),
            "sums": np.array(self.sums).reshape(-1, m),
            "coins": np.array(self.coins).reshape(-1, m),
            "clips": np.array(self.clips, dtype=float),
            "noise_c": np.array(self.noise_c, dtype=float),
        }

    def audit(self, claim, *, alpha: float = 0.05, permutations: int = 19_999, seed=None) -> dict:
        """The claim check, the conformance tests, the sampling tests, the coverage and the
        implied ε of this run against ``claim`` (:func:`audit.libraries.opacus.verdict.
        audit_run`). ``verdict`` is ``"pass"``, ``"incomplete"`` (exit 4) or ``"fail"``."""
        from audit.libraries.opacus.verdict import audit_run

        return audit_run(self, claim, alpha=alpha, permutations=permutations, seed=seed)

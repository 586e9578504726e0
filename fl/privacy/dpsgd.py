"""Sample-level DP-SGD: per-sample clipping and Gaussian noise.

Per-sample gradients come from Opacus (``GradSampleModule``, hooks mode): after a
backward pass on a sum-reduced loss each trainable parameter has ``grad_sample``
(batch × param shape). This module clips them jointly (one ℓ2 norm over all
trainable parameters per example, the standard flat clipping of DP-SGD), sums,
adds N(0, (σC)²) to every coordinate and divides by the *expected* batch size q·n
(a data-independent constant, required for the Poisson-sampling analysis).

A per-example gradient whose norm is NaN or Inf contributes zero: a non-finite norm
must never pass the clipping test as "small".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fl.privacy.rng import draw_normal


@dataclass(frozen=True)
class DpSgdParams:
    noise_multiplier: float  # σ
    clip: float  # C (ℓ2 bound on each example's gradient)
    sample_rate: float  # q: Poisson inclusion probability of each example per step
    expected_batch: float  # q · n (the normalizer)

    def __post_init__(self):
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ValueError(f"noise multiplier must be >= 0, got {self.noise_multiplier}")
        if not (self.clip > 0 and math.isfinite(self.clip)):
            raise ValueError(f"clipping bound must be > 0, got {self.clip}")
        if not (0 < self.sample_rate <= 1):
            raise ValueError(f"sample rate must be in (0, 1], got {self.sample_rate}")


def gaussian_noise(
    shape: tuple[int, ...],
    std: float,
    source,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """N(0, std²) noise of ``shape`` from ``source``: a :class:`fl.privacy.rng.NoiseSource`
    (a run's keyed CSPRNG stream) or a plain ``torch.Generator`` (simulations)."""
    return draw_normal(source, shape, std, dtype, device)


def per_sample_norms(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """‖g_i‖₂ over all ``params`` jointly, per example i (shape: batch)."""
    sq = None
    for p in params:
        gs = p.grad_sample
        v = gs.reshape(gs.shape[0], -1).float().pow(2).sum(dim=1)
        sq = v if sq is None else sq + v
    return sq.sqrt()


def clip_factors(norms: torch.Tensor, clip: float) -> tuple[torch.Tensor, dict]:
    """Per-example clipping factors c_i = min(1, C / ‖g_i‖) from the per-example norms
    (an example with a non-finite norm gets 0), and the step's stats: mean per-sample
    norm, fraction clipped, examples dropped as non-finite."""
    finite = torch.isfinite(norms)
    factor = torch.where(
        finite,
        torch.clamp(clip / (norms + 1e-6), max=1.0),
        torch.zeros_like(norms),
    )
    stats = {
        "mean_norm": float(norms[finite].mean()) if finite.any() else float("nan"),
        "frac_clipped": float((norms[finite] > clip).float().mean()) if finite.any() else 0.0,
        "nonfinite": int((~finite).sum()),
    }
    return factor, stats


def clipped_sum(p: torch.nn.Parameter, factor: torch.Tensor | None) -> torch.Tensor:
    """Σ_i c_i g_i of one parameter (non-finite entries of ``grad_sample`` count as 0);
    zeros when ``factor`` is None (an empty batch)."""
    if factor is None:
        return torch.zeros_like(p)
    gs = p.grad_sample
    gs = torch.where(torch.isfinite(gs), gs, torch.zeros_like(gs))
    return torch.einsum("i,i...->...", factor.to(gs.dtype), gs)


def set_noisy_grad(
    p: torch.nn.Parameter, summed: torch.Tensor, noise: torch.Tensor, dp: DpSgdParams
) -> None:
    """The released gradient: ``p.grad = (summed + noise) / (q·n)``; clears
    ``p.grad_sample``."""
    p.grad = ((summed + noise.to(summed.dtype)) / dp.expected_batch).to(p.dtype)
    p.grad_sample = None


def clip_and_noise(
    params: list[torch.nn.Parameter],
    dp: DpSgdParams,
    generator,
    batch_size: int,
) -> dict:
    """Replace each param's ``.grad`` with (Σ_i clip(g_i) + N(0, σ²C²I)) / (q·n).

    ``batch_size`` is the realized Poisson batch (may be 0: then only noise).
    Returns stats: mean per-sample norm, fraction clipped, examples dropped as
    non-finite.
    """
    stats = {"mean_norm": 0.0, "frac_clipped": 0.0, "nonfinite": 0}
    factor = None
    if batch_size > 0:
        factor, stats = clip_factors(per_sample_norms(params), dp.clip)
    std = dp.noise_multiplier * dp.clip
    for p in params:
        summed = clipped_sum(p, factor)
        noise = gaussian_noise(tuple(p.shape), std, generator, p.dtype, p.device)
        set_noisy_grad(p, summed, noise, dp)
    return stats

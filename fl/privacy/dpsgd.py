"""Sample-level DP-SGD: per-sample clipping and Gaussian noise.

Per-sample gradients come from Opacus (``GradSampleModule``, hooks mode): after a
backward pass on a sum-reduced loss each trainable parameter has ``grad_sample``
(batch × param shape). This module clips them jointly (one ℓ2 norm over all
trainable parameters per example, the standard flat clipping of DP-SGD), sums,
adds N(0, (σC)²) to every coordinate and divides by the *expected* batch size q·n
(a data-independent constant, required for the Poisson-sampling analysis).

A per-example gradient whose norm is NaN or Inf contributes zero: a non-finite norm
must never pass the clipping test as "small".

One fused step (:func:`clip_and_noise`): the per-sample gradients of all trainable
parameters are concatenated into one (batch × D) matrix, so the step is a handful of
large operations whatever the number of parameters — one norm per example, one clip
factor vector, one matrix-vector product Σ_i c_i g_i, one noise vector added — instead
of a dozen small ones per parameter. The step's statistics stay on the parameters'
device as 0-dim tensors (:class:`DpStats` accumulates them; reading them once per local
training is the only host synchronization): nothing in the step converts a device
value to a Python number or branches on one. The noise is the run's stream drawn
tensor by tensor in parameter order, exactly as before (the same values), concatenated
on the host and copied to the device once (pinned, asynchronous on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from fl.privacy import tap
from fl.privacy.rng import draw_normal


@dataclass(frozen=True)
class DpSgdParams:
    noise_multiplier: float  # σ
    clip: float  # C (ℓ2 bound on each example's gradient)
    sample_rate: float  # q: Poisson inclusion probability of each example per step
    expected_batch: float  # q · n (the normalizer)
    #: the share s of C² kept for the head: head gradient clipped to C·√s, the other
    #: parameters to C·√(1−s) (each example's whole gradient stays within C); 0 = joint
    head_share: float = 0.0

    def __post_init__(self):
        if not (0 <= self.head_share < 1):
            raise ValueError(f"head clip share must be in [0, 1), got {self.head_share}")
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
) -> torch.Tensor:
    """The released gradient: ``p.grad = (summed + noise) / (q·n)``; clears
    ``p.grad_sample``. Returns the privatized sum ``summed + noise`` (what gradient
    canaries observe)."""
    noisy = summed + noise.to(summed.dtype)
    p.grad = (noisy / dp.expected_batch).to(p.dtype)
    p.grad_sample = None
    return noisy


def clip_and_noise_per_parameter(
    params: list[torch.nn.Parameter], dp: DpSgdParams, generator, batch_size: int
) -> dict:
    """The per-parameter path that :func:`clip_and_noise` replaced (the same update up to
    float summation order, the same noise draws; stats as Python numbers, read from the
    device every step): a norm, a clipped sum and a noise draw per parameter. Kept as a
    reference for the tests and as the "before" side of ``fedlora bench dp_overhead``."""
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


def flat_per_sample(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The per-sample gradients of ``params`` side by side: a (batch × Σ numel) matrix,
    row i = example i's gradient flattened parameter after parameter, in float32 (or the
    widest ``grad_sample`` dtype, if wider)."""
    gss = [p.grad_sample.reshape(p.grad_sample.shape[0], -1) for p in params]
    dtype = torch.float32
    for g in gss:
        dtype = torch.promote_types(dtype, g.dtype)
    return torch.cat([g.to(dtype) for g in gss], dim=1)


def device_clip_factors(norms: torch.Tensor, clip: float) -> tuple[torch.Tensor, dict]:
    """:func:`clip_factors` without leaving the device: the factors and the step's
    statistics as 0-dim tensors (``mean_norm`` NaN and ``frac_clipped`` 0 when no norm
    is finite; ``nonfinite`` an int64 count). No host synchronization."""
    finite = torch.isfinite(norms)
    factor = torch.where(
        finite, torch.clamp(clip / (norms + 1e-6), max=1.0), torch.zeros_like(norms)
    )
    count = finite.sum()
    stats = {
        # 0/0 = NaN when no norm is finite, as clip_factors reports
        "mean_norm": torch.where(finite, norms, torch.zeros_like(norms)).sum() / count,
        "frac_clipped": (finite & (norms > clip)).sum() / count.clamp(min=1),
        "nonfinite": (~finite).sum(),
    }
    return factor, stats


def flat_noise(
    params: list[torch.nn.Parameter], std: float, source, device: torch.device
) -> torch.Tensor:
    """One N(0, std²) vector for all ``params``: a draw per parameter from ``source``, in
    parameter order, each of its shape and dtype (the same values as drawing them one at
    a time), concatenated on the host and moved to ``device`` in one copy (pinned and
    asynchronous on CUDA, so the host never waits for the device)."""
    parts = [
        gaussian_noise(tuple(p.shape), std, source, p.dtype, "cpu").reshape(-1).float()
        for p in params
    ]
    flat = torch.cat(parts)
    if device.type == "cuda":
        return flat.pin_memory().to(device, non_blocking=True)
    return flat.to(device)


def split_bounds(dp: DpSgdParams, head_cols: torch.Tensor | None) -> tuple[float, float] | None:
    """(C_head, C_rest) = (C·√s, C·√(1−s)) when the step clips the head and the other
    parameters separately: a head share s > 0 and both groups present among the trained
    parameters. None means one joint clip to C (with a single group the split would
    only shrink the sensitivity below the C that the noise is calibrated to)."""
    if dp.head_share <= 0 or head_cols is None:
        return None
    n_head = int(head_cols.sum())
    if n_head == 0 or n_head == head_cols.numel():
        return None
    return dp.clip * math.sqrt(dp.head_share), dp.clip * math.sqrt(1.0 - dp.head_share)


@dataclass
class StepFault:
    """A planted privacy fault of one local training (``--inject-fault``, TESTS ONLY: for
    auditing the auditor, docs/audit.md "Planted faults"). :func:`clip_and_noise` takes it
    as ``fault``; None (every real run) leaves the step exactly as it is.

    - ``noise_scale``: the drawn noise multiplied by this factor (the ledger unchanged);
    - ``no_clip``: every example's gradient enters the sum unclipped (a canary's too);
    - ``unnoised``: a bool over the flattened coordinates of the trained parameters: no
      noise there (the head, or one LoRA factor);
    - ``reuse``: the first step's noise draw is added again at every later step of the
      local training (no fresh draw).
    """

    noise_scale: float = 1.0
    no_clip: bool = False
    unnoised: torch.Tensor | None = None
    reuse: bool = False
    _kept: torch.Tensor | None = None

    def noise(self, params, std: float, source, device: torch.device) -> torch.Tensor:
        """The step's noise under the fault (a fresh tensor; the kept draw is never
        modified)."""
        if self.reuse and self._kept is not None:
            noise = self._kept.clone()
        else:
            noise = flat_noise(params, std, source, device)
            if self.reuse:
                self._kept = noise.clone()
        if self.noise_scale != 1.0:
            noise = noise * self.noise_scale
        if self.unnoised is not None:
            noise = torch.where(self.unnoised.to(noise.device), torch.zeros_like(noise), noise)
        return noise


def server_noise_fault(noise: torch.Tensor, cfg) -> torch.Tensor:
    """PLANTED FAULT at client level (``--inject-fault``, tests only): the server's noise
    draw times F (``noise_scale=F``) or times 0 (``server_noise_omitted``); any other fault
    leaves it. Called by ``fl.run.contexts.ServerContext.noise`` only when a fault is set."""
    name, _, value = cfg.inject_fault.partition("=")  # validated with the config
    name = name.strip()
    if cfg.dp_level != "client" or name not in ("noise_scale", "server_noise_omitted"):
        return noise
    return noise * (0.0 if name == "server_noise_omitted" else float(value))


def clip_and_noise(
    params: list[torch.nn.Parameter],
    dp: DpSgdParams,
    generator,
    batch_size: int,
    head_cols: torch.Tensor | None = None,
    canaries=None,
    fault: StepFault | None = None,
) -> dict:
    """Replace each param's ``.grad`` with (Σ_i clip(g_i) + N(0, σ²C²I)) / (q·n), in one
    fused step over all ``params`` (module doc).

    ``canaries``: the gradient canaries of this local training
    (:class:`fl.privacy.gradient_canaries.ClientCanaries`) or None (the default path,
    untouched). Each sampled included canary is one more record whose clipped gradient
    is C·e_j: it adds C at its coordinate of the clipped sum *before* the noise, which is
    drawn and added exactly as without canaries; the privatized sum is then read at the
    client's canary coordinates (the white-box observation).

    ``fault``: a planted fault (:class:`StepFault`, ``--inject-fault``, tests only) or None
    (every real run: the path below is then exactly the one without the argument).

    ``batch_size`` is the realized Poisson batch (may be 0: then only noise; stale
    ``grad_sample`` is ignored). The noise is always drawn and added. Returns the
    step's stats as 0-dim tensors on the parameters' device (:func:`device_clip_factors`;
    zeros for an empty batch); :class:`DpStats` accumulates them without a host sync.

    ``head_cols``: a bool vector over the flattened coordinates, True on the head's;
    with ``dp.head_share`` > 0 the head part and the rest of each example's gradient are
    clipped separately (:func:`split_bounds`): ‖clipped g_i‖² ≤ C²s + C²(1−s) = C², so
    the sensitivity, the noise N(0, σ²C²) and the accounting are those of the joint clip.
    ``mean_norm`` is still the joint norm; ``frac_clipped`` counts an example whose head
    or rest was clipped; an example with any non-finite entry contributes nothing.
    """
    device = params[0].device
    sizes = [p.numel() for p in params]
    split = split_bounds(dp, head_cols) if batch_size > 0 else None
    if batch_size > 0 and split is not None:
        g = flat_per_sample(params)
        cols = head_cols.to(device)
        sq = g.square()
        norms = sq.sum(dim=1).sqrt()
        n_head = torch.where(cols, sq, torch.zeros_like(sq)).sum(dim=1).sqrt()
        n_rest = torch.where(cols, torch.zeros_like(sq), sq).sum(dim=1).sqrt()
        f_head, _ = device_clip_factors(n_head, split[0])
        f_rest, _ = device_clip_factors(n_rest, split[1])
        _, stats = device_clip_factors(norms, dp.clip)
        finite = torch.isfinite(norms)
        if fault is not None and fault.no_clip:  # planted fault: no per-example clip
            f_head = f_rest = finite.to(f_head.dtype)
        f_head = torch.where(finite, f_head, torch.zeros_like(f_head))
        f_rest = torch.where(finite, f_rest, torch.zeros_like(f_rest))
        clipped = finite & ((n_head > split[0]) | (n_rest > split[1]))
        stats["frac_clipped"] = clipped.sum() / finite.sum().clamp(min=1)
        torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
        summed = torch.where(cols, f_head.to(g.dtype) @ g, f_rest.to(g.dtype) @ g)
    elif batch_size > 0:
        g = flat_per_sample(params)
        factor, stats = device_clip_factors(g.square().sum(dim=1).sqrt(), dp.clip)
        if fault is not None and fault.no_clip:  # planted fault: no per-example clip
            factor = torch.isfinite(g).all(dim=1).to(factor.dtype)
        # A row with a finite norm has only finite entries; the others have factor 0,
        # and 0·NaN = NaN, so their entries are zeroed first.
        torch.nan_to_num_(g, nan=0.0, posinf=0.0, neginf=0.0)
        summed = factor.to(g.dtype) @ g
    else:
        summed = torch.zeros(sum(sizes), device=device)
        zero = torch.zeros((), device=device)
        stats = {"mean_norm": zero, "frac_clipped": zero, "nonfinite": zero.long()}
    if canaries is not None:
        if fault is None:
            canaries.contribute(summed)
        else:
            canaries.contribute(summed, clip=not fault.no_clip)
    if fault is None:
        noise = flat_noise(params, dp.noise_multiplier * dp.clip, generator, device)
    else:
        noise = fault.noise(params, dp.noise_multiplier * dp.clip, generator, device)
    # the release: q(D) = the clipped sum (canaries included), sensitivity C (add/remove)
    released = tap.release("dpsgd", summed, noise, dp.clip)
    if canaries is not None:
        canaries.observe(released)
    released = released.div_(dp.expected_batch)
    for p, r in zip(params, released.split(sizes)):
        p.grad = r.view(p.shape).to(p.dtype)
        p.grad_sample = None
    return stats


@dataclass
class DpStats:
    """The DP-SGD statistics of a local training, accumulated step by step without
    reading them: values (0-dim tensors or numbers) are kept as they come and turned
    into numbers once, by :meth:`summary`. ``mean_norm`` and ``frac_clipped`` count the
    steps with a non-empty batch; ``nonfinite`` every step."""

    mean_norm: list = field(default_factory=list)
    frac_clipped: list = field(default_factory=list)
    nonfinite: list = field(default_factory=list)

    def add(self, stats: dict, nonempty: bool) -> None:
        if nonempty:
            self.mean_norm.append(stats["mean_norm"])
            self.frac_clipped.append(stats["frac_clipped"])
        self.nonfinite.append(stats["nonfinite"])

    def summary(self) -> dict:
        """``mean_norm`` and ``frac_clipped`` averaged over the non-empty steps (an empty
        list when there was none), ``nonfinite`` summed (an int)."""

        def mean(vals: list):
            return float(np.mean([float(v) for v in vals])) if vals else []

        return {
            "mean_norm": mean(self.mean_norm),
            "frac_clipped": mean(self.frac_clipped),
            "nonfinite": int(sum(int(v) for v in self.nonfinite)),
        }

"""W-space per-sample clipping for LoRA (FedASK's DP mode, arXiv 2507.09990).

Chain rule with the peft scaling s = alpha/R. A peft LoRA layer computes

    y_t = W0 x_t + s · B (A x̃_t),     x̃_t = dropout(x_t) (the input of ``lora_A``)

for every position t of a sequence. Treat the effective update ΔW = s·B A (m×n) as
the variable "W". With g_t = ∂l/∂y_t (m) the gradient of the loss w.r.t. the layer
output at position t:

    ∂l/∂W = Σ_t g_t x̃_tᵀ                      (m×n; the paper's G_W)
    ∂l/∂B = Σ_t s · g_t (A x̃_t)ᵀ = s · (∂l/∂W) Aᵀ   (m×r)

``lora_B``'s output is v_t = B A x̃_t and y_t depends on it through s·v_t, so the
gradient the autograd engine gives at ``lora_B``'s output is ∂l/∂v_t = s·g_t; we
divide by s to get g_t.

The mechanism (one DP-SGD step, batch of per-example losses l_i):

    G_i   = [∂l_i/∂W for every LoRA layer, ∂l_i/∂head]       (joint vector)
    c_i   = min(1, C / ‖G_i‖)                                 (‖·‖: one ℓ2 norm over all)
    Σ_W   = Σ_i c_i ∂l_i/∂W + Z_W,   Z_W ~ N(0, σ²C² I_{m×n})  per layer
    Σ_h   = Σ_i c_i ∂l_i/∂head + Z_h, Z_h ~ N(0, σ²C² I)
    B.grad    = s · Σ_W Aᵀ / (q·n)                              (post-processing, A public)
    head.grad = Σ_h / (q·n)

Adding or removing one example changes (Σ_W, Σ_h) by at most C in ℓ2, so each step is
the Poisson-subsampled Gaussian mechanism with noise multiplier σ and sampling rate q
— exactly the event ``client.train`` records; B's gradient is a public linear map of
the released W-space sum. The per-example clipped sum Σ_i c_i s ∂l_i/∂W Aᵀ is
Σ_i c_i ∂l_i/∂B (Opacus' ``grad_sample`` of B), so no per-example m×n matrix is ever
formed. The per-example norm uses the Gram identity

    ‖Σ_t g_t x̃_tᵀ‖_F² = Σ_{t,u} (g_t·g_u)(x̃_t·x̃_u)

(cost O(T²(m+n)) per example instead of O(T m n)).

Noise shape: the B-noise is s·Z_W Aᵀ/(q·n): each row of B's noise is
N(0, s²σ²C² A Aᵀ / (q·n)²) — correlated across B's columns through A Aᵀ — whereas
plain B-space clipping (``clip_and_noise`` on B's own gradient) adds isotropic
N(0, σ²C² I / (q·n)²). See docs/fedask.md.

Activations are captured by our own hooks (not Opacus' stored activations, whose
layout is private to Opacus): a forward hook on each ``lora_A`` module stores its
input x̃ (batch×T×n) and a forward hook on each ``lora_B`` module registers a tensor
hook on its output to store ∂l/∂v (batch×T×m). :class:`WSpaceClipper` is a context
manager; the hooks exist only inside ``with``.
"""

from __future__ import annotations

import torch

from fl import factors as F
from fl.privacy.dpsgd import (
    DpSgdParams,
    clip_factors,
    clipped_sum,
    gaussian_noise,
    set_noisy_grad,
)

__all__ = ["wspace_sq_norms", "wspace_sq_norms_reference", "WSpaceClipper"]


def _as_seq(t: torch.Tensor) -> torch.Tensor:
    """(b, ..., d) -> (b, T, d): a 2-D input is a length-1 sequence."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def wspace_sq_norms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Per-example ‖Σ_t g_t x_tᵀ‖_F² by the Gram trick, without forming m×n matrices.

    x: (b, T, n) layer inputs x̃_t; g: (b, T, m) output gradients g_t (2-D inputs
    (b, d) are length-1 sequences). Returns (b,) in float64:
    Σ_{t,u} (g_t·g_u)(x_t·x_u), clamped at 0 against rounding.
    """
    x, g = _as_seq(x).double(), _as_seq(g).double()
    if x.shape[:2] != g.shape[:2]:
        raise ValueError(f"x is {tuple(x.shape)} but g is {tuple(g.shape)}")
    gx = x @ x.mT  # (b, T, T)
    gg = g @ g.mT
    return torch.clamp((gx * gg).sum(dim=(1, 2)), min=0.0)


def wspace_sq_norms_reference(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Slow reference: materializes G_i = Σ_t g_t x_tᵀ (b×m×n) and takes ‖G_i‖_F²."""
    x, g = _as_seq(x).double(), _as_seq(g).double()
    G = torch.einsum("btm,btn->bmn", g, x)
    return G.pow(2).sum(dim=(1, 2))


class WSpaceClipper:
    """``grad_transform`` for ``client.train`` that privatizes in W-space.

    Use as::

        with WSpaceClipper.from_model(model, s) as gt:
            client.train(start, trainable=("B", "head"), grad_transform=gt)

    ``layers``: key → (lora_A module, lora_B module, A parameter, B parameter).
    Trainable parameters must be LoRA B factors and/or head parameters (A is public
    and fixed in FedASK's DP mode); a trainable A raises ValueError.
    After each call ``last_norms`` holds the per-example joint norms (b,) and
    ``last_noise`` (if ``keep_noise``) the W-space noise per layer key (m×n).
    """

    def __init__(self, layers: dict, scaling: float, keep_noise: bool = False):
        self.layers = layers
        self.s = float(scaling)
        self.keep_noise = keep_noise
        self._handles: list = []
        self._x: dict[str, list[torch.Tensor]] = {}
        self._g: dict[str, dict[int, torch.Tensor]] = {}
        self._nb: dict[str, int] = {}  # lora_B forward calls this step, per layer
        self._passes: dict[str, list[torch.Tensor]] = {}  # per-example ‖·‖² of ended passes
        self._bkey = {id(v[3]): k for k, v in layers.items()}
        self._akey = {id(v[2]): k for k, v in layers.items()}
        self.last_norms: torch.Tensor | None = None
        self.last_noise: dict[str, torch.Tensor] = {}

    @classmethod
    def from_model(cls, model: torch.nn.Module, scaling: float, **kw) -> WSpaceClipper:
        """Find every peft LoRA layer of ``model`` (modules whose weight is a lora_A /
        lora_B parameter of :func:`fl.factors.lora_param_map`)."""
        pmap = F.lora_param_map(model)
        owner = {}
        for _, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if isinstance(w, torch.nn.Parameter) and not list(mod.children()):
                owner[id(w)] = mod
        layers = {}
        for key, ab in pmap.items():
            if "A" not in ab or "B" not in ab:
                continue
            ma, mb = owner.get(id(ab["A"])), owner.get(id(ab["B"]))
            if ma is None or mb is None:
                raise ValueError(f"LoRA layer {key!r}: cannot find its lora_A/lora_B modules")
            layers[key] = (ma, mb, ab["A"], ab["B"])
        if not layers:
            raise ValueError("model has no LoRA layers")
        return cls(layers, scaling, **kw)

    # ---- hooks -----------------------------------------------------------------
    def __enter__(self) -> WSpaceClipper:
        for key, (ma, mb, _, _) in self.layers.items():
            self._handles.append(ma.register_forward_hook(self._fwd_a(key)))
            self._handles.append(mb.register_forward_hook(self._fwd_b(key)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._clear()

    def _clear(self) -> None:
        self._x = {}
        self._g = {}
        self._nb = {}
        self._passes = {}

    def end_pass(self) -> None:
        """One forward/backward pass of the step is over. A step may run its batch as
        several passes over disjoint sub-batches (the trainer's length buckets): each
        pass's per-example norms are computed from its own activations (its sequence
        length) and kept; the step's norms are the passes' concatenated in pass order,
        the order of Opacus' joined ``grad_sample`` rows."""
        for key in list(self._x):
            v = self.layer_sq_norms(key)
            if v is not None:
                self._passes.setdefault(key, []).append(v)
        self._x, self._g, self._nb = {}, {}, {}

    def _step_sq_norms(self, key: str) -> torch.Tensor | None:
        """The step's per-example ‖∂l_i/∂W‖_F² of one layer: the ended passes', then the
        current pass's (a caller that never calls :meth:`end_pass` has one pass)."""
        parts = list(self._passes.get(key, []))
        current = self.layer_sq_norms(key)
        if current is not None:
            parts.append(current)
        return torch.cat(parts) if parts else None

    def _fwd_a(self, key):
        def hook(_mod, inputs, _out):
            if torch.is_grad_enabled():
                self._x.setdefault(key, []).append(inputs[0].detach())

        return hook

    def _fwd_b(self, key):
        def hook(_mod, _inputs, out):
            if not (torch.is_grad_enabled() and out.requires_grad):
                return
            idx = self._nb.get(key, 0)
            self._nb[key] = idx + 1

            def grad_hook(grad, _i=idx):
                self._g.setdefault(key, {})[_i] = grad.detach()

            out.register_hook(grad_hook)

        return hook

    # ---- the transform ---------------------------------------------------------------
    def layer_sq_norms(self, key: str) -> torch.Tensor | None:
        """Per-example ‖∂l_i/∂W‖_F² of one layer from the captured activations (b,)."""
        xs = self._x.get(key, [])
        gs = self._g.get(key, {})
        if not xs:
            return None
        if len(gs) != len(xs):
            raise RuntimeError(
                f"W-space clipping: layer {key!r} saw {len(xs)} forward calls but "
                f"{len(gs)} output gradients"
            )
        # Call i of lora_A pairs with call i of lora_B (same forward order); several
        # calls per step are concatenated along positions (Σ over all of them).
        x = torch.cat([_as_seq(t) for t in xs], dim=1)
        g = torch.cat([_as_seq(gs[i]) for i in range(len(xs))], dim=1) / self.s
        return wspace_sq_norms(x, g)

    def __call__(
        self,
        params: list[torch.nn.Parameter],
        dp: DpSgdParams,
        generator: torch.Generator | None,
        batch_size: int,
    ) -> dict:
        """Set each param's ``.grad`` to the W-space privatized gradient (module doc)
        and clear ``.grad_sample``. Returns mean_norm, frac_clipped, nonfinite."""
        try:
            return self._apply(params, dp, generator, batch_size)
        finally:
            self._clear()

    def _apply(self, params, dp, generator, batch_size) -> dict:
        for p in params:
            if id(p) in self._akey:
                raise ValueError(
                    "W-space clipping needs A fixed (public); "
                    f"A of {self._akey[id(p)]!r} is trainable"
                )
        bparams = [p for p in params if id(p) in self._bkey]
        heads = [p for p in params if id(p) not in self._bkey]
        stats = {"mean_norm": 0.0, "frac_clipped": 0.0, "nonfinite": 0}
        factor = None
        self.last_norms = None
        if batch_size > 0:
            sq = None
            for p in bparams:
                v = self._step_sq_norms(self._bkey[id(p)])
                if v is None:
                    raise RuntimeError(
                        f"W-space clipping: no activations for layer {self._bkey[id(p)]!r} "
                        "(is the clipper's `with` block around the training?)"
                    )
                sq = v if sq is None else sq + v
            for p in heads:
                gs = p.grad_sample
                v = gs.reshape(gs.shape[0], -1).double().pow(2).sum(dim=1)
                sq = v if sq is None else sq + v
            norms = sq.sqrt()
            self.last_norms = norms.detach().cpu()
            factor, stats = clip_factors(norms, dp.clip)
        std = dp.noise_multiplier * dp.clip
        self.last_noise = {}
        for p in params:
            summed = clipped_sum(p, factor)
            if id(p) in self._bkey:
                key = self._bkey[id(p)]
                A = self.layers[key][2].detach()
                m, n = p.shape[0], A.shape[1]
                # Noise in W-space (m×n), then the public projection s·(·)Aᵀ.
                z = gaussian_noise((m, n), std, generator, torch.float32, p.device)
                if self.keep_noise:
                    self.last_noise[key] = z.detach().cpu()
                noise = self.s * (z @ A.float().mT)
            else:
                noise = gaussian_noise(tuple(p.shape), std, generator, p.dtype, p.device)
            set_noisy_grad(p, summed, noise, dp)
        return stats

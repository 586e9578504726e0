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

Gradient canaries (``--canary-kind gradient``, :mod:`fl.privacy.gradient_canaries`):
with the thin SVD A = U diag(S) Vᵀ (U r×r, S r, V n×r; :func:`slot_basis`, A of full row
rank r), the slot a·r + k of B (m×r) is the unit W-space vector w = e_a ⊗ V[:,k] (row a,
in A's row space, so the projection keeps all of it). A sampled included canary is one
more record whose W-space gradient K·C·w is clipped to C·w and added to Σ_W before Z_W;
in B's clipped sum that is s·C·(e_a ⊗ V[:,k]ᵀAᵀ) = s·C·S_k·U[:,k]ᵀ on row a. The
observation of the slot is the public linear function of the released B-sum row
y_a = s·(Σ_W row a)Aᵀ (before ÷ q·n)

    c_{a,k} = y_a·U[:,k] / (s·S_k) = (Σ_W row a)·V[:,k]

whose noise part z_a·V[:,k] is N(0, σ²C²), i.i.d. over (a, k) (V orthonormal), and to
which an included sampled canary adds exactly C: in these coordinates a B canary is a
flat Dirac canary, scored as one. Head canaries are plain coordinates of Σ_h.

Activations are captured by our own hooks (not Opacus' stored activations, whose
layout is private to Opacus): a forward hook on each ``lora_A`` module stores its
input x̃ (batch×T×n) and a forward hook on each ``lora_B`` module registers a tensor
hook on its output to store ∂l/∂v (batch×T×m). :class:`WSpaceClipper` is a context
manager; the hooks exist only inside ``with``.
"""

from __future__ import annotations

import numpy as np
import torch

from fl.errors import UsageError
from fl.models import factors as F
from fl.privacy import tap
from fl.privacy.dpsgd import (
    DpSgdParams,
    clip_factors,
    clipped_sum,
    gaussian_noise,
    set_noisy_grad,
)

__all__ = ["wspace_sq_norms", "wspace_sq_norms_reference", "WSpaceClipper", "slot_basis"]

#: W-space gradient canaries need A (r×n) of full row rank: σ_min(A) > this · σ_max(A)
#: (below it the r slots of a row are not all in A's numerical row space)
MIN_RANK_RATIO = 1e-6


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


def slot_basis(A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(U, S, V): the thin SVD A = U diag(S) Vᵀ of a LoRA A factor (r×n, r <= n) in
    float64 on the CPU (U r×r, S r descending, V n×r with orthonormal columns), each
    column pair's sign fixed (U[:,k]'s largest-magnitude entry positive) so that the
    slots do not depend on the SVD routine's sign choice. The W-space canary slots of
    the layer (module doc). ValueError unless A has full row rank r
    (σ_min > :data:`MIN_RANK_RATIO`·σ_max)."""
    A = A.detach().to("cpu", torch.float64)
    r, n = A.shape
    if r > n:
        raise ValueError(f"A is {r}×{n}: W-space gradient canaries need rank r <= n")
    U, S, Vh = torch.linalg.svd(A, full_matrices=False)
    if not (bool(torch.isfinite(S).all()) and float(S[-1]) > MIN_RANK_RATIO * float(S[0])):
        raise ValueError(
            f"A ({r}×{n}) is not of full row rank r = {r} (singular values "
            f"{float(S[0]):.3g} … {float(S[-1]):.3g}): its row space has fewer than r "
            "directions, so some W-space gradient canary slots would be lost to the "
            "projection; use --canary-kind input, or FedASK's --opt clip_space=b"
        )
    top = U.abs().argmax(dim=0)
    sign = torch.sign(U[top, torch.arange(r)])
    sign[sign == 0] = 1.0
    return U * sign, S, Vh.mT * sign


class _Slots:
    """The canaries of one local training on one trained parameter: their positions in
    the training's canary list (``pos``) and, for a B factor (``U`` set), their rows and
    columns in slot coordinates; for any other parameter their flat indices."""

    def __init__(self, pos, local, shape, basis=None, device="cpu"):
        self.pos = pos  # numpy: positions in ClientCanaries.ids
        self.pos_t = torch.as_tensor(pos, dtype=torch.long, device=device)
        self.local_t = torch.as_tensor(local, dtype=torch.long, device=device)
        self.U = self.S = None
        if basis is not None:
            r = shape[1]
            self.rows = local // r
            self.cols_t = torch.as_tensor(local % r, dtype=torch.long, device=device)
            self.rows_t = torch.as_tensor(self.rows, dtype=torch.long, device=device)
            U, S, _ = basis
            self.U, self.S = U.to(device), S.to(device)


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

    #: gradient canaries (``--canary-kind gradient``): B slots live in W-space
    canary_space = "w"

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
        #: (the local training's ClientCanaries, its slots per parameter index)
        self._slots: tuple | None = None

    @classmethod
    def from_model(cls, model: torch.nn.Module, scaling: float, **kw) -> WSpaceClipper:
        """Find every peft LoRA layer of ``model`` (modules whose weight is a lora_A /
        lora_B parameter of :func:`fl.models.factors.lora_param_map`)."""
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
        canaries=None,
    ) -> dict:
        """Set each param's ``.grad`` to the W-space privatized gradient (module doc)
        and clear ``.grad_sample``. Returns mean_norm, frac_clipped, nonfinite.

        ``canaries``: this local training's gradient canaries
        (:class:`fl.privacy.gradient_canaries.ClientCanaries`, module doc: B slots in
        W-space, head coordinates) or None (the default path, untouched)."""
        try:
            return self._apply(params, dp, generator, batch_size, canaries)
        finally:
            self._clear()

    def _tapped_b(self, p, summed, noise, z, A, dp, part: str) -> torch.Tensor:
        """The B factor's release through the tap (a neighbour replay is watching). What
        is compared lives in A's row space, where the W-space sum is released: with
        A = U S Vᵀ the released B-sum s·(Σ_W + Z)Aᵀ is a public map of (Σ_W + Z)·V, whose
        value part Σ_W·V = summed·U/(s·S) moves by at most ‖ΔΣ_W‖ ≤ C (V orthonormal):
        the release's declared sensitivity, jointly with the head. What is released (and
        frozen on D′) is the B-sum computed as without a tap, bit for bit. Sets
        ``p.grad``; returns the noisy B-space sum (what canaries observe)."""
        U, S, V = (t.to(p.device) for t in slot_basis(A))
        value = summed.double() @ U / (self.s * S)  # Σ_W V (m×r)
        noisy = tap.release(
            "dpsgd-wspace", value, z.double() @ V, dp.clip, part=part, released=summed + noise
        )
        p.grad = (noisy / dp.expected_batch).to(p.dtype)
        p.grad_sample = None
        return noisy

    def _canary_slots(self, params, cc) -> dict[int, _Slots]:
        """The canaries of ``cc`` per parameter index (cached for the local training: A
        is fixed within it, checked by :meth:`_apply`)."""
        if self._slots is not None and self._slots[0] is cc:
            return self._slots[1]
        flat = cc.flat.cpu().numpy()
        starts = np.cumsum([0] + [p.numel() for p in params])
        which = np.searchsorted(starts, flat, side="right") - 1
        if flat.size and (flat.min() < 0 or flat.max() >= starts[-1]):
            raise RuntimeError("gradient canaries: a coordinate outside the trained parameters")
        out = {}
        for i, p in enumerate(params):
            pos = np.flatnonzero(which == i)
            if not pos.size:
                continue
            local = flat[pos] - starts[i]
            basis = None
            if id(p) in self._bkey:
                key = self._bkey[id(p)]
                A = self.layers[key][2]
                if p.dim() != 2 or p.shape[1] != A.shape[0]:
                    raise RuntimeError(f"layer {key!r}: B {tuple(p.shape)} vs A {tuple(A.shape)}")
                try:
                    basis = slot_basis(A)
                except ValueError as exc:
                    raise UsageError(f"W-space gradient canaries, layer {key!r}: {exc}") from None
            out[i] = _Slots(pos, local, tuple(p.shape), basis, p.device)
        self._slots = (cc, out)
        return out

    def _contribute(self, sl: _Slots, summed: torch.Tensor, cc, sel: np.ndarray) -> None:
        """Add the clipped W-space gradients C·(e_a ⊗ V[:,k]) of the sampled included
        canaries on this parameter to its clipped sum (B: s·C·S_k·U[:,k]ᵀ on row a; the
        head: C at the coordinate)."""
        j = np.flatnonzero(np.isin(sl.pos, sel))
        if not j.size:
            return
        jt = torch.as_tensor(j, dtype=torch.long, device=summed.device)
        if sl.U is None:
            g = cc.clipped(j.size, summed.dtype, summed.device)
            summed.view(-1).index_put_((sl.local_t[jt],), g, accumulate=True)
            return
        coef = cc.clipped(j.size, torch.float64, summed.device)  # C along the unit w
        k = sl.cols_t[jt]
        rows = (self.s * coef * sl.S[k]).unsqueeze(1) * sl.U[:, k].mT  # (j, r)
        urows, inv = np.unique(sl.rows[j], return_inverse=True)
        delta = torch.zeros(
            (urows.size, summed.shape[1]), dtype=torch.float64, device=summed.device
        )
        delta.index_add_(0, torch.as_tensor(inv, dtype=torch.long, device=summed.device), rows)
        ur = torch.as_tensor(urows, dtype=torch.long, device=summed.device)
        summed[ur] += delta.to(summed.dtype)

    def _observe(self, sl: _Slots, noisy: torch.Tensor, out: torch.Tensor) -> None:
        """The slots' observations from this parameter's privatized sum (before ÷ q·n):
        the head's coordinates; for B, c = y_a·U[:,k] / (s·S_k) (module doc)."""
        if sl.U is None:
            out[sl.pos_t] = noisy.reshape(-1)[sl.local_t].double()
            return
        y = noisy.double()[sl.rows_t]  # (slots, r)
        c = (y * sl.U[:, sl.cols_t].mT).sum(dim=1) / (self.s * sl.S[sl.cols_t])
        out[sl.pos_t] = c

    def _apply(self, params, dp, generator, batch_size, canaries=None) -> dict:
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
        if canaries is not None:
            slots = self._canary_slots(params, canaries)
            sel = canaries.sampled()
            dev = params[0].device if params else torch.device("cpu")
            seen = torch.zeros(len(canaries.ids), dtype=torch.float64, device=dev)
        for i, p in enumerate(params):
            summed = clipped_sum(p, factor)
            if canaries is not None and i in slots:
                self._contribute(slots[i], summed, canaries, sel)
            tapped_ = tap.active() is not None
            if id(p) in self._bkey:
                key = self._bkey[id(p)]
                A = self.layers[key][2].detach()
                m, n = p.shape[0], A.shape[1]
                # Noise in W-space (m×n), then the public projection s·(·)Aᵀ.
                z = gaussian_noise((m, n), std, generator, torch.float32, p.device)
                if self.keep_noise:
                    self.last_noise[key] = z.detach().cpu()
                noise = self.s * (z @ A.float().mT)
                if tapped_:
                    noisy = self._tapped_b(p, summed, noise, z, A, dp, str(i))
                    if canaries is not None and i in slots:
                        self._observe(slots[i], noisy, seen)
                    continue
            else:
                noise = gaussian_noise(tuple(p.shape), std, generator, p.dtype, p.device)
            if tapped_:  # one release over every parameter (fl.privacy.tap)
                noisy = tap.release("dpsgd-wspace", summed, noise, dp.clip, part=str(i))
                p.grad = (noisy / dp.expected_batch).to(p.dtype)
                p.grad_sample = None
            else:
                noisy = set_noisy_grad(p, summed, noise, dp)
            if canaries is not None and i in slots:
                self._observe(slots[i], noisy, seen)
        if canaries is not None:
            canaries.record(seen)
        return stats

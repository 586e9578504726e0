"""Membership signals of a causal language model, as pure functions of per-token log-probs.

A sequence x = (x_1..x_T) is scored by the model's next-token distributions: at each scored
position t (``mask``: the response tokens of an instruction example, every token after the
first for plain text) the model gives p(· | x_<t) over the vocabulary V. Everything below
is computed from three (n, T) arrays, :class:`TokenStats`:

- ``logp``  = log p(x_t | x_<t);
- ``mu``    = E_{v ~ p(·|x_<t)} [log p(v | x_<t)]  (minus the entropy of the distribution);
- ``sigma`` = sqrt(E_v [(log p(v | x_<t) − μ_t)²]).

Signals, one value per sequence (the sign that makes "higher = member" is applied by the
attacks, :data:`SCORES`):

- sequence loss ℓ = −mean_t logp (nats per scored token); perplexity = exp(ℓ);
- reference: ℓ_target − ℓ_base (the base model, adapter off, is the reference of a LoRA);
- zlib ratio: ℓ / (bytes of zlib.compress(utf-8 text)) (Carlini et al. 2021);
- lowercase ratio: ℓ(text) / ℓ(text.lower()) (Carlini et al. 2021);
- min-k% prob: mean of the ⌈k·T⌉ lowest logp (Shi et al. 2024);
- min-k%++: the same over the standardized (logp − μ_t)/σ_t (Zhang et al. 2024).

Where k·T is not an integer the count is ⌈k·T⌉ (at least one token); ties do not matter
(the mean of the lowest values is the same whichever tied token is taken).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import numpy as np

#: smallest σ_t used by min-k%++ (a one-hot distribution has σ = 0; its token's z is then 0)
MIN_SIGMA = 1e-12


@dataclass(frozen=True, eq=False)
class TokenStats:
    """Per-token statistics of n sequences padded to T positions; entries where ``mask`` is
    False are padding and never read."""

    logp: np.ndarray  # (n, T) float64
    mu: np.ndarray  # (n, T) float64
    sigma: np.ndarray  # (n, T) float64, >= 0
    mask: np.ndarray  # (n, T) bool

    def __post_init__(self):
        shp = self.mask.shape
        if len(shp) != 2 or any(np.shape(getattr(self, f.name)) != shp for f in fields(self)):
            raise ValueError("logp, mu, sigma and mask must all have the same shape (n, T)")
        if not self.mask.any(axis=1).all():
            bad = np.flatnonzero(~self.mask.any(axis=1))[:5].tolist()
            raise ValueError(f"sequence(s) {bad} have no scored token")
        for f in ("logp", "mu", "sigma"):
            v = getattr(self, f)[self.mask]
            if not np.isfinite(v).all():
                raise ValueError(f"{f} has NaN or Inf at scored positions")

    @classmethod
    def concat(cls, parts: list[TokenStats]) -> TokenStats:
        """Stack the rows of several batches (padded to the longest T)."""
        width = max(p.mask.shape[1] for p in parts)

        def pad(a, fill):
            return np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

        return cls(
            *(
                np.concatenate([pad(getattr(p, f), 0) for p in parts])
                for f in ("logp", "mu", "sigma")
            ),
            np.concatenate([pad(p.mask, False) for p in parts]),
        )

    def subset(self, idx) -> TokenStats:
        idx = np.asarray(idx)
        return TokenStats(self.logp[idx], self.mu[idx], self.sigma[idx], self.mask[idx])


# --------------------------------------------------------------------------------- logits
def next_token_targets(input_ids, attention_mask, loss_mask=None):
    """Align a causal LM's outputs with what they predict: logits[:, t] predicts ids[:, t+1].

    Args:
        input_ids, attention_mask: (n, L) as the tokenizer gives them (right padding).
        loss_mask: (n, L) bool, the tokens to score (e.g. the response of an instruction
            example); None = every real token after the first.
    Returns: (targets (n, L−1) ints, mask (n, L−1) bool) to pair with logits[:, :-1].
    """
    ids = np.asarray(input_ids)
    att = np.asarray(attention_mask).astype(bool)
    want = att if loss_mask is None else (np.asarray(loss_mask).astype(bool) & att)
    return ids[:, 1:], want[:, 1:]


#: float64 entries of one chunk of :func:`token_stats` (2 MiB): chunks far above the
#: allocator's mmap threshold page-fault every temporary afresh (4-5x slower at V = 30k)
CHUNK_ENTRIES = 1 << 18


def token_stats(logits, targets, mask, chunk_rows: int | None = None) -> TokenStats:
    """logp, μ and σ of each position from logits (n, T, V) (numpy or torch, any float
    dtype), aligned with ``targets`` (n, T) (logits[:, t] is the distribution of
    targets[:, t]) and ``mask`` (n, T). Computed in float64, ``chunk_rows`` positions at a
    time (default: :data:`CHUNK_ENTRIES` // V; the vocabulary axis of a real LM is large).
    Each position is computed on its own, so the chunk size does not change the values."""
    import torch

    z = torch.as_tensor(logits)
    if z.ndim != 3:
        raise ValueError(f"logits must be (n, T, V), got shape {tuple(z.shape)}")
    n, t, v = z.shape
    y = torch.as_tensor(np.asarray(targets), dtype=torch.long)
    m = np.asarray(mask).astype(bool)
    if tuple(y.shape) != (n, t) or m.shape != (n, t):
        raise ValueError(f"targets and mask must be ({n}, {t}), got {tuple(y.shape)}, {m.shape}")
    if m.any() and (y[torch.as_tensor(m)].min() < 0 or y[torch.as_tensor(m)].max() >= v):
        raise ValueError(f"targets must lie in [0, {v}) at scored positions")
    flat = z.reshape(n * t, v)
    yf = y.reshape(-1).clamp(0, v - 1)
    chunk_rows = chunk_rows or max(1, CHUNK_ENTRIES // max(v, 1))
    out = np.zeros((3, n * t))
    for s in range(0, n * t, chunk_rows):
        lp = torch.log_softmax(flat[s : s + chunk_rows].to(torch.float64), dim=-1)
        p = lp.exp()
        mu = (p * lp).sum(-1)
        var = (p * (lp - mu[:, None]) ** 2).sum(-1)
        out[0, s : s + len(lp)] = lp.gather(1, yf[s : s + chunk_rows, None])[:, 0].numpy()
        out[1, s : s + len(lp)] = mu.numpy()
        out[2, s : s + len(lp)] = var.clamp_min(0).sqrt().numpy()
    logp, mu, sigma = (a.reshape(n, t) for a in out)
    return TokenStats(np.where(m, logp, 0.0), np.where(m, mu, 0.0), np.where(m, sigma, 0.0), m)


# --------------------------------------------------------------------------------- signals
def _masked(a, mask):
    a = np.asarray(a, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    if a.shape != m.shape or a.ndim != 2:
        raise ValueError(f"values and mask must be (n, T) of one shape, got {a.shape}, {m.shape}")
    if not m.any(axis=1).all():
        raise ValueError("every sequence needs at least one scored token")
    return a, m


def sequence_loss(logp, mask) -> np.ndarray:
    """(n,) mean negative log-likelihood per scored token, nats."""
    a, m = _masked(logp, mask)
    return -np.where(m, a, 0.0).sum(axis=1) / m.sum(axis=1)


def perplexity(loss) -> np.ndarray:
    """(n,) exp(ℓ) of per-token losses in nats."""
    return np.exp(np.asarray(loss, dtype=np.float64))


def _check_k(k: float) -> float:
    k = float(k)
    if not 0.0 < k <= 1.0:
        raise ValueError(f"k must be a fraction in (0, 1], got {k}")
    return k


def lowest_k_mean(values, mask, k: float = 0.2) -> np.ndarray:
    """(n,) mean of the ⌈k·T_i⌉ lowest scored values of each row (T_i its scored tokens)."""
    k = _check_k(k)
    a, m = _masked(values, mask)
    count = m.sum(axis=1)
    take = np.maximum(1, np.ceil(k * count - 1e-9).astype(np.int64))
    srt = np.sort(np.where(m, a, np.inf), axis=1)  # padding sorts last
    cols = np.arange(a.shape[1])[None, :]
    return np.where(cols < take[:, None], srt, 0.0).sum(axis=1) / take


def min_k_prob(logp, mask, k: float = 0.2) -> np.ndarray:
    """(n,) Min-K% Prob: mean of the lowest k fraction of token log-probs."""
    return lowest_k_mean(logp, mask, k)


def standardized_logp(stats: TokenStats) -> np.ndarray:
    """(n, T) (logp − μ_t) / σ_t; 0 where σ_t = 0 (a certain prediction is not surprising)."""
    sd = np.maximum(stats.sigma, MIN_SIGMA)
    z = (stats.logp - stats.mu) / sd
    return np.where(stats.sigma > MIN_SIGMA, z, 0.0)


def min_k_plus_plus(stats: TokenStats, k: float = 0.2) -> np.ndarray:
    """(n,) Min-K%++: mean of the lowest k fraction of standardized token log-probs."""
    return lowest_k_mean(standardized_logp(stats), stats.mask, k)


def zlib_bytes(texts) -> np.ndarray:
    """(n,) length in bytes of each text's zlib compression (UTF-8, default level)."""
    return np.asarray([len(zlib.compress(str(t).encode("utf-8"))) for t in texts], np.float64)


def zlib_ratio(loss, texts) -> np.ndarray:
    """(n,) ℓ / zlib bytes of the text."""
    return np.asarray(loss, dtype=np.float64) / zlib_bytes(texts)


def lowercase_ratio(loss, loss_lower) -> np.ndarray:
    """(n,) ℓ(text) / ℓ(text.lower())."""
    lo = np.asarray(loss_lower, dtype=np.float64)
    if (lo <= 0).any():
        raise ValueError("the lowercased text's loss must be > 0")
    return np.asarray(loss, dtype=np.float64) / lo


def reference_difference(loss, loss_reference) -> np.ndarray:
    """(n,) ℓ_target − ℓ_reference (the reference: the base model with the adapter off)."""
    return np.asarray(loss, dtype=np.float64) - np.asarray(loss_reference, dtype=np.float64)


# --------------------------------------------------------------------------------- per model
@dataclass(frozen=True, eq=False)
class LMSignals:
    """Per-sequence signals of one causal LM (target or shadow) on n sequences; the fields
    the classification attacks read (``loss``, ``p_true``, ``phi``) are the sequence's."""

    loss: np.ndarray  # (n,) nats per scored token
    min_k: np.ndarray  # (n,) Min-K% Prob at the config's k
    min_k_pp: np.ndarray  # (n,) Min-K%++ at the config's k
    zlib_bytes: np.ndarray  # (n,)
    tokens: np.ndarray  # (n,) scored tokens per sequence
    loss_lower: np.ndarray | None = None  # (n,) on the lowercased texts
    loss_base: np.ndarray | None = None  # (n,) of the base model (adapter off)

    @property
    def p_true(self) -> np.ndarray:
        """The per-token geometric-mean probability exp(−ℓ) (RMIA's p(x) for a sequence)."""
        return np.exp(-self.loss)

    @property
    def phi(self) -> np.ndarray:
        """LiRA's statistic for a sequence: −ℓ (approximately Gaussian across models)."""
        return -self.loss

    def subset(self, idx) -> LMSignals:
        idx = np.asarray(idx)
        return LMSignals(
            *(
                None if getattr(self, f.name) is None else getattr(self, f.name)[idx]
                for f in fields(self)
            )
        )

    @classmethod
    def from_stats(
        cls, stats: TokenStats, texts, k: float = 0.2, lower=None, base=None
    ) -> LMSignals:
        """From the model's token stats on ``texts`` (and, optionally, its stats on the
        lowercased texts and the base model's stats on ``texts``)."""
        if len(texts) != stats.mask.shape[0]:
            raise ValueError(f"{len(texts)} texts for {stats.mask.shape[0]} rows of token stats")
        loss = sequence_loss(stats.logp, stats.mask)
        return cls(
            loss,
            min_k_prob(stats.logp, stats.mask, k),
            min_k_plus_plus(stats, k),
            zlib_bytes(texts),
            stats.mask.sum(axis=1),
            None if lower is None else sequence_loss(lower.logp, lower.mask),
            None if base is None else sequence_loss(base.logp, base.mask),
        )


def perplexities(sig: LMSignals, role) -> dict:
    """Token-weighted perplexity exp(Σ_i T_i ℓ_i / Σ_i T_i) of each role's sequences
    (``role`` (n,) strings), with the adapter (``adapter``) and without it (``base``,
    where the base model's loss was computed): {role: {"adapter", "base", "sequences",
    "tokens"}}."""
    role = np.asarray(role)
    out = {}
    for r in dict.fromkeys(role.tolist()):
        m = role == r
        w = sig.tokens[m].astype(np.float64)
        ppl = [
            None if v is None else float(np.exp((v[m] * w).sum() / w.sum()))
            for v in (sig.loss, sig.loss_base)
        ]
        out[r] = {
            "adapter": ppl[0],
            "base": ppl[1],
            "sequences": int(m.sum()),
            "tokens": int(w.sum()),
        }
    return out


#: attack result name → (n,) score from LMSignals, higher = member (no reference models)
SCORES = {
    "lm_loss": lambda s: -s.loss,
    "lm_perplexity": lambda s: -perplexity(s.loss),
    "lm_reference": lambda s: -reference_difference(s.loss, s.loss_base),
    "lm_zlib": lambda s: -s.loss / s.zlib_bytes,  # zlib_ratio without recompressing
    "lm_lowercase": lambda s: -lowercase_ratio(s.loss, s.loss_lower),
    "lm_min_k": lambda s: s.min_k,
    "lm_min_k_pp": lambda s: s.min_k_pp,
}

"""Shadow-model attack (Shokri et al. 2017): learn membership from output vectors.

k shadow models are trained by the same pipeline on attacker data with known IN/OUT
splits. Their output vectors on those examples, labelled IN/OUT, train an attack
classifier (scikit-learn gradient-boosted trees), which is then applied to the target's
output vectors. As in the paper there is one attack model per class (``per_class=True``;
input: the log-softmax vector, whose order is meaningful given the class), or a single model
(input: sorted log-softmax — class-agnostic — plus log p_y and the one-hot label).
``features="logits"`` uses raw logits instead of log-softmax.
"""

from __future__ import annotations

import numpy as np

THREAT_MODEL = (
    "query access to the target's output vectors (softmax / logits) on the candidates; the "
    "training pipeline and same-distribution data with known IN/OUT splits to train shadow "
    "models and an attack classifier on their outputs"
)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    m = z.max(axis=1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=1, keepdims=True))


def features(logits, labels, per_class: bool, kind: str = "softmax") -> np.ndarray:
    """Attack-model inputs (n, d) from logits (n, C) and labels (n,)."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if kind not in ("softmax", "logits"):
        raise ValueError(f"features must be 'softmax' or 'logits', got {kind!r}")
    v = _log_softmax(z) if kind == "softmax" else z
    if per_class:
        return v
    true = v[np.arange(len(y)), y][:, None]
    onehot = np.eye(z.shape[1])[y]
    return np.hstack([-np.sort(-v, axis=1), true, onehot])


def _classifier(seed: int, n_rows: int):
    from sklearn.ensemble import HistGradientBoostingClassifier

    # sklearn's default leaf size (20) cannot split small shadow sets at all (constant
    # scores); scale it with the data instead.
    leaf = max(2, min(20, n_rows // 10))
    return HistGradientBoostingClassifier(
        max_iter=100, learning_rate=0.1, min_samples_leaf=leaf, random_state=seed
    )


def _fit_predict(xtr, ytr, xte, seed):
    if ytr.all() or not ytr.any():  # one class only: no information, score = its prior
        return np.full(len(xte), float(ytr.mean()))
    from threadpoolctl import threadpool_limits

    # One thread: the fit is tiny, and OpenMP spin-waiting on busy shared cores costs
    # orders of magnitude more than it saves.
    with threadpool_limits(1):
        clf = _classifier(seed, len(ytr)).fit(xtr, ytr)
        return clf.predict_proba(xte)[:, 1]


def shadow_scores(
    target_logits,
    target_labels,
    shadow_logits,
    shadow_labels,
    shadow_in,
    per_class: bool = True,
    kind: str = "softmax",
    seed: int = 0,
) -> np.ndarray:
    """Args:
        target_logits: (n, C) target outputs on the candidates; target_labels (n,).
        shadow_logits: (k, m, C) outputs of k shadow models on m attacker examples.
        shadow_labels: (m,) labels of those examples.
        shadow_in: (k, m) bool, shadow j trained on example i.
        per_class: one attack model per class (Shokri) or a single model.
    Returns: (n,) predicted membership probability, higher = member.
    """
    tl = np.asarray(target_logits, dtype=np.float64)
    ty = np.asarray(target_labels, dtype=np.int64)
    sl = np.asarray(shadow_logits, dtype=np.float64)
    sy = np.asarray(shadow_labels, dtype=np.int64)
    sin = np.asarray(shadow_in, dtype=bool)
    k, m, c = sl.shape
    if sin.shape != (k, m) or sy.shape != (m,) or tl.shape[1] != c:
        raise ValueError("shadow_logits (k,m,C), shadow_labels (m,), shadow_in (k,m) mismatch")
    ytr = sin.reshape(-1)
    ylab = np.tile(sy, k)
    xtr_all = features(sl.reshape(k * m, c), ylab, per_class, kind)
    xte_all = features(tl, ty, per_class, kind)
    if not per_class:
        return _fit_predict(xtr_all, ytr, xte_all, seed)
    scores = np.zeros(len(ty))
    for cls in np.unique(ty):
        te = ty == cls
        tr = ylab == cls
        if not tr.any():  # no shadow data of this class: fall back to the single model
            single = shadow_scores(tl, ty, sl, sy, sin, per_class=False, kind=kind, seed=seed)
            scores[te] = single[te]
            continue
        scores[te] = _fit_predict(xtr_all[tr], ytr[tr], xte_all[te], seed)
    return scores

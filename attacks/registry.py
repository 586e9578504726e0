"""The attacks, registered by result name, each with one entry point ``score(inputs)``.

An :class:`Attack` turns :class:`Inputs` (the target's signals, the shadows' signals and
IN masks, the settings) into one score per evaluation point, higher = member; the math
is in the attack's own module (loss, calibration, shadow, lira, rmia), this file only
says which signals each one reads. ``--attacks`` selects families; a family may give
several results (lira → lira_online and lira_offline). Results are computed and
reported in registration order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from attacks import calibration, lira, lm_signals, loss, rmia, shadow
from attacks.config import FAMILIES, AttackConfig
from attacks.signals import Signals

#: target tasks: a sequence classifier, or a causal LM (whose signals are
#: :class:`attacks.lm_signals.LMSignals`: per-sequence loss, p_true, phi and the LM signals)
TASKS = ("classification", "causal-lm")


@dataclass(frozen=True, eq=False)
class ShadowSignals:
    """Signals of k shadow / reference models on the attacker pool (m examples)."""

    in_mask: np.ndarray  # (k, m) bool: shadow j trained on pool example i
    loss: np.ndarray  # (k, m)
    logits: np.ndarray | None  # (k, m, C); None for a causal LM (LMSignals)
    p_true: np.ndarray  # (k, m)
    phi: np.ndarray  # (k, m)

    @classmethod
    def stack(cls, in_mask: np.ndarray, sigs: Sequence) -> ShadowSignals:
        def s(name):
            return np.stack([getattr(x, name) for x in sigs])

        logits = s("logits") if all(hasattr(x, "logits") for x in sigs) else None
        return cls(np.asarray(in_mask, bool), s("loss"), logits, s("p_true"), s("phi"))


@dataclass(frozen=True, eq=False)
class Inputs:
    """What an attack may read. The pool has m examples; the evaluation points (n) and
    RMIA's population z are index sets into it."""

    pool: Signals  # the target on the pool (m rows), or LMSignals for a causal-LM target
    eval_idx: np.ndarray  # (n,) pool indices of the evaluation points
    z_idx: np.ndarray  # pool indices of the population samples z
    shadows: ShadowSignals | None  # None when no selected attack needs shadows
    config: AttackConfig

    @cached_property
    def x(self) -> Signals:
        """The target on the evaluation points (n rows)."""
        return self.pool.subset(self.eval_idx)

    @cached_property
    def x_in(self) -> np.ndarray:
        """(k, n) shadow IN masks on the evaluation points."""
        return self.shadows.in_mask[:, self.eval_idx]


@dataclass(frozen=True)
class Attack:
    name: str  # result name (attacks.json, scores.npz)
    family: str  # what --attacks selects
    score: Callable[[Inputs], np.ndarray]  # (n,) scores, higher = member
    threat_model: Callable[[AttackConfig], str]  # what the attacker is assumed to have
    needs_shadows: bool = True
    tasks: tuple[str, ...] = TASKS  # the target tasks it applies to


REGISTRY: dict[str, Attack] = {}


def register(
    name: str, family: str, threat_model, needs_shadows: bool = True, tasks: tuple = TASKS
):
    """Decorator: register ``score(inputs)`` as attack ``name``; ``threat_model`` is a
    string or a function of the AttackConfig; ``tasks``: the target tasks it applies to."""
    if family not in FAMILIES:
        raise ValueError(f"unknown attack family {family!r}; add it to attacks.config.FAMILIES")
    tm = threat_model if callable(threat_model) else (lambda cfg: threat_model)

    def deco(fn):
        REGISTRY[name] = Attack(name, family, fn, tm, needs_shadows, tuple(tasks))
        return fn

    return deco


def select(families: Sequence[str], task: str = "classification") -> list[Attack]:
    """The registered attacks of these families that apply to a ``task`` target, in
    registration order."""
    return [a for a in REGISTRY.values() if a.family in families and task in a.tasks]


# ---------------------------------------------------------------------------------
@register("loss", "loss", loss.THREAT_MODEL, needs_shadows=False)
def _loss(i: Inputs):
    return loss.loss_scores(i.x.loss)


@register(
    "loss_class", "loss", loss.THREAT_MODEL_CLASS, needs_shadows=False, tasks=("classification",)
)
def _loss_class(i: Inputs):
    return loss.class_centered_scores(i.x.loss, i.x.labels)


@register("calibration", "calibration", calibration.THREAT_MODEL)
def _calibration(i: Inputs):
    return calibration.calibration_scores(i.x.loss, i.shadows.loss[:, i.eval_idx], i.x_in)


def _shadow(i: Inputs, per_class: bool):
    s = i.shadows
    return shadow.shadow_scores(
        i.x.logits,
        i.x.labels,
        s.logits,
        i.pool.labels,
        s.in_mask,
        per_class=per_class,
        seed=i.config.seed,
    )


@register("shadow", "shadow", shadow.THREAT_MODEL, tasks=("classification",))
def _shadow_per_class(i: Inputs):
    return _shadow(i, per_class=True)


@register("shadow_single", "shadow", shadow.THREAT_MODEL, tasks=("classification",))
def _shadow_single(i: Inputs):
    return _shadow(i, per_class=False)


def _lira_threat(text: str):
    return lambda cfg: text + f" (global variance: {cfg.lira_global_variance()})"


@register("lira_online", "lira", _lira_threat(lira.THREAT_MODEL_ONLINE))
def _lira_online(i: Inputs):
    gv = i.config.lira_global_variance()
    return lira.lira_online(i.x.phi, i.shadows.phi[:, i.eval_idx], i.x_in, global_variance=gv)


@register("lira_offline", "lira", _lira_threat(lira.THREAT_MODEL_OFFLINE))
def _lira_offline(i: Inputs):
    gv = i.config.lira_global_variance()
    return lira.lira_offline(i.x.phi, i.shadows.phi[:, i.eval_idx], i.x_in, global_variance=gv)


def _rmia(i: Inputs, offline_a: float | None):
    p, m = i.shadows.p_true, i.shadows.in_mask
    return rmia.rmia_scores(
        i.x.p_true,
        p[:, i.eval_idx],
        i.x_in,
        i.pool.p_true[i.z_idx],
        p[:, i.z_idx],
        m[:, i.z_idx],
        gamma=i.config.rmia_gamma,
        offline_a=offline_a,
    )


@register("rmia_online", "rmia", rmia.THREAT_MODEL)
def _rmia_online(i: Inputs):
    return _rmia(i, offline_a=None)


@register("rmia_offline", "rmia", lambda cfg: rmia.THREAT_MODEL + f" (offline a={cfg.rmia_a})")
def _rmia_offline(i: Inputs):
    return _rmia(i, offline_a=i.config.rmia_a)


# ---------------------------------------------------------------------------------
# Causal LM signals (attacks.lm_signals); the loss, calibration, LiRA and RMIA above read
# the per-sequence loss of an LMSignals target as they read a classifier's.
_LM_THREAT = (
    "query access to the target LM's token log-probabilities on the candidate texts; "
    "no reference models"
)
_LM = {
    "perplexity": ("lm_perplexity", _LM_THREAT),
    "reference": (
        "lm_reference",
        "query access to the target LM's loss and to the base model's (the adapter off: the "
        "public base of a released LoRA) on the candidate texts",
    ),
    "zlib": ("lm_zlib", _LM_THREAT),
    "lowercase": ("lm_lowercase", _LM_THREAT + " (and on their lowercased versions)"),
    "min_k": ("lm_min_k", lambda cfg: _LM_THREAT + f" (k = {cfg.min_k})"),
    "min_k_pp": (
        "lm_min_k_pp",
        lambda cfg: (
            "query access to the target LM's full next-token distributions on the "
            f"candidate texts; no reference models (k = {cfg.min_k})"
        ),
    ),
}


def _lm_attack(score_name: str):
    return lambda i: lm_signals.SCORES[score_name](i.x)


for _name, (_score, _threat) in _LM.items():
    register(_name, "lm", _threat, needs_shadows=False, tasks=("causal-lm",))(_lm_attack(_score))

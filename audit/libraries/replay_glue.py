"""Neighbour replay through the library audits' in-process drivers (#47).

:mod:`audit.replay` sits below :mod:`audit.libraries` (pyproject's layers), so the glue that
runs a Flower training through :class:`audit.libraries.flower.FlowerRun` for
:func:`audit.replay.flower.replay_flower` lives here:

* :func:`replay_flower_case` — ``build()`` returns :func:`audit.libraries.flower.audit_flower`'s
  keyword arguments (a fresh strategy each call: adaptive clipping and the accountant keep
  state); each run wraps the user's ``client_fn`` / ``train`` with the neighbour
  (:func:`audit.replay.flower.wrap_client_fn`, :func:`~audit.replay.flower.wrap_train`) and
  trains with :class:`FlowerRun` (two canary clients, always included: deterministic
  updates of exactly C on their block, the same on D and D′);
* :func:`replay_pfl_case` — ``simulate()`` runs a pfl training (the pfl audit's driver, or the
  user's own); the real users are those without the canary prefix.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["replay_flower_case", "replay_pfl_case"]


def replay_flower_case(
    build: Callable[[], dict],
    *,
    claim=None,
    neighbours=None,
    canaries=None,
    seed: int | None = None,
    log=None,
) -> dict:
    """Replay the Flower training ``build()`` describes (module doc); ``claim``: the one
    ``build()`` holds unless given; ``seed`` (tests, benchmarks): Python's ``random`` and
    numpy's global generator seeded first (the cohorts, the noise; None: as they stand).
    Returns :func:`audit.replay.flower.replay_flower`'s dict."""
    from audit.libraries.flower import FlowerCanaries, FlowerRun
    from audit.replay.flower import replay_flower, wrap_client_fn, wrap_train

    probe = build()
    claim = probe.get("claim") if claim is None else claim
    strategy = probe["strategy"]
    clip = getattr(strategy, "clipping_norm", None)
    if clip is None:  # LocalDpMod: its clip
        clip = next(
            (float(m.clipping_norm) for m in probe.get("mods", ()) if hasattr(m, "clipping_norm")),
            None,
        )

    def once():
        kw = dict(build())
        kw.pop("claim", None)
        if kw.get("client_fn") is not None:
            kw["client_fn"] = wrap_client_fn(kw["client_fn"])
        else:
            kw["train"] = wrap_train(kw["train"])
        can = canaries or FlowerCanaries(m=2, p_include=1.0, seed=0)
        FlowerRun(**kw, canaries=can).run()

    if seed is not None:
        import random

        import numpy as np

        random.seed(seed)
        np.random.seed(seed)
    return replay_flower(once, claim=claim, neighbours=neighbours, clip=clip, log=log)


def replay_pfl_case(
    simulate: Callable[[], object],
    *,
    claim=None,
    neighbours=None,
    log=None,
) -> dict:
    """Replay the pfl training ``simulate()`` runs (module doc): the neighbour is a real
    user (not one of :mod:`audit.libraries.pfl`'s canary users)."""
    from audit.libraries.pfl.canaries import CANARY_PREFIX
    from audit.replay.pfl import replay_pfl

    return replay_pfl(
        simulate,
        claim=claim,
        neighbours=neighbours,
        eligible=lambda uid: not str(uid).startswith(CANARY_PREFIX),
        log=log,
    )

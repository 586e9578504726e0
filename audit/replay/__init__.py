"""Neighbour replay: the deterministic instrument beside the canaries (#47).

Run a training on D with every release recorded, then on neighbours D′ with every random
draw frozen and the recorded outputs handed back, and compare what entered each noise
primitive (‖q(D) − q(D′)‖ against the declared sensitivity) and everything released
without noise. A violation is a concrete neighbouring pair: certain, not a p-value. A pass
covers only the neighbours and positions tried.

* :mod:`audit.replay.record` — :class:`Recorder`, the record/replay tap and the comparison;
* :mod:`audit.replay.neighbours` — the neighbours tried and the bound each is held to;
* :mod:`audit.replay.engine` — the engine's runs (``fedlora audit RUN --neighbours``; the
  job's client-local replay, :func:`replay_recorded`);
* :mod:`audit.replay.script` — a training script, unchanged (``fedlora audit-script``), with
  :mod:`audit.replay.patches` (Opacus and torch's samplers patched at import; the marks of a
  hand-written loop);
* :mod:`audit.replay.flower`, :mod:`audit.replay.pfl` — Flower's and pfl's noise calls.

docs/replay.md says what a replay proves and what a pass covers.

A stage above :mod:`audit.bundle` and below :mod:`audit.libraries` (pyproject's layers).
"""

from fl.lazy import lazy_exports

_EXPORTS = {
    "Recorder": "audit.replay.record",
    "Neighbour": "audit.replay.neighbours",
    "replay_neighbours": "audit.replay.engine",
    "replay_recorded": "audit.replay.engine",
    "audit_script": "audit.replay.script",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

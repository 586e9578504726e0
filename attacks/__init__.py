"""Membership-inference attacks on a released adapter (``fedlora attack``).

What is attacked is a :class:`Target` (a run directory, a release bundle, or a PEFT adapter
trained elsewhere with two files of candidates); :class:`AttackConfig` holds the settings;
:func:`attack` runs every attack and writes ``attacks.json``. The signals
(:mod:`attacks.signals`, :mod:`attacks.lm_signals`), the attacks (:mod:`attacks.loss`,
:mod:`attacks.calibration`, :mod:`attacks.shadow`, :mod:`attacks.lira`, :mod:`attacks.rmia`,
:mod:`attacks.client_level`) and their registry (:mod:`attacks.registry`), the shadow models
(:mod:`attacks.reference`) and the ROC metrics (:mod:`attacks.metrics`). docs/attacks.md has
the threat model and the Python API table.

In a notebook (docs/api.md)::

    import attacks
    doc = attacks.attack(attacks.Target.from_run("runs/dp"), attacks.AttackConfig(attacks=("loss",)))
    doc["attacks"]["loss"]["auc"]

The names below (``__all__``) are imported on first use: ``import attacks`` imports no torch.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "attack": "attacks.run",
    "run_attacks": "attacks.run",
    "run_attacks_adapter": "attacks.run",
    "ATTACKS": "attacks.run",
    "AttackConfig": "attacks.config",
    "parse_attacks": "attacks.config",
    "Target": "attacks.target",
    "TargetSpec": "attacks.target_spec",
    "roc_metrics": "attacks.metrics",
    "load_run": "attacks.rundata",
    "load_bundle": "attacks.rundata",
    "RunData": "attacks.rundata",
    "BundleData": "attacks.rundata",
    "adapter_signals": "attacks.signals",
    "signals_from_logits": "attacks.signals",
    "Signals": "attacks.signals",
    "REGISTRY": "attacks.registry",
    "select": "attacks.registry",
    "train_shadows": "attacks.reference",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

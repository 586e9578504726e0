"""Federated LoRA with differential privacy: the training side of fedlora-audit.

The packages, bottom up: :mod:`fl.linalg` (LoRA factor algebra), :mod:`fl.privacy` (accounting,
clipping, keyed noise, the canaries the engine places), :mod:`fl.data` and :mod:`fl.models`
(datasets, base models, heads), :mod:`fl.methods` (FedAvg, FedASK, FedPower, ... behind one
round contract), :mod:`fl.run` (the configuration, the engine and the run directory it
writes), :mod:`fl.flower` (the same rounds over Flower) and :mod:`fl.cli` (``fedlora train``,
``export``, ``base pretrain``); :mod:`fl.testing` holds the tests' tiny settings.

In a notebook (docs/api.md)::

    import fl
    from fl.testing import tiny_config
    manifest = fl.train(tiny_config(dp_level="sample", epsilon=8.0), "runs/dp", quiet=True)
    manifest["privacy"]["epsilon"]

The names below (``__all__``) are imported on first use: ``import fl`` imports no torch.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "TrainConfig": "fl.run.config",
    "train": "fl.run.engine",
    "Ledger": "fl.privacy.ledger",
    "Event": "fl.privacy.accounting",
    "epsilon": "fl.privacy.accounting",
    "calibrate_noise": "fl.privacy.accounting",
    "UsageError": "fl.errors",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""The federated methods: FedAvg, FedProx, SCAFFOLD, FFA-LoRA, FedSA, FLoRA, FlexLoRA,
HetLoRA, PLoRA, FedASK, FedPower, one module each behind one contract.

A method is a :class:`fl.methods.base.Method` registered by name (:mod:`fl.methods.registry`:
``names()``, ``get(name)``); it sees the engine only through the context protocols of
:mod:`fl.methods.context` and exchanges rounds as in :mod:`fl.methods.rounds` (the import
contract in pyproject.toml keeps the engine, its transports and Flower out of reach).

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "names": "fl.methods.registry",
    "get": "fl.methods.registry",
    "register": "fl.methods.registry",
    "Method": "fl.methods.base",
    "Options": "fl.methods.base",
    "parse_options": "fl.methods.base",
    "ClientView": "fl.methods.context",
    "RunSettings": "fl.methods.context",
    "ServerView": "fl.methods.context",
    "TrainOutcome": "fl.methods.context",
    "Replies": "fl.methods.rounds",
    "RoundInfo": "fl.methods.rounds",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""The engine's rounds over Flower: a transport (:mod:`fl.flower.transport`), the
ClientApp and ServerApp (:mod:`fl.flower.clientapp`, :mod:`fl.flower.serverapp`), the messages'
records (:mod:`fl.flower.records`) and warm simulation workers (:mod:`fl.flower.warm`); the
app entry points live in ``flower_app/``.

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "FlowerTransport": "fl.flower.transport",
    "simulation_grid": "fl.flower.transport",
    "SimulationSession": "fl.flower.transport",
    "shutdown_simulation": "fl.flower.transport",
    "bind_grid": "fl.flower.transport",
    "make_client_app": "fl.flower.clientapp",
    "config_from_run_config": "fl.flower.serverapp",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

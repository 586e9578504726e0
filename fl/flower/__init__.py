"""The engine's rounds over Flower: a transport (:mod:`fl.flower.transport`), the
ClientApp and ServerApp (:mod:`fl.flower.clientapp`, :mod:`fl.flower.serverapp`), the messages'
records (:mod:`fl.flower.records`) and warm simulation workers (:mod:`fl.flower.warm`); the
app entry points live in ``flower_app/``.

The names below (``__all__``) are imported on first use.
"""

from importlib import import_module as _import_module

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


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _import_module(module)
    if module != f"{__name__}.{name}":
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

"""The whole pipeline (`fedlora run`): train, analyze, attack, audit, report; above the
other packages, which never import it.

The modules (``__all__``) are imported on first use.
"""

from importlib import import_module as _import_module

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "cli": "pipeline.cli",
    "job": "pipeline.job",
    "progress": "pipeline.progress",
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

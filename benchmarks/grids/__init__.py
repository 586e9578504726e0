"""Grids of training runs in worker processes (``python -m benchmarks.grids GRID --out DIR``):
the privacy-utility claims (``jobs``, ``claims``), their attacks (``claims_mia``) and the DP
learning grid's helpers (``dplearn_*``). Results go to ``benchmarks/results/claims/``.

The names below (``__all__``) are imported on first use.
"""

from importlib import import_module as _import_module

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "GRIDS": "benchmarks.grids.jobs",
    "RECIPE": "benchmarks.grids.jobs",
    "best_recipe": "benchmarks.grids.jobs",
    "parse_value": "benchmarks.grids.jobs",
    "run_job": "benchmarks.grids.runner",
    "grid_task": "benchmarks.grids.runner",
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

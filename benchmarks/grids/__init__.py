"""Grids of training runs in worker processes (``python -m benchmarks.grids GRID --out DIR``):
the privacy-utility claims (``jobs``, ``claims``), their attacks (``claims_mia``) and the DP
learning grid's helpers (``dplearn_*``). Results go to ``benchmarks/results/claims/``.

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

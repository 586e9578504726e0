"""Timings behind ``fedlora bench``: each module measures A against B interleaved on one machine
and reports ratios (``harness``, ``ratios``, ``readme`` are the shared parts).

The modules (``__all__``) are imported on first use; ``fedlora bench NAME`` runs
``benchmarks.perf.NAME``.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "harness": "benchmarks.perf.harness",
    "ratios": "benchmarks.perf.ratios",
    "readme": "benchmarks.perf.readme",
    "dp_overhead": "benchmarks.perf.dp_overhead",
    "length_buckets": "benchmarks.perf.length_buckets",
    "noise_source": "benchmarks.perf.noise_source",
    "fedask_clip": "benchmarks.perf.fedask_clip",
    "engine_overhead": "benchmarks.perf.engine_overhead",
    "aggregation": "benchmarks.perf.aggregation",
    "attacks": "benchmarks.perf.attacks",
    "shadow_cost": "benchmarks.perf.shadow_cost",
    "accounting": "benchmarks.perf.accounting",
    "grad_share": "benchmarks.perf.grad_share",
    "powerdp_revisions": "benchmarks.perf.powerdp_revisions",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

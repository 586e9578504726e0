"""Side-by-side empirical ε lower bounds: this toolkit vs jax_privacy 2.0 on seeded Gaussian scores.

The comparisons (``__all__``) are imported on first use; ``run_jax`` and ``run_jax_fdp`` run
in a separate environment with jax_privacy installed, so they are not listed.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "arrays": "benchmarks.auditing.jax_privacy.arrays",
    "compare": "benchmarks.auditing.jax_privacy.compare",
    "compare_fdp": "benchmarks.auditing.jax_privacy.compare_fdp",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

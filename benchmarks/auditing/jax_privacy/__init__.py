"""Side-by-side empirical ε lower bounds: this toolkit vs jax_privacy 2.0 on seeded Gaussian scores.

The comparisons (``__all__``) are imported on first use; ``run_jax`` and ``run_jax_fdp`` run
in a separate environment with jax_privacy installed, so they are not listed.
"""

from importlib import import_module as _import_module

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "arrays": "benchmarks.auditing.jax_privacy.arrays",
    "compare": "benchmarks.auditing.jax_privacy.compare",
    "compare_fdp": "benchmarks.auditing.jax_privacy.compare_fdp",
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

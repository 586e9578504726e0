"""Auditing the auditor: how tight the empirical ε bounds are over seeds (``tightness``), which
planted faults the audit catches (``faults``), every method's one-run audit (``audit_methods``),
and the comparison with jax_privacy's auditor (``jax_privacy``). Results in
``benchmarks/results/{tightness,faults,audit_methods,jax_privacy}/``.

The modules (``__all__``) are imported on first use.
"""

from importlib import import_module as _import_module

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "tightness": "benchmarks.auditing.tightness",
    "tightness_tables": "benchmarks.auditing.tightness_tables",
    "faults": "benchmarks.auditing.faults",
    "faults_table": "benchmarks.auditing.faults_table",
    "audit_methods": "benchmarks.auditing.audit_methods",
    "libraries": "benchmarks.auditing.libraries",
    "jax_privacy": "benchmarks.auditing.jax_privacy",
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

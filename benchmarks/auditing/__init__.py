"""Auditing the auditor: how tight the empirical ε bounds are over seeds (``tightness``), which
planted faults the audit catches (``faults``), every method's one-run audit (``audit_methods``),
and the comparison with jax_privacy's auditor (``jax_privacy``). Results in
``benchmarks/results/{tightness,faults,audit_methods,jax_privacy}/``.

The modules (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

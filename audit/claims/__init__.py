"""The claim: a privacy claim made elsewhere (``fedlora audit --claim FILE``).

Takes a claim (TOML: mechanism, σ, C, q or batch/dataset size, steps, δ, the stated ε) and gives
the ε recomputed from the mechanism it describes, with the common accounting mistakes that
would explain a shortfall (``schema``: reading and validating a claim; ``check``: recompute,
compare, name the mistake).

The names below (``__all__``) are imported on first use.
"""

from importlib import import_module as _import_module

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "Claim": "audit.claims.schema",
    "load_claim": "audit.claims.schema",
    "validate_claim": "audit.claims.schema",
    "LEVELS": "audit.claims.schema",
    "SAMPLINGS": "audit.claims.schema",
    "ACCOUNTINGS": "audit.claims.schema",
    "check_claim": "audit.claims.check",
    "ClaimCheck": "audit.claims.check",
    "MATCH_TOLERANCE": "audit.claims.check",
    "UNDERSTATE_TOLERANCE": "audit.claims.check",
    "opacus_sample_rate": "audit.claims.mistakes",
    "epsilon_of_scaled_claim": "audit.claims.implied",
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

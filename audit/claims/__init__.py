"""The claim: a privacy claim made elsewhere (``fedlora audit --claim FILE``).

Takes a claim (TOML: mechanism, σ, C, q or batch/dataset size, steps, δ, the stated ε) and gives
the ε recomputed from the mechanism it describes, with the common accounting mistakes that
would explain a shortfall (``schema``: reading and validating a claim; ``check``: recompute,
compare, name the mistake).

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

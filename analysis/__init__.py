"""The noise analyses and the claims behind the figures (``fedlora analyze``).

One module per analysis, each with ``run(...)`` (rows) and ``table(rows)``:
:mod:`analysis.amplification`, :mod:`analysis.exactness`, :mod:`analysis.hetero`,
:mod:`analysis.refactorization`; the paper claims checked against measurements
(:mod:`analysis.claims`, :mod:`analysis.utility_claims`); their output schemas
(:mod:`analysis.schemas`), statistics (:mod:`analysis.stats`) and figures.

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "amplification": "analysis.amplification",
    "claims": "analysis.claims",
    "exactness": "analysis.exactness",
    "hetero": "analysis.hetero",
    "refactorization": "analysis.refactorization",
    "utility_claims": "analysis.utility_claims",
    "validate": "analysis.schemas",
    "SchemaError": "analysis.schemas",
    "SCHEMAS": "analysis.schemas",
    "mean_ci": "analysis.stats",
    "paired": "analysis.stats",
    "t_quantile": "analysis.stats",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

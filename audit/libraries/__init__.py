"""Real DP libraries audited end to end (#43): canaries that travel the library's own path.

One module per library; each gives one call that instruments a training the library runs
(its sampler, its clipping, its noise) and an ``audit(claim)`` that joins the claim check
(ε recomputed from what the run really used), the conformance tests of the noise
(:mod:`audit.bounds.conformance`), the permutation test of the sampling
(:mod:`audit.bounds.sampling`) and the noise-implied ε into one verdict.

* :mod:`audit.libraries.opacus` — Opacus (flat and per-layer clipping, ghost clipping,
  Poisson and shuffled batches, ``BatchMemoryManager``, ``make_private_with_epsilon``).

A stage above :mod:`audit.canaries` and below :mod:`audit.report` (the import contract in
pyproject.toml). The library is imported only by its own module.

The library modules (``__all__``) are imported on first use (each imports its library).
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "opacus": "audit.libraries.opacus",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

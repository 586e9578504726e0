"""Real DP libraries audited end to end (#43): canaries that travel the library's own path.

One module per library; each gives one call that instruments a training the library runs
(its sampler, its clipping, its noise) and an ``audit(claim)`` that joins the claim check
(ε recomputed from what the run really used), the conformance tests of the noise
(:mod:`audit.bounds.conformance`), the permutation test of the sampling
(:mod:`audit.bounds.sampling`) and the noise-implied ε into one verdict.

* :mod:`audit.libraries.opacus` — Opacus (flat and per-layer clipping, ghost clipping,
  Poisson and shuffled batches, ``BatchMemoryManager``, ``make_private_with_epsilon``).
* :mod:`audit.libraries.hf_trainer` — Opacus inside the Hugging Face ``Trainer``
  (``OpacusAuditCallback``, the recipe's ``OpacusTrainer``; docs/audit_hf_trainer.md).
* :mod:`audit.libraries.flower` — Flower's DP wrappers, legacy and Message API (server-
  and client-side fixed and adaptive clipping, ``LocalDpMod``), run in process with canary
  clients (``audit_flower``; docs/audit_flower.md).
* :mod:`audit.libraries.pfl` — pfl-research's central Gaussian and Laplace mechanisms on
  its simulated federation, with canary users (the ``[pfl]`` extra; docs/audit_pfl.md).
* :mod:`audit.libraries.common` — what every library audit computes alike: the one-run
  lower bound and the sampling tests as members of the conformance family.
* :mod:`audit.libraries.results` — a library audit on disk (``save_result``) and the rows
  ``fedlora report --library-audit DIR`` reads (``load_library_audits``).

Every audit returns the same keys (library, mode, run, claim, the ε's, conformance,
findings, untested, verdict, exit_code); the conformance family is Holm at the verdict's
α = 0.001 (``audit.bounds.conformance.ALPHA``), a test rejected only at 0.05 is a
``conformance_weak`` warning that does not fail the verdict, and ``alpha`` (0.05) is the
one-run lower bound's confidence.

A stage above :mod:`audit.canaries` and below :mod:`audit.report` (the import contract in
pyproject.toml). The library is imported only by its own module.

The library modules (``__all__``) are imported on first use (each imports its library).
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "opacus": "audit.libraries.opacus",
    "hf_trainer": "audit.libraries.hf_trainer",
    "flower": "audit.libraries.flower",
    "flower_audit": "audit.libraries.flower_audit",
    "pfl": "audit.libraries.pfl",
    "results": "audit.libraries.results",
    "common": "audit.libraries.common",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

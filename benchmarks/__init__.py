"""Benchmarks of fedlora-audit, grouped by what they measure, and their committed results.

- ``perf/``: timings (``fedlora bench``): interleaved A/B runs on one machine, reported as ratios.
- ``grids/``: grids of training runs in worker processes (``python -m benchmarks.grids``): the
  privacy-utility claims.
- ``auditing/``: auditing the auditor: tightness over seeds, planted faults, every method's one-run
  audit, the comparison with jax_privacy.
- ``gpu/``: the prepared scripts for a lent GPU.
- ``results/``: what they measured, data only (JSON, JSONL, Markdown); ``results/README.md`` names
  the command and machine of each folder.

The results folder is :data:`benchmarks.paths.RESULTS`. (Nothing is defined here: opacus 1.6
installs a top-level package of its own named ``benchmarks``, which Python may import for this
name outside the repository's root; the editable install still resolves our submodules.)
"""

"""Grids of training runs in worker processes (``python -m benchmarks.grids GRID --out DIR``):
the privacy-utility claims (``jobs``, ``claims``), their attacks (``claims_mia``) and the DP
learning grid's helpers (``dplearn_*``). Results go to ``benchmarks/results/claims/``.
"""

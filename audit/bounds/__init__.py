"""Bounds: empirical lower bounds on ε from canary or attack scores (numpy only).

Takes member and non-member scores (or one run's canary scores with their secret bits) and
gives certified lower bounds on ε at a stated confidence: hypothesis tests on the ROC
(``hypothesis``: Clopper–Pearson, GDP), the one-run bound of Steinke et al. and the f-DP one-run
bound (``fdp``).
"""

"""Auditing the auditor: how tight the empirical ε bounds are over seeds (``tightness``), which
planted faults the audit catches (``faults``), every method's one-run audit (``audit_methods``),
and the comparison with jax_privacy's auditor (``jax_privacy``). Results in
``benchmarks/results/{tightness,faults,audit_methods,jax_privacy}/``.
"""

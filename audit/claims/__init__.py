"""The claim: a privacy claim made elsewhere (``fedlora audit --claim FILE``).

Takes a claim (TOML: mechanism, σ, C, q or batch/dataset size, steps, δ, the stated ε) and gives
the ε recomputed from the mechanism it describes, with the common accounting mistakes that
would explain a shortfall (``schema``: reading and validating a claim; ``check``: recompute,
compare, name the mistake).
"""

"""The seeded score arrays both sides audit (numpy only, so jax_privacy's venv can import it).

Members score N(μ, 1), non-members N(0, 1): exactly μ-GDP, so the true ε(δ) is known in closed
form. Each cell (μ, n) draws from ``numpy.random.default_rng([SEED, round(10 μ), n])``: first n
member scores, then n non-member scores. The recipe, not the arrays, is committed.
"""

from __future__ import annotations

import numpy as np

SEED = 21
MUS = (0.5, 1.0, 2.0, 3.0)
NS = (1_000, 5_000, 20_000)
DELTA = 1e-5
ALPHA = 0.05


def scores(mu: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(in_scores, out_scores), each shape (n,), for the cell (mu, n)."""
    rng = np.random.default_rng([SEED, int(round(10 * mu)), int(n)])
    return rng.normal(mu, 1.0, n), rng.normal(0.0, 1.0, n)


def one_run_inputs(mu: float, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The same cell as the one-run audit sees it: scores (2n,) and is_member (2n,)."""
    x_in, x_out = scores(mu, n)
    member = np.concatenate((np.ones(n, dtype=bool), np.zeros(n, dtype=bool)))
    return np.concatenate((x_in, x_out)), member


def fingerprint(x_in: np.ndarray, x_out: np.ndarray) -> list[float]:
    """[sum of in, sum of out, in[0], out[-1]]: shows both sides audited the same arrays."""
    return [float(x_in.sum()), float(x_out.sum()), float(x_in[0]), float(x_out[-1])]


def cells() -> list[tuple[float, int]]:
    return [(mu, n) for mu in MUS for n in NS]

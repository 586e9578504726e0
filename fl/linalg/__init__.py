"""Pure linear algebra on LoRA factors, shared by the federated methods and ``analysis``.

One package, one topic a module: :mod:`~fl.linalg.core` (weights, stacking, QR, norms and
sums of factored client sets), :mod:`~fl.linalg.svd` (truncated SVD of a factored sum),
:mod:`~fl.linalg.sketching` (Gaussian sketches: FedASK's two stages, subspace iteration),
:mod:`~fl.linalg.aggregate` (the methods' server rules) and :mod:`~fl.linalg.measure`
(aggregation exactness, principal angles). Everything is re-exported here: callers
write ``from fl import linalg`` / ``linalg.factored_svd``.

Conventions
-----------
* A LoRA factor pair is ``B`` (m×r) and ``A`` (r×n); the weight update is
  ΔW = s·B A with s = alpha/r.  Every function here works on ``B`` and ``A``
  **without** the scaling s (the caller applies s in one place) unless it says
  otherwise.
* A client set is given as lists ``Bs`` = [B_1..B_K], ``As`` = [A_1..A_K] and
  ``weights`` = [p_1..p_K] (python floats, a 1-D tensor, or ``None`` = uniform 1/K).
  The ideal aggregate is S = Σ_k p_k B_k A_k (m×n). Client ranks r_k may differ
  wherever a function does not need them equal.
* Tensors in, tensors out; no state, no ``nn.Module``. Any floating dtype works
  (the tests use float64); results keep the dtype/device of the inputs. Scalars are
  returned as 0-dim tensors.
* Nothing here forms an m×n matrix unless its name or docstring says so
  (``dense_sum``, ``fold_modules(dense=True)``, ``flexlora``'s are factored too).
"""

from __future__ import annotations

from fl.linalg.aggregate import (
    fedavg_aggregate,
    fedsa_aggregate,
    ffa_aggregate,
    flexlora_aggregate,
    flexlora_redistribute,
    flora_stack,
    fold_modules,
    hetlora_aggregate,
    hetlora_pad,
    hetlora_truncate,
    hetlora_weights,
    plora_aggregate,
    unfold_modules,
)

# check_pairs, client_weights, weighted_concat, qr_q, factors_from_svd: the helpers that
# fl.privacy.powerdp and the methods share with this package.
from fl.linalg.core import (
    Weights,
    apply_stacked,
    apply_sum,
    apply_sum_t,
    check_pairs,
    client_fro_norms,
    client_weights,
    dense_sum,
    factored_fro_inner,
    factored_fro_norm,
    factored_sum_norm,
    orth,
    qr_q,
    stack_factors,
    weighted_concat,
    weighted_sum,
)
from fl.linalg.measure import (
    aggregation_error,
    largest_principal_angle,
    principal_angles,
    rowspace_angle,
)
from fl.linalg.sketching import (
    gaussian_sketch,
    project,
    refactor,
    sketch,
    sketch_basis,
    subspace_iteration,
)
from fl.linalg.svd import factored_svd, factors_from_svd, truncated_svd_factors

__all__ = [
    "weighted_sum",
    "factored_fro_norm",
    "factored_fro_inner",
    "factored_sum_norm",
    "apply_sum",
    "apply_sum_t",
    "dense_sum",
    "orth",
    "gaussian_sketch",
    "sketch",
    "sketch_basis",
    "project",
    "refactor",
    "factored_svd",
    "truncated_svd_factors",
    "fedavg_aggregate",
    "ffa_aggregate",
    "fedsa_aggregate",
    "flora_stack",
    "flexlora_aggregate",
    "flexlora_redistribute",
    "hetlora_pad",
    "hetlora_truncate",
    "hetlora_weights",
    "hetlora_aggregate",
    "fold_modules",
    "unfold_modules",
    "plora_aggregate",
    "aggregation_error",
    "principal_angles",
    "largest_principal_angle",
    "rowspace_angle",
    "subspace_iteration",
    "Weights",
    "check_pairs",
    "client_weights",
    "weighted_concat",
    "qr_q",
    "stack_factors",
    "apply_stacked",
    "client_fro_norms",
    "factors_from_svd",
]

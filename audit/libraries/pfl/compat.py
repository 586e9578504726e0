"""What the pfl audit (:mod:`audit.libraries.pfl`) imports from pfl, in one place: a missing
extra is one line naming it.
"""

from __future__ import annotations

try:
    import torch
    from pfl.callback.base import TrainingProcessCallback
    from pfl.common_types import Population
    from pfl.metrics import Metrics
    from pfl.postprocessor.base import Postprocessor
    from pfl.privacy import (
        CentrallyAppliedPrivacyMechanism,
        GaussianMechanism,
        LaplaceMechanism,
        LocalPrivacyMechanism,
    )
    from pfl.version import __version__ as PFL_VERSION
    from torch import nn
except ImportError as exc:  # the optional extra
    raise ImportError(
        f"audit.libraries.pfl needs pfl 0.6.0 (missing: {exc.name}): "
        "pip install fedlora-audit[pfl] (or ./scripts/setup.sh)"
    ) from exc

__all__ = [
    "PFL_VERSION",
    "CentrallyAppliedPrivacyMechanism",
    "GaussianMechanism",
    "LaplaceMechanism",
    "LocalPrivacyMechanism",
    "Metrics",
    "Population",
    "Postprocessor",
    "TrainingProcessCallback",
    "nn",
    "torch",
]

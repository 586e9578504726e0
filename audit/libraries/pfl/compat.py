"""What the pfl audit (:mod:`audit.libraries.pfl`) imports from pfl, in one place: a missing
extra is one line naming it, and the releases supported.

pfl 0.1.0 … 0.6.0 have every name the audit reads (``GaussianMechanism.relative_noise_stddev``
and ``privacy_accountant``, ``LaplaceMechanism._epsilon``, the accountants' fields,
``Postprocessor.postprocess_one_user``/``postprocess_server``, the callbacks'
``on_train_begin``/``after_central_iteration``), read from their sources; what moved is
``TrainingProcessCallback`` (``pfl.callback`` in 0.1–0.2, ``pfl.callback.base`` by 0.4).
"""

from __future__ import annotations

import re
import warnings

try:
    import torch
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

    try:  # a package by pfl 0.4; one module in 0.1 and 0.2
        from pfl.callback.base import TrainingProcessCallback
    except ImportError:
        from pfl.callback import TrainingProcessCallback
except ImportError as exc:  # the optional extra
    raise ImportError(
        f"audit.libraries.pfl needs pfl (0.1 … 0.6; missing: {exc.name}): "
        "pip install fedlora-audit[pfl] (or ./scripts/setup.sh)"
    ) from exc

#: the releases supported: pfl 0.1.0 (2024-03, the first) … 0.6.0, read from their sources
SUPPORTED = "pfl >= 0.1, < 0.7 (0.1.0 … 0.6.0)"
#: the first release not yet tried
BEYOND = (0, 7, 0)


def check_version(version: str = PFL_VERSION) -> str:
    """``version`` (default: the installed pfl's); a release from :data:`BEYOND` on is one
    ``RuntimeWarning`` line naming it and :data:`SUPPORTED` (every earlier release is in
    the range: 0.1.0 is pfl's first)."""
    nums = tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])
    if nums >= BEYOND:
        warnings.warn(
            f"audit.libraries.pfl supports {SUPPORTED}; the installed pfl {version} is newer "
            "and not yet tried",
            RuntimeWarning,
            stacklevel=2,
        )
    return version


__all__ = [
    "BEYOND",
    "PFL_VERSION",
    "SUPPORTED",
    "check_version",
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

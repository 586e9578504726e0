"""The pfl audit's the statistics the pfl audit adds: kept as the import path of
:mod:`audit.libraries.pfl.stats` (the pfl audit moved into the ``audit.libraries.pfl`` folder,
#47).
"""

from audit.libraries.pfl.stats import (
    contribution_test,
    laplace_epsilon,
    laplace_tests,
)

__all__ = [
    "contribution_test",
    "laplace_epsilon",
    "laplace_tests",
]

"""The pfl audit's the audit of an instrumented pfl simulation: kept as the import path of
:mod:`audit.libraries.pfl.checks` (the pfl audit moved into the ``audit.libraries.pfl`` folder,
#47).
"""

from audit.libraries.pfl.checks import (
    ALPHA,
    LB_ALPHA,
    PflAudit,
)

__all__ = [
    "ALPHA",
    "LB_ALPHA",
    "PflAudit",
]

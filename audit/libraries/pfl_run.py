"""The pfl audit's what a pfl simulation ran, against its claim and pfl's accountant: kept as the import path of
:mod:`audit.libraries.pfl.run` (the pfl audit moved into the ``audit.libraries.pfl`` folder,
#47).
"""

from audit.libraries.pfl.run import (
    REL_TOL,
    accountant_of,
    claim_findings,
    finding,
    sampling_of,
)

__all__ = [
    "REL_TOL",
    "accountant_of",
    "claim_findings",
    "finding",
    "sampling_of",
]

"""The pfl audit's the canary users, module, observer and callback: kept as the import path of
:mod:`audit.libraries.pfl.canaries` (the pfl audit moved into the ``audit.libraries.pfl`` folder,
#47).
"""

from audit.libraries.pfl.canaries import (
    BLOCK_NAME,
    CANARY_PREFIX,
    PFL_VERSION,
    CanaryCallback,
    CanaryModule,
    CanaryObserver,
    CentrallyAppliedPrivacyMechanism,
    GaussianMechanism,
    LaplaceMechanism,
    LocalPrivacyMechanism,
    PflCanaries,
)

__all__ = [
    "BLOCK_NAME",
    "CentrallyAppliedPrivacyMechanism",
    "GaussianMechanism",
    "LaplaceMechanism",
    "LocalPrivacyMechanism",
    "CANARY_PREFIX",
    "PFL_VERSION",
    "CanaryCallback",
    "CanaryModule",
    "CanaryObserver",
    "PflCanaries",
]

"""Differential privacy in the training: accounting, clipping, keyed noise, canaries.

:mod:`fl.privacy.accounting` (ε of the composed events by PLD and RDP, calibration of σ),
:mod:`fl.privacy.ledger` (a run's record of its DP events), :mod:`fl.privacy.rng` (noise from
a secret key: AES-CTR streams), :mod:`fl.privacy.clipping`, :mod:`fl.privacy.dpsgd` and
:mod:`fl.privacy.wspace` (per-example clipping and the noisy step), :mod:`fl.privacy.powerdp`
(FedPower's mechanism), and the canaries the engine places for the audit
(:mod:`fl.privacy.gradient_canaries`, :mod:`fl.privacy.sampler_canaries`,
:mod:`fl.privacy.canary_clients`).

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "epsilon": "fl.privacy.accounting",
    "epsilon_of_events": "fl.privacy.accounting",
    "calibrate_noise": "fl.privacy.accounting",
    "calibrate_client_level": "fl.privacy.accounting",
    "client_level_event": "fl.privacy.accounting",
    "Event": "fl.privacy.accounting",
    "PrivacyError": "fl.privacy.accounting",
    "NEIGHBOURING": "fl.privacy.accounting",
    "Ledger": "fl.privacy.ledger",
    "NoiseKey": "fl.privacy.rng",
    "derive_seed": "fl.privacy.rng",
    "GradientCanaries": "fl.privacy.gradient_canaries",
    "SamplerCanaries": "fl.privacy.sampler_canaries",
    "CanaryClients": "fl.privacy.canary_clients",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""The bundle: a run directory or a released bundle (``fedlora audit RUN``).

Takes what a run released (manifest, adapter, metrics, and, for the operator, the private
folder and key) and gives findings: the files' integrity and seal, the cross-checks between a
privacy field's copies, ε recomputed from the mechanism that was run (``recompute``), the replay
of the training under the key (``replay``), and the one-run canary audit of a run's own
canaries (``one_run``, called by ``audit``).

The replay itself is :func:`audit.bundle.replay.replay` (it shares its module's name, so it is
not re-exported here). The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "audit_run": "audit.bundle.audit",
    "RunAudit": "audit.bundle.audit",
    "flag_shared_keys": "audit.bundle.audit",
    "canary_scores": "audit.bundle.one_run",
    "claim_check": "audit.bundle.one_run",
    "compare_adapters": "audit.bundle.replay",
    "CUDA_RTOL": "audit.bundle.replay",
    "audit_privacy": "audit.bundle.recompute",
    "PrivacyAudit": "audit.bundle.recompute",
    "ConfigEpsilon": "audit.bundle.recompute",
    "cross_check": "audit.bundle.crosscheck",
    "validate_numbers": "audit.bundle.crosscheck",
    "Participation": "audit.bundle.participation",
    "Stated": "audit.bundle.participation",
    "run_conformance": "audit.bundle.conformance",
    "run_client_conformance": "audit.bundle.client_conformance",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

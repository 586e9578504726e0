"""The audit of a Flower run with canary clients: kept as the import path of
:mod:`audit.libraries.flower.checks` (the audit moved into the ``audit.libraries.flower``
folder, #47).
"""

from audit.libraries.flower.checks import audit_run, check_claim_fields, worst_weight

__all__ = ["audit_run", "check_claim_fields", "worst_weight"]

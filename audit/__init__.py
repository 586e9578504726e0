"""fedlora-audit's auditor: does a DP training implement the privacy it claims?

The stages, bottom up (the import layers: each uses only the stages below it):

- :mod:`audit.bounds`: empirical lower bounds on ε from scores, numpy only
  (:func:`epsilon_lower_bound`, :func:`epsilon_one_run`, :func:`fdp_one_run_bound`) and the
  conformance tests of the noise (:func:`conformance`);
- :mod:`audit.claims`: a privacy claim made elsewhere, its ε recomputed and its mistakes named
  (:func:`load_claim`, :func:`check_claim`);
- :mod:`audit.canaries`: canary sets and the hooks that put them into a training done elsewhere
  (:func:`new_canary_set`, :class:`GradientCanaryHook`, :class:`ClientCanaryHook`), and its
  audit (:func:`audit_outside`);
- :mod:`audit.bundle`: a run directory or a release bundle (:func:`audit_run`);
- :mod:`audit.libraries`: real DP libraries audited end to end;
- :mod:`audit.report`: the report (:func:`build_report`);
- :mod:`audit.cli`: the commands ``fedlora audit``, ``report``, ``canaries``.

Shared by all: :mod:`audit.findings` (:class:`Finding`, :class:`Code`, :class:`Severity`) and
:mod:`audit.records` (the typed results :class:`RunAudit`, :class:`ClaimCheck`,
:class:`ThresholdBound`, :class:`OneRunBound`, :class:`FdpBound`: frozen dataclasses that are
read-only dicts of their JSON too).

In a notebook (docs/api.md has the five common tasks)::

    import audit
    res = audit.audit_run("runs/dp", one_run=True)          # a RunAudit
    print(res.epsilon_pld, res.understated, res.one_run["epsilon_lb"])
    check = audit.check_claim(audit.load_claim("claim.toml"))
    print(check.ratio, [f["code"] for f in check.findings])

The names below (``__all__``) are imported on first use: ``import audit`` imports no torch.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "audit_run": "audit.bundle.audit",
    "RunAudit": "audit.bundle.audit",
    "Claim": "audit.claims.schema",
    "load_claim": "audit.claims.schema",
    "check_claim": "audit.claims.check",
    "ClaimCheck": "audit.claims.check",
    "epsilon_lower_bound": "audit.bounds.hypothesis",
    "ThresholdBound": "audit.bounds.hypothesis",
    "epsilon_one_run": "audit.bounds.one_run",
    "OneRunBound": "audit.bounds.one_run",
    "fdp_one_run_bound": "audit.bounds.fdp",
    "FdpBound": "audit.bounds.fdp",
    "conformance": "audit.bounds.conformance",
    "Block": "audit.bounds.conformance",
    "ConformanceResult": "audit.bounds.conformance",
    "CanarySet": "audit.canaries.canary_set",
    "new_canary_set": "audit.canaries.canary_set",
    "load_canary_set": "audit.canaries.canary_set",
    "GradientCanaryHook": "audit.canaries.hooks",
    "write_params": "audit.canaries.hooks",
    "ClientCanaryHook": "audit.canaries.client_hook",
    "audit_outside": "audit.canaries.outside",
    "build_report": "audit.report.build",
    "Finding": "audit.findings",
    "Code": "audit.findings",
    "Severity": "audit.findings",
    "Record": "audit.records",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

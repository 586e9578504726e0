"""Bounds: empirical lower bounds on ε from canary or attack scores (numpy only).

Takes member and non-member scores (or one run's canary scores with their secret bits) and
gives certified lower bounds on ε at a stated confidence: hypothesis tests on the ROC
(``hypothesis``: Clopper–Pearson, GDP), the one-run bound of Steinke et al. and the f-DP one-run
bound (``fdp``).

The conformance tests themselves are :func:`audit.bounds.conformance.conformance` (also
``audit.conformance``): the function shares its module's name, so it is not re-exported
here. The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "epsilon_lower_bound": "audit.bounds.hypothesis",
    "ThresholdBound": "audit.bounds.hypothesis",
    "clopper_pearson_upper": "audit.bounds.hypothesis",
    "gdp_epsilon": "audit.bounds.hypothesis",
    "gdp_delta": "audit.bounds.hypothesis",
    "epsilon_one_run": "audit.bounds.one_run",
    "OneRunBound": "audit.bounds.one_run",
    "one_run_p_value": "audit.bounds.one_run",
    "fdp_one_run_bound": "audit.bounds.fdp",
    "FdpBound": "audit.bounds.fdp",
    "fdp_one_run_ideal": "audit.bounds.fdp",
    "gdp_tradeoff": "audit.bounds.tradeoff",
    "mechanism_tradeoff": "audit.bounds.tradeoff",
    "ProfileCurve": "audit.bounds.tradeoff",
    "SubsampledGaussian": "audit.bounds.tradeoff",
    "MechanismFamily": "audit.bounds.tradeoff",
    "Block": "audit.bounds.conformance",
    "GroupTest": "audit.bounds.conformance",
    "ConformanceResult": "audit.bounds.conformance",
    "holm": "audit.bounds.conformance",
    "implied_noise_factor": "audit.bounds.conformance",
    "SamplingTest": "audit.bounds.sampling",
    "sampling_test": "audit.bounds.sampling",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

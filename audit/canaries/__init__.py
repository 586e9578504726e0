"""Canaries: the run's own and those for trainings done elsewhere.

Takes a canary kind and count (or a run's canary observations) and gives canary sets
(``canary_set``: new, load, verify), hooks that put canaries into an outside training
(``hooks``: plain PyTorch, Opacus, Flower) and scores (``gradient``: white-box gradient canaries;
``clients``: canary clients at client level; ``observations``: the hooks' files; ``outside`` and
``outside_conformance``: audit of a training done
elsewhere).

The names below (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "CanarySet": "audit.canaries.canary_set",
    "new_canary_set": "audit.canaries.canary_set",
    "load_canary_set": "audit.canaries.canary_set",
    "KINDS": "audit.canaries.canary_set",
    "GradientCanaryHook": "audit.canaries.hooks",
    "describe": "audit.canaries.hooks",
    "write_params": "audit.canaries.hooks",
    "input_canaries": "audit.canaries.hooks",
    "write_input_observations": "audit.canaries.hooks",
    "ClientCanaryHook": "audit.canaries.client_hook",
    "audit_outside": "audit.canaries.outside",
    "read_observations": "audit.canaries.observations",
    "write_observations": "audit.canaries.observations",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

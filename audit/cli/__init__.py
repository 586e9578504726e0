"""The commands: ``fedlora audit``, ``fedlora report`` (``audit``) and ``fedlora canaries``
(``canaries``). Building their parsers imports neither torch nor matplotlib.

The command modules (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "audit": "audit.cli.audit",
    "canaries": "audit.cli.canaries",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

"""The whole pipeline (`fedlora run`): train, analyze, attack, audit, report; above the
other packages, which never import it.

The modules (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "cli": "pipeline.cli",
    "job": "pipeline.job",
    "progress": "pipeline.progress",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

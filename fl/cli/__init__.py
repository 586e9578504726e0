"""The commands: ``fedlora train`` (``train``), ``fedlora export`` (``export``) and ``fedlora base
pretrain`` (``pretrain``). Building their parsers imports no torch.

The command modules (``__all__``) are imported on first use.
"""

from fl.lazy import lazy_exports

#: public name -> the module that defines it (for a submodule, the module itself); each is
#: imported on first use, so that importing the package (as ``fedlora --help`` does) stays light
_EXPORTS = {
    "train": "fl.cli.train",
    "export": "fl.cli.export",
    "pretrain": "fl.cli.pretrain",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

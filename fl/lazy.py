"""Lazy package exports, written once for every package ``__init__`` (as ``flwr/__init__.py``
does by hand): the public names are imported from their modules on first use, so importing a
package (as ``fedlora --help`` does) stays light.

Usage in a package ``__init__``::

    _EXPORTS = {"audit_run": "audit.bundle.audit", ...}   # name -> module that defines it
    __all__ = list(_EXPORTS)
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: dict[str, str], namespace: dict
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for ``package``: a name of ``exports`` (name → the
    module that defines it; a submodule maps to itself) is imported on first use and cached
    in ``namespace`` (the package's globals); any other name raises AttributeError, so that
    ``from package import submodule`` still imports the submodule."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = import_module(module)
        if module != f"{package}.{name}":
            value = getattr(value, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__

"""Methods register themselves by name: ``@register`` on a Method subclass."""

from __future__ import annotations

import importlib

_REGISTRY: dict[str, type] = {}
# Modules imported on first lookup so that every built-in method is registered.
_BUILTIN = (
    "fedavg",
    "ffa",
    "fedsa",
    "fedprox",
    "scaffold",
    "fedask",
    "fedpower",
    "plora",
    "flora",
    "flexlora",
    "hetlora",
    "probe",
)
_loaded = False


def register(cls: type) -> type:
    """Class decorator: register a Method subclass under its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"method {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN:
        name = f"fl.methods.{mod}"
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module must surface
                raise


def names() -> list[str]:
    """The registered methods' names, sorted (the built-in ones included)."""
    _load_builtins()
    return sorted(_REGISTRY)


def get(name: str) -> type:
    """The Method class registered as ``name`` (UsageError for an unknown name)."""
    _load_builtins()
    from fl.errors import UsageError

    if name not in _REGISTRY:
        raise UsageError(f"unknown method {name!r}; choose one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]

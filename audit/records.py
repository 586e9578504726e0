"""Typed results: a frozen dataclass that is also a read-only ``dict`` of its JSON form.

The audit's results (a run's audit, a claim check, the ε lower bounds) are records, as
:class:`audit.findings.Finding` is: attributes with types and completion in a notebook
(``res.epsilon_pld``), and :meth:`Record.to_dict` for the JSON that the CLI and the report
write (the dict these functions returned before they were records, key for key and in
the same order). A record *is* that dict too, read-only, like a ``NamedTuple`` is a
tuple: ``res["epsilon_pld"]``, ``res.get(...)``, ``"one_run" in res``, iterating over the
keys, ``json.dumps(res)``, ``res == {...}`` and ``isinstance(res, dict)`` work as before,
so no caller had to change. Assigning an item raises ``TypeError`` (assigning an
attribute raises ``FrozenInstanceError``); ``res.to_dict()`` or ``dict(res)`` is a mutable
copy. Nested values (the lists of findings, the nested dicts) are the record's own
objects, not copies.

A field named in :attr:`Record.optional_keys` is left out of the dict when it is None: a
key that the dict has only sometimes (``"one_run"`` of a run audit that did not ask for
it). Records pickle and deep-copy (worker processes return them).

A record class is declared as ``@dataclass(frozen=True, kw_only=True, eq=False)`` on
:class:`Record`, its fields in the dict's key order (``eq=False`` keeps the dict's
equality, so a record equals the plain dict of its keys).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

__all__ = ["Record"]


class Record(dict[str, Any]):
    """Base of the typed results: a frozen dataclass whose instances are read-only dicts
    of :meth:`to_dict` (see the module docstring)."""

    #: fields left out of the dict when None (keys the dict has only sometimes)
    optional_keys: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        dict.update(self, self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """The record as a plain dict (the JSON contract): every field in declaration
        order, less the :attr:`optional_keys` that are None."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in self.optional_keys:
                continue
            out[f.name] = value
        return out

    def __reduce__(self):
        return (_rebuild, (type(self), {f.name: getattr(self, f.name) for f in fields(self)}))

    def _read_only(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} is read-only; .to_dict() gives a mutable copy")

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only


def _rebuild(cls: type[Record], values: dict[str, Any]) -> Record:
    return cls(**values)

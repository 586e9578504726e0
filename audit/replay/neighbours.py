"""The neighbours a replay tries, and the bound each one is held to.

A neighbour D′ differs from D in one record (sample level) or one client (client level).
The relation, and so the bound on ‖q(D) − q(D′)‖, is derived from the mechanism's own
accounting, not chosen by the user: the engine and Opacus account Poisson-sampled Gaussians
under add/remove, so a record added or removed is held to the declared sensitivity C, and
a record replaced (remove one, add one) to 2C (the triangle inequality: each of the two
steps moves the sum by at most C).

Adversarial records are placed where bugs live: at the start and at the end of a client's
records (the first and the last physical batch, the first and the last length bucket), in
the largest and the smallest client; an added record is put into every step of its
client's local trainings (its coin frozen to 1), so every release tests it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Neighbour", "ENGINE_KINDS", "DEFAULT_ENGINE", "engine_neighbours", "parse_kinds"]

#: kind -> (relation, what the record is)
ENGINE_KINDS = {
    "remove": ("add/remove", "a typical record removed (the one drawn most often)"),
    "duplicate": ("add/remove", "a copy of a typical record added"),
    "empty": ("add/remove", "an empty text added"),
    "max-length": ("add/remove", "a text of the maximum length added"),
    "flipped": ("add/remove", "a typical record with another label added"),
    "replace": ("replace-one", "a typical record replaced by a copy with another label"),
    # client level: a client whose records are all gone contributes nothing (add/remove
    # one client, bound C)
    "empty-client": ("add/remove-client", "every record of a client removed"),
}
#: what ``fedlora audit RUN --neighbours auto`` and ``fedlora run`` try
DEFAULT_ENGINE = ("remove", "max-length")


@dataclass(frozen=True)
class Neighbour:
    """One neighbour: its ``kind`` (:data:`ENGINE_KINDS`), the ``client`` whose data it
    changes, where an added record goes among the client's records (``at``: ``"start"``
    or ``"end"``), the adjacency ``relation`` and the bound's multiple of the declared
    sensitivity (``factor``: 1 for add/remove, 2 for replace-one)."""

    kind: str
    client: str
    at: str = "end"
    #: the DP level of the run: at client level a record changed changes one client's
    #: update, clipped on both sides: the client is *replaced*, bound 2C
    level: str = "sample"

    @property
    def relation(self) -> str:
        if self.level == "client" and self.kind != "empty-client":
            return "replace-one-client"
        return ENGINE_KINDS[self.kind][0]

    @property
    def factor(self) -> float:
        return 2.0 if self.relation.startswith("replace") else 1.0

    @property
    def adds(self) -> bool:
        return self.kind not in ("remove", "empty-client")

    @property
    def removes(self) -> bool:
        return self.kind in ("remove", "replace")

    @property
    def empties(self) -> bool:
        return self.kind == "empty-client"

    def describe(self) -> str:
        where = f" at the {self.at} of client {self.client}" if self.adds else ""
        what = ENGINE_KINDS[self.kind][1]
        return f"{what}{where}" + ("" if self.adds else f" (client {self.client})")

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "client": self.client,
            "at": self.at if self.adds else None,
            "relation": self.relation,
            "bound": f"{self.factor:g}·C",
            "description": self.describe(),
        }


def parse_kinds(spec: str | None) -> tuple[str, ...]:
    """``--neighbours``: ``auto`` (:data:`DEFAULT_ENGINE`), ``all``, or a comma list of
    kinds; a clear error names an unknown kind. ``empty-client`` applies at client level
    only (it is left out of a sample-level run's neighbours)."""
    if spec is None or spec.strip() in ("", "auto"):
        return DEFAULT_ENGINE
    if spec.strip() == "all":
        return tuple(ENGINE_KINDS)
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    bad = [k for k in kinds if k not in ENGINE_KINDS]
    if bad or not kinds:
        raise ValueError(
            f"--neighbours: unknown kind(s) {bad or [spec]}; expected 'auto', 'all' or a comma "
            f"list of {', '.join(ENGINE_KINDS)}"
        )
    return kinds


def engine_neighbours(
    kinds, sizes: dict[str, int], classification: bool, level: str = "sample"
) -> list[Neighbour]:
    """The neighbours of ``kinds`` for clients of ``sizes`` (public sizes): removals in the
    largest client; additions alternately at the end of the largest client and at the
    start of the smallest; label flips only for classification. ``level``: the run's DP
    level (:attr:`Neighbour.level`)."""
    if not sizes:
        return []
    largest = max(sizes, key=lambda c: (sizes[c], c))
    smallest = min(sizes, key=lambda c: (sizes[c], c))
    out: list[Neighbour] = []
    added = 0
    for k in kinds:
        if k in ("flipped", "replace") and not classification:
            continue
        if k == "empty-client":
            if level == "client":  # sample level: a client is not the unit
                out.append(Neighbour(k, smallest, level=level))
            continue
        if k == "remove":
            out.append(Neighbour(k, largest, level=level))
            continue
        first = added % 2 == 0
        client, at = (largest, "end") if first else (smallest, "start")
        out.append(Neighbour(k, client, at, level=level))
        added += 1
    return out

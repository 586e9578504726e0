"""Record a training's releases on D, replay them on a neighbour D′, compare.

:class:`Recorder` is a :class:`fl.privacy.tap.Tap`. In ``record`` mode it lets every
release through (``q(D) + noise``) and keeps, per release, the value q(D), the released
output and the sensitivity the mechanism's accounting assumes, with where it happened
(the tap's scope: round, client, stage). In ``replay`` mode, run on a neighbour D′ with
every random draw frozen (the same key, the recorded Poisson coins of the records both
datasets share), it hands back the *recorded output* at each release, so the two runs
follow one trajectory (the same model at every step), and keeps q(D′). Then
:meth:`Recorder.compare` checks, release by release:

* ‖q(D) − q(D′)‖₂ ≤ the declared sensitivity (all parts of one release together);
  a larger distance — or a value that is not finite in either run — is a
  ``sensitivity_exceeded`` finding: a concrete neighbouring pair, certain, not a p-value;
* the same releases in the same order (kind and scope): a release missing, added or moved
  on D′ is a ``data_dependent_release`` (the number of steps, rounds or clients depended
  on the data);
* a replay that intercepted no release is never a pass (``replay_empty``).

What a pass covers: only the neighbours and positions tried (docs/audit.md, "Neighbour
replay"). A violation is certain (up to the float tolerance :data:`RTOL`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fl.privacy.tap import Tap, current_scope

__all__ = ["Recorder", "Release", "RTOL", "ATOL_REL", "distance"]

#: relative slack on the declared sensitivity (float32 rounding of the clipped sums)
RTOL = 1e-4
#: slack relative to the size of the sums compared (float32 summation order: about eight
#: float32 ulps of the larger sum; a correct run measured at most 3·10⁻⁸ over the bound)
ATOL_REL = 1e-6


@dataclass
class Release:
    """One release: where (``kind``, ``scope``), its declared ``sensitivity`` and, per
    part, q(D) (``value``), the output released on D, and q(D′) (``neighbour``)."""

    index: int
    kind: str
    scope: dict
    sensitivity: float
    value: dict[str, torch.Tensor] = field(default_factory=dict)
    output: dict[str, torch.Tensor] = field(default_factory=dict)
    neighbour: dict[str, torch.Tensor] = field(default_factory=dict)

    def where(self) -> str:
        s = ", ".join(f"{k} {v}" for k, v in self.scope.items())
        return f"release #{self.index} ({self.kind}{'; ' + s if s else ''})"


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(‖a − b‖₂ over all parts jointly, max(‖a‖, ‖b‖)); NaN when either holds a
    non-finite value or the parts differ (never a small number for a broken input)."""
    if set(a) != set(b):
        return math.nan, math.nan
    sq, na, nb = 0.0, 0.0, 0.0
    for k in a:
        x, y = a[k].double().reshape(-1), b[k].double().reshape(-1)
        if x.shape != y.shape or not (torch.isfinite(x).all() and torch.isfinite(y).all()):
            return math.nan, math.nan
        sq += float((x - y).square().sum())
        na += float(x.square().sum())
        nb += float(y.square().sum())
    return math.sqrt(sq), math.sqrt(max(na, nb))


class Recorder(Tap):
    """The record/replay tap (module doc). One recorder serves one run on D and any
    number of neighbour replays after it (:meth:`start_replay` for each)."""

    def __init__(self):
        self.mode = "record"
        self.releases: list[Release] = []
        self.masks: dict[tuple, list[torch.Tensor]] = {}
        self._mask_seen: dict[tuple, int] = {}
        self._cursor = 0
        self._group: Release | None = None
        self.divergence: str | None = None
        self.extra_releases = 0
        self.mask_map = None  # replay: callable(scope, masks_D, n) -> masks for D′
        #: record: each client's delivery per (round, stage, client) (kept only when
        #: ``keep_deliveries``); replay with ``local`` set: the other clients' are handed back
        self.keep_deliveries = False
        self.deliveries: dict[tuple, object] = {}
        self.local: str | None = None
        self._expected: list[Release] = []

    # ---- the tap -----------------------------------------------------------------------
    def release(self, kind, value, noise, sensitivity, part="", released=None):
        scope = current_scope()
        if self.mode == "record":
            out = value + noise.to(value.dtype) if released is None else released
            rel = self._group
            if rel is None or rel.kind != kind or rel.scope != scope or part in rel.value:
                rel = Release(len(self.releases), kind, scope, float(sensitivity))
                self.releases.append(rel)
                self._group = rel
            rel.value[part] = value.detach().to("cpu", copy=True)
            rel.output[part] = out.detach().to("cpu", copy=True)
            return out
        return self._replay(kind, value, noise, sensitivity, part, scope, released)

    def _replay(self, kind, value, noise, sensitivity, part, scope, released=None):
        if self.divergence is None:
            rel = self._group
            if rel is None or part in rel.neighbour or part not in rel.value:
                exp = self._expected
                rel = exp[self._cursor] if self._cursor < len(exp) else None
                self._cursor += 1
                self._group = rel
            if rel is None:
                self.divergence = (
                    f"the run on D′ made more releases than on D ({len(self._expected)}); the "
                    f"first extra one: {kind} at {scope or 'top level'}"
                )
            elif rel.kind != kind or rel.scope != scope or part not in rel.value:
                self.divergence = (
                    f"{rel.where()} on D was {kind} at {scope or 'top level'} (part "
                    f"{part!r}) on D′: the releases' order or number depends on the data"
                )
            elif tuple(rel.value[part].shape) != tuple(value.shape):
                self.divergence = (
                    f"{rel.where()}: part {part!r} has shape {tuple(value.shape)} on D′, "
                    f"{tuple(rel.value[part].shape)} on D"
                )
            else:
                rel.neighbour[part] = value.detach().to("cpu", copy=True)
                # a copy: the caller may change it in place (DP-SGD divides it by B)
                like = value if released is None else released
                return rel.output[part].to(like.device, like.dtype, copy=True)
        self.extra_releases += 1
        # off the recorded path: nothing frozen
        return value + noise.to(value.dtype) if released is None else released

    def batches(self, masks, n):
        scope = tuple(sorted(current_scope().items()))
        k = self._mask_seen.get(scope, 0)
        self._mask_seen[scope] = k + 1
        key = scope + (("call", k),)
        if self.mode == "record":
            self.masks[key] = [m.clone() for m in masks]
            return masks
        recorded = self.masks.get(key)
        if recorded is None or self.mask_map is None:
            return masks
        return self.mask_map(dict(scope), recorded, n)

    def deliver(self, cid, stage, run):
        key = (dict(current_scope()).get("round"), stage, str(cid))
        if self.mode == "record":
            out = run()
            if self.keep_deliveries:
                import copy

                self.deliveries[key] = copy.deepcopy(out)
            return out
        if self.local is not None and str(cid) != self.local and key in self.deliveries:
            import copy

            return copy.deepcopy(self.deliveries[key])  # its data is D's: its recorded reply
        return run()

    # ---- replay ----------------------------------------------------------------------
    def start_replay(self, mask_map=None, local: str | None = None) -> None:
        """Replay the recorded run on a neighbour next: ``mask_map(scope, masks_D, n′)``
        gives the frozen batches of D′ for a local training (None: as drawn). ``local``:
        retrain only this client (the others' recorded deliveries are handed back, their
        releases are not expected); needs a recording made with ``keep_deliveries``."""
        if local is not None and not self.deliveries:
            raise ValueError("a client-local replay needs deliveries recorded (keep_deliveries)")
        self.mode = "replay"
        self._cursor = 0
        self._group = None
        self._mask_seen = {}
        self.divergence = None
        self.extra_releases = 0
        self.mask_map = mask_map
        self.local = None if local is None else str(local)
        self._expected = [
            r
            for r in self.releases
            if self.local is None or str(r.scope.get("client", self.local)) == self.local
        ]
        for rel in self.releases:
            rel.neighbour = {}

    def adopt_reference(self) -> int:
        """After a replay on D itself (dropout off, say): its values become q(D) of the
        releases it reached, which are then the only ones compared. Returns how many."""
        n = 0
        for rel in self.releases:
            if rel.neighbour and set(rel.neighbour) == set(rel.value):
                rel.value, rel.neighbour = rel.neighbour, {}
                n += 1
        return n

    def compare(self, factor: float = 1.0, limit: int = 5) -> dict:
        """The replay's verdict against the recording (module doc), each release held to
        ``factor`` × its declared sensitivity (2 for a replace-one neighbour): ``releases``
        (recorded), ``compared``, ``violations`` (the first ``limit``, each with where,
        distance, bound), ``n_violations``, ``max_ratio`` (largest distance / bound),
        ``divergence`` (or None), ``empty``, ``passed``."""
        violations, compared, worst = [], 0, 0.0
        for rel in self.releases:
            if not rel.neighbour:
                continue
            compared += 1
            if set(rel.neighbour) != set(rel.value):
                continue  # a partial release: the divergence names it
            d, scale = distance(rel.value, rel.neighbour)
            bound = rel.sensitivity * factor
            ok = math.isfinite(d) and d <= bound * (1 + RTOL) + ATOL_REL * scale
            ratio = d / bound if math.isfinite(d) and bound > 0 else math.inf
            worst = max(worst, ratio)
            if not ok:
                violations.append(
                    {
                        "where": rel.where(),
                        "kind": rel.kind,
                        "scope": rel.scope,
                        "distance": d if math.isfinite(d) else None,
                        "bound": bound,
                        "nonfinite": not math.isfinite(d),
                    }
                )
        missing = self._cursor < len(self._expected) and self.divergence is None
        divergence = self.divergence
        if missing:
            divergence = (
                f"the run on D′ made {self._cursor} of the {len(self._expected)} releases of "
                "the run on D: the number of releases depends on the data"
            )
        return {
            "releases": len(self._expected),
            "compared": compared,
            "violations": violations[:limit],
            "n_violations": len(violations),
            "max_ratio": worst if compared else None,
            "divergence": divergence,
            "empty": not self._expected,
            "passed": bool(self._expected) and not violations and divergence is None,
        }


def comparison_findings(cmp: dict, who: str, relation: str, releases: list) -> list[dict]:
    """The findings of one neighbour's comparison (:meth:`Recorder.compare`), shared by every
    replay: a ``sensitivity_exceeded`` per violation (the first few, the rest counted), then a
    ``data_dependent_release`` for the divergence and for each text in ``releases`` (None
    skipped: an exception on D′, a printed line that moved). ``who`` names the neighbour."""
    from audit.findings import Code

    out = []
    for v in cmp["violations"]:
        measured = "not finite" if v["nonfinite"] else f"{v['distance']:.6g}"
        out.append(
            {
                "code": str(Code.SENSITIVITY_EXCEEDED),
                "severity": "error",
                "message": f"{v['where']}: ‖q(D) − q(D′)‖ = {measured} > {v['bound']:.6g} "
                f"({relation}) for the neighbour {who}",
            }
        )
    if cmp["n_violations"] > len(cmp["violations"]) and out:
        out[-1]["message"] += f" (and {cmp['n_violations'] - len(cmp['violations'])} more releases)"
    for text in (cmp["divergence"], *releases):
        if text:
            out.append(
                {
                    "code": str(Code.DATA_DEPENDENT_RELEASE),
                    "severity": "error",
                    "message": f"neighbour {who}: {text}",
                }
            )
    return out

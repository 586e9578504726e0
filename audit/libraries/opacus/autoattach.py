"""Over 500 lines on purpose: one patch (make_private at import), whose dataset, side channel, model wrapper and audit share the canary ids of every batch.

Sampler canaries attached at import: an unchanged Opacus script audited end to end.

:func:`canaries_at_import` patches ``opacus.PrivacyEngine.make_private`` for a block (the
release's ``make_private_with_epsilon`` computes σ from the user's loader and calls
``make_private``, so it is covered too; a nested call is wrapped once). Inside it every
``make_private`` call gets, in place of the user's objects:

* **the data** — the user's dataset with the included canary records after it
  (:class:`AutoCanaryDataset`: a canary record is record ``template``'s item, unchanged,
  so the user's collate and loop see the shapes they expect). The loader handed to Opacus
  reports the user's loader's length, so Opacus's q = 1/len(loader) and its steps per
  epoch are the user's (every record, canaries included, gets a coin at that q); the
  optimizer's expected batch size is set back to int(N·q) (N the user's dataset size),
  so the training is the user's plus the canaries;
* **the model** — :class:`AutoCanaryModel`, the user's model with the canary block
  (:class:`audit.libraries.opacus.CanaryModel`), whose ``forward(*args, **kwargs)`` is the
  user's: the canary ids do not travel as a third column. They travel by a side channel
  (:class:`CanaryIdChannel`): the dataset notes the id of each item it hands out, the loader's
  collate groups them into the batch's id vector, and the model's forward takes the id
  vector of the batch it reads — the batch whose tensors it is handed (an attribute on
  the collated tensors, else their fingerprint: shape and sum), else the oldest batch of
  its size not yet read (a loop that transforms the batch first). A forward that re-reads
  the last batch (a closure) gets its ids again, which the audit names. A Hugging Face
  output (``.logits``) has its canary rows' labels set to -100 (ignored by the model's
  own cross-entropy: a canary's gradient never reaches the user's parameters) and the
  block's term added to its ``loss``;
* **the optimizer** — the canary block's weight as one more parameter group (per-layer
  clipping: one more norm, the largest of the user's);
* **ghost clipping's criterion** — the user's criterion wrapped by
  :meth:`SamplerCanaries.criterion` (the block's term in each record's loss).

Then :meth:`SamplerCanaries.attach` instruments what ``make_private`` returned, and after
the script :meth:`CanaryRun.audit` audits every attached run against the claim. A call
the canaries cannot ride (an iterable dataset, worker processes, ``wrap_model=False``,
``batch_first=False``, shuffled batches with no room for the canaries, a distributed
module) is passed to Opacus unchanged and named in :attr:`CanaryRun.reasons`: the result
is ``incomplete`` with the reason, never an exception. So is a script that never called
``make_private``, or one that raised inside the canaried run.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from audit.coverage import PARTS, Coverage, decide
from audit.libraries.opacus.canaries import CanaryModel, SamplerCanaries, batch_fingerprint

__all__ = [
    "AutoCanaryDataset",
    "AutoCanaryModel",
    "CanaryRun",
    "canaries_at_import",
    "run_with_canaries",
]

#: the attribute the collate sets on a batch's tensors (the batch's canary ids)
_TAG = "_fedlora_canary_ids"


class _Batch:
    __slots__ = ("ids", "prints", "n")

    def __init__(self, ids: torch.Tensor, prints: list[tuple]) -> None:
        self.ids, self.prints, self.n = ids, prints, int(ids.numel())


def _leaves(obj) -> list[torch.Tensor]:
    """The tensors in a batch (a tensor, a tuple/list, a dict, a Mapping like HF's
    BatchEncoding), depth first."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict) or hasattr(obj, "items") and hasattr(obj, "keys"):
        return [t for v in obj.values() for t in _leaves(v)]
    if isinstance(obj, tuple | list):
        return [t for v in obj for t in _leaves(v)]
    return []


def _print(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), float(t.detach().double().sum().cpu()) if t.numel() else 0.0)


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and abs(a[1] - b[1]) <= 1e-9 * (abs(a[1]) + 1.0)


class CanaryIdChannel:
    """The side channel from the dataset to the model (module doc)."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.queue: deque[_Batch] = deque()
        self.last: _Batch | None = None
        self.by_order = 0  # forwards matched by size and order (the batch transformed)
        self.unmatched = 0  # training forwards with rows and no batch of their size

    def collate(self, fn: Callable) -> Callable:
        def collate(items):
            n = len(items)
            ids = self.pending[-n:] if n else []
            self.pending = []
            batch = fn(items)
            if len(ids) != n:  # items that did not come from the canary dataset
                ids = [-1] * n
            b = _Batch(torch.tensor(ids, dtype=torch.long), [])
            for t in _leaves(batch):
                if t.dim() >= 1 and t.shape[0] == n:
                    b.prints.append(_print(t))
                    with contextlib.suppress(Exception):  # a tensor that holds no attributes
                        setattr(t, _TAG, b)
            self.queue.append(b)
            return batch

        collate.__wrapped__ = fn
        return collate

    def take(self, args, kwargs, training: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the canary ids of the batch this forward reads, its first batch tensor); a
        training forward with no batch of its size is counted (``unmatched``)."""
        ts = [t for t in _leaves(list(args)) + _leaves(kwargs) if t.dim() >= 1]
        x = ts[0] if ts else None
        n = int(x.shape[0]) if x is not None else 0
        dev = x.device if x is not None else None
        hit = next(
            (getattr(t, _TAG) for t in ts if isinstance(getattr(t, _TAG, None), _Batch)), None
        )
        if hit is None and self.queue:
            prints = [_print(t) for t in ts if t.shape[0] == n]
            hit = next(
                (
                    b
                    for b in self.queue
                    if b.n == n and any(_same(p, q) for p in prints for q in b.prints)
                ),
                None,
            )
            if (
                hit is None
                and self.last is not None
                and any(_same(p, q) for p in prints for q in self.last.prints)
            ):
                hit = self.last
            if hit is None:
                hit = next((b for b in self.queue if b.n == n), None)
                self.by_order += hit is not None
        if hit is not None and hit.n != n:
            hit = None
        if hit is None and self.last is not None and self.last.n == n and n > 0:
            hit = self.last  # a forward that re-reads the last batch
        if hit is not None and hit is not self.last and hit in self.queue:
            while self.queue:  # batches collated before it and never read: dropped
                if self.queue.popleft() is hit:
                    break
            self.last = hit
        if hit is None:
            self.unmatched += bool(n) and training
            return torch.full((n,), -1, dtype=torch.long, device=dev), x
        return hit.ids.to(dev), x


class AutoCanaryDataset(torch.utils.data.Dataset):
    """The user's dataset and the included canary records after it; each item is the
    user's (a canary: record ``template``'s item) and its canary id (-1 for a real
    record) goes to the side channel, not into the item."""

    def __init__(self, base, ids, template: int, channel: CanaryIdChannel) -> None:
        self.base, self.ids, self.template, self.channel = (
            base,
            [int(j) for j in ids],
            template,
            channel,
        )
        self.n = len(base)

    def __len__(self) -> int:
        return self.n + len(self.ids)

    def __getitem__(self, i: int):
        if i < 0:
            i += len(self)
        real = i < self.n
        self.channel.pending.append(-1 if real else self.ids[i - self.n])
        return self.base[i if real else self.template]


class _UserLength(torch.utils.data.DataLoader):
    """A loader over the canaried dataset whose ``len`` is the user's loader's: Opacus's
    q = 1/len(loader) and steps stay the user's."""

    def __len__(self) -> int:
        return self._user_len


class AutoCanaryModel(CanaryModel):
    """The user's model with the canary block; ``forward(*args, **kwargs)`` is the user's
    (the canary ids come from the side channel: module doc). Attributes the wrapper does
    not have are read from the user's model (``config``, …)."""

    def __init__(self, model: nn.Module, m: int, channel: CanaryIdChannel) -> None:
        super().__init__(model, m)
        self.channel = channel
        self.cannot: str | None = None

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, *args, **kwargs):
        cid, x = self.channel.take(args, kwargs, self.training and torch.is_grad_enabled())
        is_c = cid >= 0
        labels = kwargs.get("labels")
        all_c = bool(is_c.numel()) and bool(is_c.all())
        if torch.is_tensor(labels) and labels.dim() >= 1 and labels.shape[0] == cid.numel():
            if is_c.any() and labels.is_floating_point():
                self.cannot = (
                    "the model computes its own loss from float labels: the canary rows "
                    "cannot be kept out of it"
                )
            elif all_c:
                kwargs.pop("labels")  # a batch of canaries only: no real record's loss
            elif is_c.any():
                mask = is_c.view(-1, *([1] * (labels.dim() - 1)))
                kwargs["labels"] = labels.masked_fill(mask, -100)
        out = self.model(*args, **kwargs)
        hf = not torch.is_tensor(out) and hasattr(out, "logits")
        logits = out.logits if hf else out
        if not torch.is_tensor(logits) or (logits.dim() and logits.shape[0] != cid.numel()):
            self.cannot = (
                f"the model's output ({type(out).__name__}) is not a tensor (or an output "
                "with .logits) whose first dimension is the batch"
            )
            return out
        shape = [1] * (logits.dim() - 1)
        logits = torch.where(is_c.view(-1, *shape), logits.detach(), logits)
        block = self.canary(cid)
        if self.training and torch.is_grad_enabled():
            self._seen.append(cid[is_c].detach().cpu())
            self._prints.append(batch_fingerprint(x, cid))
            self.terms_made += self.canary.route == "loss"
        logits = logits + block.view(-1, *shape).to(logits.dtype)
        if not hf:
            return logits
        out["logits"] = logits
        loss = out.get("loss") if hasattr(out, "get") else getattr(out, "loss", None)
        if loss is None and all_c and labels is not None:
            loss = logits.sum() * 0.0
        if loss is not None:
            out["loss"] = loss + block.sum().to(loss.dtype)
        return out


class CanaryRun:
    """What the canaries attached to during one run of a script (:func:`canaries_at_import`)."""

    def __init__(self, m: int, seed: int | None, p_include: float) -> None:
        self.m, self.seed, self.p_include = m, seed, p_include
        self.audits: list = []
        self.models: list[AutoCanaryModel] = []
        self.channels: list[CanaryIdChannel] = []
        self.reasons: list[str] = []
        self.error: str | None = None

    def _not_wrapped(self, why: str) -> None:
        self.reasons.append(f"make_private call {len(self.audits) + len(self.reasons) + 1}: {why}")

    def wrap(self, engine, orig, kw: dict):
        """``make_private(**kw)`` with the canaries (module doc), or unchanged with a reason."""
        module, opt, loader = kw.get("module"), kw.get("optimizer"), kw.get("data_loader")
        why = _cannot(module, opt, loader, kw)
        poisson = kw.get("poisson_sampling", True)
        can = None
        if why is None:
            seed = None if self.seed is None else self.seed + len(self.audits)
            can = SamplerCanaries(m=self.m, seed=seed, p_include=self.p_include)
            if not poisson:  # shuffled batches: the canaries must not add a batch
                n, b = len(loader.dataset), loader.batch_size
                k = int(can.included.sum())
                room = (-n) % b if not loader.drop_last else 0
                if k > room:
                    why = (
                        f"shuffled batches (poisson_sampling=False): {k} canary records would "
                        f"add a batch to ceil({n}/{b}) (room for {room}), changing the steps"
                    )
        if why is not None:
            self._not_wrapped(why)
            return orig(engine, **kw)
        ch = CanaryIdChannel()
        model = AutoCanaryModel(module, self.m, ch)
        can._model = model
        block = model.canary.linear.weight
        opt.add_param_group({"params": [block]})
        mgn = kw.get("max_grad_norm")
        if isinstance(mgn, list | tuple):
            kw["max_grad_norm"] = can.max_grad_norms(list(mgn))
        ds = AutoCanaryDataset(loader.dataset, can.included.nonzero()[0], 0, ch)
        cls = _UserLength if poisson else torch.utils.data.DataLoader
        new = cls(
            ds,
            batch_size=loader.batch_size,
            shuffle=isinstance(loader.sampler, torch.utils.data.RandomSampler),
            collate_fn=ch.collate(loader.collate_fn),
            drop_last=loader.drop_last,
            pin_memory=loader.pin_memory,
        )
        new._user_len = len(loader)
        kw.update(module=model, data_loader=new)
        ghost = "ghost" in str(kw.get("grad_sample_mode", ""))
        if ghost:
            crit = kw.get("criterion")
            kw["criterion"] = can.criterion(crit if isinstance(crit, nn.Module) else None)
        try:
            out = orig(engine, **kw)
        except Exception:  # undo what the canaries added; the user's call as it was
            opt.param_groups.pop()
            raise
        dp_opt, dp_loader = out[1], out[-1]
        if poisson:  # the mechanism is the user's: q and steps from the user's loader
            dp_opt.expected_batch_size = int(len(loader.dataset) * (1 / len(loader)))
        self.audits.append(can.attach(engine, dp_opt, dp_loader))
        self.models.append(model)
        self.channels.append(ch)
        return out

    def audit(self, claim, *, permutations: int = 19_999, alpha: float = 0.05) -> dict:
        """Every attached run audited against ``claim`` (:meth:`OpacusAudit.audit`); one
        result: ``verdict``, ``exit_code``, ``coverage`` (merged), ``findings`` (each with
        a ``severity``), ``runs`` (each run's audit), ``reasons`` (what was not wrapped)."""
        cov = Coverage()
        findings: list[dict] = []
        runs: list[dict] = []
        reasons = list(self.reasons)
        if self.error:
            reasons.append(f"the script raised with the canaries attached: {self.error}")
        if claim is None:
            reasons.append("no claim: give --claim (σ, C, q, steps, ε) to audit the canaries")
        for k, (a, model, ch) in enumerate(zip(self.audits, self.models, self.channels)):
            if model.cannot:
                reasons.append(f"run {k + 1}: {model.cannot}")
                continue
            if claim is None or self.error:
                continue
            run_claim, extra = _per_layer_claim(a, claim)
            try:
                res = a.audit(run_claim, permutations=permutations, alpha=alpha, seed=self.seed)
            except ValueError as exc:  # e.g. fewer than two noised steps
                reasons.append(f"run {k + 1}: {exc}")
                continue
            res["side_channel"] = {"by_order": ch.by_order, "unmatched": ch.unmatched}
            res["findings"] = extra + res["findings"]
            if extra:
                res["verdict"], res["exit_code"] = "fail", 1
            runs.append(res)
            cov.merge(Coverage.from_dict(res["coverage"]))
            for f in res["findings"]:
                findings.append({"severity": "error", **f, "where": f"canary run {k + 1}"})
            if ch.unmatched:
                findings.append(
                    {
                        "code": "canary_ids_lost",
                        "severity": "warning",
                        "where": f"canary run {k + 1}",
                        "message": f"{ch.unmatched} training forwards read a batch the side "
                        "channel did not collate (their rows counted as real records)",
                    }
                )
        if not self.audits and not self.reasons and not self.error:
            reasons.append("the script never called PrivacyEngine.make_private")
        if not runs:
            why = "; ".join(reasons) or "no canary run was audited"
            for p in PARTS:
                cov.skip(p, f"canaries: {why}")
        elif reasons:  # a second engine not wrapped: its mechanism is untested
            for p in PARTS:
                cov.tested.pop(p, None)
                cov.skip(p, f"canaries: {'; '.join(reasons)}")
        errors = any(f["severity"] == "error" for f in findings)
        verdict, code = decide(errors, cov)
        return {
            "instrument": "canaries",
            "verdict": verdict,
            "exit_code": code,
            "coverage": cov.to_dict(),
            "findings": findings,
            "runs": runs,
            "reasons": reasons,
        }


def _per_layer_claim(a, claim):
    """Per-layer clipping: the canary block's norm c is one more entry of Opacus's norm
    vector, so the run's C (the norm of the vector, which scales every coordinate's noise)
    is sqrt(C_user² + c²): more noise, the same σ, the same ε. The claim's C is checked
    here against the user's norms, and the canary audit is handed the claim at the run's C
    (its other fields as claimed)."""
    if claim is None or a.mode != "per_layer" or claim.clipping_norm is None:
        return claim, []
    import dataclasses

    c_run = float(a.optimizer.max_grad_norm)
    c_user = math.sqrt(max(c_run**2 - float(a._per_layer_clip) ** 2, 0.0))
    found = []
    if abs(claim.clipping_norm - c_user) > 1e-6 * max(c_user, 1e-300):
        found.append(
            {
                "code": "clipping_norm_mismatch",
                "message": f"the claim's clipping_norm = {claim.clipping_norm:.6g} but the "
                f"run's per-layer norms have norm {c_user:.6g}",
            }
        )
    return dataclasses.replace(claim, clipping_norm=c_run), found


def _cannot(module, opt, loader, kw: dict) -> str | None:
    """Why this ``make_private`` call cannot carry the canaries (None: it can)."""
    if not isinstance(module, nn.Module):
        return f"the module is a {type(module).__name__}, not an nn.Module"
    if type(module).__name__ in ("DistributedDataParallel", "DPDDP", "FSDPModule"):
        return "a distributed module (the canaries ride one process's model)"
    if not isinstance(opt, torch.optim.Optimizer):
        return "no optimizer"
    if not isinstance(loader, torch.utils.data.DataLoader):
        return f"the data_loader is a {type(loader).__name__}, not a torch DataLoader"
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return "an iterable dataset (the canary records need indices)"
    if loader.num_workers:
        return (
            f"the loader uses {loader.num_workers} worker processes: the canary ids cannot "
            "reach the model from them (num_workers=0 to audit)"
        )
    if loader.batch_size is None:
        return "the loader has its own batch_sampler (no batch_size to rebuild it with)"
    if kw.get("wrap_model") is False:
        return "wrap_model=False: the script keeps calling its own model"
    if kw.get("batch_first") is False:
        return "batch_first=False: the canary rows are found on the first dimension"
    try:
        if len(loader.dataset) < 1:
            return "an empty dataset"
    except TypeError:
        return "the dataset has no length"
    return None


@contextlib.contextmanager
def canaries_at_import(m: int = 64, seed: int | None = None, p_include: float = 0.5):
    """Patch ``PrivacyEngine.make_private`` for the block (module doc); yields the
    :class:`CanaryRun`. ``seed`` seeds the inclusion bits (tests; default: the OS's
    entropy)."""
    import opacus

    from audit.libraries.opacus.versions import check_version

    check_version()
    pe = opacus.PrivacyEngine
    orig = pe.__dict__["make_private"]
    run = CanaryRun(m, seed, p_include)
    depth = [0]

    def make_private(self, *args, **kw):
        if args or depth[0]:  # keyword-only in every release; a nested call wraps once
            return orig(self, *args, **kw)
        depth[0] += 1
        try:
            return run.wrap(self, orig, kw)
        finally:
            depth[0] -= 1

    make_private.__wrapped__ = orig
    pe.make_private = make_private
    try:
        yield run
    finally:
        pe.make_private = orig


def run_with_canaries(
    script: str | Path | Callable[[], object],
    claim,
    argv: list[str] | None = None,
    *,
    m: int = 64,
    seed: int | None = None,
    permutations: int = 19_999,
) -> dict:
    """Run ``script`` (as ``__main__``, or call it) once with the canaries attached at
    import and audit what it trained against ``claim`` (:meth:`CanaryRun.audit`); what it
    printed is kept in ``printed``. A script that raises is named, not re-raised."""
    from audit.replay.script import run_script

    t0 = time.time()
    with canaries_at_import(m=m, seed=seed) as run:
        printed, run.error = run_script(script, list(argv or []))
    trained = time.time() - t0
    res = run.audit(claim, permutations=permutations)
    res["printed"] = printed
    total = time.time() - t0
    res["seconds"] = {"run": round(trained, 2), "audit": round(total - trained, 2),
                      "total": round(total, 2)}  # fmt: skip
    return res

"""The run directory's files as the engine writes them: :class:`RunFiles`, a mixin of
:class:`fl.run.engine.Engine`.

The output folder's start (checked, created, undone on a failed start), the noise key and
config.json, splits.json, metrics.jsonl, the checkpoint after each round, the journal of a
round in flight, and the finished run: the adapter, ledger.json, the sealed manifest and the
release. The formats are in :mod:`fl.run.rundir`, :mod:`fl.run.checkpoint`,
:mod:`fl.run.inflight`, :mod:`fl.run.manifest` and :mod:`fl.run.release`.
"""

from __future__ import annotations

import os
import shutil

from fl.errors import UsageError
from fl.io import atomic_write_json, read_json
from fl.models import factors as F
from fl.privacy import rng as R
from fl.privacy.accounting import Event
from fl.run import inflight
from fl.run.checkpoint import load_checkpoint, save_checkpoint
from fl.run.integrity import file_hashes, seal
from fl.run.manifest import build_manifest
from fl.run.release import write_release
from fl.run.rundir import MANIFEST, StartUndo, append_metrics, jsonable, truncate_metrics

__all__ = ["RunFiles"]


def canonical_adapter_config(path) -> None:
    """Rewrite peft's ``adapter_config.json`` with its set-valued fields sorted: peft keeps
    ``target_modules`` as a Python set and writes it in the set's iteration order, which
    changes with the process's string-hash seed, so a run retrained in another process
    (the audit's replay) would write ``["v_proj", "q_proj"]`` where the run wrote
    ``["q_proj", "v_proj"]`` and the release would not compare equal."""
    doc = read_json(path)
    for key in ("target_modules", "exclude_modules"):
        if isinstance(doc.get(key), list):
            doc[key] = sorted(doc[key])
    atomic_write_json(path, doc)


#: the files the operator manifest vouches for (fl.run.integrity): what an audit reads
_SEALED_FILES = (
    "adapter/adapter_config.json",
    "adapter/adapter_model.safetensors",
    "config.json",
    "splits.json",
    "ledger.json",
    "metrics.jsonl",
)


class RunFiles:
    """The engine's file writing and reading. A mixin: it uses the engine's attributes
    (``out``, ``cfg``, ``rand``, ``ledger``, ``method``, ``metrics_rows``, ...) and
    :meth:`fl.run.engine.Engine.log`."""

    def prepare_out(self) -> StartUndo | None:
        """Check (and create) the output folder. A fresh start returns what it found there
        (:class:`fl.run.rundir.StartUndo`), so that a start failing before its first round
        leaves the folder as it was; a resume returns None (its files are never undone)."""
        out = self.out
        undo = None
        if self.resume:
            if not out.is_dir():
                raise UsageError(f"--resume: {out} does not exist")
        else:
            # A directory holding only a lock / temp files was killed before it wrote
            # anything: starting it again is safe.
            if out.exists() and (
                not out.is_dir()
                or any(
                    not p.name.startswith(".") and p.name != R.PRIVATE_DIR for p in out.iterdir()
                )
            ):
                raise UsageError(
                    f"output directory {out} is not empty (use --resume to continue a run)"
                )
            undo = StartUndo(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError, PermissionError) as exc:
            if undo is not None:
                undo.rollback()
            raise UsageError(
                f"cannot create output directory {out}: {exc.strerror or exc}"
            ) from None
        if not os.access(out, os.W_OK):
            raise UsageError(f"output directory {out} is not writable")
        return undo

    def _start_files(self) -> None:
        """Under the run lock, after ``setup`` checked and loaded everything: the noise key
        and its binding (the configuration it was made for: ``--noise-key`` checks it),
        then config.json. From config.json on, `--resume DIR` knows the configuration and
        finds the key beside it; a start killed before config.json released nothing, so
        its key may be replaced."""
        self._setup_randomness()
        if self.resume:
            return
        if self.rand.private:
            self.rand.key.write(self.out, overwrite=True)
            self.rand.key.write_binding(self.out, self.rand.binding_sha256, self.rand.reused_key)
        atomic_write_json(self.out / "config.json", self.cfg.to_dict())

    def _write_inflight(self, r: int, planned: list[Event]) -> None:
        """Journal a round before anything of it is sent (:mod:`fl.run.inflight`)."""
        self._rounds_begun = True  # from here a failed start is not undone
        attempt = self.rand.attempts.get(r, 0)
        charged = self._inflight_charged.get(r, [])
        inflight.write(self.out, r, attempt, self.device.type, self.cfg.transport, planned, charged)

    def _clear_inflight(self, r: int) -> None:
        inflight.clear(self.out)
        self._inflight_charged.pop(r, None)  # the checkpoint just written holds them

    def _splits_doc(self) -> dict:
        ds, sp = self.dataset, self.split
        doc = {
            "members": [ds.ids[i] for i in sp.members],
            "nonmembers": [ds.ids[i] for i in sp.nonmembers],
            "test": [ds.ids[i] for i in sp.test],
            "clients": {
                c: [self.position_ids[i] for i in p] for c, p in self.client_positions.items()
            },
        }
        if self.client_ranks:
            doc["client_ranks"] = self.client_ranks
        if self._canaries:
            doc["canaries"] = [{k: v for k, v in c.items()} for c in self._canaries["canaries"]]
        return doc

    def _append_metrics(self, row: dict) -> None:
        self.metrics_rows.append(row)
        append_metrics(self.out, row)

    def _truncate_metrics(self, completed: int) -> None:
        self.metrics_rows = truncate_metrics(self.out, completed)

    def _save_checkpoint(self, completed: int) -> None:
        save_checkpoint(
            self.out,
            completed,
            self.method,
            self.client_states,
            self.ledger,
            self.sigma,
            self.cfg,
        )

    def _load_checkpoint(self) -> None:
        loaded = load_checkpoint(self.out, self.cfg, self.method, self.sigma)
        if loaded is None:
            self.start_round = 0
            self.log("checkpoint/ has no completed round: starting from round 1")
            return
        self.start_round, self.client_states, self.ledger = loaded
        self.log(
            f"resumed from checkpoint after round {self.start_round}; ε so far "
            f"{self.ledger.epsilon('pld') if self.cfg.dp_level != 'none' else 0:.4f}"
        )

    def _finish(self, wall: float) -> dict:
        cfg = self.cfg
        adapter = self.out / "adapter"
        tmp = self.out / "adapter.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        F.set_state(self.trainer.model, self.method.released_state())
        self.trainer.model.save_pretrained(str(tmp))
        canonical_adapter_config(tmp / "adapter_config.json")
        shutil.rmtree(adapter, ignore_errors=True)
        os.replace(tmp, adapter)
        atomic_write_json(self.out / "ledger.json", self.ledger.state_dict())
        final = next((r for r in reversed(self.metrics_rows) if "accuracy" in r), {})
        eps = (
            {"pld": self.ledger.epsilon("pld"), "rdp": self.ledger.epsilon("rdp")}
            if cfg.dp_level != "none"
            else {"pld": None, "rdp": None}
        )
        manifest = jsonable(build_manifest(self, adapter, wall, final, eps))
        # the manifest vouches for the run's files and is sealed with the run key (fl.run.integrity)
        sealed = [n for n in _SEALED_FILES if (self.out / n).is_file()]
        seal(manifest, self.rand.key, file_hashes(self.out, sealed))
        atomic_write_json(self.out / MANIFEST, manifest)
        if not cfg.inject_fault:  # a run with a planted fault (tests only) is never released
            write_release(self.out, self.out / "release", key=self.rand.key)
        self.log(
            f"done: accuracy={final.get('accuracy', float('nan')):.4f} "
            + (
                f"ε={eps['pld']:.3f} (PLD), {eps['rdp']:.3f} (RDP) at δ={self.delta:g} "
                if eps["pld"] is not None
                else ""
            )
            + f"in {wall:.0f}s → {self.out}"
        )
        return manifest

"""The in-process federated engine: data, one shared model, rounds of stages, ledger,
checkpoints and the run directory.

One base model lives in memory; a client "trains" by loading its starting LoRA state
into it, running local (DP-)SGD and reading the result back.

Randomness: public draws (split, partition, init, Ω, dropout) derive from the public
``--seed``; every draw a DP guarantee relies on (DP-SGD noise, Poisson batches, client
cohorts, server noise, canary choices) comes from the run's secret noise key
(:mod:`fl.privacy.rng`, ``RUN/private/noise.key``), one stream per (purpose, round,
client, stage). Both are functions of their names only, so a resumed run — or a new
run given the same config and key — replays exactly what the first one did.

This module is the round loop: :class:`Engine` (set-up orchestration, the run loop)
and :func:`train`. Its parts live beside it: :mod:`fl.run.files` (the run directory's files:
start, splits, metrics, checkpoints, the in-flight journal, the finished run),
:mod:`fl.run.inflight` (the journal of a round in flight and what resume charges for it),
:mod:`fl.data.tokenized` (TokenizedData), :mod:`fl.run.trainer` (LocalTrainer, TrainResult),
:mod:`fl.run.batches` (poisson_masks), :mod:`fl.run.contexts` (ClientContext, ServerContext, InProcessTransport),
:mod:`fl.run.plan` (the privacy plan: rates, σ/δ, ledger events, cohorts),
:mod:`fl.run.setup` (client ranks, noise streams, canaries), :mod:`fl.run.checkpoint` and
:mod:`fl.run.manifest`. The moved names are re-exported here, so ``from fl.run.engine import
...`` keeps working.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from fl.data.datasets import partition, split_dataset
from fl.data.lm import load_task_dataset, subset, tokenize
from fl.data.tokenized import TokenizedData
from fl.errors import StoppedAtRound, UsageError
from fl.io import RunLock, atomic_write_json, read_json
from fl.methods import registry
from fl.methods.base import RoundInfo, parse_options
from fl.models.base import encoding_tokenizer, resolve_device
from fl.models.causal_lm import check_setup as check_task
from fl.privacy import rng as R
from fl.privacy import tap
from fl.privacy.accounting import Event, PrivacyError, epsilon
from fl.privacy.gradient_canaries import GradientCanaries
from fl.privacy.rng import derive_seed
from fl.run import inflight
from fl.run.batches import poisson_masks
from fl.run.config import TrainConfig
from fl.run.contexts import ClientContext, InProcessTransport, ServerContext
from fl.run.files import RunFiles
from fl.run.plan import PrivacyPlan
from fl.run.rundir import MANIFEST, SCHEMA_VERSION, SPLITS
from fl.run.setup import (
    check_client_sizes,
    check_max_length,
    draw_client_ranks,
    make_canaries,
    run_randomness,
)
from fl.run.trainer import LocalTrainer, TrainResult
from fl.run.transport import Dispatcher, transport_class

#: touch RUN/STOP to stop a run after its current round (clean: nothing in flight)
STOP_FILE = "STOP"


# ---------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------
class Engine(RunFiles, PrivacyPlan):
    def __init__(
        self,
        cfg: TrainConfig,
        out: str | Path,
        resume: bool = False,
        quiet: bool = False,
        noise_key: str | Path | R.NoiseKey | None = None,
        allow_key_reuse: bool = False,
    ):
        self.cfg = cfg.validate()
        self.noise_key_arg = noise_key
        self.allow_key_reuse = allow_key_reuse
        self._setup_done = False
        self._rounds_begun = False  # a fresh start is undone on failure until then
        self.rand: R.RunRandomness | None = None
        self.out = Path(out)
        self.resume = resume
        self.quiet = quiet or not cfg.progress
        self.fault_injector = None  # tests: callable(rnd, cid, stage) -> str | None
        self.round_bytes: dict = {}
        self.client_states: dict[str, dict] = {}
        self.client_ranks: dict[str, int] = {}
        self._log_lines: list[str] = []
        self._pending_log: list[str] = []
        self.rejected_updates = 0
        self._inflight_charged: dict[int, list[Event]] = {}
        self._reenact: dict[int, list[Event]] = {}
        #: the neighbour replay's change of the members (audit.replay.engine), applied in
        #: :meth:`setup` after the public sizes are read: callable(engine, texts, labels,
        #: prompts) -> (texts, labels, prompts), editing ``client_positions`` and
        #: ``position_ids`` as it adds or removes rows; None on every ordinary run
        self.neighbour = None

    # ---- output helpers ----------------------------------------------------------
    def progress(self, it, **kw):
        if self.quiet:
            return it
        from tqdm.auto import tqdm

        return tqdm(it, file=sys.stderr, dynamic_ncols=True, **kw)

    def log(self, msg: str) -> None:
        self._log_lines.append(msg)
        with open(self.out / "run.log", "a", encoding="utf-8") as fh:
            fh.write(msg + "\n")
        if not self.quiet:
            print(msg, file=sys.stderr, flush=True)

    def add_bytes(self, rnd: RoundInfo, cid: str, direction: str, n: int) -> None:
        d = self.round_bytes.setdefault(cid, {"up": 0, "down": 0})
        d[direction] += int(n)

    # ---- set-up ------------------------------------------------------------------
    def setup(self) -> None:
        """Load and check everything the run needs (no file of the run is written here:
        ``run`` calls it before ``_start_files``). Done once."""
        if self._setup_done:
            return
        cfg = self.cfg
        self.device = resolve_device(cfg.device)
        self.method_cls = registry.get(cfg.method)
        if cfg.dp_level not in self.method_cls.dp_levels:
            raise UsageError(
                f"method {cfg.method!r} supports dp levels {self.method_cls.dp_levels}, not {cfg.dp_level!r}"
            )
        if cfg.head_warmup_rounds and not self.method_cls.head_warmup:
            raise UsageError(
                f"head_warmup_rounds: method {cfg.method!r} re-factorizes, merges or sketches "
                "its adapter every round, so head-only rounds do not leave its factors as "
                "they were; use it with fedavg, ffa, fedsa, fedprox or scaffold"
            )
        self.options = parse_options(self.method_cls.Options, cfg.opts)
        self._pending_log += check_task(cfg, self.method_cls)
        ds = load_task_dataset(cfg)
        self.dataset = ds
        split = split_dataset(len(ds), cfg.members, cfg.nonmembers, cfg.test, cfg.seed)
        self.split = split
        member_labels = ds.labels[split.members]
        parts = partition(
            member_labels,
            cfg.clients,
            cfg.partition,
            cfg.dirichlet_alpha,
            cfg.seed,
            cfg.min_client_size,
        )
        check_client_sizes(parts, cfg)
        self.client_positions = {str(k): p for k, p in enumerate(parts)}
        self.client_ranks = draw_client_ranks(cfg)
        self._setup_randomness()
        check_max_length(cfg)
        tok = encoding_tokenizer(cfg.model)  # only encodes: this thread's copy
        texts, prompts, self.position_ids = subset(ds, split.members)
        labels = list(ds.labels[split.members])
        self.public_sizes = {c: len(p) for c, p in self.client_positions.items()}
        gradient = cfg.canaries > 0 and cfg.canary_kind == "gradient"
        self._canaries = (
            {} if gradient else make_canaries(cfg, ds, split, self.rand, self.client_ids())
        )
        for c in self._canaries.get("canaries", []):
            if c["included"]:
                # Added to the client's data (add/remove neighbours), never replacing
                # a member: the one-run audit's bound assumes exactly that relation.
                pos = len(texts)
                texts.append(c["text"])
                labels.append(c["label"])
                if prompts is not None:
                    prompts.append("")  # a canary is plain text: all its tokens are targets
                self.position_ids.append(c["id"])
                cid = c["client"]
                self.client_positions[cid] = np.append(self.client_positions[cid], pos)
        if self.neighbour is not None:  # the neighbour replay's D′ (audit.replay.engine)
            texts, labels, prompts = self.neighbour(self, texts, labels, prompts)
        self.members_data = tokenize(
            cfg.task, texts, labels, tok, cfg.max_length, prompts, self.position_ids
        )
        self.test_data = self._tokenize_rows(split.test, tok)
        self.trainer = LocalTrainer(
            cfg,
            ds.num_classes,
            self.device,
            frozen_encoder=not getattr(self.method_cls, "trains_factors", True),
        )
        self.trainer.prefix.notify = self.log
        if gradient:  # white-box Dirac canaries in DP-SGD's sums (fl.privacy.gradient_canaries)
            self._canaries = GradientCanaries.for_engine(self).splits_doc()
        if cfg.sampler_canaries > 0 and self.out is not None:  # fl.privacy.sampler_canaries
            self.trainer.sampler_out = Path(self.out)
        self.server = ServerContext(self)
        self.method = self.method_cls(self.server, self.options)
        self._setup_privacy()
        self.method.init_state(self.trainer.initial_state())
        self.start_round = 0
        self.metrics_rows: list[dict] = []
        self._setup_done = True

    def _setup_randomness(self) -> None:
        """The run's noise streams (:func:`fl.run.setup.run_randomness`), made once."""
        if self.rand is not None:
            return
        self.rand = run_randomness(
            self.cfg,
            self.noise_key_arg,
            self.out,
            self.resume,
            self._pending_log,
            allow_key_reuse=self.allow_key_reuse,
        )

    # ---- run -----------------------------------------------------------------------
    def run(self) -> dict:
        undo = self.prepare_out()
        try:
            lock = RunLock(self.out)
            lock.__enter__()
        except BaseException:
            # the folder is another process's (or cannot be locked): undo only a folder
            # this start created, never entries another process may be writing
            if undo is not None and undo.created_root is not None:
                undo.rollback()
            raise
        try:
            # Everything (data, partition, model, tokenizer, options, σ) is loaded and
            # checked before the first file of the run is written; a failure up to the
            # first round undoes what this start wrote (never a resumed run's files).
            self.setup()
            self._start_files()
            return self._run_locked()
        except BaseException:
            if undo is not None and not self._rounds_begun:
                # (checkpoint/ is first written by the first round's journal)
                if not (self.out / "checkpoint").exists():
                    undo.rollback()  # under the lock; .lock itself goes with it
            raise
        finally:
            lock.__exit__(None, None, None)

    def _run_locked(self) -> dict:
        t0 = time.time()
        self.setup()
        cfg = self.cfg
        if self.resume:
            self._load_checkpoint()
            self._account_inflight()
        if self.start_round == 0 or not (self.out / SPLITS).exists():
            atomic_write_json(self.out / SPLITS, self._splits_doc())
        if self.start_round >= cfg.rounds and (self.out / MANIFEST).exists():
            self.log(f"run already complete ({cfg.rounds} rounds)")
            return read_json(self.out / MANIFEST)
        self._truncate_metrics(self.start_round)
        dispatcher = Dispatcher(self, self.make_transport())
        for line in self._pending_log:
            self.log(line)
        self._pending_log = []
        self.log(
            f"fedlora train: method={cfg.method} model={cfg.model} dataset={cfg.dataset} "
            f"clients={cfg.clients} rounds={cfg.rounds} dp={cfg.dp_level} σ={self.sigma:.4g} "
            f"δ={self.delta:g} device={self.device}"
            + (f" (resuming at round {self.start_round + 1})" if self.start_round else "")
        )
        rounds = self.progress(
            range(self.start_round, cfg.rounds),
            desc="rounds",
            initial=self.start_round,
            total=cfg.rounds,
        )
        for r in rounds:
            rt = time.time()
            if r in self._reenact:  # a replay of a run whose round r was re-run
                evs = self._reenact.pop(r)
                self.rand.attempts[r] = inflight.final_attempt(evs)
                for ev in evs:
                    self.ledger.record(ev)
            clients = self.sample_clients(r)
            rnd = RoundInfo(index=r, seed=derive_seed(cfg.seed, "round", r), clients=clients)
            planned = self._planned_events(r, clients)
            if self.ledger.would_exceed(planned, cfg.accountant):
                self.log(
                    f"stopping before round {r + 1}: it would take ε past the budget "
                    f"{self.ledger.budget:g} (now {self.ledger.epsilon(cfg.accountant):.3f})"
                )
                break
            self.round_bytes = {}
            self.rejected_updates = 0
            self._write_inflight(r, planned)
            # Under client-level DP the server releases (noise) even for an empty cohort:
            # skipping would reveal that no client was sampled.
            if clients or cfg.dp_level == "client":

                def send(cl, stage, payload, per_client=False, _rnd=rnd):
                    return dispatcher.send(self.method, _rnd, cl, stage, payload, per_client)

                with tap.scope(round=r):  # labels the round's releases (fl.privacy.tap)
                    extra = self.method.server_round(rnd, clients, send) or {}
            else:
                extra = {"skipped": "no client sampled"}
            row = {"round": r + 1, "clients": clients}
            if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
                row.update(
                    self.trainer.evaluate(
                        self.method.released_state(), self.test_data, cfg.eval_batch_size
                    )
                )
                for name, st in self.method.eval_states().items():
                    ev = self.trainer.evaluate(st, self.test_data, cfg.eval_batch_size)
                    row[f"{name}_accuracy"] = ev["accuracy"]
            if cfg.eval_nonmembers and r + 1 == cfg.rounds and len(self.split.nonmembers):
                ev = self.trainer.evaluate(
                    self.method.released_state(), self._validation_data(), cfg.eval_batch_size
                )
                row["val_accuracy"] = ev["accuracy"]
                for k in ("balanced_accuracy", "perplexity"):  # classification / causal-lm
                    if k in ev:
                        row[f"val_{k}"] = ev[k]
            row["epsilon"] = self.ledger.epsilon("pld") if cfg.dp_level != "none" else None
            row["bytes_up"] = sum(v["up"] for v in self.round_bytes.values())
            row["bytes_down"] = sum(v["down"] for v in self.round_bytes.values())
            row["bytes_per_client"] = self.round_bytes
            row["rejected_updates"] = self.rejected_updates
            row.update(extra)
            row["seconds"] = time.time() - rt
            self._append_metrics(row)
            self.log(self._summary_line(row))
            self._save_checkpoint(r + 1)
            self._clear_inflight(r)
            stop = self.out / STOP_FILE
            if stop.exists() and r + 1 < cfg.rounds:
                stop.unlink()
                self.log(f"stopped after round {r + 1} ({STOP_FILE} found); resume with --resume")
                raise StoppedAtRound(
                    f"{self.out}: stopped after round {r + 1} of {cfg.rounds} as {STOP_FILE} "
                    f"asked; no round is in flight: `fedlora train --resume {self.out}` goes on"
                )
        return self._finish(time.time() - t0)

    def _validation_data(self) -> TokenizedData:
        """The non-member pool, tokenized on first use (``--eval-nonmembers``)."""
        if getattr(self, "_val_data", None) is None:
            self._val_data = self._tokenize_rows(
                self.split.nonmembers, encoding_tokenizer(self.cfg.model)
            )
        return self._val_data

    def _tokenize_rows(self, idx, tok) -> TokenizedData:
        """Rows ``idx`` of the data set, tokenized for the run's task."""
        texts, prompts, ids = subset(self.dataset, idx)
        return tokenize(
            self.cfg.task, texts, self.dataset.labels[idx], tok, self.cfg.max_length, prompts, ids
        )

    def noise_key_file(self) -> str | None:
        """Path of the run's key file (for Flower nodes on this machine), or None."""
        if not self.rand.private:
            return None
        if isinstance(self.noise_key_arg, str | Path):
            return str(Path(self.noise_key_arg).resolve())
        own = self.out / R.PRIVATE_DIR / R.KEY_FILE
        return str(own.resolve()) if own.is_file() else None

    def noise_key_id(self) -> str | None:
        return self.rand.key.key_id if self.rand.private else None

    # ---- rounds started but not completed ------------------------------------------
    def replays_bit_exact(self) -> bool:
        """Does re-running a round reproduce its releases bit for bit? On the CPU with
        the in-process transport, yes: every draw is a function of (key, round, client,
        stage) and the computation is deterministic. On a GPU (non-deterministic
        kernels) or over Flower (node-side state outlives a server kill) it may not."""
        return self.device.type == "cpu" and self.cfg.transport == "inprocess"

    def _account_inflight(self) -> None:
        """On resume: a round that was started but not completed may have released. Replayed
        bit for bit it is charged nothing new; otherwise its planned events are charged and
        it is re-run as a new attempt with fresh streams (:mod:`fl.run.inflight`)."""
        res = inflight.resume(
            self.out, self.start_round, self.replays_bit_exact(), self.cfg.dp_level
        )
        if res is None:
            return
        self.rand.attempts[res.round] = res.attempt
        for ev in res.charged:
            self.ledger.record(ev)
        self._inflight_charged[res.round] = list(res.charged)
        self.log(res.message())
        # the journal stays until the re-run journals the round again (an atomic
        # overwrite): a stop before then still finds these charges

    def make_transport(self):
        if self.cfg.transport == "inprocess":
            return InProcessTransport(self)
        # Transports above the engine (Flower) are looked up by name: they import the
        # engine, the engine does not import them (no cycle; see pyproject's contracts).
        return transport_class(self.cfg.transport)(self)

    def _summary_line(self, row: dict) -> str:
        parts = [f"round {row['round']}/{self.cfg.rounds}"]
        if "perplexity" in row:  # causal-lm: next-token accuracy, token-weighted NLL
            parts.append(
                f"ppl={row['perplexity']:.2f} loss={row['loss']:.4f} tok_acc={row['accuracy']:.4f}"
            )
        elif "accuracy" in row:
            parts.append(
                f"acc={row['accuracy']:.4f} bal_acc={row['balanced_accuracy']:.4f} loss={row['loss']:.4f}"
            )
        if row.get("epsilon") is not None:
            parts.append(f"ε={row['epsilon']:.3f}")
        if "train_loss" in row:
            parts.append(f"train_loss={row['train_loss']:.4f}")
        parts.append(f"{row['seconds']:.1f}s")
        return " | ".join(parts)


def train(
    cfg: TrainConfig,
    out: str | Path,
    resume: bool = False,
    quiet: bool = False,
    noise_key: str | Path | R.NoiseKey | None = None,
    reenact: list | None = None,
    allow_key_reuse: bool = False,
) -> dict:
    """Run (or resume) a federated training run; returns the manifest. ``noise_key``: a
    key file (or key) to reuse instead of a fresh secret one (a replay). ``reenact``: the
    replayed run's ledger events; the rounds it re-run after a stop are re-run here as
    the same attempt, with its ``interrupted`` charges at the same place in the ledger.
    ``allow_key_reuse``: a key file made for another configuration is accepted (else
    refused); the run's noise is then recorded as not private (:mod:`fl.run.setup`)."""
    eng = Engine(
        cfg, out, resume=resume, quiet=quiet, noise_key=noise_key, allow_key_reuse=allow_key_reuse
    )
    if reenact:
        eng._reenact = inflight.attempts_from_ledger(reenact)
    return eng.run()


__all__ = [
    "Engine",
    "train",
    "derive_seed",
    "ClientContext",
    "ServerContext",
    "PrivacyError",
    "epsilon",
    "SCHEMA_VERSION",
    "TokenizedData",
    "TrainResult",
    "LocalTrainer",
    "poisson_masks",
    "InProcessTransport",
]

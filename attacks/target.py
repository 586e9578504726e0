"""What is attacked: one frozen record for a run directory, a foreign PEFT adapter or a
release bundle, with its candidate examples and the pipeline its shadows are trained with.

Three ways in (each a constructor of :class:`Target`):

- a run directory (:meth:`Target.from_run`): members and non-members from the run's
  ``splits.json`` are the candidates; the attacker pool adds the run's test examples,
  which are also RMIA's population z; shadows use the run's configuration;
- a foreign adapter (:meth:`Target.from_adapter`): candidates from two CSV/JSONL files,
  pool = z = the candidates; shadows use a reference pipeline (one client, non-private,
  the adapter's rank / alpha / target modules, overridden by ``shadow_config``);
- a release bundle (:meth:`Target.from_bundle`): as a foreign adapter, with the base
  model, max_length, seed and shadow configuration from the bundle's public manifest.

How ``fedlora attack`` names a target is :class:`attacks.target_spec.TargetSpec`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from fl.errors import UsageError


def _signals():
    """attacks.signals, imported on first use: it imports torch, which building the
    command line (``fedlora attack --help``) must not."""
    from attacks import signals

    return signals


KINDS = ("run", "adapter", "bundle")


@dataclass(frozen=True, eq=False)
class Target:
    """A released adapter on its base model, and the attacker pool of m examples:
    candidates (role ``member`` / ``nonmember``, the evaluation points) and, for a run
    directory, the attacker's own examples (role ``test``)."""

    kind: str  # one of KINDS
    source: str  # the run directory, adapter folder or bundle, as attacks.json names it
    adapter_dir: Path  # PEFT adapter folder (adapter_config.json + safetensors)
    base_model: str  # fl.models.base name or local HF folder
    max_length: int  # tokens per example
    base_seed: int  # seed of a random-init base model (tiny-bert, tiny-gpt2)
    num_labels: int  # classes of the head
    batch_size: int  # examples per forward pass when computing signals
    ids: tuple[str, ...]  # (m,) pool ids
    texts: tuple[str, ...]  # (m,)
    labels: np.ndarray  # (m,) int64
    role: np.ndarray  # (m,) "member" | "nonmember" | "test"
    shadow_config: object  # fl.run.config.TrainConfig of the shadows' training pipeline
    pool_note: str  # how the attacker pool was formed (attacks.json's shadow design)
    method: str | None = None  # the target's own method, dataset, DP level, where known
    dataset: str | None = None
    dp_level: str | None = None
    members_from: str | None = None  # the candidate files (foreign adapter, bundle)
    nonmembers_from: str | None = None
    task: str = "classification"  # or "causal-lm" (signals: attacks.lm_signals.LMSignals)
    prompts: tuple[str, ...] | None = None  # (m,) causal-LM instruction prompts
    clients: dict | None = None  # a run's client shards, client id → member ids

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown target kind {self.kind!r}; choose one of {KINDS}")
        m = len(self.texts)
        if not (len(self.ids) == len(self.labels) == len(self.role) == m):
            raise ValueError("ids, texts, labels and role must have one entry per example")

    # ------------------------------------------------------------------ views
    @property
    def eval_idx(self) -> np.ndarray:
        """Pool indices of the evaluation points (members, then non-members)."""
        return np.flatnonzero(self.role != "test")

    @property
    def is_member(self) -> np.ndarray:
        """(n,) bool over the evaluation points."""
        return self.role[self.eval_idx] == "member"

    @property
    def z_idx(self) -> np.ndarray:
        """Pool indices of RMIA's population z: a run's test examples, else the whole pool."""
        if self.kind == "run":
            return np.flatnonzero(self.role == "test")
        return np.arange(len(self.texts))

    @property
    def default_attacks(self) -> tuple[str, ...]:
        """Every attack for a run directory; the loss attack (no shadows) otherwise."""
        from attacks.config import FAMILIES

        return FAMILIES if self.kind == "run" else ("loss",)

    @property
    def default_out(self) -> Path:
        return Path(self.source) / "attacks"

    def signals(self, device="auto", cache_dir=None, progress: bool = True, min_k=0.2):
        """The target model's signals on the whole pool (m rows, pool order):
        :class:`Signals`, or for a causal LM :class:`attacks.lm_signals.LMSignals`
        (with the base model's loss and the lowercased texts' loss)."""
        return self.signals_of(self.adapter_dir, self.base_seed, device, cache_dir, progress, min_k)

    def signals_of(
        self, adapter_dir, seed, device="auto", cache_dir=None, progress=False, min_k=0.2
    ):
        """The signals of ``adapter_dir`` (the target's, or a shadow's, trained from base
        seed ``seed``) on the pool; a shadow's LM signals leave out the base and lowercase
        passes (only the target's are read)."""
        if self.task == "causal-lm":
            from attacks.lm_target import lm_adapter_signals

            return lm_adapter_signals(
                adapter_dir,
                self.base_model,
                list(self.texts),
                None if self.prompts is None else list(self.prompts),
                self.max_length,
                device=device,
                seed=seed,
                k=min_k,
                batch_size=self.batch_size,
                cache_dir=cache_dir,
                extras=Path(adapter_dir) == Path(self.adapter_dir),
            )
        return _signals().adapter_signals(
            adapter_dir,
            self.base_model,
            list(self.texts),
            self.labels,
            self.max_length,
            device=device,
            seed=seed,
            num_labels=self.num_labels,
            batch_size=self.batch_size,
            cache_dir=cache_dir,
            progress=progress,
        )

    def document(self) -> dict:
        """attacks.json's ``target`` block."""
        counts = {
            "n_members": int(self.is_member.sum()),
            "n_nonmembers": int((~self.is_member).sum()),
        }
        if self.task != "classification":
            counts["task"] = self.task
        if self.kind == "run":
            return {
                "run_dir": self.source,
                "model": self.base_model,
                "dataset": self.dataset,
                "method": self.method,
                "dp_level": self.dp_level,
                **counts,
            }
        doc = {
            "adapter": self.source if self.kind == "adapter" else str(self.adapter_dir),
            "model": self.base_model,
            **counts,
        }
        if self.kind == "bundle":
            doc.update(
                bundle=self.source,
                method=self.method,
                dataset=self.dataset,
                dp_level=self.dp_level,
                members_from=self.members_from,
                nonmembers_from=self.nonmembers_from,
            )
        return doc

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_run(cls, run_dir) -> Target:
        """A finished run directory (see :func:`attacks.rundata.load_run`)."""
        from attacks.rundata import load_run
        from fl.run.config import TrainConfig

        run = load_run(run_dir)
        cfg = TrainConfig.from_dict(run.config)
        raw = run.config
        return cls(
            kind="run",
            source=str(run.run_dir),
            adapter_dir=run.run_dir / "adapter",
            base_model=raw["model"],
            max_length=int(raw.get("max_length", 64)),
            base_seed=int(raw.get("seed", 0)),
            num_labels=run.num_labels,
            batch_size=int(raw.get("eval_batch_size", 128)),
            ids=tuple(run.ids),
            texts=tuple(run.texts),
            labels=run.labels,
            role=run.role,
            shadow_config=cfg,
            pool_note="the run's members ∪ non-members ∪ test examples",
            method=cfg.method,
            dataset=cfg.dataset,
            dp_level=cfg.dp_level,
            task=run.task,
            prompts=None if run.prompts is None else tuple(run.prompts),
            clients=_client_shards(run.run_dir),
        )

    @classmethod
    def from_adapter(
        cls,
        adapter,
        model: str,
        members_file,
        nonmembers_file,
        max_length: int = 64,
        base_seed: int = 0,
        shadow_config: dict | None = None,
        text_column: str = "text",
        label_column: str = "label",
        batch_size: int = 128,
    ) -> Target:
        """A PEFT LoRA adapter trained elsewhere, on ``model``, with the candidates of two
        local files. The shadows' reference pipeline is fedlora's centralised training
        (one client, non-private) of a LoRA like the adapter's (:func:`adapter_shadow_fields`:
        rank, alpha, dropout, target modules, layers, the head's pooling), TrainConfig
        defaults overridden by ``shadow_config`` (fields of TrainConfig)."""
        from fl.run.config import TrainConfig

        acfg = _signals().read_adapter_config(adapter)
        base_cfg = base_model_config(model)
        check_max_length(max_length, model, base_cfg)
        causal = acfg.get("task_type") == "CAUSAL_LM"
        if causal:
            from fl.data.lm import load_lm_dataset

            mem, non = (
                load_lm_dataset(str(f), text_column) for f in (members_file, nonmembers_file)
            )
            if (mem.prompts is None) != (non.prompts is None):
                fmt = {True: "text", False: "prompt/response (instruction)"}
                raise UsageError(
                    "the member and non-member files must have one format: "
                    f"{members_file} is {fmt[mem.prompts is None]}, "
                    f"{nonmembers_file} is {fmt[non.prompts is None]}"
                )
            ml, nl = np.zeros(len(mem), np.int64), np.zeros(len(non), np.int64)
            n_cls = 1
            n_mem, n_non = len(mem), len(non)
            texts = tuple(mem.texts) + tuple(non.texts)
        else:
            mem = _read_candidates(members_file, text_column, label_column)
            non = _read_candidates(nonmembers_file, text_column, label_column)
            (ml, nl), n_cls = _joint_labels([mem[1], non[1]])
            if len(set(mem[1]) | set(non[1])) < 2:
                raise UsageError(
                    "need at least 2 distinct labels across the member and non-member files, "
                    f"found {sorted(set(mem[1]) | set(non[1]))}"
                )
            n_mem, n_non = len(mem[0]), len(non[0])
            texts = tuple(mem[0]) + tuple(non[0])
        num_labels = _signals().adapter_num_labels(adapter) or n_cls
        if n_cls > num_labels:
            raise UsageError(
                f"the data has {n_cls} classes but the adapter's head has {num_labels}"
            )
        d = dict(
            model=model,
            dataset="synthetic",
            max_length=max_length,
            clients=1,
            seed=base_seed,
            **adapter_shadow_fields(adapter, acfg, base_cfg),
        )
        if causal:
            d.update(task="causal-lm", lm_format="text" if mem.prompts is None else "instruction")
        d.update(shadow_config or {})
        scfg = TrainConfig.from_dict(d)
        ids = [f"members:{i}" for i in range(n_mem)]
        ids += [f"nonmembers:{i}" for i in range(n_non)]
        return cls(
            kind="adapter",
            source=str(adapter),
            adapter_dir=Path(adapter),
            base_model=model,
            max_length=max_length,
            base_seed=base_seed,
            num_labels=num_labels,
            batch_size=batch_size,
            ids=tuple(ids),
            texts=texts,
            labels=np.concatenate([ml, nl]),
            role=np.array(["member"] * n_mem + ["nonmember"] * n_non),
            shadow_config=scfg,
            pool_note=(
                "the given members ∪ non-members (reference pipeline: fedlora, "
                f"{scfg.clients} client(s), {scfg.rounds} rounds × {scfg.local_steps} steps, "
                f"dp_level={scfg.dp_level}, rank {scfg.rank}, lora_layers {scfg.lora_layers}, "
                f"pooling {scfg.pooling})"
            ),
            members_from=str(members_file),
            nonmembers_from=str(nonmembers_file),
            task=scfg.task,
            prompts=(
                tuple(mem.prompts) + tuple(non.prompts)
                if causal and mem.prompts is not None
                else None
            ),
        )

    @classmethod
    def from_bundle(
        cls,
        bundle_dir,
        members_file,
        nonmembers_file,
        shadow_config: dict | None = None,
        **candidates,
    ) -> Target:
        """A release bundle (``RUN/release``, ``fedlora export``): it carries no member
        list, so the candidates come from two files; the base model, max_length and seed
        from its public manifest, whose configuration (updated with ``shadow_config``)
        also trains the shadows. ``candidates``: ``text_column``, ``label_column``,
        ``batch_size`` of :meth:`from_adapter`."""
        from attacks.rundata import load_bundle

        b = load_bundle(bundle_dir)
        cfg = b.config
        shadow = {k: v for k, v in cfg.items() if k not in ("device", "progress")}
        shadow.update(shadow_config or {})
        t = cls.from_adapter(
            b.adapter_dir,
            cfg["model"],
            members_file,
            nonmembers_file,
            max_length=int(cfg.get("max_length", 64)),
            base_seed=int(cfg.get("seed", 0)),
            shadow_config=shadow,
            **candidates,
        )
        return replace(
            t,
            kind="bundle",
            source=str(b.bundle_dir),
            method=cfg.get("method"),
            dataset=cfg.get("dataset"),
            dp_level=cfg.get("dp_level"),
        )


def _client_shards(run_dir) -> dict | None:
    """splits.json's client shards (client id → ids), None where it has none."""
    from fl.run import rundir

    shards = (rundir.read_splits(run_dir) or {}).get("clients")
    return {str(c): list(ids) for c, ids in shards.items()} if isinstance(shards, dict) else None


def _read_candidates(path, text_column: str, label_column: str) -> tuple[list, list]:
    """(texts, label strings) of a classification candidate file (CSV/JSONL, as
    :func:`fl.data.datasets.load_local` reads it). One label per file is fine: the labels of the
    member and non-member files are pooled (:func:`_joint_labels`)."""
    from fl.data.datasets import read_rows

    rows = read_rows(str(path))
    header = [str(k) for k in rows[0] if k is not None]
    for col in (text_column, label_column):
        if col not in header:
            raise UsageError(f"{path}: column {col!r} not found (have {sorted(header)})")
    texts, labels = [], []
    for i, r in enumerate(rows):
        t, y = r.get(text_column), r.get(label_column)
        if t is None or y is None or str(t).strip() == "" or str(y).strip() == "":
            raise UsageError(
                f"{path}: row {i + 1} has an empty {text_column!r} or {label_column!r}"
            )
        texts.append(str(t))
        labels.append(str(y).strip())
    return texts, labels


def _joint_labels(raw) -> tuple[list[np.ndarray], int]:
    """Map the label strings of several files to one set of class indices (integers as
    themselves, else sorted names, as fl.data.datasets.load_local does for one file)."""
    names = sorted({v for r in raw for v in r})
    if all(v.lstrip("-").isdigit() for v in names):
        vals = [np.asarray([int(v) for v in r], np.int64) for r in raw]
        if min(int(v) for v in names) < 0:
            raise UsageError("integer labels must be >= 0")
        return vals, max(int(v) for v in names) + 1
    return [np.asarray([names.index(v) for v in r], np.int64) for r in raw], len(names)


def base_model_config(model: str):
    """The Hugging Face config of a base model, read without its weights (None when the
    folder has no readable config: loading the model then reports it)."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from fl.models.base import model_folder, tiny_model_config

    hf_logging.set_verbosity_error()  # as fl.models.base does: config notices are not ours
    if model in ("tiny-bert", "tiny-gpt2"):
        return tiny_model_config(model, 2, 30522)  # only positions and layers are read
    path = model_folder(model)  # UsageError for an unknown name
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return None


#: models whose position ids start after the padding index (RoBERTa's offset)
_POSITION_OFFSET = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet")


def model_positions(config) -> int | None:
    """How many tokens the model's position embeddings cover (None: not recorded)."""
    if config is None:
        return None
    for name in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"):
        n = getattr(config, name, None)
        if isinstance(n, int) and n > 0:
            if getattr(config, "model_type", "") in _POSITION_OFFSET:
                n -= int(getattr(config, "pad_token_id", None) or 1) + 1
            return n
    return None


def check_max_length(max_length: int, model: str, config=None) -> None:
    """UsageError when ``max_length`` exceeds the positions of ``model`` (its config,
    read when not given): longer inputs cannot be embedded."""
    n = model_positions(config if config is not None else base_model_config(model))
    if n is not None and max_length > n:
        raise UsageError(
            f"--max-length {max_length} exceeds the {n} token positions of model {model}; "
            f"use --max-length {n} or less"
        )


def adapter_shadow_fields(adapter, acfg: dict, config) -> dict:
    """TrainConfig fields that make the shadows' LoRA like a foreign adapter's: rank,
    alpha, dropout, target modules, the layers it adapts (``layers_to_transform``: the top
    N layers → ``lora_layers`` N; none → every layer; another set → the top layers down to
    its lowest, the smallest top-N set that contains it) and the pooling its head reads
    (:func:`attacks.signals.adapter_pooling`: a Hugging Face classification head reads the
    CLS pooler)."""
    tm = acfg.get("target_modules")
    out = dict(
        rank=int(acfg.get("r", 8)),
        alpha=float(acfg.get("lora_alpha", 16)),
        lora_dropout=float(acfg.get("lora_dropout", 0.0) or 0.0),
        target_modules=",".join(sorted(tm)) if isinstance(tm, list) else "",
        pooling=_signals().adapter_pooling(adapter),
    )
    layers = acfg.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    n_layers = None
    if config is not None:
        n_layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not layers:
        out["lora_layers"] = 0
    elif isinstance(n_layers, int) and all(0 <= int(i) < n_layers for i in layers):
        out["lora_layers"] = n_layers - min(int(i) for i in layers)
    else:
        out["lora_layers"] = 0
    return out

"""A finished causal-LM run read back for scoring: its model with the run's adapter
(:func:`load_run_lm`) and one of its splits tokenized (:func:`run_split_data`). Part of the
run stage (they read a run directory); the model code is :mod:`fl.models.causal_lm`."""

from __future__ import annotations

from pathlib import Path

from fl.errors import UsageError
from fl.models.base import load_tokenizer
from fl.models.causal_lm import load_causal_lm


def load_run_lm(run_dir: str | Path, device="cpu"):
    """(model, tokenizer, cfg) of a finished causal-LM run (a run directory or a release
    bundle): the base model of its config (``tiny-gpt2`` rebuilt from the run's seed)
    with the run's LoRA adapter in place, in eval mode. Score with
    :func:`token_logprobs` (``adapter=False`` for the base model)."""
    import json

    from peft import PeftModel

    from fl.run.config import TrainConfig
    from fl.run.rundir import ADAPTER, MANIFEST

    run = Path(run_dir)
    try:
        man = json.loads((run / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{run}: no readable {MANIFEST} ({exc})") from None
    cfg = TrainConfig.from_dict(man.get("config") or {})
    if cfg.task != "causal-lm":
        raise UsageError(f"{run} is a {cfg.task} run, not a causal-LM run")
    base = load_causal_lm(cfg.model, seed=cfg.seed)
    try:
        model = PeftModel.from_pretrained(base, str(run / ADAPTER), is_trainable=False)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise UsageError(f"cannot load the adapter of {run}: {str(exc).splitlines()[0]}") from None
    model.to(device)
    model.eval()
    return model, load_tokenizer(cfg.model), cfg


def run_split_data(run_dir: str | Path, split: str, tokenizer, cfg):
    """An :class:`fl.data.lm.LmTokenizedData` of one split of a run directory
    (``members``, ``nonmembers`` or ``test``, read from its ``splits.json``, in that
    order; a release bundle has no splits). Returns (data, ids)."""
    import json

    from fl.data.lm import LmTokenizedData, load_task_dataset, subset
    from fl.run.rundir import SPLITS

    try:
        doc = json.loads((Path(run_dir) / SPLITS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{run_dir}: no readable {SPLITS} ({exc})") from None
    if split not in ("members", "nonmembers", "test"):
        raise UsageError(f"unknown split {split!r}; use members, nonmembers or test")
    ds = load_task_dataset(cfg)
    row = {k: i for i, k in enumerate(ds.ids)}
    missing = [k for k in doc[split] if k not in row]
    if missing:
        raise UsageError(f"{run_dir}: {len(missing)} {split} ids not in the dataset ({missing[0]})")
    texts, prompts, ids = subset(ds, [row[k] for k in doc[split]])
    return LmTokenizedData(texts, tokenizer, cfg.max_length, prompts=prompts, ids=ids), ids

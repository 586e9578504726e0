"""What is read from a run directory or a release bundle to attack it.

:func:`load_run` rebuilds a finished run's member, non-member and test examples from its
splits.json and dataset (:class:`RunData`; ids touched by audit canaries are left out);
:func:`load_bundle` reads a release bundle's public configuration and adapter folder
(:class:`BundleData`); :func:`run_signals` scores a run's released adapter on its
examples with :func:`attacks.signals.adapter_signals`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attacks.signals import Signals, adapter_signals, read_adapter_config
from fl.errors import UsageError
from fl.run import rundir

__all__ = ["BundleData", "RunData", "load_bundle", "load_run", "run_signals"]


@dataclass
class RunData:
    """A finished run's config and its member / non-member / test examples."""

    run_dir: Path
    config: dict
    texts: list[str]  # members, then non-members, then test
    labels: np.ndarray  # (n,)
    ids: list[str]
    role: np.ndarray  # (n,) "member" | "nonmember" | "test"
    num_labels: int
    prompts: list[str] | None = None  # causal-LM instruction data: the prompts (texts: responses)
    task: str = "classification"  # the run's TrainConfig.task


def load_run(run_dir: str | Path) -> RunData:
    """Read manifest.json + splits.json and rebuild the examples from the dataset
    (ids ``<dataset>:<row>`` → rows via ``TextDataset.ids``); ids touched by audit
    canaries are left out (see below)."""
    from fl.data.datasets import load_dataset

    d = Path(run_dir)
    man = rundir.read_manifest(d)
    if rundir.is_release(man):
        raise UsageError(
            f"{d} is a release bundle: it carries no member list (the members are in the "
            f"operator's splits.json); attack it with `fedlora attack {d} --members FILE "
            "--nonmembers FILE`"
        )
    cfg = man.get("config")
    if not isinstance(cfg, dict) or "dataset" not in cfg or "model" not in cfg:
        raise UsageError(f"{d}/manifest.json has no usable 'config' block")
    splits = rundir.read_splits(d)
    if splits is None:
        raise UsageError(f"{d} has no splits.json (the run's member list); cannot attack it")
    task = cfg.get("task", "classification")
    if task == "causal-lm":
        from fl.data.lm import load_lm_dataset

        ds = load_lm_dataset(
            cfg["dataset"],
            cfg.get("text_column", "text"),
            cfg.get("prompt_field", "prompt"),
            cfg.get("response_field", "response"),
            cfg.get("lm_format", "auto"),
        )
    else:
        ds = load_dataset(
            cfg["dataset"], cfg.get("text_column", "text"), cfg.get("label_column", "label")
        )
    pos = {i: k for k, i in enumerate(ds.ids)}
    # Audit canaries (handled by audit/) make some ids ambiguous: an included canary
    # replaced the member at its position (that member was never trained on), and a
    # canary's source is a non-member whose text (mislabelled) may have been trained on.
    # Both are left out of the attack.
    skip = set()
    for c in splits.get("canaries", []) or []:
        if c.get("source_id"):
            skip.add(c["source_id"])
        p = c.get("position")
        if c.get("included") and p is not None and 0 <= int(p) < len(splits.get("members", [])):
            skip.add(splits["members"][int(p)])
    texts, labels, ids, role, prompts = [], [], [], [], []
    for r, key in (("member", "members"), ("nonmember", "nonmembers"), ("test", "test")):
        for i in splits.get(key, []):
            if i in skip:
                continue
            if i not in pos:
                raise UsageError(f"{d}/splits.json: id {i!r} is not in dataset {cfg['dataset']!r}")
            texts.append(ds.texts[pos[i]])
            prompts.append(None if ds.prompts is None else ds.prompts[pos[i]])
            labels.append(int(ds.labels[pos[i]]))
            ids.append(i)
            role.append(r)
    role = np.asarray(role)
    if not (role == "member").any() or not (role == "nonmember").any():
        raise UsageError(f"{d}/splits.json needs both members and non-members to attack")
    return RunData(
        d, cfg, texts, np.asarray(labels, np.int64), ids, role, ds.num_classes,
        None if ds.prompts is None else prompts, task,
    )  # fmt: skip


@dataclass
class BundleData:
    """A release bundle's adapter and public configuration (no member list)."""

    bundle_dir: Path
    adapter_dir: Path
    config: dict
    num_labels: int | None
    manifest: dict


def load_bundle(bundle_dir: str | Path) -> BundleData:
    """Read a release bundle (``RUN/release``, ``fedlora export``): its public manifest's
    configuration (base model, max_length, seed) and the adapter folder."""
    from fl.io import read_json

    d = Path(bundle_dir)
    if not (d / rundir.MANIFEST).is_file():
        raise UsageError(f"{d} has no manifest.json (not a release bundle)")
    man = read_json(d / rundir.MANIFEST)
    if not rundir.is_release(man):
        raise UsageError(f"{d} is not a release bundle (its manifest is not the public one)")
    cfg = man.get("config")
    if not isinstance(cfg, dict) or "model" not in cfg:
        raise UsageError(f"{d}/manifest.json has no usable 'config' block")
    read_adapter_config(d / rundir.ADAPTER)
    n = (man.get("data") or {}).get("num_classes")
    return BundleData(d, d / rundir.ADAPTER, cfg, n if isinstance(n, int) else None, man)


def run_signals(
    run: RunData | str | Path,
    texts: list[str] | None = None,
    labels=None,
    device="auto",
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> Signals:
    """Signals of a run's released adapter, on the given examples (default: all of the
    run's members, non-members and test examples, in ``RunData`` order)."""
    run = load_run(run) if not isinstance(run, RunData) else run
    cfg = run.config
    if texts is None:
        texts, labels = run.texts, run.labels
    return adapter_signals(
        run.run_dir / "adapter",
        cfg["model"],
        texts,
        labels,
        int(cfg.get("max_length", 64)),
        device=device,
        seed=int(cfg.get("seed", 0)),
        num_labels=run.num_labels,
        batch_size=int(cfg.get("eval_batch_size", 128)),
        cache_dir=cache_dir,
        progress=progress,
    )

"""Shadow / reference models: the same training pipeline on attacker data with known splits.

Design (the standard LiRA set-up, Carlini et al. 2022): the attacker has a pool of n
examples — the candidates it wants to score plus its own same-distribution data — and
trains k shadow models, each on a random half of the pool. Shadows come in complementary
pairs (shadow 2j trains on a half H_j, shadow 2j+1 on the rest), so every example is IN
exactly ⌊k/2⌋ or ⌈k/2⌉ shadows and OUT of the others. The same shadows serve as Watson's
reference models (calibration uses the OUT ones), Shokri's shadow models, LiRA's shadows
and RMIA's reference models.

Each shadow is a full ``fl.run.engine.train`` run with the target's configuration (same model,
method, federated set-up, rounds, local steps, DP level and budget, and seed — the seed
fixes the random-init base of tiny models, which the attacker is assumed to know); only
the data differs. The pool is written to a JSONL file whose row order makes
``fl.data.datasets.split_dataset`` pick exactly the chosen half as members (verified after
training against the shadow's splits.json). Finished shadows are reused on later calls
when their configuration and data are unchanged.

Shadows are independent tasks (:mod:`fl.distributed`: on Ray, or in this process one
after another, with the same results). With LoRA on the top layers, the frozen prefix is
the same model for every shadow and every shadow's data is a subset of the pool: each
process encodes the whole pool once (:func:`fl.models.heads.shared_rows`) and every shadow's
halves take their rows from it, so a shadow costs its top-layer training only.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fl.errors import UsageError


@dataclass
class ShadowSet:
    in_mask: np.ndarray  # (k, n) bool: shadow j trained on pool example i
    adapter_dirs: list[Path]  # k PEFT adapter folders
    seconds: list[float]  # wall seconds to train each shadow (when it was trained)
    reused: list[bool]  # True where a finished shadow from an earlier call was reused
    config: dict  # the first shadow's TrainConfig (dataset/members differ per shadow)


def shadow_halves(n: int, k: int, seed: int) -> np.ndarray:
    """(k, n) bool IN masks: complementary pairs of random halves (odd k: last unpaired)."""
    if k < 1 or n < 2:
        raise UsageError(f"need >= 1 shadow and >= 2 pool examples, got k={k}, n={n}")
    rng = np.random.default_rng([seed, 0x5AD0])
    masks = np.zeros((k, n), dtype=bool)
    for j in range(0, k, 2):
        h = np.zeros(n, dtype=bool)
        h[rng.permutation(n)[: n // 2]] = True
        masks[j] = h
        if j + 1 < k:
            masks[j + 1] = ~h
    return masks


def _spec_hash(cfg_dict: dict, rows: list[dict]) -> str:
    h = hashlib.sha256()
    keep = {k: v for k, v in cfg_dict.items() if k not in ("device", "progress", "dataset")}
    h.update(json.dumps(keep, sort_keys=True, default=str).encode())
    for r in rows:
        h.update(json.dumps(r, sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def train_shadows(
    cfg,
    ids: list[str],
    texts: list[str],
    labels,
    k: int,
    out_dir: str | Path,
    seed: int = 0,
    device: str = "auto",
    progress: bool = True,
    num_labels: int | None = None,
    workers: int = 1,
    ray_address: str | None = "none",
    share_prefix: bool = True,
    only: list[int] | None = None,
) -> ShadowSet:
    """Train (or reuse) k shadow models on random halves of the pool.

    Args:
        cfg: the target's fl.run.config.TrainConfig (copied; data fields replaced per shadow).
        ids, texts, labels: the attacker's pool, n examples; labels (n,) ints.
        k: number of shadow models.
        out_dir: folder for shadow_<j>.jsonl and shadow_<j>/ run directories.
        seed: seed of the IN/OUT assignment.
        num_labels: classes of the target head; every class must occur in the pool.
        workers, ray_address: the shadows still to train run as independent tasks
            (:func:`fl.distributed.run_tasks`: ``workers`` at once, 0 = one per CPU, on
            Ray at ``ray_address``; ``workers=1`` or ``ray_address="none"``: here, in
            order). A failed shadow is retried once; if it fails again the call raises
            after the others have finished (they are kept and reused by the next call).
        share_prefix: the shadows take their frozen-prefix cache rows from the whole
            pool's, encoded once per process (:func:`fl.models.heads.shared_rows`) instead of
            each encoding its own halves.
        only: train (or reuse) these shadows only, leaving the others' files untouched
            (their ``seconds`` NaN): one shadow as a task of its own, trained ahead for a
            later call with the same arguments to reuse (``fedlora run``).
    """
    from fl.data.datasets import split_dataset
    from fl.distributed import run_tasks
    from fl.io import atomic_write_json
    from fl.run.config import TrainConfig

    labels = np.asarray(labels, dtype=np.int64)
    n = len(texts)
    c = int(num_labels if num_labels is not None else labels.max() + 1)
    missing = sorted(set(range(c)) - set(labels.tolist()))
    if missing:
        raise UsageError(f"the attacker pool has no example of class(es) {missing}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    masks = shadow_halves(n, k, seed)
    secs: list[float] = [float("nan")] * k
    reused = [False] * k
    first_cfg = None
    tasks = []
    if only is not None and not set(only) <= set(range(k)):
        raise UsageError(f"only: shadows {sorted(set(only) - set(range(k)))} are not in 0..{k - 1}")
    for j in range(k):
        if only is not None and j not in only:
            continue
        in_idx = np.flatnonzero(masks[j])
        out_idx = np.flatnonzero(~masks[j])
        a = len(in_idx)
        sp = split_dataset(n, a, 0, n - a, cfg.seed)
        order = np.empty(n, dtype=np.int64)
        order[sp.members] = in_idx
        order[sp.test] = out_idx
        rows = [{"id": ids[r], "text": texts[r], "label": int(labels[r])} for r in order]
        data_path = out_dir / f"shadow_{j}.jsonl"
        run_dir = out_dir / f"shadow_{j}"
        d = cfg.to_dict()
        d.update(
            dataset=str(data_path.resolve()),
            text_column="text",
            label_column="label",
            members=a,
            nonmembers=0,
            test=n - a,
            canaries=0,
            progress=False,
            device=device,
            eval_every=int(cfg.rounds),
        )
        first_cfg = first_cfg or TrainConfig.from_dict(d).to_dict()
        spec = _spec_hash(d, rows)
        spec_path = out_dir / f"shadow_{j}.spec.json"
        if (run_dir / "manifest.json").is_file() and spec_path.is_file():
            old = json.loads(spec_path.read_text(encoding="utf-8"))
            if old.get("spec") == spec:
                secs[j] = float(old.get("seconds", float("nan")))
                reused[j] = True
                continue
        pool = (texts, labels.tolist(), d["model"], int(d["max_length"])) if share_prefix else None
        tasks.append(dict(j=j, cfg=d, rows=rows, spec=spec, run_dir=str(run_dir), pool=pool))
    bar = None
    if progress and tasks:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks), desc="shadow models", unit="model")
    failed = []
    for o in run_tasks(train_shadow, tasks, workers=workers, address=ray_address, report=_warn):
        t = tasks[o.index]
        j = t["j"]
        if bar is not None:
            bar.update(1)
        if not o.ok:
            failed.append(f"shadow {j}: {o.error or o.skipped}")
            continue
        got = set(
            json.loads(Path(t["run_dir"], "splits.json").read_text(encoding="utf-8"))["members"]
        )
        if got != {ids[i] for i in np.flatnonzero(masks[j])}:
            raise RuntimeError(f"shadow {j}: the engine's member split is not the intended half")
        atomic_write_json(
            out_dir / f"shadow_{j}.spec.json",
            {"spec": t["spec"], "seconds": o.value, "n_in": int(masks[j].sum())},
        )
        secs[j] = float(o.value)
    if bar is not None:
        bar.close()
    if failed:
        raise RuntimeError("shadow training failed: " + "; ".join(failed))
    dirs = [out_dir / f"shadow_{j}" / "adapter" for j in range(k)]
    return ShadowSet(masks, dirs, secs, reused, first_cfg or {})


def _warn(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def train_shadow(task: dict) -> float:
    """One shadow model (a task of :func:`train_shadows`, here or on a Ray worker): writes
    its JSONL and trains it from scratch; returns the wall seconds of the training."""
    from fl.run.config import TrainConfig
    from fl.run.engine import train

    run_dir = Path(task["run_dir"])
    if run_dir.exists():  # stale or unfinished shadow of ours: retrain from scratch
        shutil.rmtree(run_dir)
    with open(task["cfg"]["dataset"], "w", encoding="utf-8") as fh:
        for r in task["rows"]:
            # ASCII escapes: load_local splits lines with str.splitlines, which also breaks
            # at U+2028, U+0085 and other characters that occur in real text.
            fh.write(json.dumps(r, ensure_ascii=True) + "\n")
    scfg = TrainConfig.from_dict(task["cfg"])
    t0 = time.perf_counter()
    with _shared_pool(task["pool"]):
        train(scfg, run_dir, quiet=True)
    return time.perf_counter() - t0


def _shared_pool(pool):
    """:func:`fl.models.heads.shared_rows` over the tokenized pool (nothing when ``pool`` is None)."""
    from contextlib import nullcontext

    if pool is None:
        return nullcontext()
    from fl.data.tokenized import TokenizedData
    from fl.models.base import encoding_tokenizer
    from fl.models.heads import shared_rows

    texts, labels, model, max_length = pool
    return shared_rows(
        TokenizedData(list(texts), np.asarray(labels), encoding_tokenizer(model), max_length)
    )

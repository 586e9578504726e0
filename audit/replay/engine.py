"""Neighbour replay of the engine's runs (``fedlora audit RUN --neighbours``).

The run is trained again from its configuration and key with a :class:`Recorder` tapped
into every release (:mod:`fl.privacy.tap`: DP-SGD's steps, the client-level aggregate),
then once per neighbour D′ (:mod:`audit.replay.neighbours`) with the same key, the
recorded Poisson coins of the records both datasets share (the neighbour's added record
drawn at every step), and the recorded outputs handed back at every release. Per
neighbour: every release's ‖q(D) − q(D′)‖ against its bound, the sequence of releases,
and everything the run releases without noise — the public manifest, the public
per-round metrics, the adapter — identical, else ``data_dependent_release`` naming the
field; an exception on D′ is one too (a crash is observable).

Two things are held fixed on purpose, and said in the result: the clients' public sizes
(q = B/n_k is computed from them; the toolkit discloses n_k, docs/privacy.md) and
dropout (off in both runs: a dropout mask drawn per batch position would move with the
neighbour and change other records' gradients, which is randomness, not data).
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from audit.findings import Code
from audit.replay.neighbours import Neighbour, engine_neighbours, parse_kinds
from audit.replay.record import Recorder
from fl.errors import UsageError
from fl.io import read_json

__all__ = [
    "replay_neighbours",
    "replay_recorded",
    "read_replay",
    "summary_line",
    "REPLAY_FILE",
    "REPLAY_VOLATILE",
]

#: where ``fedlora run`` keeps a DP run's neighbour replay (operator-side, beside attacks/)
REPLAY_FILE = Path("audit") / "neighbour_replay.json"

#: public manifest fields a replay legitimately changes (when/where it ran)
REPLAY_VOLATILE = {"created", "versions", "tool_version", "device", "wall_seconds", "log"}


def _release_view(out: Path) -> dict:
    """What a run releases without noise, for comparison: the public manifest (volatile
    fields and the MAC removed), the public metrics rows, the adapter's sha256."""
    from fl.run.config import RUNTIME_FIELDS
    from fl.run.release import PUBLIC_METRICS, public_manifest
    from fl.run.rundir import read_metrics

    m = public_manifest(read_json(out / "manifest.json"))
    for k in REPLAY_VOLATILE:
        m.pop(k, None)
    for k in RUNTIME_FIELDS:  # where and how it ran (device, progress, ...), not its result
        (m.get("config") or {}).pop(k, None)
    (m.get("integrity") or {}).pop("mac", None)
    (m.get("integrity") or {}).pop("files", None)
    rows = [
        {k: r[k] for k in PUBLIC_METRICS if k in r} for r in read_metrics(out, strict=False) or []
    ]
    adapter = out / "adapter" / "adapter_model.safetensors"
    sha = hashlib.sha256(adapter.read_bytes()).hexdigest() if adapter.is_file() else None
    return {"manifest": m, "metrics": rows, "adapter_sha256": sha}


def _diff(a, b, path: str, out: list[str], limit: int = 8) -> None:
    if len(out) >= limit:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            _diff(a.get(k), b.get(k), f"{path}.{k}", out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{path}[{i}]", out, limit)
    elif json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
        out.append(path)


def _hook(nb: Neighbour, state: dict, max_length: int) -> Callable:
    """The engine's ``neighbour`` hook for ``nb`` (edits the members before tokenizing)."""

    def apply(eng, texts, labels, prompts):
        pos = np.asarray(eng.client_positions[nb.client])
        state["n_client"] = len(pos)
        j = state["row"]  # the typical record: an index into the client's positions
        src = int(pos[j])
        if nb.removes:
            pos = np.delete(pos, j)
        if nb.empties:
            pos = pos[:0]
        if nb.adds:
            text, label = texts[src], labels[src]
            if nb.kind == "empty":
                text = ""
            elif nb.kind == "max-length":
                text = " ".join(["privacy"] * (2 * max_length))
            elif nb.kind in ("flipped", "replace"):
                classes = sorted(set(labels))
                label = classes[(classes.index(label) + 1) % len(classes)]
            texts = [*texts, text]
            labels = [*labels, label]
            if prompts is not None:
                prompts = [*prompts, ""]
            eng.position_ids.append(f"replay-{nb.kind}")
            new = len(texts) - 1
            pos = np.insert(pos, 0 if nb.at == "start" else len(pos), new)
        eng.client_positions[nb.client] = pos
        return texts, labels, prompts

    return apply


def _mask_map(nb: Neighbour, state: dict) -> Callable:
    """Frozen coins for D′: the recorded masks of D, the removed row deleted, the added
    row inserted with its coin at 1 (drawn at every step)."""
    import torch

    def apply(scope: dict, masks, n_dp: int):
        if str(scope.get("client")) != nb.client:
            return [m.clone() for m in masks]
        n_d = n_dp + (1 if nb.removes else 0) - (1 if nb.adds else 0)
        if nb.empties:  # no example left; the sampler canaries' rows keep their coins
            return [m[state["n_client"] :].clone() for m in masks]
        out = []
        for m in masks:
            ex, tail = m[:n_d], m[n_d:]
            if nb.removes:
                ex = torch.cat([ex[: state["row"]], ex[state["row"] + 1 :]])
            if nb.adds:
                one = torch.ones(1, dtype=ex.dtype)
                ex = torch.cat([one, ex]) if nb.at == "start" else torch.cat([ex, one])
            out.append(torch.cat([ex, tail]))
        return out

    return apply


def _typical_row(rec: Recorder, client: str, n: int) -> int:
    """The client's record drawn most often on D (ties: the first): a removal then
    changes the most releases."""
    counts = np.zeros(n)
    for key, masks in rec.masks.items():
        if str(dict(key).get("client")) == client:
            for m in masks:
                counts += m[:n].numpy().astype(float)
    return int(np.argmax(counts))


def _config_and_key(run: Path, key_path):
    from fl.privacy.rng import NoiseKey
    from fl.run.config import TrainConfig

    m = read_json(run / "manifest.json")
    cfg_dict = (
        read_json(run / "config.json") if (run / "config.json").is_file() else m.get("config")
    )
    if not isinstance(cfg_dict, dict):
        raise UsageError(f"{run}: no configuration to replay (config.json or the manifest's)")
    cfg = TrainConfig.from_dict(cfg_dict)
    cfg.device, cfg.progress = "cpu", False
    if cfg.dp_level == "none":
        raise UsageError(f"{run}: the run claims no DP; there is no release to replay")
    key = None
    if not cfg.insecure_deterministic_noise:
        key_path = Path(key_path) if key_path else run / "private" / "noise.key"
        if not key_path.is_file():
            raise UsageError(
                f"{run}: the neighbour replay needs the run's noise key ({key_path} not found; "
                "give it with --key)"
            )
        key = NoiseKey.read(key_path)
    return cfg, key


def _train_pass(cfg, out: Path, key, rec, hook=None) -> tuple[object, str | None]:
    """One training of the replay under ``rec``, dropout off: (the engine, the exception
    it raised or None)."""
    from fl.models.base import dropout_off
    from fl.privacy.tap import tapped
    from fl.run.engine import Engine

    eng = Engine(cfg, out, quiet=True, noise_key=key)
    eng.neighbour = hook
    try:
        eng.setup()
        eng.dropout_layers_off = dropout_off(eng.trainer.model)
        with tapped(rec):
            eng.run()
    except Exception as exc:  # an exception on D′ is itself a release
        return eng, f"{type(exc).__name__}: {exc}"
    return eng, None


def replay_neighbours(
    run: Path,
    key_path: Path | None = None,
    kinds: str | tuple | None = None,
    log: Callable[[str], None] | None = None,
    work: Path | None = None,
) -> dict:
    """Replay ``run`` on D and on each neighbour of ``kinds``, every client retrained
    (module doc). Returns ``{"performed", "verdict" ("pass" | "fail" | "incomplete"),
    "mode" ("full"), "neighbours": [per neighbour: the neighbour, the comparison, the
    differing public fields, an exception], "findings": [{"code", "severity",
    "message"}], "releases", "seconds" (D, each neighbour), "held_fixed"}``."""
    run = Path(run)
    say = log or (lambda s: None)
    kinds = parse_kinds(kinds) if not isinstance(kinds, tuple) else kinds
    cfg, key = _config_and_key(run, key_path)
    rec = Recorder()
    with tempfile.TemporaryDirectory(prefix="fedlora-replay-", dir=work) as tmp:
        root = Path(tmp)
        t0 = time.time()
        say("replay: training on D (the run's data) with the releases recorded")
        eng, err = _train_pass(cfg, root / "D", key, rec)
        if err:
            raise UsageError(f"replay of {run} on its own data failed: {err}")
        seconds = {"D": round(time.time() - t0, 2)}
        return _neighbour_passes(
            cfg,
            key,
            rec,
            eng,
            kinds,
            root,
            say,
            seconds,
            local=False,
            view_d=_release_view(root / "D"),
        )


def replay_recorded(
    cfg, run: Path, rec, kinds=None, log=None, work: Path | None = None, reference: str = "auto"
) -> dict:
    """The job's replay, right after a training recorded by ``rec`` (made with
    ``keep_deliveries``): per neighbour only its client is retrained (the others'
    recorded replies are handed back). A training that drew dropout is replayed first on D,
    dropout off (the reference q(D): a mask drawn per batch position moves with the
    neighbour), then on D′; one free of dropout (``dropout = "off"``, or a model without
    any) is its own reference: its recorded q(D) and its release (``run``) are compared
    with D′ directly, one pass per neighbour. ``reference``: ``"auto"`` (so), ``"always"``
    (the pass on D in every case). A bug that carries one client's data into another
    client's training is seen only by :func:`replay_neighbours`, which retrains every
    client."""
    from fl.models.base import active_dropout

    if reference not in ("auto", "always"):
        raise ValueError(f"reference must be 'auto' or 'always', got {reference!r}")
    say = log or (lambda s: None)
    kinds = parse_kinds(kinds) if not isinstance(kinds, tuple) else kinds
    cfg = type(cfg).from_dict(cfg.to_dict())
    cfg.device, cfg.progress = "cpu", False
    _, key = (None, None) if cfg.insecure_deterministic_noise else _config_and_key(run, None)
    with tempfile.TemporaryDirectory(prefix="fedlora-replay-", dir=work) as tmp:
        from fl.run.engine import Engine

        probe = Engine(cfg, Path(tmp) / "probe", quiet=True, noise_key=key)
        probe.setup()
        # its own reference only where a pass on D would redo its arithmetic: no dropout,
        # and trained on the CPU as the replay is (another device rounds differently)
        own = (
            reference == "auto"
            and not active_dropout(probe.trainer.model)
            and read_json(Path(run) / "manifest.json").get("device") == "cpu"
        )
        res = _neighbour_passes(
            cfg, key, rec, probe, kinds, Path(tmp), say, {}, local=True,
            view_d=_release_view(Path(run)) if own else None,
        )  # fmt: skip
        res["reference"] = (
            "the recorded training (no dropout)" if own else "a pass on D, dropout off"
        )
        return res


def _neighbour_passes(cfg, key, rec, eng, kinds, root, say, seconds, local, view_d=None) -> dict:
    nbs = engine_neighbours(
        kinds, dict(eng.public_sizes), cfg.task == "classification", cfg.dp_level
    )
    findings: list[dict] = []
    results = []
    refs: dict[str, dict] = {}
    for i, nb in enumerate(nbs):
        t0 = time.time()
        if local and view_d is None and nb.client not in refs:
            # the reference q(D) of this client's releases: D itself, dropout off, on the
            # recorded trajectory
            rec.start_replay(None, local=nb.client)
            _, err = _train_pass(cfg, root / f"ref{nb.client}", key, rec)
            cmp = rec.compare()
            if err or cmp["divergence"]:
                raise UsageError(f"the replay on D itself diverged: {err or cmp['divergence']}")
            rec.adopt_reference()
            refs[nb.client] = _release_view(root / f"ref{nb.client}")
        base_view = refs[nb.client] if local and view_d is None else view_d
        state = {"row": _typical_row(rec, nb.client, eng.public_sizes[nb.client])}
        say(f"replay: neighbour {i + 1}/{len(nbs)}: {nb.describe()}")
        rec.start_replay(_mask_map(nb, state), local=nb.client if local else None)
        _, error = _train_pass(cfg, root / f"N{i}", key, rec, _hook(nb, state, cfg.max_length))
        cmp = rec.compare(factor=nb.factor)
        diffs: list[str] = []
        if error is None and cmp["releases"]:  # with nothing frozen, every output moves
            _diff(base_view, _release_view(root / f"N{i}"), "release", diffs)
        seconds[f"N{i}"] = round(time.time() - t0, 2)
        results.append(
            {
                "neighbour": nb.to_dict(),
                "row": state["row"],
                "comparison": cmp,
                "public_diffs": diffs,
                "exception": error,
            }
        )
        findings += _findings(nb, cmp, diffs, error)
    if not rec.releases:
        # never a pass: nothing was compared (an incomplete replay, not a finding against
        # the run: its releases are made where the tap does not reach)
        findings.append(
            {
                "code": str(Code.REPLAY_EMPTY),
                "severity": "warning",
                "message": f"the replay intercepted no release: {cfg.method}'s noise at "
                f"{cfg.dp_level} level does not pass through the release tap "
                "(fl.privacy.tap), so no sensitivity was compared",
            }
        )
    if any(f["severity"] == "error" for f in findings):
        verdict = "fail"
    else:
        verdict = "pass" if rec.releases and results else "incomplete"
    return {
        "performed": True,
        "verdict": verdict,
        "mode": "client-local" if local else "full",
        "releases": len(rec.releases),
        "neighbours": results,
        "findings": findings,
        "seconds": seconds,
        "held_fixed": {
            "public_sizes": "each client's n_k (disclosed; q = B/n_k is computed from it)",
            "dropout": "off in every replayed training",
        }
        | (
            {"other_clients": "only the neighbour's client retrained; the others' recorded replies"}
            if local
            else {}
        ),
    }


def _findings(nb: Neighbour, cmp: dict, diffs: list[str], error: str | None) -> list[dict]:
    from audit.replay.record import comparison_findings

    return comparison_findings(
        cmp,
        f"'{nb.describe()}'",
        f"{nb.relation}, {nb.factor:g}·C",
        [
            None if error is None else f"the training on D′ raised {error} (on D it did not)",
            f"released without noise and different on D′: {', '.join(diffs)}" if diffs else None,
        ],
    )


def summary_line(res: dict) -> str:
    """One line for the CLI and the verdict table."""
    n = len(res.get("neighbours", []))
    worst = [r["comparison"]["max_ratio"] for r in res.get("neighbours", [])]
    worst = [w for w in worst if w is not None and math.isfinite(w)]
    ratio = f", largest ‖Δq‖/bound {max(worst):.3f}" if worst else ""
    word = "neighbour" if n == 1 else "neighbours"
    return f"{res['verdict']} ({n} {word} × {res['releases']} releases{ratio})"


def read_replay(run_dir: Path) -> dict | None:
    """The neighbour replay ``fedlora run`` wrote for a run (``RUN/audit/
    neighbour_replay.json``), checked: None when there is none; a ``{"verdict": "not
    read", "error"}`` record when the file is not a replay's (never an exception)."""
    path = Path(run_dir) / REPLAY_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        ok = (
            isinstance(doc, dict)
            and doc.get("verdict") in ("pass", "fail", "incomplete")
            and isinstance(doc.get("neighbours"), list)
            and isinstance(doc.get("findings"), list)
            and isinstance(doc.get("releases"), int)
            and all(
                isinstance(f, dict) and {"code", "severity", "message"} <= set(f)
                for f in doc["findings"]
            )
        )
        if not ok:
            raise ValueError("not a neighbour replay's record")
        if doc["verdict"] == "pass" and (
            not doc["releases"] or any(f["severity"] == "error" for f in doc["findings"])
        ):
            raise ValueError("'pass' beside an error finding or with no release compared")
        return doc
    except (OSError, ValueError) as exc:
        return {"verdict": "not read", "error": f"{path}: {exc}", "findings": [], "neighbours": []}

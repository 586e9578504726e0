"""The release bundle: exactly what a run may publish.

A run directory is the operator's: it holds the member ids (``splits.json``), the
sampled cohorts and per-client training losses (``metrics.jsonl``, ``run.log``),
un-noised statistics in ``manifest.json`` and the secret noise key (``private/``).
None of that may be published. The bundle (``RUN/release/``, written at the end of a
run, or ``fedlora export RUN --out DIR``) holds:

- ``adapter/``: the PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``);
- ``manifest.json``: the *public* manifest, built from the operator manifest through
  :data:`PUBLIC_FIELDS` (an allow-list: a field not named there is dropped), with
  everything needed to recompute ε (mechanism, neighbouring relation, σ, C, δ, the
  ledger of events with their sampling rates and step counts, the accountant) and
  nothing computed from private data without noise;
- ``metrics.jsonl``: per round, the test-set metrics of the released global model
  and ε so far (test data is not protected; the global model of every round is a
  post-processing of DP releases).

What the public manifest discloses on purpose is listed in its ``disclosed`` field: the
per-client sampling rates q_k = B/n_k (hence each client's size) are needed to
recompute ε and are therefore released (sample level only: at client level neither the
rates nor the per-client steps are published); the config and its public seed, which
determine the benchmark's membership split for whoever holds the data set.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from fl.errors import UsageError
from fl.io import atomic_write_json, atomic_write_text, file_sha256, read_json
from fl.privacy.rng import KEY_FILE, PRIVATE_DIR, NoiseKey
from fl.run.integrity import file_hashes, seal, verify_mac
from fl.run.rundir import ADAPTER, ADAPTER_WEIGHTS, MANIFEST, METRICS, is_release, read_metrics

#: allow-list of the public manifest: True keeps the value, a dict recurses.
PUBLIC_FIELDS: dict = {
    "schema_version": True,
    "tool": True,
    "tool_version": True,
    "created": True,
    "config": True,
    "method": True,
    "method_options": True,
    "released": True,
    "model": True,
    "client_ranks": True,
    "seeds": True,
    "versions": True,
    "adapter_sha256": True,
    "device": True,
    "privacy": {
        "level": True,
        "neighbouring": True,
        "assumptions": True,
        "mechanism": True,
        "noise_multiplier": True,
        "client_noise_multipliers": True,
        "clipping_norm": True,
        "delta": True,
        "target_epsilon": True,
        "sampling": True,
        "sample_rates": True,
        "steps_per_round": True,
        "rounds": True,
        "rounds_completed": True,
        "client_sampling": True,
        "participation_accounting": True,
        "method_mechanism": True,
        "noise": {
            "source": True,
            "private": True,
            "generator": True,
            "key_bits": True,
            "key_id": True,
            "warning": True,
            "note": True,
            # a key reused on another configuration: the original's config hash
            "reused_key": True,
        },
        "epsilon": True,
        "ledger": True,
    },
    "data": {
        "dataset": True,
        "num_classes": True,
        "label_names": True,
        "n_members": True,
        "n_nonmembers": True,
        "n_test": True,
    },
    "metrics": {
        "final": {"accuracy": True, "balanced_accuracy": True, "loss": True, "perplexity": True}
    },
}

#: per-round fields of the public metrics.jsonl
PUBLIC_METRICS = ("round", "accuracy", "balanced_accuracy", "loss", "perplexity", "epsilon")

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")

DISCLOSED = [
    "privacy.sample_rates / the ledger's sample rates: q_k = batch_size / n_k, so each "
    "client's example count n_k (needed to recompute ε)",
    "privacy.ledger: which clients trained in which round (sample level; no amplification "
    "by client sampling is claimed there)",
    "metrics: accuracy and loss of the released model on the public test split",
    "config and seeds: the membership split and the client partition are functions of the "
    "public seed and the data set, so whoever holds the data set can recompute which of its "
    "examples were members (a benchmark's split, drawn from a public corpus; the DP guarantee "
    "does not rest on hiding it, and membership-inference scores of a bundle assume an "
    "attacker who does not use it)",
]


def _filter(obj, allow):
    if allow is True:
        return obj
    if not isinstance(obj, dict):
        return None
    return {k: _filter(v, allow[k]) for k, v in obj.items() if k in allow}


def public_manifest(manifest: dict) -> dict:
    """The allow-listed part of an operator manifest (plus ``visibility`` and
    ``disclosed``)."""
    out = _filter(manifest, PUBLIC_FIELDS)
    priv = out.get("privacy")
    if isinstance(priv, dict) and priv.get("level") != "sample" and "steps_per_round" in priv:
        # ε needs per-client steps at sample level only; with local_epochs they give n_k
        priv["steps_per_round"] = {}
    out["visibility"] = "public"
    out["disclosed"] = list(DISCLOSED)
    return out


def public_metrics(run_dir: Path) -> str:
    rows = read_metrics(run_dir) or []
    return "".join(json.dumps({k: r[k] for k in PUBLIC_METRICS if k in r}) + "\n" for r in rows)


#: what a bundle folder holds (anything else in a target folder is not ours to replace)
BUNDLE_ENTRIES = (ADAPTER, MANIFEST, METRICS)


def check_release_target(out_dir: str | Path) -> None:
    """Refuse to replace a folder that is not a release bundle: ``out_dir`` may be
    absent, empty, or a bundle (public manifest) holding bundle files only. Anything
    else (a run directory, unrelated files, a bundle someone added files to, e.g.
    ``attacks/``) is named in a :class:`UsageError` and left untouched."""
    out_dir = Path(out_dir)
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise UsageError(f"{out_dir} exists and is not a folder; refusing to replace it")
    entries = sorted(p.name for p in out_dir.iterdir())
    if not entries:
        return
    if not is_release(out_dir):
        raise UsageError(
            f"{out_dir} is not empty and is not a release bundle ({', '.join(entries[:5])}"
            f"{', ...' if len(entries) > 5 else ''}); refusing to overwrite it: choose an "
            "empty or new --out folder"
        )
    extra = [e for e in entries if e not in BUNDLE_ENTRIES]
    if (out_dir / "adapter").is_dir():
        extra += [f"adapter/{p.name}" for p in sorted((out_dir / "adapter").iterdir())
                  if p.name not in ADAPTER_FILES]  # fmt: skip
    if extra:
        raise UsageError(
            f"{out_dir} is a release bundle holding other files too ({', '.join(extra[:5])}"
            f"{', ...' if len(extra) > 5 else ''}); refusing to replace it (they would be "
            "lost): move them or choose another --out folder"
        )


#: the files a bundle's manifest vouches for (``integrity.files``, :mod:`fl.run.integrity`)
SEALED_FILES = ("adapter/adapter_config.json", "adapter/adapter_model.safetensors", METRICS)


def run_key(run_dir: Path, manifest: dict):
    """The run's noise key (``RUN/private/noise.key``) when the run is keyed and the file
    is there and belongs to it; None otherwise (no DP, seeded noise, or a key removed)."""
    noise = (manifest.get("privacy") or {}).get("noise")
    if not isinstance(noise, dict) or noise.get("source") != "keyed_csprng":
        return None
    path = run_dir / PRIVATE_DIR / KEY_FILE
    if not path.is_file():
        return None
    key = NoiseKey.read(path)
    if key.key_id != noise.get("key_id"):
        raise UsageError(
            f"{path} has key id {key.key_id}, but {run_dir}/manifest.json records "
            f"{noise.get('key_id')!r}: the key or the manifest was replaced"
        )
    return key


def write_release(run_dir: str | Path, out_dir: str | Path, key=None) -> Path:
    """Write the bundle of a finished run to ``out_dir`` (replaced atomically: a reader
    sees the old bundle or the new one, never half of one). ``out_dir`` must be absent,
    empty or a bundle (:func:`check_release_target`). The public manifest is sealed
    (:mod:`fl.run.integrity`) with ``key``, or the run's own key file when None."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    mpath = run_dir / MANIFEST
    if not mpath.is_file():
        raise UsageError(f"{run_dir} is not a finished run (no {MANIFEST})")
    manifest = read_json(mpath)
    if not isinstance(manifest, dict):
        raise UsageError(f"{mpath}: must hold a JSON object")
    if is_release(manifest):
        raise UsageError(f"{run_dir} is a release bundle already, not a run directory")
    if manifest.get("injected_fault") or (manifest.get("config") or {}).get("inject_fault"):
        raise UsageError(
            f"{run_dir} was trained with a planted privacy fault (--inject-fault "
            f"{manifest.get('injected_fault') or manifest['config']['inject_fault']}, tests "
            "only): it is not private and is never released"
        )
    adapter = run_dir / ADAPTER
    for name in ADAPTER_FILES:
        if not (adapter / name).is_file():
            raise UsageError(f"{run_dir}: adapter/{name} is missing")
    want = manifest.get("adapter_sha256")
    if not want:
        raise UsageError(
            f"{mpath} records no adapter_sha256; refusing to release an unchecked adapter"
        )
    got = file_sha256(adapter / ADAPTER_WEIGHTS)
    if got != want:
        raise UsageError(
            f"{run_dir}: adapter/adapter_model.safetensors is corrupt or was replaced (sha256 "
            f"{got[:16]}…, the manifest records {str(want)[:16]}…); refusing to release it"
        )
    if out_dir.resolve() == run_dir.resolve() or run_dir.resolve() in out_dir.resolve().parents:
        if out_dir.resolve() != (run_dir / "release").resolve():
            raise UsageError("export into the run directory is only allowed as RUN/release")
    if key is None:
        key = run_key(run_dir, manifest)
    if key is not None:
        ok, why = verify_mac(manifest, key)
        if ok is False:
            raise UsageError(
                f"{mpath}: {why}: the operator manifest was edited after the run; refusing "
                "to release it"
            )
    check_release_target(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "adapter").mkdir(parents=True)
    for name in ADAPTER_FILES:
        shutil.copyfile(adapter / name, tmp / "adapter" / name)
    atomic_write_text(tmp / METRICS, public_metrics(run_dir))
    pub = seal(public_manifest(manifest), key, file_hashes(tmp, SEALED_FILES))
    atomic_write_json(tmp / MANIFEST, pub)
    # A bundle is meant to be published: world-readable files (atomic writes make 0600).
    for f in (tmp / MANIFEST, tmp / METRICS, *(tmp / "adapter").iterdir()):
        os.chmod(f, 0o644)
    old = out_dir.with_name(f".{out_dir.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


__all__ = [
    "BUNDLE_ENTRIES",
    "check_release_target",
    "PUBLIC_FIELDS",
    "PUBLIC_METRICS",
    "public_manifest",
    "write_release",
    "is_release",
    "DISCLOSED",
    "SEALED_FILES",
    "run_key",
]

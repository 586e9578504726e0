"""The release bundle holds only what may be published; `fedlora export` writes the same
bundle and refuses what it must not overwrite; the run key stays private; a bundle can
be attacked and reported on without the operator's files.

The allow-list below is written out here on purpose, independently of
``fl.run.release.PUBLIC_FIELDS``: a field added to the public manifest must be added here too,
after someone has asked whether it may be published.
"""

import dataclasses
import json
import re
import shutil
import stat

import numpy as np
import pytest

from pipeline.cli import main

ANY = object()  # any JSON value (the subtree is still scanned for forbidden text)
SCALAR = object()  # a string, number, bool or null


class MapOf:
    """A JSON object with arbitrary keys (matching ``key``) whose values match ``spec``."""

    def __init__(self, spec, key=r".+"):
        self.spec, self.key = spec, re.compile(key)


class ListOf:
    def __init__(self, spec):
        self.spec = spec


def _config_fields():
    from fl.run.config import TrainConfig

    return {f.name: SCALAR for f in dataclasses.fields(TrainConfig) if f.name != "opts"} | {
        "opts": MapOf(SCALAR)
    }


EVENT = {k: SCALAR for k in
         ("kind", "noise_multiplier", "sample_rate", "count", "unit", "round", "stage", "note")}  # fmt: skip
PUBLIC_MANIFEST = {
    "schema_version": SCALAR,
    "tool": SCALAR,
    "tool_version": SCALAR,
    "created": SCALAR,
    "visibility": SCALAR,
    "disclosed": ListOf(SCALAR),
    "config": None,  # filled in by _manifest_spec (TrainConfig's fields)
    "method": SCALAR,
    "method_options": MapOf(SCALAR),
    "released": SCALAR,
    "client_ranks": SCALAR,  # null unless heterogeneous ranks
    # how the model was built: public configuration, nothing computed from data
    "model": {
        k: SCALAR
        for k in (
            "name",
            "task",
            "lm_format",  # causal-lm: text or instruction (which fields the data file has)
            "precision",
            "pooling",
            "head_init",
            "lora_layers",
            "frozen_prefix_layers",
            "prefix_cache",
            "lr",
            "head_lr",
            "lr_schedule",
            "head_warmup_rounds",
        )
    },
    "seeds": {"seed": SCALAR},
    "versions": MapOf(SCALAR),
    "adapter_sha256": SCALAR,
    "device": SCALAR,  # where it trained (cpu / cuda): replay tolerance
    # the seal (fl.run.integrity): hashes of the bundle's files and a MAC under the run key
    "integrity": {
        "files": MapOf(
            SCALAR,
            key=r"adapter/adapter_config\.json|adapter/adapter_model"
            r"\.safetensors|metrics\.jsonl",
        ),
        "mac": {"algorithm": SCALAR, "key": SCALAR, "value": SCALAR},
    },
    "privacy": {
        "level": SCALAR,
        "neighbouring": SCALAR,
        "assumptions": ListOf(SCALAR),  # what the neighbouring relation takes as public
        "mechanism": SCALAR,
        "noise_multiplier": SCALAR,
        # σ_k per client (each calibrated to its public q_k: discloses nothing new)
        "client_noise_multipliers": MapOf(SCALAR, r"\d+"),
        "clipping_norm": SCALAR,
        "delta": SCALAR,
        "target_epsilon": SCALAR,
        "sampling": SCALAR,
        "sample_rates": MapOf(SCALAR, r"\d+"),
        "steps_per_round": MapOf(SCALAR, r"\d+"),
        "rounds": SCALAR,
        "rounds_completed": SCALAR,
        "client_sampling": {"scheme": SCALAR, "clients_per_round": SCALAR, "total_clients": SCALAR},
        "participation_accounting": SCALAR,
        "method_mechanism": SCALAR,
        "noise": {
            "source": SCALAR,
            "private": SCALAR,
            "generator": SCALAR,
            "key_bits": SCALAR,
            "key_id": SCALAR,
            "warning": SCALAR,
            "note": SCALAR,
            # --allow-key-reuse: the key id and the original and this run's config hashes
            "reused_key": {
                "key_id": SCALAR,
                "original_config_sha256": SCALAR,
                "config_sha256": SCALAR,
            },
        },
        "epsilon": {"pld": SCALAR, "rdp": SCALAR},
        "ledger": {
            "version": SCALAR,
            "level": SCALAR,
            "neighbouring": SCALAR,
            "delta": SCALAR,
            "budget": SCALAR,
            "events": ListOf(EVENT),
        },
    },
    "data": {
        "dataset": SCALAR,
        "num_classes": SCALAR,
        "label_names": ListOf(SCALAR),
        "n_members": SCALAR,
        "n_nonmembers": SCALAR,
        "n_test": SCALAR,
    },
    "metrics": {
        "final": {
            "accuracy": SCALAR,
            "balanced_accuracy": SCALAR,
            "loss": SCALAR,
            "perplexity": SCALAR,  # causal-lm: test perplexity
        }
    },
}
METRICS_ROW = {
    k: SCALAR for k in ("round", "accuracy", "balanced_accuracy", "loss", "perplexity", "epsilon")
}
BUNDLE_FILES = {
    "adapter/adapter_config.json",
    "adapter/adapter_model.safetensors",
    "manifest.json",
    "metrics.jsonl",
}
FORBIDDEN_TEXT = ("train_loss", "client_sizes", "splits_sha256", "members_sha256",
                  "update_norm", "frac_clipped", "agg_noise", "subspace_error", "key_location",
                  "wall_seconds", "bytes_per_client", "public_log_note")  # fmt: skip
FORBIDDEN_KEYS = ("log",)  # the operator manifest's log lines


def _manifest_spec():
    return PUBLIC_MANIFEST | {"config": _config_fields()}


def _adapter_config_spec():
    """PEFT's own fields (from peft, not from this repository) plus its bookkeeping keys."""
    from peft import LoraConfig

    keys = {f.name for f in dataclasses.fields(LoraConfig)}
    keys |= {"peft_type", "task_type", "peft_version", "auto_mapping", "revision",
             "base_model_name_or_path", "inference_mode"}  # fmt: skip
    return {k: ANY for k in keys}


def _walk(value, spec, path, bad):
    """Record in ``bad`` every path of ``value`` the spec does not allow."""
    if spec is ANY:
        return
    if spec is SCALAR:
        if isinstance(value, dict | list):
            bad.append(f"{path}: expected a scalar, got {type(value).__name__}")
        return
    if isinstance(spec, MapOf):
        if not isinstance(value, dict):
            bad.append(f"{path}: expected an object")
            return
        for k, v in value.items():
            if not spec.key.fullmatch(str(k)):
                bad.append(f"{path}.{k}: key not allowed")
            _walk(v, spec.spec, f"{path}.{k}", bad)
        return
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            bad.append(f"{path}: expected a list")
            return
        for i, v in enumerate(value):
            _walk(v, spec.spec, f"{path}[{i}]", bad)
        return
    assert isinstance(spec, dict)
    if not isinstance(value, dict):
        bad.append(f"{path}: expected an object")
        return
    for k, v in value.items():
        if k not in spec:
            bad.append(f"{path}.{k}: field not on the allow-list")
        else:
            _walk(v, spec[k], f"{path}.{k}", bad)


def _items(value):
    """Every (key, value) pair of a JSON document, recursively."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, v
            yield from _items(v)
    elif isinstance(value, list):
        for v in value:
            yield from _items(v)


def _files(d):
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file()}


def _safetensors_header(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n])


@pytest.fixture(scope="module")
def canary_run(tmp_path_factory):
    """One run for the file's two tests (both only read it; the export writes elsewhere)."""
    from fl.run.engine import train
    from fl.testing import tiny_config

    run = tmp_path_factory.mktemp("release") / "run"
    cfg = tiny_config(method="fedavg", dp_level="sample", noise_multiplier=2.0, canaries=4,
                      nonmembers=60, rounds=2)  # fmt: skip
    train(cfg, run, quiet=True)
    return run


def test_release_bundle_holds_only_allow_listed_fields(canary_run, tmp_path, capsys):
    run, rel = canary_run, canary_run / "release"
    assert _files(rel) == BUNDLE_FILES

    bad: list[str] = []
    manifest = json.loads((rel / "manifest.json").read_text())
    _walk(manifest, _manifest_spec(), "manifest", bad)
    assert manifest["visibility"] == "public" and manifest["disclosed"]
    rows = [json.loads(x) for x in (rel / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for i, row in enumerate(rows):
        _walk(row, METRICS_ROW, f"metrics[{i}]", bad)
    acfg = json.loads((rel / "adapter" / "adapter_config.json").read_text())
    _walk(acfg, _adapter_config_spec(), "adapter_config", bad)
    header = _safetensors_header(rel / "adapter" / "adapter_model.safetensors")
    assert header.pop("__metadata__", {"format": "pt"}) == {"format": "pt"}
    for name in header:  # LoRA factors and the classification head only
        if not re.search(r"\.lora_[AB]\.weight$|\.(classifier|score)\.(weight|bias)$", name):
            bad.append(f"adapter tensor {name}: not a LoRA factor or head parameter")
    assert not bad, "\n".join(bad)

    # forbidden things, anywhere in the bundle (keys, values, binary files)
    items = [*_items(manifest), *(kv for r in rows for kv in _items(r)), *_items(acfg)]
    assert not {k for k, _ in items} & set(FORBIDDEN_KEYS)
    # "clients" is allowed as the config's client count, never as a list (a sampled cohort)
    assert not [v for k, v in items if k == "clients" and not isinstance(v, int)]
    blob = b"".join((rel / f).read_bytes() for f in sorted(BUNDLE_FILES))
    splits = json.loads((run / "splits.json").read_text())
    op = json.loads((run / "manifest.json").read_text())
    key_hex = (run / "private" / "noise.key").read_text().strip()
    canaries = splits["canaries"]
    assert len(canaries) == 4
    forbidden = list(FORBIDDEN_TEXT) + [key_hex, str(run), str(run.parent), str(tmp_path)]
    forbidden += [op["data"]["splits_sha256"], op["data"]["members_sha256"]]
    forbidden += [c["text"] for c in canaries] + [c["id"] for c in canaries]
    ids = splits["members"] + splits["nonmembers"] + splits["test"]
    ids += [c["source_id"] for c in canaries]
    assert ids and all(i.startswith("synthetic:") for i in ids)
    forbidden += [f'"{i}"' for i in ids]  # as JSON strings, so synthetic:1 ≠ synthetic:12
    assert b"synthetic:" not in blob  # no id of any kind
    found = [f for f in forbidden if f.encode() in blob]
    assert not found, found
    assert bytes.fromhex(key_hex) not in blob
    # the operator's files do hold these (so the test can fail)
    assert "train_loss" in (run / "metrics.jsonl").read_text() and "log" in op
    assert isinstance(
        json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["clients"], list
    )
    assert splits["members"][0] in (run / "splits.json").read_text()

    # `fedlora export` writes the same bundle
    exp = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(exp)]) == 0
    assert "wrote release bundle" in capsys.readouterr().out
    assert _files(exp) == BUNDLE_FILES
    for f in BUNDLE_FILES:
        assert (exp / f).read_bytes() == (rel / f).read_bytes(), f
        assert stat.S_IMODE((exp / f).stat().st_mode) == 0o644, f  # meant to be published


def test_noise_key_is_private(canary_run):
    run = canary_run
    priv, key = run / "private", run / "private" / "noise.key"
    assert stat.S_IMODE(priv.stat().st_mode) == 0o700
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    key_hex = key.read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key_hex)
    files = [run / n for n in ("config.json", "manifest.json", "metrics.jsonl", "run.log",
                               "splits.json", "ledger.json")]  # fmt: skip
    files += sorted((run / "checkpoint").rglob("*"))
    files += sorted((run / "adapter").rglob("*")) + sorted((run / "release").rglob("*"))
    files = [f for f in files if f.is_file()]
    assert any(f.parent.name == "checkpoint" for f in files)
    for f in files:
        data = f.read_bytes()
        assert key_hex.encode() not in data and key_hex.upper().encode() not in data, f
        assert bytes.fromhex(key_hex) not in data, f
    # the public key id is a fingerprint, not the key
    m = json.loads((run / "manifest.json").read_text())
    assert m["privacy"]["noise"]["key_id"] and m["privacy"]["noise"]["key_id"] not in key_hex


def _one_line_error(capsys, needle):
    err = capsys.readouterr().err
    assert err.startswith("fedlora: error:") and err.count("\n") == 1, err
    assert needle in err, err


def test_export_errors(tmp_path, tiny_cfg, capsys):
    from fl.run.engine import train

    run = tmp_path / "run"
    train(tiny_cfg(rounds=1), run, quiet=True)
    out = tmp_path / "out"

    assert main(["export", str(tmp_path / "nope"), "--out", str(out)]) == 2
    _one_line_error(capsys, "not found")
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), "--out", str(out)]) == 2
    _one_line_error(capsys, "not a fedlora run directory")
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(run / "config.json", unfinished / "config.json")
    assert main(["export", str(unfinished), "--out", str(out)]) == 2
    _one_line_error(capsys, "unfinished run")
    assert main(["export", str(run / "release"), "--out", str(out)]) == 2
    _one_line_error(capsys, "release bundle already")

    corrupt = tmp_path / "corrupt"
    shutil.copytree(run, corrupt)
    w = corrupt / "adapter" / "adapter_model.safetensors"
    b = bytearray(w.read_bytes())
    b[-1] ^= 0x01
    w.write_bytes(bytes(b))
    assert main(["export", str(corrupt), "--out", str(out)]) == 2
    _one_line_error(capsys, "corrupt")
    assert not out.exists()

    # an existing non-empty folder that is not a bundle: refused, left as it was
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["export", str(run), "--out", str(other)]) == 2
    _one_line_error(capsys, "refusing to overwrite")
    assert _files(other) == {"notes.txt"} and (other / "notes.txt").read_text() == "mine"
    # another run directory is not a bundle either
    assert main(["export", str(run), "--out", str(corrupt)]) == 2
    _one_line_error(capsys, "not a release bundle")

    # an earlier bundle is replaced; a bundle someone added files to is not
    assert main(["export", str(run), "--out", str(out)]) == 0
    (out / "metrics.jsonl").write_text("stale\n")
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert (out / "metrics.jsonl").read_bytes() == (run / "release" / "metrics.jsonl").read_bytes()
    (out / "attacks").mkdir()
    (out / "attacks" / "attacks.json").write_text("{}")
    assert main(["export", str(run), "--out", str(out)]) == 2
    _one_line_error(capsys, "attacks")
    assert (out / "attacks" / "attacks.json").read_text() == "{}"
    # into the run directory: only as RUN/release
    assert main(["export", str(run), "--out", str(run / "pub")]) == 2
    _one_line_error(capsys, "RUN/release")


def test_attack_and_report_on_a_bundle(tmp_path, tiny_cfg, capsys):
    from attacks.rundata import load_run
    from audit.report.build import build_report
    from fl.errors import UsageError
    from fl.run.engine import train

    run = tmp_path / "run"
    train(tiny_cfg(rounds=1, dp_level="sample", noise_multiplier=2.0), run, quiet=True)
    bundle = run / "release"

    assert main(["attack", str(bundle), "--device", "cpu"]) == 2
    _one_line_error(capsys, "no member list")
    with pytest.raises(UsageError, match="no member list"):
        load_run(bundle)
    assert main(["attack", str(bundle), "--adapter", str(bundle / "adapter"),
                 "--members", "m", "--nonmembers", "n"]) == 2  # fmt: skip
    _one_line_error(capsys, "release bundle")

    # the candidates come from files; the same examples score as in the run-directory mode
    data = load_run(run)
    files = {}
    for role in ("member", "nonmember"):
        files[role] = tmp_path / f"{role}s.jsonl"
        with open(files[role], "w") as fh:
            for t, y in zip(
                np.array(data.texts)[data.role == role], data.labels[data.role == role]
            ):
                fh.write(json.dumps({"text": str(t), "label": int(y)}) + "\n")
    rc = main(["attack", str(bundle), "--members", str(files["member"]), "--nonmembers",
               str(files["nonmember"]), "--device", "cpu", "--bootstrap", "0", "--json"])  # fmt: skip
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target"]["bundle"] == str(bundle) and set(doc["attacks"]) == {"loss", "loss_class"}
    assert json.loads((bundle / "attacks" / "attacks.json").read_text())["target"]["bundle"]
    rc = main(["attack", str(run), "--attacks", "loss", "--out", str(tmp_path / "r"),
               "--device", "cpu", "--bootstrap", "0"])  # fmt: skip
    assert rc == 0
    capsys.readouterr()
    a = np.load(bundle / "attacks" / "scores.npz")["loss"]
    b = np.load(tmp_path / "r" / "scores.npz")["loss"]
    np.testing.assert_allclose(a, b, rtol=1e-5)

    s = build_report([str(bundle), str(run)], str(tmp_path / "report"))
    kinds = {r["run"]: r["kind"] for r in s["runs"]}
    assert kinds == {"release": "bundle", "run": "run"}
    (b_info,) = s["bundles"]
    assert b_info["not_shown"] and any("splits_hash" in x for x in b_info["audit_skipped"])
    md = (tmp_path / "report" / "report.md").read_text()
    assert "release is a release bundle: without the operator's files" in md
    assert "audit check skipped: splits_hash" in md
    assert main(["report", str(bundle), "--out", str(tmp_path / "rep2")]) == 0

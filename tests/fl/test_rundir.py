"""fl.run.rundir: the run directory's one reader/writer (layout, schema version, formats)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fl.errors import UsageError
from fl.run import rundir


def test_one_schema_version_and_one_jsonable_everywhere():
    import audit.bundle.audit
    import fl.run.engine
    import fl.run.manifest

    assert fl.run.manifest.SCHEMA_VERSION is rundir.SCHEMA_VERSION
    assert audit.bundle.audit.SCHEMA_VERSION is rundir.SCHEMA_VERSION
    assert fl.run.engine.SCHEMA_VERSION is rundir.SCHEMA_VERSION
    assert not hasattr(fl.run.manifest, "_jsonable")


def test_one_file_sha256():
    import attacks.signals
    import audit.bundle.audit
    import fl.io
    import fl.run.manifest

    for mod in (attacks.signals, audit.bundle.audit, fl.run.manifest):
        assert mod.file_sha256 is fl.io.file_sha256


def test_jsonable():
    doc = {
        1: (np.int64(3), np.float32(0.5)),
        "t": torch.tensor([1.0, 2.0]),
        "nan": float("nan"),
        "inf": math.inf,
        "ninf": np.float64(-math.inf),
    }
    assert rundir.jsonable(doc) == {
        "1": [3, 0.5],
        "t": [1.0, 2.0],
        "nan": None,
        "inf": "inf",
        "ninf": "-inf",
    }


def test_metrics_append_read_truncate(tmp_path):
    assert rundir.read_metrics(tmp_path) is None
    for r in (1, 2, 3):
        rundir.append_metrics(tmp_path, {"round": r, "loss": np.float64(r / 2), "x": math.nan})
    path = tmp_path / rundir.METRICS
    assert path.read_text().splitlines()[0] == '{"round": 1, "loss": 0.5, "x": null}'
    with open(path, "a") as fh:
        fh.write('{"round": 4, "lo')  # torn by a kill
    assert [r["round"] for r in rundir.read_metrics(tmp_path)] == [1, 2, 3]
    with pytest.raises(UsageError, match="line 4 is not valid JSON"):
        rundir.read_metrics(tmp_path, strict=True)
    kept = rundir.truncate_metrics(tmp_path, 2)
    assert [r["round"] for r in kept] == [1, 2]
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in kept)
    assert rundir.read_metrics(tmp_path, strict=True) == kept


def test_manifest_splits_config_release(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        rundir.read_manifest(tmp_path / "nope")
    with pytest.raises(UsageError, match="manifest.json"):
        rundir.read_manifest(tmp_path)
    assert not rundir.is_release(tmp_path)
    assert rundir.read_splits(tmp_path) is None and rundir.read_config(tmp_path) is None
    (tmp_path / rundir.MANIFEST).write_text(json.dumps({"schema_version": 99}))
    assert rundir.read_manifest(tmp_path) == {"schema_version": 99}
    with pytest.raises(UsageError, match="schema_version"):
        rundir.read_manifest(tmp_path, check_schema=True)
    (tmp_path / rundir.MANIFEST).write_text(
        json.dumps({"schema_version": rundir.SCHEMA_VERSION, "visibility": "public"})
    )
    assert rundir.read_manifest(tmp_path, check_schema=True)["visibility"] == "public"
    assert rundir.is_release(tmp_path) and rundir.is_release({"visibility": "public"})
    (tmp_path / rundir.SPLITS).write_text("[1]")
    with pytest.raises(UsageError, match="JSON object"):
        rundir.read_splits(tmp_path)
    (tmp_path / rundir.CONFIG).write_text('{"seed": 1}')
    assert rundir.read_config(tmp_path) == {"seed": 1}

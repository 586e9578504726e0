import math

import pytest
import torch

from analysis import refactorization as rf
from analysis.schemas import validate
from fl.privacy.accounting import epsilon


def test_gaussian_sigma_matches_pld_accountant():
    eps, delta = 4.0, 1e-5
    sigma = rf.sigma_for("powerdp", eps, delta, iters=2)  # 5 releases
    achieved = epsilon(sigma / math.sqrt(5), 1.0, 1, delta)
    assert achieved == pytest.approx(eps, rel=0.01)
    assert rf.gaussian_delta(eps, math.sqrt(5) / sigma) <= delta * (1 + 1e-9)


def test_errors_reference():
    g = torch.Generator().manual_seed(0)
    B = torch.randn(8, 2, generator=g, dtype=torch.float64)
    A = torch.randn(2, 6, generator=g, dtype=torch.float64)
    e = rf.errors(B, A, B, A)
    assert e["subspace_error"] < 1e-12 and e["reconstruction_error"] < 1e-12
    # orthogonal row space: sin θ = 1
    A2 = torch.zeros(2, 6, dtype=torch.float64)
    A2[0, 0] = A2[1, 1] = 1.0
    A3 = torch.zeros(2, 6, dtype=torch.float64)
    A3[0, 2] = A3[1, 3] = 1.0
    assert rf.errors(B, A2, B, A3)["subspace_error"] == pytest.approx(1.0)


def test_run(tmp_path):
    doc = rf.run(out=tmp_path, m=24, n=20, rank=2, clients=50, epsilons=[1.0, 16.0, 1e4], trials=2)
    validate(doc)
    by = {(r["scheme"], r["epsilon"]): r for r in doc["rows"]}
    for s in ("powerdp", "input"):
        assert by[(s, 16.0)]["reconstruction_error"] < by[(s, 1.0)]["reconstruction_error"]
        assert by[(s, 1e4)]["reconstruction_error"] < 1e-2  # → the non-private SVD
    assert (
        by[("output", 16.0)]["reconstruction_error"]
        > 10 * by[("powerdp", 16.0)]["reconstruction_error"]
    )
    assert by[("output_heuristic", 16.0)]["dp_valid"] is False
    assert (tmp_path / "refactorization.svg").stat().st_size > 0


def test_from_run(tmp_path):
    import json

    from safetensors.torch import save_file

    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "base_model.model.l.lora_A.weight": torch.randn(4, 16, generator=g),
            "base_model.model.l.lora_B.weight": torch.randn(20, 4, generator=g),
        },
        str(run / "adapter" / "adapter_model.safetensors"),
    )
    (run / "manifest.json").write_text(
        json.dumps({"config": {"alpha": 8, "rank": 4, "clients": 4}})
    )
    doc = rf.run(runs=[run], rank=4, epsilons=[2.0, 1e6], trials=1, figure=False)
    validate(doc)
    pd = {r["epsilon"]: r for r in doc["rows"] if r["scheme"] == "powerdp"}
    # Δ = ‖W̄‖/K with K = 4: only a huge ε makes the noise negligible
    assert pd[1e6]["reconstruction_error"] < 1e-2 and pd[1e6]["clients"] == 4
    assert pd[2.0]["reconstruction_error"] > 10 * pd[1e6]["reconstruction_error"]

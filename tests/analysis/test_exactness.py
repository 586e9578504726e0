import json
import math

import torch

from analysis import exactness as ex
from analysis.schemas import validate
from fl import linalg


def _rel(M, S):
    return float(torch.linalg.matrix_norm(M - S) / torch.linalg.matrix_norm(S))


def _by(res, method, p=None, orank=None):
    out = [
        r
        for r in res
        if r["method"] == method
        and (p is None or r["oversketch"] == p)
        and (orank is None or r["output_rank"] == orank)
    ]
    assert out, (method, p, orank)
    return math.sqrt(out[0]["num_sq"] / out[0]["den_sq"])


def test_errors_match_dense_references():
    m, n, r, K = 20, 18, 3, 3
    Bs, As, w = ex.client_factors(m, n, r, K, False, seed=5)
    S = sum(p * B @ A for p, B, A in zip(w, Bs, As))
    res = ex.method_errors(Bs, As, w, oversketch=(0, 2, (K - 1) * r), seed=0)
    # fedavg: (Σ p B)(Σ p A) by hand
    Bf = sum(p * B for p, B in zip(w, Bs))
    Af = sum(p * A for p, A in zip(w, As))
    assert abs(_by(res, "fedavg") - _rel(Bf @ Af, S)) < 1e-12
    assert _by(res, "fedavg") > 0.1
    # hetlora by hand: weights ∝ ‖B_k A_k‖_F (norms only, as the method trains)
    nk = torch.tensor(
        [float(torch.linalg.matrix_norm(B @ A)) for B, A in zip(Bs, As)],
        dtype=torch.float64,
    )
    wk = nk / nk.sum()
    Bh = sum(x * B for x, B in zip(wk, Bs))
    Ah = sum(x * A for x, A in zip(wk, As))
    assert abs(_by(res, "hetlora") - _rel(Bh @ Ah, S)) < 1e-12
    # flexlora / fedpower at rank r: Eckart–Young truncation error of S
    s = torch.linalg.svdvals(S)
    ey = float(torch.sqrt(torch.sum(s[r:] ** 2)) / torch.sqrt(torch.sum(s**2)))
    assert abs(_by(res, "flexlora", orank=r) - ey) < 1e-10
    # power iteration (4 iterations, no noise) approaches but cannot beat Eckart–Young
    assert ey - 1e-12 <= _by(res, "fedpower", orank=r) < 1.1 * ey
    # exact ones
    assert _by(res, "flora") < 1e-12
    assert _by(res, "flexlora", orank=K * r) < 1e-12
    assert _by(res, "fedpower", orank=K * r) < 1e-12
    assert _by(res, "fedask", p=(K - 1) * r, orank=K * r) < 1e-12  # wide sketch
    assert _by(res, "fedask", p=2, orank=r + 2) > 1e-3  # too narrow
    assert not any(r_["method"] == "ffa" for r_ in res)  # FFA needs a shared A


def test_shared_a_is_exact_for_fedavg_ffa_fedask():
    Bs, As, w = ex.client_factors(20, 18, 3, 4, True, seed=1)
    res = ex.method_errors(Bs, As, w, oversketch=(0,), seed=0)
    for meth in ("fedavg", "ffa", "fedask"):
        assert _by(res, meth) < 1e-12


def test_run_outputs(tmp_path):
    doc = ex.run(seed=0, out=tmp_path, m=16, n=12, rank=2, clients=(2, 3))
    validate(json.loads((tmp_path / "exactness.json").read_text()))
    validate(doc)
    for ext in ("png", "svg"):
        assert (tmp_path / f"exactness.{ext}").stat().st_size > 0
    assert {r["method"] for r in doc["rows"]} == set(ex.METHODS)
    assert ex.run(seed=0, m=16, n=12, rank=2, clients=(2, 3), figure=False) == doc


def _fake_run(path, B, A, method="fedavg", alpha=8.0, rank=None, clients=3, metrics=()):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter").mkdir()
    rank = rank or B.shape[1]
    save_file(
        {
            "base_model.model.enc.q.lora_A.weight": A.float().contiguous(),
            "base_model.model.enc.q.lora_B.weight": B.float().contiguous(),
        },
        str(path / "adapter" / "adapter_model.safetensors"),
    )
    man = {
        "method": method,
        "config": {"alpha": alpha, "rank": rank, "clients": clients, "method": method, "seed": 0},
        "privacy": {"level": "none", "noise_multiplier": 0.0},
    }
    (path / "manifest.json").write_text(json.dumps(man))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return path


def test_from_runs(tmp_path):
    Bs, As, w = ex.client_factors(12, 10, 2, 3, False, seed=2)
    dirs = [_fake_run(tmp_path / f"r{k}", B, A) for k, (B, A) in enumerate(zip(Bs, As))]
    doc = ex.run(runs=dirs, oversketch=[0, 4])
    validate(doc)
    s = 8.0 / 2
    sB = [(s * B).float().double() for B in Bs]
    Af = [A.float().double() for A in As]
    flora = [r for r in doc["rows"] if r["method"] == "flora"][0]
    assert flora["relative_error"] < 1e-6 and flora["clients"] == 3
    fedavg = [r for r in doc["rows"] if r["method"] == "fedavg"][0]
    Bg, Ag = linalg.fedavg_aggregate(sB, Af, None)
    ref = float(linalg.aggregation_error(Bg, Ag, sB, Af, None))
    assert abs(fedavg["relative_error"] - ref) < 1e-9

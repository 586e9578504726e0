"""The claim checker: recomputes ε for the described mechanism and names the mistakes.

Each mistaken claim is crafted by computing, with the accountant directly, the ε the
mistake produces; the checker must recognise it. References: fl.privacy.accounting.epsilon
(the composed subsampled Gaussian), dp_accounting's accountants composed directly and the
GDP closed form (k Gaussians of multiplier s are μ-GDP with μ = √k/s), which the checker
must reproduce for a correct claim. Every ε is under add/remove of one example (sample
level) or one client (client level): fixed-size batches / cohorts have sensitivity 2C.
"""

import json
import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

import audit.claims.check
from audit.bounds.hypothesis import gdp_epsilon
from audit.claims.check import check_claim, load_claim, validate_claim
from fl.errors import UsageError
from fl.privacy.accounting import NEIGHBOURING, epsilon

DELTA = 1e-6
# σ = 2 (1 before): every check here compares ε's computed at one σ, and the PLDs that
# compute them cost a third to a fifth as much as at σ = 1 (a PLD's grid grows as σ falls)
SIGMA = 2.0
B, N, S, R, M, K = 32, 1000, 10, 10, 5, 10  # batch, records/client, steps, rounds, clients
Q = B / N

BASE = dict(
    level="sample",
    noise_multiplier=SIGMA,
    clipping_norm=1.0,
    sampling="poisson",
    batch_size=B,
    dataset_size=N,
    steps_per_round=S,
    rounds=R,
    clients_per_round=M,
    total_clients=K,
    accounting="composed",
    noise_source="keyed_csprng",
    delta=DELTA,
)


def plain(mult: float, count: int, delta: float) -> float:
    """ε(δ) of ``count`` plain Gaussians of multiplier ``mult`` by the PLD accountant
    (fl.privacy.accounting.epsilon) on a 1e-3 grid: for a plain Gaussian it agrees with the
    default 1e-4 grid (and the closed form) to within 1.6e-7 relative at every (mult, count,
    δ) used here, at a tenth of the cost (1.2 s for 100 steps at σ = 2 on the 1e-4 grid)."""
    return epsilon(mult, 1.0, count, delta, discretization=1e-3)


def codes(res, severity=None):
    return {f["code"] for f in res["findings"] if severity is None or f["severity"] == severity}


@pytest.fixture(scope="module")
def eps_true():
    return epsilon(SIGMA, Q, S * R, DELTA)


def test_correct_claim_passes(eps_true):
    res = check_claim(dict(BASE, claimed_epsilon=eps_true))
    assert res["epsilon_pld"] == pytest.approx(eps_true, rel=1e-9)
    assert res["epsilon_rdp"] == pytest.approx(epsilon(SIGMA, Q, S * R, DELTA, "rdp"), rel=1e-9)
    assert res["epsilon_rdp"] >= res["epsilon_pld"]
    assert not res["understated"]
    assert res["ratio"] == pytest.approx(1.0)
    assert not codes(res, "error")
    assert set(res) >= {"claimed_epsilon", "delta", "epsilon_pld", "epsilon_rdp", "understated"}
    # an RDP-computed (looser) correct claim is not understated either
    assert not check_claim(dict(BASE, claimed_epsilon=res["epsilon_rdp"]))["understated"]


def test_no_composition_across_rounds(eps_true):
    one_round = epsilon(SIGMA, Q, S, DELTA)
    res = check_claim(dict(BASE, claimed_epsilon=one_round, accounting="unknown"))
    assert res["understated"] and res["ratio"] == pytest.approx(eps_true / one_round)
    assert codes(res, "error") == {"no_composition_across_rounds"}
    msg = next(f["message"] for f in res["findings"])
    assert f"{R} rounds" in msg and f"{one_round:.4g}" in msg and f"{eps_true:.4g}" in msg
    # the direct rule: the claimant says so
    res = check_claim(dict(BASE, claimed_epsilon=one_round, accounting="per_round"))
    assert "no_composition_across_rounds" in codes(res, "error")
    # ... a per_round label on a correct figure is only a warning
    res = check_claim(dict(BASE, claimed_epsilon=eps_true, accounting="per_round"))
    assert codes(res, "warning") == {"no_composition_across_rounds"} and not codes(res, "error")


def test_wrong_sample_rate():
    wrong = epsilon(SIGMA, B / (K * N), S * R, DELTA)  # batch over the whole federation
    res = check_claim(dict(BASE, claimed_epsilon=wrong))
    assert res["understated"]
    assert codes(res, "error") == {"wrong_sample_rate"}
    msg = res["findings"][0]["message"]
    assert f"{K * N}" in msg and f"{Q:.4g}" in msg


@pytest.mark.parametrize("sampling", ["shuffle", "fixed_batch"])
def test_amplification_without_random_sampling(sampling):
    poisson = epsilon(SIGMA, Q, S * R, DELTA)
    res = check_claim(dict(BASE, sampling=sampling, claimed_epsilon=poisson))
    # reference: no amplification, and fixed-size batches have sensitivity 2C under
    # add/remove: every one of the R*S steps is a plain Gaussian of multiplier σ/2, i.e.
    # μ-GDP with μ = √(R*S)/(σ/2) (checked against dp_accounting below).
    mu = math.sqrt(R * S) / (SIGMA / 2)
    assert res["epsilon_pld"] == pytest.approx(gdp_epsilon(mu, DELTA), rel=1e-9)
    assert res["understated"]
    assert codes(res, "error") == {"amplification_without_random_sampling"}
    assert sampling in res["findings"][0]["message"]


CLIENT = dict(
    level="client",
    noise_multiplier=SIGMA,
    sampling="fixed_batch",
    rounds=20,
    clients_per_round=10,
    total_clients=100,
    noise_source="csprng",
    delta=1e-4,
)


def test_client_sampling_ignored_client_level():
    kw = CLIENT
    amplified = epsilon(SIGMA, 0.1, 20, 1e-4)
    res = check_claim(dict(kw, claimed_epsilon=amplified))
    # a fixed cohort of 10 of 100 clients: 20 plain Gaussians at σ/2 (sensitivity 2C)
    assert res["epsilon_pld"] == pytest.approx(plain(SIGMA / 2, 20, 1e-4), rel=1e-4)
    assert codes(res, "error") == {"client_sampling_ignored"}
    assert "10/100" in res["findings"][0]["message"]
    # with Poisson client sampling the amplified figure is the correct one
    res = check_claim(dict(kw, sampling="poisson", claimed_epsilon=amplified))
    assert not res["understated"] and not codes(res, "error")


def test_client_sampling_ignored_sample_level():
    amplified = epsilon(SIGMA, Q * M / K, S * R, DELTA)
    res = check_claim(dict(BASE, claimed_epsilon=amplified))
    assert codes(res, "error") == {"client_sampling_ignored"}


def test_delta_too_large(eps_true):
    n = K * N
    delta = 2.0 / n
    e = epsilon(SIGMA, Q, S * R, delta)
    res = check_claim(dict(BASE, delta=delta, claimed_epsilon=e))
    assert not res["understated"]
    assert codes(res, "error") == {"delta_too_large"}
    assert str(n) in res["findings"][0]["message"]
    # client level: n = clients
    res = check_claim(
        dict(level="client", noise_multiplier=2.0, sampling="all", rounds=3,
             clients_per_round=5, total_clients=5, delta=0.25, claimed_epsilon=100.0)
    )  # fmt: skip
    assert codes(res, "error") == {"delta_too_large"}


def test_unexplained_and_no_noise(eps_true):
    res = check_claim(dict(BASE, claimed_epsilon=eps_true * 0.8))
    assert codes(res, "error") == {"unexplained_understatement"}
    res = check_claim(dict(BASE, noise_multiplier=0.0, claimed_epsilon=1.0))
    assert res["understated"] and math.isinf(res["epsilon_pld"]) and math.isinf(res["ratio"])
    assert "noise_not_applied" in codes(res, "error")


def test_missing_clipping_norm_is_info(eps_true):
    kw = {k: v for k, v in BASE.items() if k != "clipping_norm"}
    res = check_claim(dict(kw, claimed_epsilon=eps_true))
    assert codes(res) == {"clipping_norm_missing"} and not codes(res, "error")


def test_sample_rate_instead_of_batch(eps_true):
    kw = {k: v for k, v in BASE.items() if k not in ("batch_size", "dataset_size")}
    res = check_claim(dict(kw, sample_rate=Q, claimed_epsilon=eps_true))
    assert res["epsilon_pld"] == pytest.approx(eps_true, rel=1e-9) and not codes(res, "error")


def test_load_json_and_toml(tmp_path, eps_true):
    claim = dict(BASE, claimed_epsilon=eps_true, name="paper X, table 2")
    pj = tmp_path / "c.json"
    pj.write_text(json.dumps(claim))
    lines = [f"{k} = {json.dumps(v)}" for k, v in claim.items()]
    pt = tmp_path / "c.toml"
    pt.write_text("\n".join(lines) + "\n")
    a, b = load_claim(pj), load_claim(pt)
    assert a == b == validate_claim(claim)
    assert check_claim(a)["epsilon_pld"] == pytest.approx(eps_true, rel=1e-9)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"level": "record"}, "level"),
        ({"sampling": "random"}, "sampling"),
        ({"accounting": "daily"}, "accounting"),
        ({"noise_multiplier": "1.0"}, "noise_multiplier"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"delta": 1.5}, "delta"),
        ({"rounds": 2.5}, "rounds"),
        ({"claimed_epsilon": 0}, "claimed_epsilon"),
        ({"epsilon": 3.0}, "epsilon"),
        ({"batch_size": 5000}, "batch_size"),
        ({"sample_rate": 0.5}, "sample_rate"),
        ({"clients_per_round": 50}, "clients_per_round"),
    ],
)
def test_schema_errors_name_the_field(change, field):
    with pytest.raises(UsageError, match=field):
        validate_claim({**BASE, "claimed_epsilon": 1.0, **change})


@pytest.mark.parametrize(
    "missing", ["level", "rounds", "delta", "claimed_epsilon", "steps_per_round"]
)
def test_missing_fields(missing):
    claim = {k: v for k, v in dict(BASE, claimed_epsilon=1.0).items() if k != missing}
    with pytest.raises(UsageError, match=missing):
        validate_claim(claim)


def test_client_level_needs_client_counts():
    with pytest.raises(UsageError, match="total_clients"):
        validate_claim(
            dict(level="client", noise_multiplier=1.0, sampling="poisson", rounds=3,
                 clients_per_round=2, delta=1e-5, claimed_epsilon=1.0)
        )  # fmt: skip


def test_bad_files(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        load_claim(tmp_path / "nope.json")
    p = tmp_path / "c.toml"
    p.write_text("level = \n")
    with pytest.raises(UsageError, match="cannot parse"):
        load_claim(p)
    p = tmp_path / "c.json"
    p.write_text("[1, 2]")
    with pytest.raises(UsageError, match="object"):
        load_claim(p)


def test_cli_exit_codes(tmp_path, capsys, eps_true):
    from pipeline.cli import main

    good = tmp_path / "good.json"
    good.write_text(json.dumps(dict(BASE, claimed_epsilon=eps_true)))
    assert main(["audit", "--claim", str(good), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["understated"] is False and doc["epsilon_pld"] == pytest.approx(eps_true)

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(BASE, claimed_epsilon=epsilon(SIGMA, Q, S, DELTA))))
    assert main(["audit", "--claim", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "understated" in out and "no_composition_across_rounds" in out

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(dict(BASE)))
    assert main(["audit", "--claim", str(broken)]) == 2
    err = capsys.readouterr().err
    assert "claimed_epsilon" in err and err.count("\n") == 1
    assert main(["audit", "--claim", str(good), "/some/run"]) == 2
    assert main(["audit", "--claim", str(good), "--one-run"]) == 2


# --------------------------------------------------------------------------- add/remove


def dp_eps(event, count, delta, acc="pld", grid=1e-4):
    a = (
        pld.PLDAccountant(value_discretization_interval=grid)
        if acc == "pld"
        else rdp.RdpAccountant()
    )
    a.compose(dp_accounting.SelfComposedDpEvent(event, count))
    return a.get_epsilon(delta)


def test_neighbouring_relation_is_stated():
    assert "add/remove" in audit.claims.check.__doc__
    res = check_claim(dict(BASE, claimed_epsilon=1.0))
    assert res["neighbouring"] == NEIGHBOURING["sample"] == "add/remove one example"
    res = check_claim(dict(CLIENT, claimed_epsilon=1.0))
    assert res["neighbouring"] == NEIGHBOURING["client"] == "add/remove one client"


# (level, sampling, overrides, count, multiplier): count plain Gaussians of that multiplier
FIXED = [
    ("sample", "fixed_batch", {}, R * S, SIGMA / 2),
    ("sample", "shuffle", {}, R * S, SIGMA / 2),
    ("sample", "all", {}, R * S, SIGMA),
    ("client", "fixed_batch", {}, 20, SIGMA / 2),
    ("client", "shuffle", {"steps_per_round": 3}, 60, SIGMA / 2),
    ("client", "fixed_batch", {"clients_per_round": 100}, 20, SIGMA),  # everyone
    ("client", "all", {"clients_per_round": 100}, 20, SIGMA),
]


@pytest.mark.parametrize("level, sampling, over, count, mult", FIXED)
def test_plain_references_against_dp_accounting_and_closed_form(level, sampling, over, count, mult):
    base = BASE if level == "sample" else CLIENT
    claim = dict(base, sampling=sampling, claimed_epsilon=1.0, **over)
    delta = claim["delta"]
    res = check_claim(claim)
    closed = gdp_epsilon(math.sqrt(count) / mult, delta)
    assert res["epsilon_pld"] == pytest.approx(closed, rel=1e-9)
    # the PLD accountant estimates the same curve (pessimistically, tightly)
    # (a 1e-2 grid: still pessimistic, and fast at the large ε (10-100) of plain Gaussians:
    # at most 1.1e-6 relative above the closed form in every case here, 1e-3's 1.1e-8)
    direct = dp_eps(dp_accounting.GaussianDpEvent(mult), count, delta, grid=1e-2)
    assert closed * (1 - 1e-6) <= direct <= closed * 1.01
    direct_rdp = dp_eps(dp_accounting.GaussianDpEvent(mult), count, delta, "rdp")
    assert res["epsilon_rdp"] == pytest.approx(direct_rdp, rel=1e-9)
    if mult < SIGMA:
        assert "σ/2" in res["mechanism"] and "2C" in res["mechanism"]


def test_poisson_references_against_dp_accounting():
    res = check_claim(dict(BASE, claimed_epsilon=1.0))
    ev = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA))
    assert res["epsilon_pld"] == pytest.approx(dp_eps(ev, R * S, DELTA), rel=1e-9)
    res = check_claim(dict(CLIENT, sampling="poisson", claimed_epsilon=1.0))
    ev = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(SIGMA))
    assert res["epsilon_pld"] == pytest.approx(dp_eps(ev, 20, 1e-4), rel=1e-9)


@pytest.mark.parametrize("level", ["sample", "client"])
def test_fixed_size_never_below_sensitivity_c(level):
    base = BASE if level == "sample" else CLIENT
    fixed = check_claim(dict(base, sampling="fixed_batch", claimed_epsilon=1.0))
    over = {} if level == "sample" else {"clients_per_round": base["total_clients"]}
    every = check_claim(dict(base, sampling="all", claimed_epsilon=1.0, **over))
    assert fixed["epsilon_pld"] > every["epsilon_pld"]


# claims computed the old way (sensitivity C for fixed-size batches / cohorts):
# (base, sampling, the mistaken ε, the codes expected)
REPLACEMENT = [
    (BASE, "fixed_batch", plain(SIGMA, R * S, DELTA), set()),
    # shuffle: one Gaussian per pass over the client's data at sensitivity C
    (BASE, "shuffle", plain(SIGMA, R * math.ceil(S * Q), DELTA), set()),
    (BASE, "shuffle", plain(SIGMA, R * S, DELTA), set()),
    (BASE, "fixed_batch", plain(SIGMA, S, DELTA), {"no_composition_across_rounds"}),
    (CLIENT, "fixed_batch", plain(SIGMA, 20, 1e-4), set()),
    (CLIENT, "shuffle", plain(SIGMA, 1, 1e-4), {"no_composition_across_rounds"}),
]


@pytest.mark.parametrize("base, sampling, claimed, more", REPLACEMENT)
def test_replacement_sensitivity_ignored(base, sampling, claimed, more):
    res = check_claim(dict(base, sampling=sampling, claimed_epsilon=claimed))
    assert res["understated"]
    assert codes(res, "error") == {"replacement_sensitivity_ignored"} | more
    msg = next(f["message"] for f in res["findings"] if f["code"].startswith("replacement"))
    assert "2C" in msg and "add/remove" in msg and f"{claimed:.4g}" in msg
    if sampling == "shuffle" and base is BASE:
        assert "shift every later batch" in msg


def test_replace_one_direct_rule_uses_the_reference_sensitivity():
    # accounting = per_round on a fixed cohort: one round of the reference is S Gaussians
    # at σ/2, composed over the rounds to the reference ε
    one = plain(SIGMA / 2, 1, 1e-4)
    res = check_claim(dict(CLIENT, accounting="per_round", claimed_epsilon=one))
    msg = next(f["message"] for f in res["findings"] if f["code"] == "no_composition_across_rounds")
    assert f"{one:.4g}" in msg


@pytest.mark.parametrize(
    "source, severity",
    [("seeded", "error"), ("unknown", "warning"), (None, "warning"), ("csprng", None),
     ("keyed_csprng", None)],
)  # fmt: skip
def test_noise_reproducible(source, severity, eps_true):
    claim = dict(BASE, claimed_epsilon=eps_true)
    claim.pop("noise_source")
    if source is not None:
        claim["noise_source"] = source
    res = check_claim(claim)
    assert res["noise_source"] == (source or "unknown")
    assert not res["understated"]
    found = [f for f in res["findings"] if f["code"] == "noise_reproducible"]
    if severity is None:
        assert not found
    else:
        assert [f["severity"] for f in found] == [severity]
        assert "seed" in found[0]["message"] and "subtract" in found[0]["message"]


def test_noise_source_validated_and_cli_exit(tmp_path, eps_true):
    from pipeline.cli import main

    with pytest.raises(UsageError, match="noise_source"):
        validate_claim(dict(BASE, claimed_epsilon=1.0, noise_source="urandom"))
    p = tmp_path / "seeded.toml"
    claim = dict(BASE, claimed_epsilon=eps_true, noise_source="seeded")
    p.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in claim.items()))
    assert main(["audit", "--claim", str(p), "--json"]) == 1  # an error finding


def test_client_all_with_a_partial_cohort_is_an_error():
    with pytest.raises(UsageError, match="clients_per_round"):
        validate_claim(dict(CLIENT, sampling="all", claimed_epsilon=1.0))


def test_docs_example_claim(tmp_path):
    """The TOML example of docs/audit.md loads and is a correct claim."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "audit.md").read_text("utf-8")
    block = doc.split("```toml\n", 1)[1].split("```", 1)[0]
    p = tmp_path / "example.toml"
    p.write_text(block)
    claim = load_claim(p)
    res = check_claim(claim)
    assert claim.noise_source == "keyed_csprng" and claim.sampling == "fixed_batch"
    assert not res["understated"] and not codes(res, "error") and not codes(res, "warning")
    # the claim is the fixed-cohort reference, not the sensitivity-C figure
    mu = math.sqrt(claim.rounds) / (claim.noise_multiplier / 2)
    assert claim.claimed_epsilon == pytest.approx(gdp_epsilon(mu, claim.delta), rel=2e-3)


def test_claim_is_a_frozen_record_validated_when_built():
    import dataclasses

    from audit.claims.check import Claim

    doc = dict(BASE, claimed_epsilon=1.0, rounds=10.0, name="paper X")
    c = Claim(**doc)  # built directly: checked and normalized like a file's table
    assert c == validate_claim(doc) == Claim.from_dict(c.to_dict())
    assert c.rounds == 10 and isinstance(c.rounds, int) and c.to_dict()["name"] == "paper X"
    assert "notes" not in c.to_dict() and c.to_dict()["sample_rate"] is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.rounds = 1
    with pytest.raises(UsageError, match="delta"):
        Claim(**dict(doc, delta=1.0))
    with pytest.raises(UsageError, match="steps_per_round"):
        Claim(**{k: v for k, v in doc.items() if k != "steps_per_round"})
    cl = Claim(**dict(CLIENT, claimed_epsilon=1.0))
    assert cl.steps_per_round == 1 and cl.accounting == "unknown"  # the defaults
    with pytest.raises(UsageError, match="accounting"):
        Claim(**dict(CLIENT, claimed_epsilon=1.0, accounting=None))  # None: only in a file


# --------------------------------------------------------------- Opacus's sample rate
OPACUS_CLAIM = dict(level="sample", noise_multiplier=1.0, clipping_norm=1.0, sampling="poisson",
                    batch_size=64, dataset_size=1000, steps_per_round=40, rounds=1,
                    accounting="composed", noise_source="csprng", delta=1e-5)  # fmt: skip


def test_opacus_sample_rate_is_recognised():
    """Opacus samples at q = 1/len(loader) = 1/ceil(1000/64) = 1/16, not 64/1000: its ε
    (3.038, its own PRV accountant) is right for what ran; the q = 0.064 reading gives
    3.094 and was reported as an unexplained understatement."""
    import warnings

    from opacus.accountants import PRVAccountant

    acc = PRVAccountant()
    acc.history = [(1.0, 1 / 16, 40)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opacus_eps = acc.get_epsilon(1e-5)
    assert round(opacus_eps, 3) == 3.038
    r = check_claim({**OPACUS_CLAIM, "claimed_epsilon": round(opacus_eps, 3)})
    codes = {f["code"]: f for f in r["findings"]}
    assert "unexplained_understatement" not in codes
    f = codes["opacus_sample_rate"]
    assert f["severity"] == "warning"
    assert "q = 0.064, which gives ε = 3.094" in f["message"], f["message"]
    assert "1/ceil(1000/64) = 0.0625" in f["message"]
    assert not r["understated"]
    assert r["epsilon_pld"] == pytest.approx(opacus_eps, rel=0.01)  # the mechanism that ran
    assert "q=0.0625" in r["mechanism"]


def test_opacus_rate_does_not_excuse_a_real_understatement():
    r = check_claim({**OPACUS_CLAIM, "claimed_epsilon": 2.0})
    codes = [f["code"] for f in r["findings"]]
    assert r["understated"] and "opacus_sample_rate" not in codes
    assert "unexplained_understatement" in codes
    assert r["epsilon_pld"] == pytest.approx(3.094, abs=2e-3)  # q = 64/1000 as written


def test_no_opacus_finding_when_the_batch_divides_the_data():
    r = check_claim({**OPACUS_CLAIM, "dataset_size": 1024, "claimed_epsilon": 2.5})
    assert "opacus_sample_rate" not in [f["code"] for f in r["findings"]]

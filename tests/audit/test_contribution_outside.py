"""The outside audit's two-sided clip test (``contribution``: a drawn gradient canary adds
EXACTLY C) on observation files whose data are far from zero at the canaries' coordinates:
a correct per-example clip is ``ok``; a clip of the batch sum (each drawn canary adds about
C/√(canaries drawn)) passes the one-sided clip test and is failed by the two-sided one; canaries
added to the clipped sum (``add_clipped``) leave the clipping untested (incomplete)."""

import json

import numpy as np
import pytest

from audit.canaries import canary_set as CS
from audit.canaries import observations as OB
from audit.canaries import outside as O

PARAMS = {"params": [{"name": "l0.weight", "shape": [40, 20]}]}
M, T, SIGMA = 200, 8, 1.0


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from fl.privacy.rng import NoiseKey

    d = tmp_path_factory.mktemp("contribution")
    (d / "params.json").write_text(json.dumps(PARAMS))
    kp = NoiseKey(bytes(range(32))).write(d, overwrite=True)
    out = CS.new_canary_set("gradient", M, d / "set", params=str(d / "params.json"), clip=1.0,
                            key_file=kp)  # fmt: skip
    claim = dict(level="sample", noise_multiplier=SIGMA, clipping_norm=1.0, sampling="poisson",
                 sample_rate=1.0, steps_per_round=T, rounds=1, claimed_epsilon=20.0,
                 delta=1e-5, noise_source="keyed_csprng")  # fmt: skip
    return d, out, CS.load_canary_set(out, key_file=kp), claim, kp


def _audit(made, name, x, **fields):
    d, out, cs, claim, kp = made
    f = dict(kind="gradient", set_sha256=cs.sha256, obs=x, sigma=SIGMA, clip=1.0, q=1.0)
    obs = OB.write_observations(d / f"{name}.npz", {**f, **fields})
    return O.audit_outside(out, obs, claim, key_file=kp)


def _data(seed):
    """(data, noise) at q = 1: a large per-coordinate data gradient that drifts over the
    steps, and the claim's noise."""
    rng = np.random.default_rng(seed)
    base = rng.standard_t(3, M) * 3
    data = np.stack([base * (1 + 0.1 * t) for t in range(T)])
    return data, rng.normal(0, SIGMA, (T, M))


def _tests(res):
    return {t["test"]: t for t in res["conformance"]["tests"]}


def test_a_clip_of_each_example_is_ok(made):
    inc = made[2].included
    data, noise = _data(0)
    res = _audit(made, "ok", data + noise + inc[None, :])
    assert res["verdict"] == "ok" and O.exit_code(res) == 0, res["findings"]
    t = _tests(res)["contribution"]
    assert not t["rejected"] and t["p_value"] > 0.05
    assert res["coverage"]["tested"]["clipping"] == ["canaries"]
    assert res["conformance"]["canaries_entered"] == "per_example"


def test_a_clip_of_the_batch_sum_fails_by_the_two_sided_test_only(made):
    inc = made[2].included
    _, noise = _data(1)
    # one clip of the batch sum to C: the canaries (K·C each) dominate it, the data vanish,
    # each canary adds C/√(canaries drawn)
    x = noise + inc[None, :] / np.sqrt(inc.sum())
    res = _audit(made, "batch", x)
    tests = _tests(res)
    assert tests["clip"]["p_value"] == 1.0 and not tests["clip"]["rejected"]  # "at most C"
    t = tests["contribution"]
    # at q = 1 only the first step has random coins (the inclusion bits): 200 terms
    assert t["rejected"] and t["log10_p"] < -3.5 and t["statistic"] < 0.3, t
    assert res["verdict"] == "does not implement its claim" and O.exit_code(res) == 1
    (f,) = [f for f in res["findings"] if f["code"] == "mechanism_mismatch"]
    assert "contribution test" in f["message"] and "EXACTLY C" in f["message"]


def test_canaries_added_to_the_clipped_sum_leave_the_clipping_untested(made):
    inc = made[2].included
    data, noise = _data(2)
    res = _audit(made, "added", data + noise + inc[None, :], canaries_entered="clipped_sum")
    assert res["verdict"] == "incomplete" and O.exit_code(res) == 4
    assert res["coverage"]["untested"] == ["clipping"]
    assert "add_clipped" in res["coverage"]["why"]["clipping"]
    with pytest.raises(O.UsageError, match="canaries_entered"):
        _audit(made, "bad", data + noise, canaries_entered="sideways")

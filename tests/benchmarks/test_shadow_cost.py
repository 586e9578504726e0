"""The shadow-cost benchmark measures the target it names: the ε = 8 FedAvg-LoRA run of
`fedlora run`'s default preset."""

from benchmarks import shadow_cost
from pipeline.job import PRESETS, RUNS


def test_target_is_the_default_presets_eps8_fedavg_run():
    name, method, over = next(r for r in RUNS if r[0] == "fedavg-eps8")
    over = {k: v for k, v in over.items() if k != "canaries"}  # canaries: not in the pool
    want = {**PRESETS["default"].base, **over, "method": method, "seed": 0}
    assert shadow_cost.TARGET == want
    # the canaries' non-members fit in the preset's non-member pool: same pool size
    assert PRESETS["default"].canaries + 50 <= want["nonmembers"]

"""The shadow-cost benchmark measures the target it names: the ε = 8 FedAvg-LoRA run of
`fedlora run`'s default preset."""

from benchmarks.perf import shadow_cost
from pipeline.job import PRESETS, RUNS


def test_target_is_the_default_presets_eps8_fedavg_run():
    name, method, over = next(r for r in RUNS if r[0] == "fedavg-eps8")
    # the job's gradient canaries live in the clipped sums, not in the attacker's pool
    over = {k: v for k, v in over.items() if k != "canaries"}
    want = {**PRESETS["default"].base, **over, "method": method, "seed": 0}
    assert shadow_cost.TARGET == want

"""Benchmark 6: seconds to calibrate σ for a long run, PLD vs RDP.

``fl.privacy.accounting.calibrate_noise(ε=8, q, steps, δ)`` — binary search on σ with
each probe a full composition of ``steps`` Poisson-subsampled Gaussian steps — for
a 1000-round run of 10 local steps per round (steps = 10 000), q = 32/400 (the default
batch 32 on a client of 400 examples), δ = 1e-5. Baseline: the RDP accountant;
candidate: the PLD accountant (the reported figure). Ratio = PLD time / RDP time.
"""

from __future__ import annotations

from benchmarks.perf import harness

NAME = "accounting"
TARGET_EPS, Q, DELTA, LOCAL_STEPS = 8.0, 32 / 400, 1e-5, 10


def run(quick: bool, device: str = "cpu") -> dict:
    from fl.privacy.accounting import calibrate_noise

    rounds = 20 if quick else 1000
    steps = rounds * LOCAL_STEPS
    reps = 1 if quick else 3
    sigmas = {}

    def cal(acc: str):
        def f():
            sigmas[acc] = calibrate_noise(TARGET_EPS, Q, steps, DELTA, acc)

        return f

    times = harness.interleaved({"rdp": cal("rdp"), "pld": cal("pld")}, reps=reps, warmup=0)
    spread = harness.paired_ratio(times["rdp"], times["pld"])
    return harness.result(
        NAME,
        workload=(
            f"calibrate_noise(ε={TARGET_EPS:g}, q={Q:g}, steps={steps} = {rounds} rounds × "
            f"{LOCAL_STEPS} local steps, δ={DELTA:g}); {reps} interleaved repetition(s)"
        ),
        baseline="RDP accountant calibration",
        candidate="PLD accountant calibration",
        ratio=spread["median"],
        ratio_kind="time",
        target=None,
        met=None,
        details={
            "rounds": rounds,
            "steps": steps,
            "rdp": harness.summarize(times["rdp"]),
            "pld": harness.summarize(times["pld"]),
            "sigma": sigmas,
        },
        spread=spread,
    )

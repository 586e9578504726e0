"""Peak RSS of a short full-scale top-layer run, with or without a malloc_trim after each
local training: ``python -m benchmarks.grids.dplearn_memory base|trim OUT_DIR`` (prints one JSON line).

As measured on 2026-12-02: the recipe then in configs/minilm-tweets-dp-top1.toml (rank 8,
constant rates) for 2 rounds x 8 steps. The trim variant wraps LocalTrainer.run, which is
what fl.run.trainer.release_freed_memory does inside it now (so today both variants trim).
"""

import ctypes
import json
import sys
import threading
import time
from pathlib import Path

import fl.run.trainer as T
from fl.run.config import TrainConfig, load_toml
from fl.run.engine import train

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "minilm-tweets-dp-top1.toml"


def rss_gb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def main(variant: str, out: str) -> None:
    if variant == "trim":
        libc = ctypes.CDLL("libc.so.6")
        orig = T.LocalTrainer.run

        def run(self, *a, **k):
            try:
                return orig(self, *a, **k)
            finally:
                libc.malloc_trim(0)

        T.LocalTrainer.run = run
    peak = {"rss": 0.0, "trace": []}

    def watch():
        t0 = time.time()
        while True:
            r = rss_gb()
            peak["rss"] = max(peak["rss"], r)
            peak["trace"].append((round(time.time() - t0), round(r, 2)))
            time.sleep(2)

    threading.Thread(target=watch, daemon=True).start()
    fields = {**load_toml(str(RECIPE)), "epsilon": 8.0, "rounds": 2, "local_steps": 8}
    cfg = TrainConfig(**{**fields, "eval_every": 2, "progress": False})
    t0 = time.time()
    train(cfg, out, quiet=True)
    doc = {
        "variant": variant,
        "peak_rss_gb": round(peak["rss"], 2),
        "end_rss_gb": round(rss_gb(), 2),
        "wall_s": round(time.time() - t0, 1),
        "trace": peak["trace"][::10],
    }
    print(json.dumps(doc))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

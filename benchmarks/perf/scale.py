"""Over 500 lines on purpose: one benchmark, whose model sizes, timing, memory probes, fit and figure share the measured rows.

Memory and time of a DP and a non-DP local step as a Llama-architecture model grows
(issue #48): ``python -m benchmarks.perf.scale [--out DIR] [--widths 256,512,...]``.

Models: one shape family (:func:`fl.models.decoders.decoder_shape`: GQA with 4 query heads
per key/value head, heads of 64, MLP ≈ 8/3·width, depth = width/64, tied embeddings,
Llama-2's 32,000-row vocabulary), random weights, each written as a Hugging Face folder
(safetensors) and loaded by the engine's own path (``LocalTrainer``: ``load_causal_lm``,
peft LoRA on q_proj/v_proj of every layer, Opacus hooks on the LoRA factors). Data: the
same synthetic texts for every model, tokenized by one byte-level BPE tokenizer, each
example filling its ``seq`` tokens (no padding), batch ``batch`` (q = 1: every step takes
the whole batch, so each step sees exactly batch × seq tokens).

Per (model, LoRA rank, sequence length): seconds per non-DP step and per DP-SGD step
(the engine's ``DpSgd`` privatizer: per-example gradients, joint clipping, keyed noise),
interleaved (nodp, dp, dp, nodp, ...; median of ``reps``; one warm-up DP step per LoRA
set-up), the peak
resident memory of the process during each kind of step (RSS sampled every 2 ms from
``/proc/self/statm``) and its rise above the process at rest just before the step, and the bytes of per-example gradients the DP step held (Σ
``grad_sample.nbytes`` when the privatizer is called; compared with what per-example
gradients of the whole base model would take).

The fit (:func:`fit_linear`, relative least squares): step time
``t = a + b·N·T`` (N parameters, T tokens per step) for DP and non-DP steps, and peak
memory ``M = m0 + m1·N + m2·T·N^(2/3)`` (weights ∝ N, plus activations ∝ tokens × depth ×
width, which is ∝ T·N^(2/3) in this shape family: :data:`MEMORY_FEATURES`); each fit's in-sample
relative error and its leave-the-largest-model-out error (fit on the smaller models,
predict the largest) are reported beside its predictions for 1 B, 7 B and 13 B.

By default one thread (``torch.set_num_threads(1)``), CPU, fp32, and the seconds are CPU
seconds of the measuring thread (``time.thread_time``: on a shared, oversubscribed machine
wall time measures the neighbours; the wall time is kept beside it in results.json).
``--device cuda --precisions fp32,bf16`` measures on a GPU (wall seconds after a
synchronization, CUDA's peak allocated memory; ``benchmarks/gpu/gpu_llama_scale.sh``);
``--widths``, ``--ranks``, ``--seqs``, ``--batch``, ``--reps`` change the grid. Writes
``results.json``, ``table.md`` and ``scale.png`` to ``benchmarks/results/scale/`` (or
``--out``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.paths import RESULTS

OUT = RESULTS / "scale"
WIDTHS = (256, 512, 1024, 1536)
RANKS = (8, 64)
SEQS = (32, 128)
BATCH = 4
VOCAB = 32000
PREDICT = {"1B": 1.0e9, "7B": 6.74e9, "13B": 13.0e9}
#: the memory fit's features of (N parameters, T tokens per step)
MEMORY_FEATURES = ("1", "N", "T·N^(2/3)")


# ---- the fit (pure numpy; tests/benchmarks/test_scale.py) ----------------------------
def time_features(n: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Columns [1, N·T] of the step-time model t = a + b·N·T."""
    n, t = np.asarray(n, float), np.asarray(t, float)
    return np.stack([np.ones_like(n), n * t], axis=1)


def memory_features(n: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Columns [1, N, T·N^(2/3)] of the peak-memory model (weights ∝ N; activations ∝
    tokens × depth × width, and depth × width ∝ N^(2/3) in this shape family)."""
    n, t = np.asarray(n, float), np.asarray(t, float)
    return np.stack([np.ones_like(n), n, t * n ** (2 / 3)], axis=1)


def fit_linear(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients c ≥ 0 minimising Σ_i ((x_i·c − y_i) / y_i)² (relative least squares,
    so a 10 M and a 600 M model weigh alike); negative coefficients are dropped and the
    rest refitted (a time or a byte count never shrinks as the model grows)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    keep = np.ones(x.shape[1], bool)
    while True:
        w = x[:, keep] / y[:, None]
        c, *_ = np.linalg.lstsq(w, np.ones_like(y), rcond=None)
        if (c >= 0).all() or keep.sum() == 1:
            out = np.zeros(x.shape[1])
            out[keep] = np.maximum(c, 0)
            return out
        idx = np.flatnonzero(keep)
        keep[idx[np.argmin(c)]] = False


def relative_errors(x: np.ndarray, y: np.ndarray, c: np.ndarray) -> np.ndarray:
    """(x·c − y) / y per row."""
    return (np.asarray(x, float) @ c - np.asarray(y, float)) / np.asarray(y, float)


def fit_report(n, t, y, features) -> dict:
    """The fit of ``y`` on ``features(n, t)``: coefficients, the in-sample max and RMS
    relative error, and the error at the largest N when fitted without it."""
    n, t, y = (np.asarray(v, float) for v in (n, t, y))
    x = features(n, t)
    c = fit_linear(x, y)
    err = relative_errors(x, y, c)
    big = n == n.max()
    holdout = None
    if (~big).sum() >= x.shape[1] and big.any():
        c_small = fit_linear(x[~big], y[~big])
        holdout = float(np.max(np.abs(relative_errors(x[big], y[big], c_small))))
    return {
        "coef": c.tolist(),
        "max_rel_error": float(np.max(np.abs(err))),
        "rms_rel_error": float(np.sqrt(np.mean(err**2))),
        "holdout_largest_rel_error": holdout,
    }


def predict(fit: dict, features, n: float, t: float) -> float:
    return float(features(np.array([n]), np.array([t]))[0] @ np.asarray(fit["coef"]))


# ---- the table -------------------------------------------------------------------------
def _bytes(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}" if b < 10 * k else f"{b / k:.1f} {unit}"
    return f"{int(b)} B"


def _params(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def format_table(rows: list[dict]) -> str:
    """The measured points as a Markdown table (one row per model × precision × rank ×
    length). Memory is the peak RSS of the process on the CPU, CUDA's peak allocated
    memory on a GPU; the rise is the step's peak above the level just before it."""
    head = (
        "| parameters | width × layers | precision | LoRA rank (adapter params) | "
        "tokens/step (b × L) | s/step non-DP | s/step DP | DP/non-DP | peak memory non-DP | "
        "peak memory DP | step's rise non-DP / DP | per-example grads (DP) | "
        "same for the whole base |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {_params(r['parameters'])} | {r['hidden']} × {r['layers']} | "
            f"{r.get('precision', 'fp32')} | {r['rank']} ({r['adapter_parameters']:,}) | "
            f"{r['tokens']} ({r['batch']} × {r['seq']}) | {r['s_nodp']:.3f} | {r['s_dp']:.3f} | "
            f"{r['s_dp'] / r['s_nodp']:.2f} | {_bytes(r['mem_nodp'])} | {_bytes(r['mem_dp'])} | "
            f"{_bytes(r['mem_rise_nodp'])} / {_bytes(r['mem_rise_dp'])} | "
            f"{_bytes(r['grad_sample_bytes'])} | {_bytes(r['base_grad_sample_bytes'])} |"
        )
    return head + "\n".join(lines) + "\n"


def format_fits(fits: dict, tokens: list[int]) -> str:
    """The fits and their predictions for :data:`PREDICT` at each measured T."""
    out = [
        "| quantity | model | coefficients | max / RMS rel. error (in sample) | "
        "error at the largest model, fitted without it | "
        + " | ".join(f"{k} at T={t}" for k in PREDICT for t in tokens)
        + " |",
        "|---|---|---|---|---|" + "---|" * (len(PREDICT) * len(tokens)),
    ]
    for name, f in fits.items():
        feats = memory_features if name == "peak_memory" else time_features
        model = "m0 + m1·N + m2·T·N^(2/3)" if name == "peak_memory" else "a + b·N·T"
        coef = ", ".join(f"{c:.3g}" for c in f["coef"])
        hold = f["holdout_largest_rel_error"]
        preds = []
        for n in PREDICT.values():
            for t in tokens:
                v = predict(f, feats, n, t)
                preds.append(_bytes(v) if name == "peak_memory" else f"{v:.1f} s")
        out.append(
            f"| {name} | {model} | {coef} | {100 * f['max_rel_error']:.1f}% / "
            f"{100 * f['rms_rel_error']:.1f}% | "
            f"{'—' if hold is None else f'{100 * hold:.1f}%'} | " + " | ".join(preds) + " |"
        )
    return "\n".join(out) + "\n"


# ---- measurement ---------------------------------------------------------------------
class RssPeak:
    """The peak resident set size of this process while the block runs (sampled every
    ``period`` s from /proc/self/statm in a thread; torch releases the GIL in its ops)."""

    PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self._stop = period, 0, threading.Event()

    @classmethod
    def now(cls) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * cls.PAGE

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(self.period)

    def __enter__(self):
        self.peak = self.now()
        self._stop.clear()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.now())


def _texts(n: int, seq: int) -> list[str]:
    """n texts long enough to fill ``seq`` byte-level BPE tokens (synthetic words)."""
    from fl.data.datasets import make_synthetic

    per = max(1, -(-seq // 10))  # a synthetic text is ≥ 10 tokens
    base = make_synthetic(max(n * per, 64)).texts
    return [" ".join(base[i * per : (i + 1) * per]) for i in range(n)]


def _trainer(
    folder: str, rank: int, seq: int, batch: int, device: str, precision: str, physical: int = 0
):
    import torch

    from fl.run.config import TrainConfig
    from fl.run.trainer import LocalTrainer

    cfg = TrainConfig(
        task="causal-lm",
        model=folder,
        dataset="synthetic",
        max_length=seq,
        batch_size=batch,
        rank=rank,
        alpha=2.0 * rank,
        lora_layers=0,
        progress=False,
        device=device,
        precision=precision,
        length_buckets=False,
        physical_batch=physical,
    )
    return LocalTrainer(cfg, 0, torch.device(device))


class DevicePeak:
    """Peak memory of one step: the process's RSS on the CPU (:class:`RssPeak`), CUDA's
    ``max_memory_allocated`` on a GPU; ``rest`` is the level just before the step."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def __enter__(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.rest = torch.cuda.memory_allocated()
        else:
            self._rss = RssPeak().__enter__()
            self.rest = RssPeak.now()
        return self

    def __exit__(self, *exc):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._rss.__exit__(*exc)
            self.peak = self._rss.peak


def measure_model(
    folder: str,
    info: dict,
    reps: int,
    log,
    device: str = "cpu",
    precisions: tuple[str, ...] = ("fp32",),
    ranks: tuple[int, ...] = RANKS,
    seqs: tuple[int, ...] = SEQS,
    batch: int = BATCH,
    physical: int = 0,
) -> list[dict]:
    """Every (precision, rank, seq) point of one model folder. Seconds are CPU seconds of
    this thread on the CPU (robust on a shared machine; wall beside them), wall seconds
    after a synchronization on a GPU."""
    from benchmarks.perf.dp_overhead import bench_streams
    from fl.data.lm import LmTokenizedData
    from fl.models.base import load_tokenizer
    from fl.privacy.dpsgd import DpSgdParams
    from fl.run.local_step import DpSgd, NoPrivacy

    held: list[int] = []

    class MeasuredDpSgd(DpSgd):
        """The engine's privatizer, counting the per-example gradient bytes it is given."""

        def __call__(self, params, batch_size):
            held.append(
                sum(
                    p.grad_sample.nbytes
                    for p in params
                    if getattr(p, "grad_sample", None) is not None
                )
            )
            return super().__call__(params, batch_size)

    import torch

    cuda = device.startswith("cuda")
    tok = load_tokenizer(folder)
    rows = []
    for precision in precisions:
        for rank in ranks:
            tr = _trainer(folder, rank, max(seqs), batch, device, precision, physical)
            start = tr.initial_state()
            params = tr._set_trainable({"A", "B"})
            adapter = sum(p.numel() for p in params)
            total = sum(p.numel() for p in tr.model.parameters())
            for seq in seqs:
                data = LmTokenizedData(_texts(batch, seq), tok, seq)
                assert int(data.lengths.min()) == seq, "every example must fill the sequence"
                noise, batches = bench_streams("scale", info["hidden"], precision, rank, seq)
                dp = DpSgdParams(
                    noise_multiplier=1.0, clip=1.0, sample_rate=1.0, expected_batch=batch
                )

                def step(private, tr=tr, start=start, data=data, dp=dp, noise=noise, b=batches):
                    priv = MeasuredDpSgd(dp, noise) if private else NoPrivacy()
                    tr.run(start, data, np.arange(batch), 1, {"A", "B"}, priv, [], b, 0)

                if seq == seqs[0]:
                    step(True)  # warm-up, once per trainer (first touch, Opacus hooks)
                times = {False: [], True: []}
                walls = {False: [], True: []}
                peaks = {False: 0, True: 0}
                rises = {False: 0, True: 0}
                for i in range(reps):
                    for private in (False, True) if i % 2 == 0 else (True, False):
                        gc.collect()
                        with DevicePeak(device) as mem:
                            t0, c0 = time.perf_counter(), time.thread_time()
                            step(private)
                            if cuda:
                                torch.cuda.synchronize()
                            c1, t1 = time.thread_time(), time.perf_counter()
                        times[private].append(t1 - t0 if cuda else c1 - c0)
                        walls[private].append(t1 - t0)
                        peaks[private] = max(peaks[private], mem.peak)
                        rises[private] = max(rises[private], mem.peak - mem.rest)
                row = {
                    "kind": info["kind"],
                    "device": device,
                    "precision": precision,
                    "hidden": info["shape"]["hidden"],
                    "layers": info["shape"]["layers"],
                    "parameters": total,
                    "rank": rank,
                    "adapter_parameters": adapter,
                    "seq": seq,
                    "batch": batch,
                    "physical_batch": physical,
                    "tokens": batch * seq,
                    "s_nodp": float(np.median(times[False])),
                    "s_dp": float(np.median(times[True])),
                    "s_nodp_all": times[False],
                    "s_dp_all": times[True],
                    "wall_nodp": float(np.median(walls[False])),
                    "wall_dp": float(np.median(walls[True])),
                    "mem_nodp": peaks[False],
                    "mem_dp": peaks[True],
                    "mem_rise_nodp": rises[False],
                    "mem_rise_dp": rises[True],
                    "grad_sample_bytes": max(held),
                    # at the measured bytes per element (4 in fp32, 2 under bf16 autocast)
                    "base_grad_sample_bytes": int(max(held) / (batch * adapter))
                    * batch
                    * (total - adapter),
                }
                held.clear()
                rows.append(row)
                log(
                    f"  {precision} rank {rank} seq {seq}: non-DP {row['s_nodp']:.3f} s, DP "
                    f"{row['s_dp']:.3f} s (×{row['s_dp'] / row['s_nodp']:.2f}); peak "
                    f"{_bytes(row['mem_nodp'])} / {_bytes(row['mem_dp'])}; per-example grads "
                    f"{_bytes(row['grad_sample_bytes'])}"
                )
            del tr, start, params
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return rows


def fits_of(rows: list[dict]) -> dict:
    n = [r["parameters"] for r in rows]
    t = [r["tokens"] for r in rows]
    return {
        "s_nodp": fit_report(n, t, [r["s_nodp"] for r in rows], time_features),
        "s_dp": fit_report(n, t, [r["s_dp"] for r in rows], time_features),
        "peak_memory": fit_report(n, t, [r["mem_dp"] for r in rows], memory_features),
    }


def figure(rows: list[dict], fits: dict, path: Path) -> None:
    """Three panels: step time against N·T with the fits; peak memory against N with the
    fit extrapolated to 13 B; per-example gradient bytes against N (LoRA vs whole base)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in rows})
    ranks = sorted({r["rank"] for r in rows})
    batch = rows[0]["batch"]
    cpu = rows[0].get("device", "cpu") == "cpu"
    what = "peak RSS" if cpu else "peak CUDA memory"
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.4))
    nt = np.array([r["parameters"] * r["tokens"] for r in rows], float)
    grid = np.logspace(np.log10(nt.min() / 2), np.log10(nt.max() * 2), 50)
    for key, mark, label in (("s_nodp", "o", "non-DP"), ("s_dp", "s", "DP-SGD")):
        ax[0].scatter(nt, [r[key] for r in rows], marker=mark, label=f"{label} (measured)")
        a, b = fits[key]["coef"]
        ax[0].plot(grid, a + b * grid, label=f"{label} fit a + b·N·T")
    ax[0].set(
        xscale="log",
        yscale="log",
        xlabel="parameters × tokens per step",
        ylabel="CPU seconds per step (1 thread)" if cpu else "seconds per step",
        title="step time",
    )
    ax[0].legend(fontsize=8)
    n = np.array([r["parameters"] for r in rows], float)
    for seq in seqs:
        sel = [r for r in rows if r["seq"] == seq]
        ax[1].scatter(
            [r["parameters"] for r in sel],
            [r["mem_dp"] / 2**30 for r in sel],
            label=f"{what}, DP step, T={batch * seq}",
        )
        g = np.logspace(np.log10(n.min() / 2), np.log10(max(PREDICT.values())), 50)
        ax[1].plot(
            g,
            memory_features(g, np.full_like(g, batch * seq))
            @ np.array(fits["peak_memory"]["coef"])
            / 2**30,
            "--",
            label=f"fit, T={batch * seq}",
        )
    for name, v in PREDICT.items():
        ax[1].axvline(v, color="grey", lw=0.5)
        ax[1].text(v, 0.3, name, fontsize=8)
    ax[1].set(
        xscale="log",
        yscale="log",
        xlabel="parameters N",
        ylabel="GiB",
        title=f"{what} ({rows[0].get('precision', 'fp32')})",
    )
    ax[1].legend(fontsize=8)
    for rank in ranks:
        sel = [r for r in rows if r["rank"] == rank and r["seq"] == max(seqs)]
        ax[2].plot(
            [r["parameters"] for r in sel],
            [r["grad_sample_bytes"] / 2**20 for r in sel],
            "o-",
            label=f"per-example grads held, rank {rank}",
        )
    sel = [r for r in rows if r["rank"] == ranks[0] and r["seq"] == max(seqs)]
    ax[2].plot(
        [r["parameters"] for r in sel],
        [r["base_grad_sample_bytes"] / 2**20 for r in sel],
        "k:",
        label="if the whole base had them",
    )
    ax[2].set(
        xscale="log",
        yscale="log",
        xlabel="parameters N",
        ylabel="MiB",
        title=f"per-example gradients (batch {batch})",
    )
    ax[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows: list[dict], out: Path, meta: dict) -> dict:
    """results.json, table.md and scale.png in ``out``; the fits use the rows of the first
    precision measured (fp32 by default)."""
    out.mkdir(parents=True, exist_ok=True)
    first = rows[0].get("precision", "fp32")
    fit_rows = [r for r in rows if r.get("precision", "fp32") == first]
    # a fit in N needs models of at least three sizes (the memory model has 3 coefficients)
    sizes = len({r["hidden"] for r in fit_rows})
    fits = fits_of(fit_rows) if sizes >= 3 else {}
    tokens = sorted({r["tokens"] for r in rows})
    preds = {
        name: {
            k: {
                str(t): predict(
                    f, memory_features if name == "peak_memory" else time_features, n, t
                )
                for t in tokens
            }
            for k, n in PREDICT.items()
        }
        for name, f in fits.items()
    }
    doc = {"meta": meta, "rows": rows, "fits": fits, "predictions": preds}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = [
        "# Memory and time as the model grows (`python -m benchmarks.perf.scale`)\n",
        f"{meta['note']}\n",
        format_table(rows),
    ]
    if fits:
        md += [
            "\n## Fits and predictions\n",
            f"N = parameters, T = tokens per step; relative least squares over the {first} "
            "rows; the predictions extrapolate far beyond the measured range (same device, "
            "precision and thread count) and are only as good as the held-out error suggests.\n",
            format_fits(fits, tokens),
        ]
    else:
        md.append(f"\nNo fit: {sizes} model size(s) measured; a fit needs at least 3.\n")
    (out / "table.md").write_text("\n".join(md))
    if fits:
        figure(fit_rows, fits, out / "scale.png")
    return doc


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def main(argv=None) -> int:
    import torch

    from fl.models.decoders import decoder_shape, write_decoder_folder
    from fl.models.pretrain import train_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="model widths")
    ap.add_argument("--ranks", default=",".join(map(str, RANKS)), help="LoRA ranks")
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)), help="sequence lengths")
    ap.add_argument("--batch", type=int, default=BATCH, help="examples per step")
    ap.add_argument("--reps", type=int, default=2, help="timed steps of each kind per point")
    ap.add_argument("--kind", default="llama", choices=("llama", "qwen2"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--precisions", default="fp32", help="fp32, bf16 or fp32,bf16")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument(
        "--physical-batch", type=int, default=0, help="examples per pass (0: the whole batch)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ranks, seqs = _ints(args.ranks), _ints(args.seqs)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    t_all = time.perf_counter()
    rows = []
    tok = train_tokenizer(_texts(64, 32), 1024)

    def log(msg):
        print(f"[scale +{time.perf_counter() - t_all:.0f}s] {msg}", flush=True)

    for width in _ints(args.widths):
        with tempfile.TemporaryDirectory(prefix="fedlora-scale-") as tmp:
            shape = decoder_shape(width, context=max(seqs))
            info = write_decoder_folder(tmp, args.kind, shape, tokenizer=tok, model_vocab=VOCAB)
            log(f"{args.kind} width {width}, {shape.layers} layers: {_params(info['parameters'])}")
            info["hidden"] = width
            rows += measure_model(
                tmp,
                info,
                args.reps,
                log,
                args.device,
                precisions,
                ranks,
                seqs,
                args.batch,
                args.physical_batch,
            )
        gc.collect()
    where = (
        f"{platform.node()} ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end), "
        f"{args.threads} torch thread(s), CPU seconds of the measuring thread"
        if args.device == "cpu"
        else f"{torch.cuda.get_device_name(0)}, wall seconds after synchronization"
    )
    meta = {
        "note": (
            f"Measured {time.strftime('%Y-%m-%d', time.gmtime())} on {where}; "
            f"{'/'.join(precisions)}, torch {torch.__version__}; {args.kind} shape family "
            f"(fl.models.decoders.decoder_shape), vocabulary {VOCAB}, batch {args.batch} "
            f"({args.physical_batch or args.batch} a pass), LoRA "
            f"on q_proj/v_proj of every layer, median of {args.reps} interleaved steps (one "
            f"warm-up DP step per LoRA set-up); total {time.perf_counter() - t_all:.0f} s."
        ),
        "device": args.device,
        "precisions": list(precisions),
        "widths": list(_ints(args.widths)),
        "ranks": list(ranks),
        "seqs": list(seqs),
        "reps": args.reps,
        "batch": args.batch,
        "physical_batch": args.physical_batch,
        "threads": args.threads,
        "vocab": VOCAB,
    }
    write(rows, Path(args.out), meta)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

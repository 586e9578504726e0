"""A hand-written PyTorch DP-SGD loop with a classic noise-scaling bug, and the audit that
catches it.

    python docs/examples/dpsgd_bug_audit.py [--work DIR] [--steps 200] [--records 400]
                                            [--q 0.05] [--epsilon 2] [--canaries 1000]

The loop (an MLP on synthetic data; Poisson batches at rate q; per-example gradients with
``torch.func``; a flat clip at C; the expected batch size B = q·n as the divisor, as Opacus
does) is trained once per variant with gradient canaries
(``audit.canaries.hooks.GradientCanaryHook``), each with its own way of adding the noise:

``correct``   the privatized sum S + N(0, σ²C²), then divided by B. The hook observes the
              sum: noise std σC, as claimed.
``average``   the noise added to the AVERAGED gradient with std σC/B: S/B + N(0, (σC/B)²).
              This is the same mechanism (B × that is S + N(0, σ²C²)); the hook observes
              the average with ``scale=B``, i.e. the sum with noise σC. Not a bug.
``bug``       the classic bug: the noise is calibrated for the average (std σC/B) but added
              to the SUM before the division, S + N(0, (σC/B)²), then divided by B — the noise
              divided by B twice (the average carries σC/B² instead of σC/B). The hook
              observes the sum with noise σC/B: observed/claimed = 1/B.
``batch_clip`` the other classic bug: the noise is right, but the loop clips the BATCH SUM to
              norm C instead of each example (a record's gradient no longer bounded by C
              alone). The canaries share that one clip: each drawn canary adds about
              C/√(canaries drawn), less than C, so the one-sided clip test ("at most C")
              passes it; the two-sided one (``contribution``: a drawn canary adds exactly
              C, :func:`audit.bounds.contribution.clip_contribution_test`) fails it.

The claim is the same for all: Poisson-subsampled Gaussian, σ calibrated to the
target ε at q over the steps, C = 1. Each training's observations are audited with
``audit.canaries.outside.audit_outside``, what ``fedlora audit --canaries DIR
--observations FILE --claim CLAIM`` runs: the conformance tests use the CLAIM's σ (the
file's is the trainer's word), so the correct and the average loops pass and the bug is
``mechanism_mismatch`` ("does not implement its claim", exit 1), the batch clip too (by the
two-sided clip test).

The printed observed/claimed ratio is the audit's: sqrt(Σe²/σ² / N) over the canaries'
innovations, an estimate that the data's own step-to-step variation at the canary
coordinates can only push up (so it sits a little above the true 1/B for the bug). The
true ratio of the noise added is printed beside it.

Everything runs on the CPU in seconds (docs/audit.md, "Conformance tests of a training done
elsewhere").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import secrets
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

VARIANTS = ("correct", "average", "bug", "batch_clip")


def build_model(features: int, hidden: int, classes: int = 2, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, classes)
    )


def synthetic_data(n: int, features: int, seed: int = 0):
    """n records x ~ N(0, I), label 1 when a fixed random direction's score is positive."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, generator=g)
    return x, (x @ w > 0).long()


def train(model, x, y, hook, *, variant, sigma, clip, q, steps, lr=0.5, seed=None):
    """DP-SGD by hand with the canary hook; returns (train accuracy, std of the noise on
    the sum in units of σC: 1 for ``correct``, ``average`` and ``batch_clip``, 1/B for
    ``bug``).
    ``seed`` (tests only) makes the batches and the noise reproducible, hence not private."""
    import torch
    from torch.func import functional_call, grad, vmap

    n = len(x)
    B = q * n  # the expected batch size: the divisor (a Poisson batch's own size varies)
    names = [k for k, _ in model.named_parameters()]
    hook.bind(model.named_parameters())
    # the batches and the noise from torch's generator seeded from OS entropy
    gen = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))
    for _ in range(steps):
        idx = torch.nonzero(torch.rand(n, generator=gen) < q).flatten()  # Poisson batch
        params = {k: v.detach() for k, v in model.named_parameters()}
        if len(idx):
            g = per_example(params, x[idx], y[idx])
            per = [g[k] for k in names]
        else:
            per = [torch.zeros((0, *p.shape)) for p in params.values()]
        # the canaries: K·C·e_j per-example rows, before the clip
        per = [torch.cat([a, r]) for a, r in zip(per, hook.canary_rows())]
        if variant == "batch_clip":  # the bug: ONE clip of the batch sum to norm C
            summed = [a.sum(0) for a in per]
            norm = torch.sqrt(sum(s.pow(2).sum() for s in summed))
            summed = [s * torch.clamp(clip / norm.clamp_min(1e-12), max=1.0) for s in summed]
        else:  # each example clipped to norm C, then summed
            norms = torch.sqrt(sum(a.reshape(len(a), -1).pow(2).sum(1) for a in per))
            f = torch.clamp(clip / norms.clamp_min(1e-12), max=1.0)
            summed = [torch.einsum("i,i...->...", f, a) for a in per]
        z = [torch.randn(p.shape, generator=gen) for p in params.values()]
        if variant in ("correct", "batch_clip"):  # N(0, σ²C²) on the sum, then / B
            noisy_sum = [s + sigma * clip * e for s, e in zip(summed, z)]
            hook.observe(noisy_sum)
            avg = [s / B for s in noisy_sum]
        elif variant == "average":  # N(0, (σC/B)²) on the average: the same mechanism
            avg = [s / B + sigma * clip / B * e for s, e in zip(summed, z)]
            hook.observe(avg, scale=B)
        elif variant == "bug":  # the average's noise σC/B added to the SUM, then / B
            noise_std = sigma * clip / B  # "the noise for the average"
            noisy_sum = [s + noise_std * e for s, e in zip(summed, z)]
            hook.observe(noisy_sum)
            avg = [s / B for s in noisy_sum]
        else:
            raise ValueError(f"unknown variant {variant!r}")
        with torch.no_grad():
            for p, a in zip(model.parameters(), avg):
                p -= lr * a
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    return acc, (1.0 / B if variant == "bug" else 1.0)


def run(work: Path, *, steps=200, records=400, q=0.05, epsilon=2.0, delta=1e-5, canaries=1000,
        features=100, hidden=64, clip=1.0, variants=VARIANTS, alpha=0.05, quiet=False,
        seed=None) -> dict:  # fmt: skip
    """Make the canary set and the claim, train and audit each variant; returns
    ``{variant: (audit result, exit code, true noise ratio, accuracy)}``. ``seed`` (tests
    only): the canary sets' keys (``work/key-VARIANT/private/noise.key``, given as
    ``--key``) and the training's generator from it, so the whole run is reproducible."""
    import torch

    from audit.canaries import canary_set as CS
    from audit.canaries.hooks import GradientCanaryHook, write_params
    from audit.canaries.outside import audit_outside, exit_code
    from audit.claims.check import check_claim
    from fl.privacy.accounting import calibrate_noise
    from fl.privacy.rng import NoiseKey

    torch.set_num_threads(1)
    work.mkdir(parents=True, exist_ok=True)
    sigma = calibrate_noise(epsilon, q, steps, delta)
    claim = {
        "name": "hand-written DP-SGD (docs/examples/dpsgd_bug_audit.py)",
        "level": "sample",
        "noise_multiplier": sigma,
        "clipping_norm": clip,
        "sampling": "poisson",
        "sample_rate": q,
        "dataset_size": records,
        "batch_size": round(q * records),
        "steps_per_round": steps,
        "rounds": 1,
        "accounting": "composed",
        "noise_source": "unknown",
        "notes": "torch's generator seeded from OS entropy",
        "claimed_epsilon": epsilon,
        "delta": delta,
    }
    if abs(q * records - round(q * records)) > 1e-9:
        del claim["batch_size"], claim["dataset_size"]
    (work / "claim.json").write_text(json.dumps(claim, indent=1), encoding="utf-8")
    recomputed = check_claim(claim)["epsilon_pld"]
    x, y = synthetic_data(records, features)
    out = {}
    for variant in variants:
        model = build_model(features, hidden)
        write_params(model, work / "params.json")
        cdir = work / f"canaries-{variant}"  # a fresh set (fresh key) for each training
        kp = None
        if seed is not None:
            secret = hashlib.sha256(f"dpsgd_bug_audit {seed} {variant}".encode()).digest()
            (work / f"key-{variant}").mkdir(exist_ok=True)
            kp = NoiseKey(secret).write(work / f"key-{variant}", overwrite=True)
        CS.new_canary_set(
            "gradient", canaries, cdir, params=work / "params.json", clip=clip, key_file=kp
        )
        hook = GradientCanaryHook.load(cdir, sample_rate=q, sigma=sigma, key_file=kp)
        acc, true_ratio = train(model, x, y, hook, variant=variant, sigma=sigma, clip=clip, q=q,
                                steps=steps, seed=seed)  # fmt: skip
        obs = hook.write_observations(work / f"obs-{variant}.npz")
        res = audit_outside(cdir, obs, work / "claim.json", alpha=alpha, key_file=kp)
        out[variant] = (res, exit_code(res), true_ratio, acc)
    if not quiet:
        d = sum(p.numel() for p in build_model(features, hidden).parameters())
        print(f"MLP {features}-{hidden}-2 ({d} parameters), {records} records, q = {q:g} "
              f"(expected batch B = {q * records:g}), {steps} steps, C = {clip:g}, "
              f"σ = {sigma:.4g}: claimed ε = {epsilon:g} at δ = {delta:g} (recomputed "
              f"{recomputed:.4g}); {canaries} gradient canaries per training")  # fmt: skip
        for variant, (res, rc, true_ratio, acc) in out.items():
            print(describe(variant, res, rc, true_ratio, acc))
        print(f"rerun one audit: fedlora audit --canaries {work}/canaries-bug "
              f"--observations {work}/obs-bug.npz --claim {work}/claim.json")  # fmt: skip
    return out


def describe(variant: str, res: dict, rc: int, true_ratio: float, acc: float) -> str:
    c = res["conformance"]
    lines = [f"{variant}: verdict {res['verdict'].upper()} (exit {rc}); train accuracy {acc:.3f}"]
    for t in c["tests"]:
        if t["test"] == "scale":
            lo, hi = t["ratio_ci"]
            lines.append(
                f"  noise observed/claimed ({t['group']}): {t['observed_over_claimed']:.4f} "
                f"[{lo:.4f}, {hi:.4f}]; true {true_ratio:.4f}"
            )
    for t in c["tests"]:
        if t["test"] == "contribution":
            p = "p < 1e-300" if t["log10_p"] <= -300 else f"p = {t['p_value']:.3g}"
            lines.append(
                f"  a drawn canary adds {t['statistic']:.4f}·C ({t['group']}; exactly 1 under "
                f"a clip of each example; two-sided {p})"
            )
    rej = ", ".join(c["rejected"]) or "none"
    ge = "≥ " if c["implied_epsilon_at_least"] else ""
    eps = c["implied_epsilon"]
    lines.append(
        f"  conformance tests rejected: {rej}; coins {c['coins']}; noise-implied ε "
        f"{ge}{'inf' if math.isinf(eps) else f'{eps:.4g}'} (factor {c['implied_factor']:.4g}); "
        f"one-run ε_lb {res['epsilon_lb']:.3g}"
    )
    codes = [f["code"] for f in res["findings"] if f["severity"] == "error"]
    if codes:
        lines.append("  error findings: " + ", ".join(dict.fromkeys(codes)))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", help="folder for the files (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--q", type=float, default=0.05)
    ap.add_argument("--epsilon", type=float, default=2.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--canaries", type=int, default=1000)
    ap.add_argument("--features", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=64)
    a = ap.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="dpsgd-bug-audit-"))
    out = run(work, steps=a.steps, records=a.records, q=a.q, epsilon=a.epsilon, delta=a.delta,
              canaries=a.canaries, features=a.features, hidden=a.hidden)  # fmt: skip
    # the example succeeds when the audit tells the loops apart: the correct loops are not
    # failed (exit 4, incomplete: the loop's own sampler is not observed; never 1)
    ok = out["correct"][1] in (0, 4) and out["average"][1] in (0, 4)
    ok = ok and out["bug"][0]["verdict"] == "does not implement its claim"
    ok = ok and out["batch_clip"][0]["verdict"] == "does not implement its claim"
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

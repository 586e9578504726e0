"""Over 500 lines on purpose: one table, whose Opacus and HF cases, replay column, rows and Markdown share the row format that results.py validates; Flower's and pfl's cases are their own modules.

What each DP library's modes really give (#43 item 2): train small, audit every run end to end.

    python -m benchmarks.auditing.libraries [--quick] [--library NAME ...] [--out DIR]

Four libraries, each trained through its own DP path (CPU, one thread, seconds per case),
correct configurations and the misuses the library accepts without an error, every run
audited by the library's one call in :mod:`audit.libraries` (claim check, conformance of
the noise at the verdict's α = 0.001, sampling tests, noise-implied ε, one-run bound):

* ``opacus`` — a small MLP (10 → 16 → 2) on synthetic data (N = 1020 records, batch 100,
  M = 128 sampler canaries of which about 64 are included, so Opacus's q = 1/len(loader)
  stays 1/11) in every mode a user can pick, and tiny BERT + PEFT LoRA (the cases below);
* ``hf_trainer`` — Opacus inside ``transformers.Trainer`` (``benchmarks.auditing.libraries_hf``);
* ``flower`` — Flower's DP wrappers, both APIs (``benchmarks.auditing.libraries_flower``);
* ``pfl`` — pfl-research's central mechanisms (``benchmarks.auditing.libraries_pfl``; the
  ``[pfl]`` extra: skipped with a line naming it when pfl is not installed).

The rows go to ``benchmarks/results/libraries/{results.json,table.md}`` (command, machine,
date and commit at the top); ``fedlora report --library-audit benchmarks/results/libraries``
shows them. The misuses the toolkit cannot detect are rows that say so, with the reason.
``--quick``: fewer steps, no power repeats (a smoke run, not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.paths import RESULTS

N, BATCH, M, DELTA, CLIP = 1020, 100, 128, 1e-5, 1.0
#: the sampling tests' most permutations (sequential: a few hundred under the null; the
#: floor 1/20 000 is below Holm's 0.001/k for the families here)
PERMUTATIONS = 19_999

#: (name, kind, what the row is)
CASES = [
    ("flat_poisson", "correct", "flat clipping, Poisson batches (DPDataLoader)"),
    ("flat_shuffle_as_poisson", "misuse", "poisson_sampling=False, accounted as Poisson"),
    ("per_layer", "correct", "clipping='per_layer'"),
    ("ghost", "correct", "grad_sample_mode='ghost' (fast gradient clipping)"),
    ("batch_memory_manager", "correct", "BatchMemoryManager, physical batch 32"),
    ("with_epsilon", "correct", "make_private_with_epsilon(target ε = 3)"),
    ("low_sigma", "misuse", "noise multiplier set by hand to 0.6 × the calibrated one"),
    ("averaged_noise", "misuse", "noise multiplier divided by the batch size (averaged-noise bug)"),
    ("peft_lora", "correct", "tiny BERT + PEFT LoRA, flat clipping, Poisson batches"),
]

#: the LoRA case: records, batch, canaries (q = 1/len(loader) = 1/32)
LORA_N, LORA_BATCH, LORA_M = 480, 16, 32

#: misuses no audit of the release can see, with the reason
UNDETECTABLE = [
    (
        "secure_mode=False",
        "the noise is drawn by torch.normal, open to floating-point attacks "
        "(arXiv:2107.10138); its distribution is Gaussian at the claimed scale, so no "
        "statistical test of the release sees it — read PrivacyEngine(secure_mode=...)",
    ),
    (
        "noise_generator seeded by the user",
        "a seeded noise is reproducible by whoever knows the seed; it is Gaussian and fresh "
        "to any test that does not know the seed — declare noise_source in the claim",
    ),
    (
        "one person's data in several records",
        "Opacus protects a record; the unit of privacy is outside the mechanism the "
        "canaries travel through",
    ),
]


#: the neighbours each library's replay tries for the table (docs/replay.md): a typical
#: record (client, user) removed or replaced, and one far above C placed at both ends of the
#: batches. The adversarial ones are left to the tests: a NaN record or client fails every
#: library (NaN passes Opacus's and Flower's clip), a client with no data crashes Flower's
#: clip, a huge num_examples moves FedAvg's weighted mean (tests/audit/test_replay_*.py)
REPLAY_NEIGHBOURS = {
    "opacus": "remove,scaled@end,scaled@start",
    # token records: no float features to scale (a removal and a duplicate at both ends)
    "hf_trainer": "remove,duplicate@end,duplicate@start",
    "flower": "replace,huge",
    "pfl": "replace,huge",
}
#: rows whose records differ from their library's (token ids: no float features to scale)
REPLAY_CASE_NEIGHBOURS = {("opacus", "peft_lora"): "remove,duplicate@end,duplicate@start"}
#: the replay's trainings: Opacus MLP and LoRA steps, HF and Flower quick, pfl rounds
REPLAY_STEPS, REPLAY_PFL_ROUNDS = 60, 5
#: rows the replay cannot drive, with the reason (a "not run" replay)
REPLAY_NOT_RUN = {
    (
        "hf_trainer",
        "trainer_own_loader",
    ): "the Trainer builds its own loader from train_dataset: the neighbour reaches only "
    "make_private's loader, which the training does not use (a replay there would compare "
    "D with D's records shifted, not with a neighbour)",
}
#: (library, case) -> (the expected verdict, why) where it is not the kind's ("correct":
#: pass, else fail); filled from what the rows measured, each with its reason
EXPECTED: dict[tuple[str, str], tuple[str, str]] = {}
#: what the replay's findings are (the script audit's other findings are its noise tests)
REPLAY_CODES = ("sensitivity_exceeded", "data_dependent_release", "replay_empty")


def train_and_audit(
    case: str,
    steps: int,
    seed: int = 0,
    sigma: float = 1.0,
    permutations: int = PERMUTATIONS,
    audit: bool = True,
) -> dict:
    """Train the MLP through Opacus in mode ``case`` for ``steps`` noised steps and audit it;
    returns the audit's result with ``wall_s`` and ``case``. ``audit=False`` (the neighbour
    replay calls the training once per neighbour): the training only, no canary statistics;
    returns ``{"case", "claim", "wall_s"}``."""
    import torch
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from audit.libraries.opacus import SamplerCanaries

    t0 = time.time()
    warnings.filterwarnings("ignore")
    if case == "peft_lora":
        return _lora(steps, seed, sigma, permutations, t0, audit=audit)
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(N, 10, generator=g)
    y = (x[:, 0] + 0.3 * x[:, 1] > 0).long()
    torch.manual_seed(seed)
    # the inclusion bits are seeded here so that a row reproduces; a real audit draws them
    # from the OS's entropy (the default) and keeps them secret
    can = SamplerCanaries(m=M, seed=seed)
    ds = can.dataset(TensorDataset(x, y))
    model = can.model(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True)
    pe = PrivacyEngine(accountant="prv")
    crit = nn.CrossEntropyLoss()
    q = 1 / len(loader)
    kw = dict(module=model, optimizer=opt, data_loader=loader)
    claim_sigma = sigma
    claimed_eps = None
    if case == "with_epsilon" or case in ("low_sigma", "averaged_noise"):
        from opacus.accountants.utils import get_noise_multiplier

        epochs = steps / len(loader)
        calibrated = get_noise_multiplier(
            target_epsilon=3.0, target_delta=DELTA, sample_rate=q, epochs=epochs, accountant="prv"
        )
        claim_sigma, claimed_eps = calibrated, 3.0
        if case == "with_epsilon":
            model, opt, loader = pe.make_private_with_epsilon(
                **kw, target_epsilon=3.0, target_delta=DELTA, epochs=epochs, max_grad_norm=CLIP
            )
        else:
            used = 0.6 * calibrated if case == "low_sigma" else calibrated / BATCH
            model, opt, loader = pe.make_private(**kw, noise_multiplier=used, max_grad_norm=CLIP)
    elif case == "per_layer":
        n_user = len(list(model.model.parameters()))
        norms = can.max_grad_norms([CLIP / n_user**0.5] * n_user, canary_norm=CLIP / n_user**0.5)
        model, opt, loader = pe.make_private(
            **kw, noise_multiplier=sigma, max_grad_norm=norms, clipping="per_layer"
        )
    elif case in ("ghost", "ghost_plain"):
        # the canaries' term joins each record's loss, so ghost clipping's second pass
        # clips a canary like a record (audit.libraries.opacus: SamplerCanaries.criterion);
        # "ghost_plain" (tests, not a table row) hands Opacus the plain criterion instead
        model, opt, crit, loader = pe.make_private(
            **kw,
            criterion=can.criterion(crit) if case == "ghost" else crit,
            noise_multiplier=sigma,
            max_grad_norm=CLIP,
            grad_sample_mode="ghost",
        )
    else:
        model, opt, loader = pe.make_private(
            **kw,
            noise_multiplier=sigma,
            max_grad_norm=CLIP,
            poisson_sampling=case != "flat_shuffle_as_poisson",
        )
    obs = can.attach(pe, opt, loader)
    done = 0
    while done < steps:
        if case == "batch_memory_manager":
            with BatchMemoryManager(
                data_loader=loader, max_physical_batch_size=32, optimizer=opt
            ) as mem:
                for xb, yb, cid in mem:
                    opt.zero_grad()
                    crit(model(xb, cid), yb).backward()
                    opt.step()
                    done = len(obs.obs)
                    if done >= steps:
                        break
        else:
            for xb, yb, cid in loader:
                opt.zero_grad()
                crit(model(xb, cid), yb).backward()
                opt.step()
                done = len(obs.obs)
                if done >= steps:
                    break
    train_s = time.time() - t0
    # Opacus's accountant at a tiny σ grows past memory (measured: killed at 22 GB for
    # σ ≈ 0.02); the calibrated runs claim their target ε and do not ask it here
    eps_acc = None if claimed_eps or not audit else pe.get_epsilon(DELTA)
    # the claim a user of Opacus writes: Opacus's σ (the calibrated one for the misuses),
    # its q and steps, Poisson sampling, the accountant's ε (target ε for the calibrated runs)
    per_layer_c = float(opt.max_grad_norm)
    claim = dict(
        level="sample",
        noise_multiplier=claim_sigma,
        sampling="poisson",
        rounds=1,
        steps_per_round=len(obs.obs),
        sample_rate=q,
        clipping_norm=per_layer_c,
        claimed_epsilon=claimed_eps if claimed_eps else eps_acc,
        delta=DELTA,
        accounting="composed",
    )
    if not audit:
        return {"case": case, "claim": claim, "wall_s": time.time() - t0}
    res = obs.audit(claim, permutations=permutations, seed=seed)
    res["case"] = case
    res["train_s"] = train_s
    res["wall_s"] = time.time() - t0
    return res


def _lora(
    steps: int, seed: int, sigma: float, permutations: int, t0: float, audit: bool = True
) -> dict:
    """Tiny BERT + PEFT LoRA (docs/examples/opacus_peft_audit.py's model and data) through
    Opacus's flat clipping and Poisson batches, with the sampler canaries."""
    import torch
    from opacus import PrivacyEngine

    from audit.libraries.opacus import SamplerCanaries

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "examples"))
    from opacus_peft_audit import build_model, synthetic_data

    torch.manual_seed(seed)
    can = SamplerCanaries(m=LORA_M, seed=seed)
    ds = can.dataset(synthetic_data(LORA_N, seed=seed))
    model = can.model(build_model(seed=seed))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    pe = PrivacyEngine(accountant="prv")
    model, opt, loader = pe.make_private(
        module=model,
        optimizer=opt,
        data_loader=torch.utils.data.DataLoader(ds, batch_size=LORA_BATCH),
        noise_multiplier=sigma,
        max_grad_norm=CLIP,
    )
    obs = can.attach(pe, opt, loader)
    model.train()
    while len(obs.obs) < steps:
        for x, mask, y, cid in loader:
            opt.zero_grad()
            if len(y):
                out = model(x, cid, attention_mask=mask)
                torch.nn.functional.cross_entropy(out, y).backward()
            else:  # an empty Poisson batch: Opacus still takes a (noise-only) step
                for p in opt.params:
                    p.grad_sample = torch.zeros((0, *p.shape))
            opt.step()
            if len(obs.obs) >= steps:
                break
    train_s = time.time() - t0
    claim = dict(
        level="sample",
        noise_multiplier=sigma,
        sampling="poisson",
        rounds=1,
        steps_per_round=len(obs.obs),
        sample_rate=1 / len(loader),
        clipping_norm=CLIP,
        claimed_epsilon=pe.get_epsilon(DELTA) if audit else None,
        delta=DELTA,
        accounting="composed",
    )
    if not audit:
        return {"case": "peft_lora", "claim": claim, "wall_s": time.time() - t0}
    res = obs.audit(claim, permutations=permutations, seed=seed)
    res.update(case="peft_lora", train_s=train_s, wall_s=time.time() - t0)
    return res


def _script_replay(train, clip: float | None, neighbours: str) -> dict:
    """The replay column from :func:`audit.replay.script.audit_script` on ``train`` (a
    training without the canary statistics), held to ``clip`` (the claim's C). What the
    training prints is compared (lines that differ between two runs on D, timings, are not);
    a training that is not deterministic on D is a replay "not run"."""
    import types

    from audit.replay.script import audit_script

    claim = types.SimpleNamespace(clipping_norm=clip, noise_multiplier=None)
    res = audit_script(train, claim, neighbours)
    rp = res["replay"]
    compared = [n["comparison"] for n in rp["neighbours"] if "comparison" in n]
    codes = [
        f["code"]
        for f in res["findings"]
        if f["code"] in REPLAY_CODES and (f["severity"] == "error" or f["code"] == "replay_empty")
    ]
    errors = [c for c in codes if c != "replay_empty"]
    det = rp.get("determinism") or {"deterministic": True}
    verdict = "fail" if errors else ("pass" if rp["releases"] and compared else "not run")
    ratios = [c["max_ratio"] for c in compared if c["max_ratio"] is not None]
    out = {
        "verdict": verdict,
        "neighbours": len(compared),
        "releases": int(rp["releases"]),
        "findings": list(dict.fromkeys(codes)),
        "max_ratio": max(ratios) if ratios else None,
        "seconds": round(sum(rp["seconds"].values()), 2),
        "skipped": [n["neighbour"] for n in rp["neighbours"] if "skipped" in n],
    }
    if verdict == "pass" and not det["deterministic"]:
        out["verdict"] = "not run"
        out["reason"] = f"not deterministic on D: {det.get('divergence') or det}"
    return out


def replay_case(lib: str, case: str, res: dict) -> dict:
    """The neighbour replay of one row (:data:`REPLAY_NEIGHBOURS`): ``{"verdict", "neighbours",
    "releases", "findings"}`` (:mod:`audit.libraries.results`' format) plus ``max_ratio``
    (the largest ‖q(D) − q(D′)‖ / bound) and ``seconds``. ``res``: the row's canary audit
    (its claim)."""
    why = REPLAY_NOT_RUN.get((lib, case))
    if why:
        return {"verdict": "not run", "neighbours": 0, "releases": 0, "findings": [], "reason": why}
    claim = res.get("claim") or {}
    nb = REPLAY_CASE_NEIGHBOURS.get((lib, case), REPLAY_NEIGHBOURS[lib])
    if lib == "opacus":
        return _script_replay(
            lambda: train_and_audit(case, REPLAY_STEPS, audit=False),
            claim.get("clipping_norm"),
            nb,
        )
    if lib == "hf_trainer":
        from benchmarks.auditing.libraries_hf import CLIP as HF_CLIP
        from benchmarks.auditing.libraries_hf import run_case

        return _script_replay(
            lambda: run_case(case, quick=True, permutations=99),
            claim.get("clipping_norm") or HF_CLIP,
            nb,
        )
    t0 = time.time()
    if lib == "flower":
        import functools

        from audit.libraries.replay_glue import replay_flower_case
        from audit.replay.flower import summary
        from benchmarks.auditing.libraries_flower import build

        out = replay_flower_case(
            functools.partial(build, case, quick=True, seed=0), neighbours=nb, seed=0
        )
    else:
        from audit.libraries.replay_glue import replay_pfl_case
        from audit.replay.flower import summary
        from benchmarks.auditing.libraries_pfl import simulate

        sigma = claim.get("noise_multiplier")
        out = replay_pfl_case(
            lambda: simulate(case, seed=0, rounds=REPLAY_PFL_ROUNDS, sigma=sigma),
            claim=claim,
            neighbours=nb,
        )
    return {**summary(out), "max_ratio": out["max_ratio"], "seconds": round(time.time() - t0, 2)}


def _p(res: dict, group: str) -> float | None:
    for t in res["conformance"]["tests"]:
        if t["group"] == group:
            return 10 ** t["log10_p"]
    return None


def row(
    res: dict, kind: str, what: str, version: str, replay: dict | None = None, lib: str = ""
) -> dict:
    """One table row from a library audit's result (any library: the keys are shared) and
    its neighbour replay (:func:`replay_case`). The verdict is both instruments': a failed
    replay fails the row (its findings join the row's), a passed one tests the clipping
    (:class:`audit.coverage.Coverage`), so a part the canaries could not reach may be
    covered by it; ``expected`` is :data:`EXPECTED`'s where a row's is not its kind's."""
    from audit.coverage import Coverage, decide

    conf = res["conformance"]
    findings = [f["code"] for f in res["findings"]]
    verdict, untested, coverage = res["verdict"], res["untested"], res.get("coverage")
    if replay is not None:
        failed = replay["verdict"] == "fail"
        if failed:
            findings += [c for c in replay["findings"] if c not in findings]
        if coverage is not None:
            cov = Coverage.from_dict(coverage)
            if replay["verdict"] == "pass":
                cov.add("clipping", "replay")
            verdict = decide(verdict == "fail" or failed, cov)[0]
            coverage, untested = cov.to_dict(), cov.untested()
        elif failed:
            verdict = "fail"
    expected, reason = EXPECTED.get(
        (lib, res["case"]), ("pass" if kind == "correct" else "fail", "")
    )
    worst = min(
        (t for t in conf["tests"] if "observed_over_claimed" in t and t["test"] == "scale"),
        key=lambda t: t["observed_over_claimed"],
        default=None,
    )
    return {
        "library": res.get("library", "opacus"),
        "version": version,
        "mode": res["case"],
        "kind": kind,
        "what": what,
        "claimed_epsilon": res["claimed_epsilon"],
        "recomputed_epsilon": res["recomputed_epsilon"],
        "accountant_epsilon": res["accountant_epsilon"],
        "epsilon_lower_bound": res["epsilon_lower_bound"],
        "implied_epsilon": res["implied_epsilon"],
        "recomputed_at_least": res["recomputed_epsilon_at_least"],
        "implied_at_least": res["implied_epsilon_at_least"],
        "conformance": "pass" if conf["passed"] else "reject: " + ", ".join(conf["rejected"]),
        "noise_ratio": worst["observed_over_claimed"] if worst else None,
        "sampling_p_release": _p(res, "sampling:release"),
        "sampling_p_sampler": _p(res, "sampling:sampler"),
        "sampling_p_rate": _p(res, "sampling:rate"),
        "findings": findings,
        "canary_clip_error": res.get("canary_clip_error"),
        "untested": untested,
        "coverage": coverage,
        "replay": replay,
        "canary_verdict": res["verdict"],
        "verdict": verdict,
        "expected": expected,
        "expected_reason": reason,
        "steps": res["run"].get("steps"),
        "sigma_run": res["run"].get("noise_multiplier"),
        "wall_s": res["wall_s"],
    }


def replay_cell(rep: dict | None) -> str:
    """The replay column: verdict, neighbours × releases, the largest ‖Δq‖/bound."""
    if rep is None:
        return "—"
    if rep["verdict"] == "not run":
        return "not run" + (f": {rep['reason']}" if rep.get("reason") else "")
    ratio = f", max ‖Δq‖/bound {_fmt(rep.get('max_ratio'))}" if rep.get("max_ratio") else ""
    text = f"{rep['verdict']} ({rep['neighbours']} nb × {rep['releases']} rel{ratio})"
    if rep["findings"]:
        text += ": " + ", ".join(rep["findings"])
    return text


def _fmt(x, nd=3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        if x != x or x == float("inf"):
            return "∞"
        return f"{x:.{nd}g}"
    return str(x)


#: the libraries, in the table's order: name -> (module with CASES/UNDETECTABLE/run_case
#: or None for Opacus's cases here, what the runs are)
LIBRARIES = {
    "opacus": (None, ""),
    "hf_trainer": (
        "benchmarks.auditing.libraries_hf",
        "tiny BERT (2 layers, hidden 64, vocab 100) + PEFT LoRA r = 8, N = 480 synthetic "
        "token records, Poisson batch 16 (q = 1/31), M = 32 canaries, 60 steps, σ = 1, "
        "C = 1, trained by transformers.Trainer with Opacus's DP optimizer and loader",
    ),
    "flower": (
        "benchmarks.auditing.libraries_flower",
        "logistic regression (numpy) on synthetic data, 10 clients + 16 canary clients, "
        "cohorts of m = 6 of the 26 nodes, 20 rounds, σ = 4, C = 0.5, in process (no Ray)",
    ),
    "pfl": (
        "benchmarks.auditing.libraries_pfl",
        "linear model 4 → 1 over 20 users × 5 rows + 64 canary users (about 32 included), "
        "pfl's FederatedAveraging on its SimulatedBackend, 20 central iterations, cohort 10, "
        "σ from pfl's PLD accountant at ε = 8 (Laplace: ε 0.5 per round)",
    ),
}


def table(header: dict, rows: list[dict], power: list[dict], undetectable: list[dict]) -> str:
    out = [
        "# DP libraries audited end to end (#43)",
        "",
        f"Command: `{header['command']}`  ",
        f"Machine: {header['machine']}  ",
        f"Date: {header['date']}  ",
        f"Commit: {header['commit']}{' (dirty tree)' if header['dirty'] else ''}  ",
        f"Versions: {header['versions']}  ",
        f"Wall time: {header.get('wall_s', 0):.0f} s on one thread",
        "",
        "Setups:",
        "",
    ]
    out += [f"- **{name}**: {text}" for name, text in header["setups"].items()]
    if header.get("skipped"):
        out += ["", "Not run: " + "; ".join(header["skipped"])]
    out += [
        "",
        "| library | version | mode | kind | claimed ε | recomputed ε | library accountant ε | "
        "ε lower bound | implied ε | conformance | noise obs/claimed | sampling p (release) | "
        "sampling p (sampler) | rate p | findings | replay | verdict | expected | wall s | "
        "replay s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            "| "
            + " | ".join(
                [
                    r["library"],
                    r["version"],
                    r["mode"],
                    r["kind"],
                    _fmt(r["claimed_epsilon"]),
                    ("≥ " if r["recomputed_at_least"] else "") + _fmt(r["recomputed_epsilon"]),
                    _fmt(r["accountant_epsilon"]),
                    _fmt(r["epsilon_lower_bound"]),
                    ("≥ " if r["implied_at_least"] else "") + _fmt(r["implied_epsilon"]),
                    r["conformance"],
                    _fmt(r["noise_ratio"]),
                    _fmt(r["sampling_p_release"]),
                    _fmt(r["sampling_p_sampler"]),
                    _fmt(r["sampling_p_rate"]),
                    ", ".join(dict.fromkeys(r["findings"])) or "—",
                    replay_cell(r.get("replay")),
                    r["verdict"],
                    r["expected"] + ("²" if r.get("expected_reason") else ""),
                    f"{r['wall_s']:.1f}",
                    _fmt((r.get("replay") or {}).get("seconds")),
                ]
            )
            + " |"
        )
    for u in undetectable:
        out.append(
            f"| {u['library']} | {u['version']} | {u['misuse']} | misuse | — | — | — | — | — | "
            f"— | — | — | — | — | not detectable: {u['reason']} | — | — | — | — | — |"
        )
    reasons = [r for r in rows if r.get("expected_reason")]
    if reasons:
        out += ["", "² Expected verdicts that are not their kind's, and why:", ""]
        out += [
            f"- {r['library']} {r['mode']}: {r['expected']} — {r['expected_reason']}"
            for r in reasons
        ]
    if power:
        out += [
            "",
            "## Opacus: power of the sampling tests (shuffled batches accounted as Poisson) and "
            "false alarms (correct Poisson runs)",
            "",
            "| case | repeats | steps | sampling (release) p ≤ 0.001 | sampling (sampler) "
            "p ≤ 0.001 | the data alone flag it (Holm family rejects at 0.001) | verdict fail |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in power:
            out.append(
                f"| {p['case']} | {p['repeats']} | {p['steps']} | {p['release']} | "
                f"{p['sampler']} | {p['data']} | {p['fail']} |"
            )
    out += [
        "",
        "**Columns.** Claimed ε: what a user of the library writes (its accountant's ε, or a "
        "target ε calibrated by it); recomputed ε: dp-accounting's PLD for the mechanism the "
        "run really used (≥: σ below 0.25, computed at 0.25, a lower bound); library "
        "accountant ε: the library's own figure for the run; ε lower bound: the one-run bound "
        "(the larger of Steinke et al.'s and the f-DP one, each at α/2 = 0.025) from the "
        "canaries' inclusion bits (p = 1/2), — where no canary carries a contribution "
        "(LocalDpMod's first releases only); implied ε: the claim's mechanism at σ "
        "times the worst group's upper confidence bound on the observed noise factor; "
        "conformance: the Holm family (scale, fresh, clip, the sampling permutation tests and "
        "the library's own: Flower's weights, pfl's contribution and Laplace tests) at the "
        "verdict's α = 0.001, a test rejected only at 0.05 being a `conformance_weak` warning "
        "(not in the verdict); noise obs/claimed: the worst scale test's ratio; the sampling "
        "p columns: the permutation tests' p-values (sequential, at most 19 999 "
        "permutations), rate p: the included canaries' draws against Binomial(T·n, q). The "
        "Opacus rows: MLP σ = 1 (unless calibrated), C = 1, δ = 1e-5, 300 noised steps; the "
        "ε lower bound from 128 canaries; ghost clipping's canaries travel through the loss "
        "(SamplerCanaries.criterion given to make_private). "
        "Replay: the neighbour replay (docs/replay.md; Opacus and the Trainer by "
        "`audit.replay.script.audit_script`, Flower and pfl by `audit.replay.flower` / "
        "`audit.replay.pfl`): the same training run on D and on each neighbour with every "
        "random draw frozen, ‖q(D) − q(D′)‖ at every noise call against the bound derived "
        "from the mechanism (C for a record added or removed; 2·std/σ = 2C/m for a Flower "
        "client replaced, σ the larger of the claim's and the wrapper's; LocalDpMod's own "
        "sensitivity; 2·C·σ_mech/σ for a pfl user replaced)."
        f" Neighbours: {'; '.join(f'{k}: {v}' for k, v in REPLAY_NEIGHBOURS.items())}"
        f"; peft_lora: {REPLAY_CASE_NEIGHBOURS[('opacus', 'peft_lora')]}"
        f" ({REPLAY_STEPS} Opacus steps, the Trainer's and Flower's quick runs, "
        f"{REPLAY_PFL_ROUNDS} pfl rounds); nb × rel: neighbours compared × releases; a "
        "failed replay fails the row (its findings join the row's), a passed one tests the "
        "clipping. The verdict is both instruments' (`audit.coverage.decide`): pass only "
        "when sampling, clipping, noise and accounting were each tested, incomplete (exit 4) "
        "otherwise. A pass of the replay covers only the neighbours and positions tried; replay "
        "s: its wall time (the run on D, the script audit's second run on D, each neighbour). "
        "Details per library: docs/audit.md (Opacus), docs/audit_hf_trainer.md, "
        "docs/audit_flower.md, docs/audit_pfl.md.",
        "",
    ]
    return "\n".join(out)


def header(argv: list[str], setups: dict, versions: dict) -> dict:
    import torch

    def git(*a):
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, check=True).stdout
        except Exception:
            return ""

    return {
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.auditing.libraries " + " ".join(argv),
        "commit": git("rev-parse", "HEAD").strip() or "?",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no").strip()),
        "machine": f"{platform.node()}: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}),"
        f" Python {platform.python_version()}, torch {torch.__version__}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items()),
        "setups": setups,
    }


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("opacus", "transformers", "peft", "flwr", "pfl", "dp-accounting"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def _print(r: dict) -> None:
    print(
        f"{r['library']:10s} {r['mode']:26s} verdict {r['verdict']:4s} (expected "
        f"{r['expected']}) ε claimed {_fmt(r['claimed_epsilon'])} recomputed "
        f"{_fmt(r['recomputed_epsilon'])} implied {_fmt(r['implied_epsilon'])} "
        f"{sorted(set(r['findings']))} replay {replay_cell(r.get('replay'))} {r['wall_s']:.1f}s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m benchmarks.auditing.libraries")
    ap.add_argument("--quick", action="store_true", help="fewer steps, no power repeats")
    ap.add_argument("--out", type=Path, default=RESULTS / "libraries")
    ap.add_argument("--steps", type=int, default=None, help="Opacus MLP steps (default 300)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats for the power rows")
    ap.add_argument(
        "--library", action="append", choices=sorted(LIBRARIES), help="default: all four"
    )
    ap.add_argument("--no-replay", action="store_true", help="the canary audits only")
    a = ap.parse_args(argv)
    import importlib

    import torch

    torch.set_num_threads(1)
    t_start = time.time()
    libs = a.library or list(LIBRARIES)
    steps = a.steps or (60 if a.quick else 300)
    repeats = a.repeats if a.repeats is not None else (0 if a.quick else 10)
    versions = _versions()
    setups: dict[str, str] = {}
    skipped: list[str] = []
    rows: list[dict] = []
    undetectable: list[dict] = []
    power: list[dict] = []
    for lib in libs:
        modname, text = LIBRARIES[lib]
        if modname is None:  # Opacus: the cases of this module
            setups[lib] = (
                f"MLP 10-16-2, synthetic N = {N}, batch {BATCH}, M = {M} sampler canaries "
                f"(inclusion p = 1/2), q = 1/len(loader) = 1/11, {steps} noised steps, σ = 1 "
                f"(unless calibrated), C = {CLIP}, δ = {DELTA}; peft_lora: tiny BERT (2 layers, "
                f"hidden 64) + PEFT LoRA r = 8 on query/value, N = {LORA_N}, batch "
                f"{LORA_BATCH}, M = {LORA_M}, q = 1/32, σ = 1"
            )
            for case, kind, what in CASES:
                res = train_and_audit(case, steps, permutations=PERMUTATIONS)
                rep = replay_case(lib, case, res) if not a.no_replay else None
                rows.append(row(res, kind, what, versions["opacus"], rep, lib))
                _print(rows[-1])
            undet, version = UNDETECTABLE, versions["opacus"]
        else:
            try:
                mod = importlib.import_module(modname)
                if lib == "pfl":
                    import audit.libraries.pfl  # noqa: F401 - the extra's one-line message
            except ImportError as exc:
                if a.library:  # asked for by name: say so and fail
                    raise SystemExit(f"--library {lib}: {exc}") from exc
                skipped.append(f"{lib} ({exc})")
                print(f"{lib}: skipped ({exc})", flush=True)
                continue
            setups[lib] = text
            version = None
            for case, kind, what in mod.CASES:
                res = mod.run_case(case, seed=0, quick=a.quick, permutations=PERMUTATIONS)
                version = version or str(res.get("version", "?"))
                rep = replay_case(lib, case, res) if not a.no_replay else None
                rows.append(row(res, kind, what, version, rep, lib))
                _print(rows[-1])
            undet = mod.UNDETECTABLE
        undetectable += [
            {"library": lib, "version": version or "?", "misuse": n, "reason": r} for n, r in undet
        ]
    if "opacus" in libs:
        power = _power(steps, repeats, versions["opacus"])
    head = header(argv, setups, versions)
    head["skipped"] = skipped
    head["wall_s"] = time.time() - t_start
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {**head, "rows": rows, "undetectable": undetectable, "power": power}
    (a.out / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (a.out / "table.md").write_text(table(head, rows, power, undetectable))
    wrong = [f"{r['library']}:{r['mode']}" for r in rows if r["verdict"] != r["expected"]]
    print(
        f"wrote {a.out}/results.json and table.md in {head['wall_s']:.0f} s; verdicts not as "
        f"expected: {wrong or 'none'}"
    )
    return 0


def _power(steps: int, repeats: int, version: str) -> list[dict]:
    """Opacus's sampling tests over ``repeats`` seeds: shuffled batches accounted as Poisson
    (power) and correct Poisson runs (false alarms), at the verdict's level."""
    out = []
    for case in ("flat_shuffle_as_poisson", "flat_poisson") if repeats else ():
        rel = smp = fail = data = 0
        for s in range(1, repeats + 1):
            res = train_and_audit(case, steps, seed=s, permutations=PERMUTATIONS)
            r = row(res, "", "", version)
            rel += r["sampling_p_release"] <= 0.001
            smp += r["sampling_p_sampler"] <= 0.001
            fail += r["verdict"] == "fail"
            data += "conformance_rejected" in r["findings"]
        out.append(
            {
                "case": case,
                "repeats": repeats,
                "steps": steps,
                "release": f"{rel}/{repeats}",
                "sampler": f"{smp}/{repeats}",
                "fail": f"{fail}/{repeats}",
                "data": f"{data}/{repeats}",
            }
        )
        print(out[-1], flush=True)
    return out


if __name__ == "__main__":
    raise SystemExit(main())

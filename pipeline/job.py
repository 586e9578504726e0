"""The main job, `fedlora run`: the whole pipeline, from training to the report.

`fedlora run` trains the default methods under the default budgets, runs the noise
analyses, the membership-inference attacks and the audits, and writes the report.
Presets:

- ``quick``: tiny-bert on synthetic text (about 2 minutes on 2 CPU cores); what the
  test suite runs end to end.
- ``default``: all-MiniLM-L6-v2 on the tweets corpus (within 15 minutes on 2 quiet CPU
  cores; its DP runs use the set-up of docs/learning.md; its six training runs and the
  non-private run's two shadow models go two at a time as Ray tasks).

Every sample-level DP run carries white-box gradient canaries (``--canary-kind
gradient``, :mod:`fl.privacy.gradient_canaries`), so the report's verdict table gives each
a certified one-run lower bound on ε (Steinke et al. and f-DP) beside the ledger's ε.

A stage that cannot run (a method or package that does not exist) is reported as
missing in the report; a stage that fails is reported with its error, and the job
exits non-zero.

What the job prints goes to ``OUT/job.log`` too (each line after its time), as it
happens: its stages and, while the runs train, a line per finished round of each run
with its time left and the trainings' (:mod:`pipeline.progress`, which reads the rows
the runs append to their ``metrics.jsonl``); ``--no-progress`` keeps the round lines
out of the terminal, not out of the log.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks.paths import RESULTS
from fl.errors import UsageError
from fl.run.config import TrainConfig
from pipeline.progress import JobLog, Progress


@dataclass(frozen=True)
class Preset:
    """What `fedlora run --preset NAME` trains and attacks."""

    base: dict  # TrainConfig fields shared by every run (each run adds its overrides)
    #: on the attack_runs. LiRA needs 4 shadows; RMIA and calibration work with 2 (the
    #: reference models are the job's costliest stage after training: issue 35)
    attacks: tuple = ("loss", "calibration", "rmia")
    shadows: int = 2
    attack_runs: tuple = ("fedavg-nodp",)  # the other runs get the loss attack only
    #: white-box gradient canaries in every sample-level DP run (RUNS: canaries=-1), the
    #: one-run audit's evidence in the verdict table; every trained method must hold this
    #: many coordinates (FFA-LoRA and FedASK train B and the head only)
    canaries: int = 500
    #: sampler canaries per client in the same runs (``--sampler-canaries``): drawn into
    #: batches by the trainer's own sampler, they let the audit test the sampling (#42)
    sampler_canaries: int = 400
    #: training runs at once: > 1 runs them (and the attack runs' shadow models) as Ray
    #: tasks of one torch thread each (on 2 cores two one-thread runs finish sooner than
    #: two two-thread runs in turn)
    train_workers: int = 1
    #: the neighbours every DP run is replayed on after its training (#47; only the
    #: neighbour's client retrained: audit.replay.engine.replay_recorded); () for none.
    #: One (the record drawn most often removed) keeps the job's cost to one client-local
    #: pass per DP run (its trainings run without dropout: no reference pass on D);
    #: `fedlora audit RUN --neighbours all` tries every kind.
    replay: tuple = ("remove",)


PRESETS: dict[str, Preset] = {
    # tiny-bert on synthetic text, about 2 minutes on 2 CPU cores (what the tests run)
    "quick": Preset(
        base=dict(model="tiny-bert", dataset="synthetic", members=300, nonmembers=120, test=100)
        | dict(max_length=24, clients=3, rounds=2, local_steps=20, batch_size=32, lr=0.03)
        | dict(rank=4, alpha=8.0, head_init="random", head_lr=0.0, lora_layers=0, dropout="off"),
        canaries=500,
    ),
    # all-MiniLM-L6-v2 on the tweets corpus, within 15 minutes on 2 quiet CPU cores
    # (presets are stated in full: they do not follow TrainConfig's defaults; the fields
    # they do not name do). The DP set-up of issue 18: mean pooling (minilm's own), zero
    # head, LoRA on the top layer over a cached frozen prefix, LoRA lr 1e-3 and head lr
    # 3e-2, 3 rounds x 6 Poisson batches of 128 of 400 examples per client. 20 batches
    # before issue 35 (the job took 1 443 s): FedAvg-LoRA at ε = 8, seed 0, 0.848 / 0.765
    # balanced; 10 batches 0.842 / 0.752; 6 batches 0.838 / 0.741 in a third of the time
    # (batches of 64 x 10: 0.836 / 0.742, and weaker canaries at q = 0.16). Dropout off
    # (#47): a training free of dropout's draws is its own reference for the neighbour
    # replay, one client-local pass per neighbour instead of two (docs/replay.md).
    "default": Preset(
        base=dict(model="minilm", dataset="tweets", members=2000, nonmembers=500, test=500)
        | dict(max_length=48, clients=5, rounds=3, eval_every=3, local_steps=6, batch_size=128)
        | dict(lr=1e-3, head_lr=3e-2, lora_layers=1, pooling="auto", head_init="zero")
        | dict(rank=8, alpha=16.0, dropout="off"),
        canaries=5000,
        train_workers=2,
    ),
}

# (run name, method, overrides). Methods not registered are reported as missing.
RUNS = (
    ("fedavg-nodp", "fedavg", dict()),
    ("fedavg-eps8", "fedavg", dict(dp_level="sample", epsilon=8.0, canaries=-1)),
    ("ffa-eps8", "ffa", dict(dp_level="sample", epsilon=8.0, canaries=-1)),
    ("fedask-eps8", "fedask", dict(dp_level="sample", epsilon=8.0, canaries=-1)),
    ("fedpower-eps8", "fedpower", dict(dp_level="sample", epsilon=8.0, canaries=-1)),
    ("plora-eps8", "plora", dict(dp_level="sample", epsilon=8.0, client_ranks="2,4", canaries=-1)),
)
#: the committed privacy–utility grids (issue 18), one folder per grid with its
#: results.jsonl: the claims analysis decides the papers' utility claims from them (this
#: job's own runs are one seed each, too few to decide them)
CLAIMS_GRIDS = RESULTS / "claims"

ANALYSES = ("amplification", "exactness", "hetero", "refactorization", "claims")
#: the job's log in its output directory: every line it prints, as it prints it
JOB_LOG = "job.log"


def train_run(task: tuple) -> dict:
    """One training run of the job, ``(config dict, run directory, quiet, replay kinds)``:
    a Ray task when the preset trains runs at once. A DP run is trained with its releases
    recorded and then replayed on neighbours, only the neighbour's client retrained
    (:func:`audit.replay.engine.replay_recorded`), into ``RUN/audit/neighbour_replay.json``.
    Returns the run's accuracy and ε (and the replay's verdict)."""
    from fl.run.engine import train

    cfg, out, quiet, *rest = task
    kinds = rest[0] if rest else None
    config = TrainConfig.from_dict(cfg)
    if not kinds or config.dp_level == "none":
        m = train(config, out, quiet=quiet)
        return {
            "accuracy": m["metrics"]["final"].get("accuracy"),
            "epsilon": m["privacy"]["epsilon"]["pld"],
        }
    from audit.replay.engine import REPLAY_FILE, replay_recorded, summary_line
    from audit.replay.record import Recorder
    from fl.privacy.tap import tapped

    rec = Recorder()
    rec.keep_deliveries = True
    with tapped(rec):
        m = train(config, out, quiet=quiet)
    t0 = time.time()
    res = replay_recorded(config, Path(out), rec, kinds=tuple(kinds))
    res["seconds_total"] = round(time.time() - t0, 2)
    path = Path(out) / REPLAY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2, default=str))
    return {
        "accuracy": m["metrics"]["final"].get("accuracy"),
        "epsilon": m["privacy"]["epsilon"]["pld"],
        "replay": summary_line(res),
    }


def job_task(task) -> dict:
    """One task of the job's pool: a training (:func:`train_run`'s tuple) or, as a dict,
    one shadow model of an attacked run trained ahead (:func:`shadow_run`)."""
    return shadow_run(task) if isinstance(task, dict) else train_run(task)


def shadow_run(task: dict) -> dict:
    """Shadow ``task["j"]`` of the run at ``task["run"]``, trained as a task beside the
    job's trainings once that run has ended (:func:`attacks.run.train_shadow_ahead`; the
    attack stage then reuses it: same arguments, same spec). A run not (yet) finished
    leaves the shadow to the attack stage."""
    from attacks.run import train_shadow_ahead

    run = Path(task["run"])
    if not (run / "manifest.json").is_file():
        return {"skipped": f"{run.name} has not finished: the attack stage trains it"}
    sec = train_shadow_ahead(
        run, task["j"], shadows=task["shadows"], seed=task["seed"], out=run / "attacks"
    )
    return {"seconds": sec}


def run_job(
    preset: str = "default", out: str = "reports/latest", seed: int = 0, progress: bool = True
) -> dict:
    if preset not in PRESETS:
        raise UsageError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = PRESETS[preset]
    outp = Path(out)
    if outp.exists() and any(outp.iterdir()):
        raise UsageError(f"output directory {outp} is not empty; choose a new --out")
    outp.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _log = JobLog(outp / JOB_LOG)
    from fl.distributed import run_tasks
    from fl.methods import registry

    status: dict = {"preset": preset, "runs": {}, "attacks": {}, "analyses": {}, "errors": []}
    run_dirs = []
    commands = [f"fedlora run --preset {preset} --out {out}"]
    todo = [r for r in RUNS if r[1] in registry.names()]
    for name, method, _ in RUNS:
        if method not in registry.names():
            status["runs"][name] = "missing: method not available"
    parallel = spec.train_workers > 1 and len(todo) > 1
    slots = min(spec.train_workers, len(todo)) if parallel else 1
    tasks = []
    for i, (name, method, over) in enumerate(todo, 1):
        base = dict(spec.base)
        if preset == "default" and method == "plora":
            over = dict(over, client_ranks="4,8")
        over = dict(over)
        if over.pop("canaries", 0) == -1:  # white-box gradient canaries (issue 35)
            over |= dict(canaries=spec.canaries, canary_kind="gradient")
            over |= dict(sampler_canaries=spec.sampler_canaries)
        cfg = TrainConfig(
            **{
                **base,
                **over,
                "method": method,
                "seed": seed,
                "progress": progress and not parallel,
            }
        )
        _log(
            f"[{i}/{len(todo)}] training {name} ({method}, {cfg.dp_level} DP, {cfg.model}/{cfg.dataset})"
            + (" (queued)" if i > slots else "")
        )
        # quiet: the job reports each run's rounds itself (pipeline.progress)
        kinds = spec.replay if cfg.dp_level != "none" else None
        tasks.append((cfg.to_dict(), str(outp / "runs" / name), True, kinds))
    # The attacked runs' shadow models go in the same pool after the trainings (they start
    # once their run has ended), so the pool stays full instead of waiting for the attack
    # stage; the attack reuses them (attacks.reference.train_shadows: same spec).
    shadow_tasks = []
    if importlib.util.find_spec("attacks") is not None:
        from attacks.registry import select

        if any(a.needs_shadows for a in select(spec.attacks, "classification")):
            for name, _, _ in todo:
                if name in spec.attack_runs:
                    t = tasks[[n for n, _, _ in todo].index(name)]
                    shadow_tasks += [
                        {"run": t[1], "j": j, "shadows": spec.shadows, "seed": seed, "name": name}
                        for j in range(spec.shadows)
                    ]
    outcomes = {}
    progress_log = Progress(
        [(name, t[1], t[0]["rounds"]) for (name, _, _), t in zip(todo, tasks)],
        slots,
        emit=lambda line: _log(line, echo=progress),
    )
    progress_log.start()
    with progress_log.watch(interval=1.0):
        # run_tasks starts the runs in order as slots free up, as Progress expects
        for oc in run_tasks(
            job_task,
            tasks + shadow_tasks,
            workers=slots,
            threads=1 if parallel else None,
            retries=0,  # a half-written run directory is not retried into
            report=_log,
        ):
            if oc.index >= len(todo):  # a shadow model trained ahead
                t = shadow_tasks[oc.index - len(todo)]
                what = f"[shadows] {t['name']} shadow {t['j'] + 1}/{t['shadows']}"
                if oc.ok and "seconds" in oc.value:
                    _log(f"{what} trained in {oc.value['seconds']:.0f} s", echo=progress)
                else:  # not an error: the attack stage trains what is missing
                    why = oc.error or oc.skipped or (oc.value or {}).get("skipped")
                    _log(f"{what} left to the attack stage ({why})", echo=progress)
                continue
            outcomes[oc.index] = oc
            progress_log.finished(
                todo[oc.index][0], oc.ok, value=oc.value, error=oc.error or oc.skipped
            )
    for i, (name, _, _) in enumerate(todo):
        oc = outcomes[i]
        if not oc.ok:  # reported, job exits non-zero
            status["runs"][name] = f"failed: {oc.error or oc.skipped}"
            status["errors"].append(f"train {name}: {oc.error or oc.skipped}")
            continue
        status["runs"][name] = oc.value
        run_dirs.append(Path(tasks[i][1]))

    # --- attacks
    try:
        attacks_mod = importlib.import_module("attacks.run")
    except ModuleNotFoundError:
        attacks_mod = None
        status["attacks"] = "missing: attacks package not available"
    if attacks_mod is not None:
        for rd in run_dirs:
            names = spec.attacks if rd.name in spec.attack_runs else ("loss",)
            _log(f"attacking {rd.name}: {', '.join(names)}")
            try:
                res = attacks_mod.run_attacks(
                    str(rd),
                    attacks=names,
                    shadows=spec.shadows,
                    workers=spec.train_workers,  # the shadows train at once, like the runs
                    out=str(rd / "attacks"),
                    seed=seed,
                    progress=progress,
                )
                status["attacks"][rd.name] = {
                    k: v.get("auc")
                    for k, v in (res.get("attacks") or {}).items()
                    if isinstance(v, dict)
                }
            except Exception as exc:  # noqa: BLE001
                status["attacks"][rd.name] = f"failed: {type(exc).__name__}: {exc}"
                status["errors"].append(f"attack {rd.name}: {traceback.format_exc(limit=3)}")

    # --- analyses
    adir = outp / "analysis"
    claims_doc = None
    for name in ANALYSES:
        try:
            mod = importlib.import_module(f"analysis.{name}")
        except ModuleNotFoundError:
            status["analyses"][name] = "missing: analysis not available"
            continue
        _log(f"analysis: {name}")
        grids = sorted(str(p.parent) for p in CLAIMS_GRIDS.glob("*/results.jsonl"))
        kw = {"grids": grids} if name == "claims" and grids else {}
        try:
            doc = mod.run(seed=seed, out=str(adir / name), **kw)
            status["analyses"][name] = "ok"
            if name == "claims":
                claims_doc = doc
        except Exception as exc:  # noqa: BLE001
            status["analyses"][name] = f"failed: {type(exc).__name__}: {exc}"
            status["errors"].append(f"analysis {name}: {traceback.format_exc(limit=3)}")

    # --- report (audits are run inside, per run)
    from audit.report.build import build_report

    _log("writing the report")
    summary = build_report(
        [str(d) for d in run_dirs],
        str(outp / "report"),
        analyses_dir=str(adir),
        claims=claims_doc,
        commands=commands,
        title=f"fedlora-audit report ({preset} preset)",
    )
    status["report"] = summary["html"]
    status["report_md"] = summary["markdown"]
    status["missing_sections"] = summary["missing"]
    status["seconds"] = time.time() - t0
    (outp / "summary.json").write_text(json.dumps(status, indent=2, default=str))
    return status


def _print_summary(st: dict) -> None:
    print(f"\nfedlora run ({st['preset']}) finished in {st['seconds']:.0f}s")
    for name, r in st["runs"].items():
        if isinstance(r, dict):
            eps = r["epsilon"]
            eps_s = (
                "non-private"
                if eps is None
                else f"ε={eps:.3f}"
                if isinstance(eps, float)
                else f"ε={eps}"
            )
            print(f"  {name:16s} accuracy={r['accuracy']:.3f}  {eps_s}")
        else:
            print(f"  {name:16s} {r}")
    if isinstance(st["attacks"], dict):
        for name, a in st["attacks"].items():
            if isinstance(a, dict):
                print(
                    f"  attacks on {name}: "
                    + ", ".join(f"{k} AUC={v:.3f}" for k, v in a.items() if v is not None)
                )
            else:
                print(f"  attacks on {name}: {a}")
    if st.get("missing_sections"):
        print(f"  missing report sections: {', '.join(st['missing_sections'])}")
    for e in st["errors"]:
        print(f"  ERROR {e.splitlines()[0]}")
    print(f"report: {st['report']}")


def register(sub) -> None:
    p = sub.add_parser("run", help="the main job: train, analyze, attack, audit, report")
    p.add_argument(
        "--preset",
        default="default",
        choices=sorted(PRESETS),
        help="quick (tiny model) or default (minilm/tweets)",
    )
    p.add_argument(
        "--out", default=None, help="output directory (default: reports/<preset>-<timestamp>)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2^32 - 1], got {args.seed}")
    out = args.out or time.strftime(f"reports/{args.preset}-%Y%m%d-%H%M%S")
    st = run_job(args.preset, out, seed=args.seed, progress=args.progress)
    _print_summary(st)
    return 1 if st["errors"] else 0

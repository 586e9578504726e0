"""docs/api.md runs as written: every ```python block, in a fresh folder, in a fresh process
(tiny-bert on synthetic text, on the CPU). The first block trains ``runs/dp``; the blocks
that read it get a copy. Each block's printed lines and files are checked, so a block that
runs but says something else fails too.

Each block's process is forked from one that has imported the third-party libraries only
(:data:`PRELOAD`: torch, transformers, dp_accounting, ...; importing them took most of
each block's time), never the project: every block imports ``fl``, ``audit`` and
``attacks`` itself, as ``python block.py`` would, and runs as its ``__main__``."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "api.md"
RUN = "runs/dp"


def _blocks() -> list[tuple[str, str]]:
    """(id, code) of every ```python block, the id its section's title and number."""
    out, section, n = [], "", 0
    fence = re.compile(r"^```python\n(.*?)^```\n", re.S | re.M)
    text = DOC.read_text(encoding="utf-8")
    pos = 0
    for m in fence.finditer(text):
        for line in text[pos : m.start()].splitlines():
            if line.startswith("## "):
                section, n = line[3:].strip(), 0
        pos = m.end()
        n += 1
        out.append((f"{section} [{n}]", m.group(1)))
    return out


BLOCKS = dict(_blocks())
TRAIN = next(k for k in BLOCKS if k.startswith("1. Train"))

#: per block: lines its output must match (regular expressions) and files it must write.
#: The canary sets' keys are fresh secrets (as they must be), so a correct training fails a
#: conformance test (or its one-run bound exceeds the claim) at level α = 0.05 about one time
#: in twenty: the verdicts are checked for their form here; tests/audit/ checks the tests'
#: level and power with fixed keys.
EXPECT = {
    TRAIN: ([r"'fedavg'", r"\{'pld': \d", r"'rdp': \d"], [f"{RUN}/manifest.json"]),
    "2. Audit a run or a release bundle [1]": (
        [
            r"^ε stored \d\S* recomputed \d",
            r"^understated: False tampered: False$",
            r"^certified ε lower bound: \d",
            r"^findings: \[('mechanism_mismatch')?\]$",
            r"^noise conforms to the claim: (True|False)$",
            r"^noise-implied ε: \d",
            r"^bundle \d\S* \[.*'splits_hash'",
        ],
        ["audit.json", "report/report.html", "report/report.md", f"{RUN}/release/manifest.json"],
    ),
    "2. Audit a run or a release bundle [2]": (
        [r"^\d\S* \d\S* \d\S*$", r"\(ε, δ\)-DP is rejected|canaries"],
        [],
    ),
    "3. Check a claim [1]": (
        [r"^claimed 0\.77 recomputed 4\.3", r"^understated: True", r"^error no_composition_across_rounds"],
        ["claim.toml"],
    ),
    "4. Attack an adapter [1]": (
        [r"^loss attack AUC: \d", r"^balanced accuracy: \d"],
        ["attacks-run/attacks.json", "attacks-adapter/attacks.json", "members.jsonl"],
    ),
    "5. Audit a training done elsewhere [1]": (
        [
            r"^verdict: (ok|incomplete|does not implement its claim|leaks more than claimed)$",
            r"^certified ε lower bound: \d\S* claimed: 4\.0$",
            r"^noise conforms to the claim: (True|False)$",
        ],
        ["canaries/canaries.json", "observations.npz"],
    ),
}  # fmt: skip


def test_every_block_is_checked():
    assert set(BLOCKS) == set(EXPECT), sorted(set(BLOCKS) ^ set(EXPECT))


#: seconds a block may run
TIMEOUT = 300
#: what the forking process imports before it forks a block (third-party only)
PRELOAD = ("numpy", "torch", "transformers", "transformers.models.bert.modeling_bert", "peft",
           "opacus", "dp_accounting", "scipy.stats", "scipy.signal", "matplotlib.pyplot")  # fmt: skip
#: the forking process: for each request (script, stdout file, stderr file, timeout) a child
#: runs the script as ``python script`` would (its folder as cwd and sys.path[0], its
#: module as __main__, stdin empty), killed by SIGALRM after the timeout; its exit status
#: is the reply
FORKER = r"""
import importlib, json, os, signal, sys, traceback, types
for name in sys.argv[1].split(","):
    importlib.import_module(name)
reply = os.fdopen(os.dup(1), "w")
print("ready", file=reply, flush=True)
for line in sys.stdin:
    script, log, err, timeout = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(timeout)
            for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, log, os.O_WRONLY),
                                   (2, err, os.O_WRONLY)):
                f = os.open(path, mode | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o644)
                os.dup2(f, fd)
                os.close(f)
            sys.stdin = open(0, closefd=False)
            here = os.path.dirname(script)
            os.chdir(here)
            sys.argv, sys.path[0] = [script], here
            main = types.ModuleType("__main__")
            main.__file__ = script
            sys.modules["__main__"] = main
            with open(script, encoding="utf-8") as fh:
                exec(compile(fh.read(), script, "exec"), main.__dict__)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), file=reply, flush=True)
os._exit(0)  # nothing to clean up: a normal exit would tear down torch et al. (seconds)
"""


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    """The forking process (:data:`FORKER`), with the blocks' environment."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               MPLBACKEND="Agg", FEDLORA_RAY_ADDRESS="none")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    log = tmp_path_factory.mktemp("forker") / "stderr.txt"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", FORKER, ",".join(PRELOAD)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                text=True, cwd=log.parent)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready", log.read_text()[-4000:]
    yield proc, log
    proc.stdin.close()
    proc.wait(timeout=60)


def _run(forker, code: str, cwd: Path) -> str:
    proc, log = forker
    script = cwd / "block.py"
    script.write_text(code, encoding="utf-8")
    out, err = cwd.parent / f"{cwd.name}.stdout", cwd.parent / f"{cwd.name}.stderr"
    proc.stdin.write(json.dumps([str(script), str(out), str(err), TIMEOUT]) + "\n")
    proc.stdin.flush()
    rc = proc.stdout.readline().strip()
    assert rc, f"the forking process died: {log.read_text()[-4000:]}"
    stdout = out.read_text(encoding="utf-8")
    assert rc == "0", f"exit {rc}\n{stdout[-2000:]}\n{err.read_text(encoding='utf-8')[-4000:]}"
    return stdout


def _check(name: str, out: str, cwd: Path) -> None:
    lines, files = EXPECT[name]
    for pattern in lines:
        assert re.search(pattern, out, re.M), f"{name}: no line matches {pattern!r}:\n{out}"
    for f in files:
        assert (cwd / f).is_file(), f"{name}: {f} was not written"


@pytest.fixture(scope="module")
def trained(forker, tmp_path_factory):
    """The first block, run once: its folder holds ``runs/dp``."""
    cwd = tmp_path_factory.mktemp("api-train")
    return cwd, _run(forker, BLOCKS[TRAIN], cwd)


def test_train_block(trained):
    cwd, out = trained
    _check(TRAIN, out, cwd)


@pytest.mark.parametrize("name", [k for k in BLOCKS if k != TRAIN])
def test_block(name, trained, forker, tmp_path):
    code = BLOCKS[name]
    cwd = tmp_path / "block"
    cwd.mkdir()
    if RUN in code:
        shutil.copytree(trained[0] / RUN, cwd / RUN)
    _check(name, _run(forker, code, cwd), cwd)

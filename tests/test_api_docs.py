"""docs/api.md runs as written: every ```python block, in a fresh folder, in a fresh process
(tiny-bert on synthetic text, on the CPU). The first block trains ``runs/dp``; the blocks
that read it get a copy. Each block's printed lines and files are checked, so a block that
runs but says something else fails too."""

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


def _run(code: str, cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               MPLBACKEND="Agg", FEDLORA_RAY_ADDRESS="none")  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    script = cwd / "block.py"
    script.write_text(code, encoding="utf-8")
    r = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r.stdout


def _check(name: str, out: str, cwd: Path) -> None:
    lines, files = EXPECT[name]
    for pattern in lines:
        assert re.search(pattern, out, re.M), f"{name}: no line matches {pattern!r}:\n{out}"
    for f in files:
        assert (cwd / f).is_file(), f"{name}: {f} was not written"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The first block, run once: its folder holds ``runs/dp``."""
    cwd = tmp_path_factory.mktemp("api-train")
    return cwd, _run(BLOCKS[TRAIN], cwd)


def test_train_block(trained):
    cwd, out = trained
    _check(TRAIN, out, cwd)


@pytest.mark.parametrize("name", [k for k in BLOCKS if k != TRAIN])
def test_block(name, trained, tmp_path):
    code = BLOCKS[name]
    if RUN in code:
        shutil.copytree(trained[0] / RUN, tmp_path / RUN)
    _check(name, _run(code, tmp_path), tmp_path)

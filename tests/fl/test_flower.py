# Over 500 lines on purpose: the simulation and the loopback-deployment tests check Flower
# against in-process runs through the same helpers (_run, _compare, _events, _rows), and the
# simulation tests share the module-scoped Flower session (Ray) and in-process references.
"""The Flower transport: equivalence with the in-process engine on Flower's simulation
runtime, faults, and a real loopback deployment (SuperLink + SuperNodes started as
processes). Record conversion: test_flower_records.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from fl.methods import registry

# One worker runs the whole file (scripts/test.sh: `pytest -n 2 --dist loadfile`), so the
# Flower simulation session (Ray) and the in-process references are built once.
from fl.run.engine import Engine
from fl.run.transport import Dispatcher

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


# -------------------------------------------------------------- simulation equivalence
# One Flower simulation session (Ray, CLIENTS virtual SuperNodes) serves every test
# below: every run uses the same client count, so Ray is started once per module.
CLIENTS = 2


def _small(tiny_cfg, **kw):
    base = dict(members=120, nonmembers=30, test=40, clients=CLIENTS, local_steps=1, rounds=2)
    base.update(kw)
    return tiny_cfg(**base)


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _run(cfg, out: Path, fault=None, key_of: Path | None = None) -> tuple[dict, Engine]:
    """Train; ``key_of``: a run whose noise key to reuse (the key holder's replay)."""
    private = cfg.dp_level != "none"  # a run without DP draws from its public seed
    key = key_of / "private" / "noise.key" if key_of is not None and private else None
    eng = Engine(cfg, out, quiet=True, noise_key=key)
    eng.fault_injector = fault
    manifest = eng.run()
    return manifest, eng


def _events(manifest: dict) -> list[dict]:
    return manifest["privacy"]["ledger"]["events"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _effective(adapter: dict) -> dict:
    """Each LoRA module's update B·A (and every other tensor as it is). Two processes can
    round ~1e-8 apart, which may flip the sign LAPACK picks for a singular-vector pair in
    an SVD refactorization (FedASK, FLoRA, ...): (−B_i)(−A_i) is the same update, so the
    released model is compared, not the arbitrary sign of its factors."""
    out = {}
    for k, v in adapter.items():
        if ".lora_A." in k:
            continue
        if ".lora_B." in k:
            a = adapter[k.replace(".lora_B.", ".lora_A.")]
            out[k.replace(".lora_B.", ".lora_BA.")] = v.double() @ a.double()
        else:
            out[k] = v.double()
    return out


def _compare(out_a: Path, out_b: Path, man_a: dict, man_b: dict, tol=1e-6) -> None:
    a, b = _adapter(out_a), _adapter(out_b)
    assert a and set(a) == set(b)
    a, b = _effective(a), _effective(b)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= tol, diff
    assert _events(man_a) == _events(man_b)
    assert man_a["privacy"]["epsilon"] == man_b["privacy"]["epsilon"]
    for x, y in zip(_rows(out_a), _rows(out_b), strict=True):
        assert x["bytes_per_client"] == y["bytes_per_client"]
        assert x["clients"] == y["clients"]


def _ray_cpus() -> int:
    """The CPUs a local Ray instance counts on this machine (what ray.init detects)."""
    try:
        from ray._private.utils import get_num_cpus

        return max(1, int(get_num_cpus()))
    except Exception:  # noqa: BLE001 - another Ray: Flower's default, an actor per CPU
        return 1


@pytest.fixture(scope="module")
def flower_sim():
    """The module's simulation session runs one ClientApp actor: Flower starts an actor
    per FEDLORA_FLOWER_CPUS CPUs of the machine (each imports torch and the app, seconds
    of CPU), which then takes the virtual SuperNodes' messages in turn. The actor a
    message lands on changes nothing a client computes (its state is the node's
    ``context.state``; the cached client engine is a function of the run's config), so
    the runs equal the in-process ones as with an actor per node."""
    from fl.flower.transport import shutdown_simulation

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDLORA_FLOWER_CPUS", str(_ray_cpus()))
        yield
        shutdown_simulation()


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory):
    """In-process reference runs, each computed once per module: (out, manifest)."""
    cache: dict = {}

    def get(cfg, name: str):
        if name not in cache:
            out = tmp_path_factory.mktemp(f"inprocess-{name}")
            cache[name] = (out, _run(cfg, out)[0])
        return cache[name]

    return get


METHODS = [
    ("fedavg", dict(dp_level="sample", noise_multiplier=1.0)),
    ("fedask", dict(dp_level="sample", noise_multiplier=1.0)),
    ("fedpower", dict()),
    ("plora", dict()),
    ("flora", dict()),
    ("flexlora", dict(client_ranks_list="2,4")),
    ("hetlora", dict(client_ranks_list="2,4")),
    ("scaffold", dict()),
    ("fedsa", dict()),
    ("fedprox", dict()),
    ("ffa", dict(dp_level="sample", noise_multiplier=1.0)),
    ("probe", dict(dp_level="sample", noise_multiplier=1.0)),
]


def test_every_registered_method_is_covered():
    assert {m for m, _ in METHODS} == set(registry.names())


@pytest.mark.parametrize("method,kw", METHODS, ids=lambda m: str(m))
def test_flower_simulation_matches_inprocess(tmp_path, tiny_cfg, flower_sim, inprocess, method, kw):
    out_a, man_a = inprocess(_small(tiny_cfg, method=method, **kw), method)
    man_b, _ = _run(
        _small(tiny_cfg, method=method, transport="flower", **kw), tmp_path / "flower", key_of=out_a
    )
    _compare(out_a, tmp_path / "flower", man_a, man_b)
    if kw.get("dp_level") == "sample":
        assert len(_events(man_b)) == 2 * CLIENTS  # per round and client, on the server
    log = (tmp_path / "flower" / "run.log").read_text()
    assert "flower: client → node" in log
    # the session's nodes answered their partition ids once; later runs reuse the map
    from fl.flower import transport

    assert sorted(transport._SESSION.partitions) == [str(c) for c in range(CLIENTS)]
    ref = [round(r["seconds"], 2) for r in _rows(out_a)]
    sim = [round(r["seconds"], 2) for r in _rows(tmp_path / "flower")]
    print(f"\n{method} seconds/round: in-process {ref}, Flower simulation {sim}")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after "pid (comm)": [state, ppid, ...]."""
    stat = (Path("/proc") / str(pid) / "stat").read_text()
    return stat[stat.rindex(")") + 2 :].split()


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = int(_stat(pid)[1])
        if pid == ancestor:
            return True
    return False


def _actor_niceness() -> list[int]:
    """Niceness of the Flower simulation actors (Ray worker processes) started by this
    process (its descendants: another session's actors on the machine do not count)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and b"ClientAppActor" in (d / "cmdline").read_bytes():
                if _descends_from(int(d.name), os.getpid()):
                    found.append(int(_stat(int(d.name))[16]))
        except OSError:  # the process ended while being read
            continue
    return found


def test_simulation_actors_keep_the_drivers_priority(tmp_path, tiny_cfg, flower_sim):
    """Ray would start the actors at niceness 15; they do the clients' work while the
    server waits, so beside other work they were starved (185 s for a first round that
    takes 21 s at the driver's priority)."""
    _run(_small(tiny_cfg, method="fedprox", transport="flower", rounds=1), tmp_path / "x")
    nice = _actor_niceness()
    assert nice  # one actor here (flower_sim); an actor per CPU by default
    assert set(nice) == {os.getpriority(os.PRIO_PROCESS, 0)}


def test_fedask_client_failing_between_stages(tmp_path, tiny_cfg, flower_sim):
    """Client 1 fails in stage 2 (project) of round 1 after training in stage 1: the
    round completes with the survivor (Y and Q recomputed from it), client 1's DP steps
    stay in the ledger — identically in-process and over Flower (where the failure is
    raised on the Flower client)."""
    kw = dict(method="fedask", dp_level="sample", noise_multiplier=1.0)

    def fault(rnd, cid, stage):
        return "killed" if (rnd.index, cid, stage) == (0, "1", "project") else None

    man_a, _ = _run(_small(tiny_cfg, **kw), tmp_path / "a", fault)
    man_b, _ = _run(
        _small(tiny_cfg, transport="flower", **kw), tmp_path / "b", fault, tmp_path / "a"
    )
    _compare(tmp_path / "a", tmp_path / "b", man_a, man_b)
    row = _rows(tmp_path / "b")[0]
    assert row["stage2_failed"] == {"1": "ClientFailure: killed"}
    assert row["survivors"] == ["0"]
    assert not row.get("round_discarded")
    assert {e["unit"] for e in _events(man_b) if e["round"] == 0} == {"client:0", "client:1"}
    assert "client 1 failed in stage 'project'" in (tmp_path / "b" / "run.log").read_text()


def test_error_reply_and_missing_reply_are_client_failures(tmp_path, tiny_cfg, monkeypatch):
    """What a killed client looks like to the server over Flower: its node answers with a
    Flower error, or nothing arrives before the stage timeout. Both go to
    ``replies.failed`` with the reason, in the log too; no event enters the ledger."""
    from types import SimpleNamespace

    from fl.flower.transport import FlowerTransport
    from fl.methods.base import RoundInfo

    eng = Engine(_small(tiny_cfg, method="fedask", transport="flower"), tmp_path / "x", quiet=True)
    eng.setup()
    (tmp_path / "x").mkdir(exist_ok=True)
    sent = []

    class Reply:
        metadata = SimpleNamespace(src_node_id=10)
        error = SimpleNamespace(code=3, reason="ClientApp process exited (killed)")

        def has_error(self):
            return True

    class Grid:
        def send_and_receive(self, msgs, timeout):
            sent.extend(msgs)
            assert timeout == 1.5
            return [Reply()]  # node 11 (client 1) never answers

    # Outside a Flower run a Message cannot be built (no run id); keep what it was given.
    import fl.flower.transport as T

    monkeypatch.setattr(T, "Message", lambda **kw: SimpleNamespace(**kw))
    tr = FlowerTransport(eng, grid=Grid(), timeout=1.5)
    tr.nodes = {"0": 10, "1": 11}
    n_events = len(eng.ledger.events)
    rnd = RoundInfo(0, 7, ["0", "1"])
    replies = Dispatcher(eng, tr).send(
        eng.method, rnd, ["0", "1"], "project", {"Q": torch.zeros(4, 2)}
    )
    assert [m.message_type for m in sent] == ["train.project", "train.project"]
    assert not replies.ok
    assert replies.failed == {
        "0": "FlowerError 3: ClientApp process exited (killed)",
        "1": "Timeout: no reply within 1.5s",
    }
    assert len(eng.ledger.events) == n_events
    log = "\n".join(eng._log_lines)
    assert "client 0 failed in stage 'project': FlowerError 3" in log
    assert "client 1 failed in stage 'project': Timeout" in log


def test_flower_resume_keeps_ledger(tmp_path, tiny_cfg, flower_sim, inprocess):
    """The server stops in round 2 (an exception on the server side); resuming over
    Flower from the round-1 checkpoint gives the adapter and ledger of an
    uninterrupted (in-process) run: the ledger is restored, not reset."""
    kw = dict(method="fedavg", dp_level="sample", noise_multiplier=1.0)
    out_full, full = inprocess(_small(tiny_cfg, **kw), "fedavg")

    class Stop(Exception):
        pass

    def stop(rnd, cid, stage):
        if rnd.index == 1:
            raise Stop("server stopped")

    with pytest.raises(Stop):
        _run(_small(tiny_cfg, transport="flower", **kw), tmp_path / "part", stop, out_full)
    assert (tmp_path / "part" / "checkpoint" / "meta-00001.json").exists()
    eng = Engine(
        _small(tiny_cfg, transport="flower", **kw), tmp_path / "part", resume=True, quiet=True
    )
    resumed = eng.run()
    # Round 2 had started (journaled) when the server stopped: over Flower a re-run is
    # not guaranteed bit-exact (node-side state outlives the server), so its planned
    # events are charged once more and it is re-run as attempt 1, with fresh noise: the
    # first attempt's noise over a computation that may differ would cancel in a
    # difference. The adapter therefore differs from the uninterrupted run's.
    charged = [e for e in _events(resumed) if e["stage"] == "interrupted"]
    assert [(e["unit"], e["round"]) for e in charged] == [("client:0", 1), ("client:1", 1)]
    rest = [e for e in _events(resumed) if e["stage"] != "interrupted"]
    assert rest == _events(full)
    assert resumed["privacy"]["epsilon"]["pld"] > full["privacy"]["epsilon"]["pld"]
    a, b = _adapter(out_full), _adapter(tmp_path / "part")
    assert set(a) == set(b)
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) > 1e-3
    keep = ("round", "accuracy", "clients", "bytes_per_client", "epsilon")
    (first,) = [{k: r.get(k) for k in keep} for r in _rows(tmp_path / "part") if r["round"] == 1]
    assert first == {k: _rows(out_full)[0].get(k) for k in keep}  # round 1 is kept
    log = (tmp_path / "part" / "run.log").read_text()
    assert "cannot be replayed bit-exactly" in log and "attempt 1 with fresh noise" in log
    assert "resumed from checkpoint after round 1" in (tmp_path / "part" / "run.log").read_text()


# --------------------------------------------------------------- loopback deployment
def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


DEPLOY_TIMEOUT = 110.0  # seconds for the whole deployment, processes included

# `flower-supernode` (flwr.supernode.cli:flower_supernode) whose loop pulls the SuperLink
# every 0.25 s (Flower's runtime API's own poll interval) instead of sleeping 3 s after
# an empty pull (flwr 1.42 start_client_internal: a fixed time.sleep(3), no option): each
# stage of a run paid up to 3 s of it. Only the loop's sleeps are shortened; the SuperNode
# is Flower's own, unchanged (with another flwr the patch is left out: only slower).
SUPERNODE = """
import sys, time
try:
    import flwr.supernode.start_client_internal as loop
except ImportError:
    loop = None
class Clock:
    sleep = staticmethod(lambda s: time.sleep(min(s, 0.25)))
    def __getattr__(self, name):
        return getattr(time, name)
if getattr(loop, "time", None) is time:
    loop.time = Clock()
from flwr.supernode.cli import flower_supernode
sys.argv[0] = "flower-supernode"
sys.exit(flower_supernode())
"""


def test_deployment_loopback(tmp_path, tiny_cfg):
    """A real SuperLink and two SuperNodes on 127.0.0.1 (insecure: loopback only), each
    a separate process group; a round of FedASK submitted with `flwr run`. The
    adapter and ledger equal the in-process run's; every process started here is
    killed (process group) in a finally. SuperNodes launch ClientApps, and the SuperLink
    its ServerApp, through the warm ``flwr-clientapp`` and ``flwr-serverapp``, and each
    starts its ``flower-superexec`` the same way (fl.flower.warm): Flower's own entry
    points in a forked, pre-imported process.

    One round: its two stages (sketch, then project) run in two ClientApp processes per
    node, the second on the state the first left in the node's ``context.state``, which
    is what a deployment adds to the simulation tests above (they run every method for
    two rounds on the same ClientApp code); a second round repeated the same messages."""
    t_start = time.time()
    kw = dict(method="fedask", dp_level="sample", noise_multiplier=1.0, rounds=1)
    link, node0, node1 = _free_ports(3)  # SuperLink (all its HTTP APIs), SuperNodes
    shim_dir = tmp_path / "bin"
    # AF_UNIX paths are limited to ~107 bytes; tmp_path can be longer (xdist, TMPDIR).
    sock_dir = Path(tempfile.mkdtemp(prefix="fedlora-warm-", dir="/tmp"))
    sock = sock_dir / "s"
    base_env = dict(
        os.environ,
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        FLWR_TELEMETRY_ENABLED="0",
        PYTHONUNBUFFERED="1",
        # SuperExecs look for new tasks every 1 s by default; Flower's own knob.
        FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.2",
    )
    homes = {n: tmp_path / f"home-{n}" for n in ("superlink", "node0", "node1", "user")}
    for h in homes.values():
        h.mkdir()
    (homes["user"] / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n[superlink.loopback]\n'
        f'address = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    out = tmp_path / "run"
    procs: list[subprocess.Popen] = []
    logs = []

    def start(args, name, **extra_env):
        fh = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115 - closed in the finally
        logs.append(fh)
        env = dict(base_env, **extra_env)
        procs.append(
            subprocess.Popen(
                args,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=tmp_path,
            )
        )

    def tails() -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp_path.glob("*.log"))
        )

    try:
        from fl.flower.warm import write_shim

        write_shim(str(shim_dir), str(sock))
        write_shim(str(shim_dir), str(sock), "flwr-serverapp")
        write_shim(str(shim_dir), str(sock), "flower-superexec")
        start([sys.executable, "-m", "fl.flower.warm", "serve", str(sock)], "warm")
        # It listens at once and imports after: the SuperLink's and SuperNodes' SuperExecs
        # (their shims) then wait in its backlog for their forks, never fall back.
        while not sock.exists():
            assert procs[0].poll() is None, f"warm server exited\n{tails()}"
            assert time.time() - t_start < DEPLOY_TIMEOUT / 2, f"warm server not up\n{tails()}"
            time.sleep(0.05)
        start(
            [
                str(VENV_BIN / "flower-superlink"),
                "--insecure",
                "--host", "127.0.0.1",
                "--port", str(link),
                "--disable-runtime-dependency-installation",
            ],
            "superlink",
            FLWR_HOME=str(homes["superlink"]),
            PATH=f"{shim_dir}{os.pathsep}{base_env['PATH']}",
        )  # fmt: skip
        for k, port in enumerate((node0, node1)):
            start(
                [
                    sys.executable, "-c", SUPERNODE,
                    "--insecure",
                    "--superlink", f"127.0.0.1:{link}",
                    "--host", "127.0.0.1",
                    "--port", str(port),
                    "--node-config", f"partition-id={k} num-partitions={CLIENTS}",
                    "--max-wait-time", str(int(DEPLOY_TIMEOUT)),
                ],
                f"supernode{k}",
                FLWR_HOME=str(homes[f"node{k}"]),
                PATH=f"{shim_dir}{os.pathsep}{base_env['PATH']}",
            )  # fmt: skip
        # The in-process reference meanwhile (the processes above are starting up).
        man_a, _ = _run(_small(tiny_cfg, **kw), tmp_path / "inprocess")
        rc = (
            f"out-dir='{out}' method='fedask' clients={CLIENTS} rounds=1 members=120 "
            "nonmembers=30 test=40 local-steps=1 dp-level='sample' noise-multiplier=1.0 "
            f"stage-timeout=60.0 noise-key='{tmp_path / 'inprocess/private/noise.key'}'"
        )
        # `flwr run` fails at once if the SuperLink is not listening yet; the ServerApp
        # itself waits (up to stage-timeout) for a SuperNode per client.
        while not (_listening(link) and sock.exists()):
            assert procs[1].poll() is None, f"SuperLink exited\n{tails()}"
            assert time.time() - t_start < DEPLOY_TIMEOUT / 2, (
                f"SuperLink or warm server not up\n{tails()}"
            )
            time.sleep(0.2)
        budget = DEPLOY_TIMEOUT - (time.time() - t_start)
        run = subprocess.run(
            [str(VENV_BIN / "flwr"), "run", str(ROOT / "flower_app"), "loopback", "--stream",
             "--run-config", rc],
            env=dict(base_env, FLWR_HOME=str(homes["user"])),
            capture_output=True,
            text=True,
            timeout=budget,
            cwd=tmp_path,
        )  # fmt: skip
        assert (out / "manifest.json").exists(), (
            f"flwr run rc={run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{tails()}"
        )
        man_b = json.loads((out / "manifest.json").read_text())
        assert man_b["privacy"]["rounds_completed"] == 1
        assert man_b["config"]["transport"] == "flower"
        assert len(_events(man_b)) == CLIENTS  # in the server's ledger
        _compare(tmp_path / "inprocess", out, man_a, man_b)
        log = (out / "run.log").read_text()
        assert "flower: client → node" in log
        # Every ClientApp message went through the warm server (one fork each).
        node_logs = [(tmp_path / f"supernode{k}.log").read_text() for k in range(CLIENTS)]
        assert all("flwr-clientapp" in t for t in node_logs)
        # So did the SuperLink's and each SuperNode's flower-superexec, and the ServerApp.
        forked = (tmp_path / "warm.log").read_text()
        assert forked.count("forked flower-superexec") == 1 + CLIENTS, forked
        assert forked.count("forked flwr-serverapp") == 1, forked
        assert forked.count("forked flwr-clientapp") >= 2 * CLIENTS, forked  # two stages
        # The ClientApps ran with each SuperNode's FLWR_HOME (where it installed the app).
        for k in range(CLIENTS):
            assert any((homes[f"node{k}"] / "apps").iterdir())
        secs = [round(r["seconds"], 2) for r in _rows(out)]
        ref = [round(r["seconds"], 2) for r in _rows(tmp_path / "inprocess")]
        print(f"\nseconds/round: in-process {ref}, loopback deployment {secs}")
    finally:
        _stop_groups([p.pid for p in procs], procs)
        for fh in logs:
            fh.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    # Every process of every group is gone, not just the leaders (superexecs, the
    # ServerApp and ClientApp processes are started by the SuperLink and SuperNodes).
    assert not [pid for p in procs for pid in _group_members(p.pid)]


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes in process group ``pgid``."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(d.name))
    return found


def _stop_groups(pgids: list[int], procs: list[subprocess.Popen], grace: float = 1.0) -> None:
    """SIGTERM every group, wait up to ``grace`` s for all members, then SIGKILL. The
    run is over by then; a second is what the SuperLink itself gives its SuperExec (a
    process that holds torch & co. spends seconds of CPU tearing its interpreter down)."""
    for g in pgids:
        try:
            os.killpg(g, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.time() + grace
    while time.time() < deadline and any(_group_members(g) for g in pgids):
        for p in procs:
            p.poll()
        time.sleep(0.1)
    for g in pgids:
        if _group_members(g):
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait(5)
    deadline = time.time() + 5
    while time.time() < deadline and any(_group_members(g) for g in pgids):
        time.sleep(0.1)


def test_warm_shim_falls_back_to_real_clientapp(tmp_path):
    """Without a warm server the shim runs the real flwr-clientapp (next on PATH) with
    the same arguments and exit code."""
    from fl.flower.warm import write_shim

    shim = write_shim(str(tmp_path / "bin"), str(tmp_path / "absent.sock"))
    env = dict(os.environ, PATH=f"{shim.parent}{os.pathsep}{VENV_BIN}{os.pathsep}/usr/bin:/bin")
    res = subprocess.run(
        ["flwr-clientapp", "--help"], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert "Run a Flower ClientApp" in res.stdout
    bad = subprocess.run(
        ["flwr-clientapp", "--no-such-flag"], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "flwr-clientapp: error" in bad.stderr

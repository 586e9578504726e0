"""The Flower transport: the engine's ``send(clients, stage, payload)`` over Flower's
Message API (``grid.send_and_receive``).

Two ways a grid is found:

- inside a Flower ``ServerApp`` (``flwr run``, simulation or deployment): the
  ServerApp's main (``fl.flower.serverapp``) binds its grid with :func:`bind_grid` and
  runs the engine's round loop itself, so the method's server program runs in the
  ServerApp main over ``grid.send_and_receive``;
- ``fedlora train --transport flower`` (no grid bound): the transport starts Flower's
  simulation runtime (Ray) in a background thread with one virtual SuperNode per
  client, whose ServerApp main hands its grid to this process and waits; the engine
  thread then drives the same grid. The session is reused by later runs in the same
  process with the same number of clients, and stopped at exit (or
  :func:`shutdown_simulation`).

Node ↔ client mapping: each SuperNode holds one partition (``partition-id`` in its
node config; the simulation runtime sets it); at start the server asks every node for
it (``query.partition``) and addresses client ``str(partition-id)``.

Faults: a node whose reply is a Flower error, or that does not reply within the
timeout (``FEDLORA_FLOWER_TIMEOUT`` seconds, default 600), is a *lost* reply: the
engine's Dispatcher (``fl.run.transport``) charges the DP-SGD event it planned for that
client. A handler that raised ``ClientFailure`` reports its DP events and rolls its
node-side state back. Either way the client goes to ``replies.failed``. Any other
exception in a handler is a bug and is re-raised on the server with the client's
traceback (as in-process), after the Dispatcher charged the client's DP cost. Events
that do not parse make the reply a failure. This transport only moves payloads; byte
counts, validation, failures and the ledger (the server's plan, checked against what
each node reports) are the Dispatcher's.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from contextlib import contextmanager

from flwr.app import Message, RecordDict

from fl.flower import records as R
from fl.flower.clientapp import META

_BOUND = threading.local()


def default_timeout() -> float:
    return float(os.environ.get("FEDLORA_FLOWER_TIMEOUT", "600"))


#: seconds between two pulls of a stage's replies: Flower's simulation grid's own
#: interval (``InMemoryGrid.pull_interval``); its deployment grid (``HttpGrid``) waits 3 s
REPLY_POLL = 0.1


def send_and_receive(grid, messages: list, timeout: float) -> list:
    """``grid.send_and_receive(messages, timeout=timeout)``, pulling the replies every
    :data:`REPLY_POLL` s. Flower's deployment grid sleeps 3 s after each pull that
    misses a reply, so a stage that takes a fraction of a second cost up to 3 s there
    (up to 15 s of a two-round FedASK run's five stages). What is sent, what comes back
    and the timeout are Flower's (``Grid.push_messages``, ``Grid.pull_messages``); a grid
    that is not one of Flower's (``flwr.serverapp.Grid``) does its own
    ``send_and_receive``."""
    from flwr.serverapp import Grid

    if not isinstance(grid, Grid):
        return list(grid.send_and_receive(messages, timeout=timeout))
    pending = set(grid.push_messages(messages))
    end = time.time() + timeout
    got: list = []
    while True:
        replies = list(grid.pull_messages(pending))
        got += replies
        pending -= {r.metadata.reply_to_message_id for r in replies}
        left = end - time.time()
        if not pending or left <= 0:
            return got
        time.sleep(min(REPLY_POLL, left))


@contextmanager
def bind_grid(grid, timeout: float | None = None):
    """Make ``grid`` the one FlowerTransport uses in this thread (ServerApp main)."""
    prev = getattr(_BOUND, "grid", None), getattr(_BOUND, "timeout", None)
    _BOUND.grid, _BOUND.timeout = grid, timeout
    try:
        yield grid
    finally:
        _BOUND.grid, _BOUND.timeout = prev


class FlowerTransport:
    """``send`` for :class:`fl.run.engine.Engine` over a Flower grid (see the module doc)."""

    name = "flower"

    def __init__(self, engine, grid=None, timeout: float | None = None):
        self.engine = engine
        self._grid = grid if grid is not None else getattr(_BOUND, "grid", None)
        self.timeout = timeout or getattr(_BOUND, "timeout", None) or default_timeout()
        self.nodes: dict[str, int] | None = None  # client id -> node id
        self._session: SimulationSession | None = None  # the simulation grid's session

    # ---- grid and node mapping -------------------------------------------------------
    def grid(self):
        if self._grid is None:
            self._grid = simulation_grid(self.engine.cfg.clients, self.engine.log)
            self._session = _SESSION
        return self._grid

    def node_map(self) -> dict[str, int]:
        """client id → node id, by asking every node its partition id; waits (up to
        the timeout) until every client of the run has a node. On this process's
        simulation session the answer of its first run is reused: its virtual SuperNodes
        and their partition ids are fixed for the session's life (a round trip through
        the ClientApp actor per node and run, before)."""
        if self.nodes is not None:
            return self.nodes
        grid, want = self.grid(), set(self.engine.client_ids())
        session = self._session
        if session is not None and want <= set(session.partitions):
            found = dict(session.partitions)
        else:
            found = self._ask_partitions(grid, want)
            if session is not None:
                session.partitions = dict(found)
        extra = sorted(set(found) - want)
        if extra:
            self.engine.log(f"flower: nodes for unknown partitions {extra} are not used")
        self.nodes = {c: found[c] for c in want}
        self.engine.log(f"flower: client → node {self.nodes}")
        return self.nodes

    def _ask_partitions(self, grid, want: set[str]) -> dict[str, int]:
        """partition (client id) → node id, asked of every node until ``want`` is covered."""
        from fl.errors import UsageError

        found: dict[str, int] = {}
        asked: set[int] = set()
        deadline = time.time() + self.timeout
        while True:
            new = [n for n in grid.get_node_ids() if n not in asked]
            if new:
                msgs = [
                    Message(
                        content=R.encode({}, RecordDict(), META),
                        dst_node_id=n,
                        message_type="query.partition",
                    )
                    for n in new
                ]
                for rep in send_and_receive(grid, msgs, max(1.0, deadline - time.time())):
                    node = rep.metadata.src_node_id
                    if rep.has_error():
                        continue  # asked again if it reconnects as a new node
                    asked.add(node)
                    pid = R.decode(rep.content, META)["partition_id"]
                    if pid is None:
                        self.engine.log(f"flower: node {node} has no partition-id; ignored")
                        continue
                    cid = str(pid)
                    if cid in found and found[cid] != node:
                        raise UsageError(
                            f"two SuperNodes ({found[cid]}, {node}) hold partition-id {cid}"
                        )
                    found[cid] = node
            if want <= set(found):
                break
            if time.time() > deadline:
                raise UsageError(
                    f"flower: no SuperNode for client(s) {sorted(want - set(found), key=int)} "
                    f"after {self.timeout:.0f}s (start one per partition with "
                    f"--node-config 'partition-id=K num-partitions={len(want)}')"
                )
            time.sleep(0.5)
        return found

    # ---- the transport interface --------------------------------------------------------
    def deliver(self, method, rnd, stage, payloads, faults):
        """Send one ``train.<stage>`` message per client and collect the replies as
        :class:`fl.run.transport.Delivery` (the engine's Dispatcher does the rest)."""
        from fl.privacy.accounting import Event, PrivacyError
        from fl.run.transport import Delivery

        eng = self.engine
        if not stage.isidentifier():
            raise RuntimeError(f"stage name {stage!r} is not a Flower action name")
        nodes = self.node_map()
        grid = self.grid()
        cfg_dict = eng.cfg.to_dict()
        msgs, by_node = [], {}
        for cid, p in payloads:
            meta = {
                "cfg": cfg_dict,
                "sigma": float(eng.sigma),
                # sample level: σ_k per client mechanism (q, steps), see PrivacyPlan
                "mechanism_sigmas": [
                    [q, s, float(v)] for (q, s), v in getattr(eng, "mechanism_sigmas", {}).items()
                ],
                "index": rnd.index,
                # a round re-run after a stop draws fresh streams (Engine._account_inflight)
                "attempt": eng.rand.attempts.get(rnd.index, 0),
                "seed": rnd.seed,
                "clients": list(rnd.clients),
                "cid": cid,
                "fault": faults.get(cid),
                # Where the node finds the run's secret noise key when its node config
                # names none (simulation: same machine); never the key itself.
                "noise_key_file": eng.noise_key_file(),
                "noise_key_id": eng.noise_key_id(),
            }
            content = R.encode(p, RecordDict(), "payload")
            R.encode(meta, content, META)
            msgs.append(
                Message(
                    content=content,
                    dst_node_id=nodes[cid],
                    message_type=f"train.{stage}",
                    group_id=f"round-{rnd.index + 1}",
                )
            )
            by_node[nodes[cid]] = cid
        got: dict[str, Message] = {}
        for rep in send_and_receive(grid, msgs, self.timeout):
            cid = by_node.get(rep.metadata.src_node_id)
            if cid is not None:
                got[cid] = rep
        out: dict[str, Delivery] = {}
        for cid, _ in payloads:
            rep = got.get(cid)
            if rep is None:
                out[cid] = Delivery(failed=f"Timeout: no reply within {self.timeout:g}s", lost=True)
                continue
            if rep.has_error():
                out[cid] = Delivery(
                    failed=f"FlowerError {rep.error.code}: {rep.error.reason}", lost=True
                )
                continue
            meta = R.decode(rep.content, META)
            try:
                events = [Event.from_dict(ev) for ev in meta.get("events", [])]
            except PrivacyError as exc:
                # Unreadable events: the reply is not used; the Dispatcher charges the
                # server's plan (a training stage) and logs the failure.
                out[cid] = Delivery(None, [], f"rejected update: malformed DP event: {exc}")
                continue
            if meta.get("error"):
                # a bug: the Dispatcher charges the client's DP cost, then re-raises it
                out[cid] = Delivery(None, events, error=f"(over Flower) {meta['error']}")
                continue
            if meta.get("failed"):
                out[cid] = Delivery(None, events, meta["failed"])
                continue
            out[cid] = Delivery(R.decode(rep.content, "payload"), events)
        return out


# ---------------------------------------------------------------------------------
# Flower's simulation runtime, driven from this process
# ---------------------------------------------------------------------------------
class SimulationSession:
    """``flwr.simulation.run_simulation`` in a daemon thread. Its ServerApp main puts
    its grid on a queue and waits until :meth:`close`; the caller uses the grid."""

    def __init__(self, num_supernodes: int, backend_config: dict | None = None, log=print):
        from flwr.serverapp import ServerApp

        from fl.flower.clientapp import app as client_app

        self.num_supernodes = num_supernodes
        #: partition id (client id) → node id, as the first run's nodes answered
        self.partitions: dict[str, int] = {}
        self._grid_q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        server_app = ServerApp()

        @server_app.main()
        def _main(grid, context):
            self._grid_q.put(grid)
            self._stop.wait()

        cpus = int(os.environ.get("FEDLORA_FLOWER_CPUS", "1"))
        self.backend_config = backend_config or {
            "client_resources": {"num_cpus": cpus, "num_gpus": 0.0},
            # Ray starts its workers at niceness 15; here they do all of the clients'
            # work while this process waits, so on a busy machine they were starved (the
            # first round over Flower took 185 s instead of 21 s beside two trainings).
            # 0 = no adjustment: the actors keep this process's priority. No task runs
            # outside the ClientApp actors, each started in a worker of its own: the idle
            # workers Ray prestarts for a first driver went unused (~0.4 s of CPU each).
            "init_args": {
                "include_dashboard": False,
                "log_to_driver": False,
                "_system_config": {"worker_niceness": 0, "prestart_worker_first_driver": False},
            },
        }

        def _run():
            from flwr.simulation import run_simulation

            try:
                run_simulation(
                    server_app=server_app,
                    client_app=client_app,
                    num_supernodes=num_supernodes,
                    backend_config=self.backend_config,
                )
            except BaseException as exc:  # noqa: BLE001 - reported to the waiting caller
                self.error = exc
                self._grid_q.put(None)

        t0 = time.time()
        self.thread = threading.Thread(target=_run, name="flower-simulation", daemon=True)
        self.thread.start()
        grid = self._grid_q.get(timeout=600)
        if grid is None:
            raise RuntimeError(f"Flower simulation failed to start: {self.error!r}")
        self.grid = grid
        log(
            f"flower: simulation runtime up ({num_supernodes} SuperNodes) in {time.time() - t0:.1f}s"
        )

    def close(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self.thread.join(timeout)


_SESSION: SimulationSession | None = None


def simulation_grid(num_supernodes: int, log=print):
    """The grid of the process's simulation session (started or restarted for this
    number of SuperNodes)."""
    global _SESSION
    if _SESSION is not None and (
        _SESSION.num_supernodes != num_supernodes or not _SESSION.thread.is_alive()
    ):
        shutdown_simulation()
    if _SESSION is None:
        _SESSION = SimulationSession(num_supernodes, log=log)
    return _SESSION.grid


def shutdown_simulation() -> None:
    """Close this process's shared simulation session, if one is open."""
    global _SESSION
    if _SESSION is not None:
        _SESSION.close()
        _SESSION = None


# Interpreter exit joins non-daemon threads (Ray's, Flower's) *before* atexit handlers
# run, so a plain atexit hook would wait forever; threading's own exit hook runs first
# (what concurrent.futures uses).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(shutdown_simulation)
else:  # pragma: no cover - every supported Python has it
    atexit.register(shutdown_simulation)

__all__ = [
    "FlowerTransport",
    "bind_grid",
    "send_and_receive",
    "simulation_grid",
    "shutdown_simulation",
    "SimulationSession",
]

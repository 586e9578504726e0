"""A warm ``flwr-clientapp`` for SuperNodes (and ``flwr-serverapp`` for a SuperLink):
fork a pre-imported process per message.

A Flower 1.42 SuperNode runs every message in a new ``flwr-clientapp`` process
(started by ``flower-superexec`` from ``PATH``). For fedlora that process spends
~7 s of CPU importing torch, transformers, peft and opacus before it does
~0.3 s of work (the client engine setup), for every stage of every round. A SuperLink
starts each run's ``flwr-serverapp`` the same way (~4 s of imports once per run), and
each SuperNode and SuperLink starts a ``flower-superexec`` (the process that launches
those apps; 1.5-3.5 s of CPU, mostly imports, each) as it starts.

This module removes the import cost without changing what Flower runs:

- ``python -m fl.flower.warm serve SOCKET`` imports everything once and listens on a
  Unix socket; per request it forks, and the child runs Flower's own
  ``flwr-clientapp`` entry point (``flwr.supernode.cli.flwr_clientapp``; or
  ``flwr-serverapp``'s, ``flower-superexec``'s) with the request's arguments and
  standard streams. The parent stays single-threaded and never runs torch ops, so
  forking it is safe.
- ``python -m fl.flower.warm shim DIR SOCKET [--name NAME]`` writes an executable
  ``DIR/flwr-clientapp`` (or ``DIR/NAME``: ``flwr-serverapp``, ``flower-superexec``)
  that forwards its arguments, environment, working directory and stdin/stdout/stderr
  (passed as file descriptors) to the server, which runs that entry point, relays
  SIGTERM/SIGINT to the forked child and exits with its exit code. Put ``DIR`` first on the SuperNode's (the
  SuperLink's) ``PATH``. If the server is not reachable the shim runs the real command
  (the next one on ``PATH``). The server listens before it imports: a shim that
  connects meanwhile waits for its fork (start the server before the SuperLink and
  SuperNodes, and their ``flower-superexec`` is forked too).

The socket is created mode 0600 (only the SuperNode's user may use it). Optional:
without it a SuperNode works as Flower ships it, only slower.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import stat
import sys
from pathlib import Path

PRELOAD = (
    "flwr.supernode.cli.flwr_clientapp",
    "flwr.supernode.runtime.run_clientapp",
    "flwr.superlink.cli.flwr_serverapp",
    "flwr.supercore.cli.flower_superexec",
    "flwr.supercore.superexec.run_superexec",
    "fl.flower.clientapp",
    "fl.flower.serverapp",
    "fl.run.engine",
    "fl.methods",
    "transformers",
    "transformers.models.bert.modeling_bert",
    "transformers.models.bert.tokenization_bert",
    "peft",
    "opacus",
)


def preload() -> None:
    """Import what every ClientApp message needs (imports only: no torch ops, so no
    thread pools exist when the server forks)."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional dependency absent here is absent in the child too
            pass
    # fl.methods registers methods lazily on first lookup; do it before forking.
    from fl.flower.clientapp import stage_names

    stage_names()


#: the commands a shim may stand for: Flower's entry points (module, function)
ENTRY_POINTS = {
    "flwr-clientapp": ("flwr.supernode.cli.flwr_clientapp", "flwr_clientapp"),
    "flwr-serverapp": ("flwr.superlink.cli.flwr_serverapp", "flwr_serverapp"),
    # the SuperNode's and SuperLink's launcher of the two above (long-lived: it polls
    # for tasks and runs each with the app command it finds on PATH, i.e. the shims)
    "flower-superexec": ("flwr.supercore.cli.flower_superexec", "flower_superexec"),
}


def _child(conn: socket.socket, req: dict, fds: list[int]) -> None:
    """In the forked child: take the caller's stdio, environment (``FLWR_HOME`` is the
    SuperNode's) and working directory, run the shim's command (``ENTRY_POINTS``), exit."""
    argv = list(req["argv"])
    name = req.get("name", "flwr-clientapp")
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    for i, fd in enumerate(fds[:3]):
        os.dup2(fd, i)
        os.close(fd)
    code = 1
    try:
        import importlib

        module, function = ENTRY_POINTS[name]
        sys.argv = [name, *argv]
        getattr(importlib.import_module(module), function)()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the caller's stderr, exit 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(sock_path: str) -> None:
    """Run the warm server on ``sock_path`` until SIGTERM/SIGINT."""
    path = Path(sock_path)
    if path.exists():
        path.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Only this user may connect: a request runs code with the environment it sends.
    old_umask = os.umask(0o177)
    try:
        srv.bind(str(path))
    finally:
        os.umask(old_umask)
    srv.listen(64)
    # Listening before the imports: a shim that connects meanwhile (a SuperExec started
    # with its SuperNode) waits in the backlog for its fork instead of falling back to
    # the real command.
    preload()
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the shim's connection
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print(f"fedlora warm clientapp server on {path} (pid {os.getpid()})", flush=True)
    try:
        while not stop:
            for _key, _ev in sel.select(timeout=0.1):
                conn, _ = srv.accept()
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
                    req = json.loads(msg.decode())
                except (OSError, ValueError):
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    srv.close()
                    for c in waiting.values():
                        c.close()
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    _child(conn, req, fds)
                for fd in fds:
                    os.close(fd)
                print(f"forked {req.get('name', 'flwr-clientapp')} (pid {pid})", flush=True)
                try:
                    conn.sendall(f"pid {pid}\n".encode())
                except OSError:
                    pass
                waiting[pid] = conn
            # Reap finished children and tell their shims the exit code.
            while waiting:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = waiting.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()
    finally:
        for pid in waiting:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        srv.close()
        path.unlink(missing_ok=True)


SHIM = """#!{python}
# fedlora warm {name} shim (written by `python -m fl.flower.warm shim`).
import json, os, shutil, signal, socket, sys
SOCK = {sock!r}
NAME = {name!r}
def real():
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.abspath(p) != here)
    exe = shutil.which(NAME, path=path)
    if exe is None:
        sys.exit(NAME + " not found on PATH")
    os.execv(exe, [exe, *sys.argv[1:]])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(SOCK)
    req = dict(argv=sys.argv[1:], env=dict(os.environ), cwd=os.getcwd(), name=NAME)
    socket.send_fds(s, [json.dumps(req).encode()], [0, 1, 2])
except OSError:
    s.close()
    real()
f = s.makefile("r")
child = None
def fwd(sig, _frame):
    if child:
        try:
            os.kill(child, sig)
        except ProcessLookupError:
            pass
signal.signal(signal.SIGTERM, fwd)
signal.signal(signal.SIGINT, fwd)
code = 1
for line in f:
    kind, _, val = line.strip().partition(" ")
    if kind == "pid":
        child = int(val)
    elif kind == "exit":
        code = int(val)
        break
sys.exit(code if code >= 0 else 128 - code)
"""


def write_shim(directory: str, sock_path: str, name: str = "flwr-clientapp") -> Path:
    """Write the ``name`` shim (a key of :data:`ENTRY_POINTS`) into ``directory``;
    returns its path."""
    if name not in ENTRY_POINTS:
        raise ValueError(f"no warm entry point {name!r}; expected one of {sorted(ENTRY_POINTS)}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    p = d / name
    p.write_text(SHIM.format(python=sys.executable, sock=str(sock_path), name=name))
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return p


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m fl.flower.warm", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the warm server")
    s.add_argument("socket")
    w = sub.add_parser("shim", help="write DIR/flwr-clientapp forwarding to SOCKET")
    w.add_argument("dir")
    w.add_argument("socket")
    w.add_argument(
        "--name", default="flwr-clientapp", choices=sorted(ENTRY_POINTS), help="the command"
    )
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        serve(a.socket)
    else:
        print(write_shim(a.dir, a.socket, a.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["serve", "write_shim", "preload", "main"]

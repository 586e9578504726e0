"""Independent tasks on Ray, or one after another in this process.

:func:`run_tasks` runs ``fn(arg)`` for every ``arg`` of a list (shadow models, the
measurement grids' jobs) and yields an :class:`Outcome` per task as each finishes:

- ``address="local"`` (the default): a Ray instance started on this machine (``num_cpus``
  = the usable CPUs, or ``workers`` when more; no dashboard; quiet logs; usage statistics
  off, so it works offline), kept for the rest of the process and reused by later calls;
- any other address (``ray://host:10001``, ``host:6379``, ``auto``): that cluster; the
  code must be installed on its nodes;
- ``address="none"`` or ``workers=1``: in this process, in order (tests, debugging).

``workers`` bounds the tasks in flight (0: one per usable CPU). A task that raises, or
whose worker dies, is reported through ``report`` and run again, at most ``retries`` more
times, while the others go on; a task that still fails yields an outcome with its error.
With a ``deadline`` (``time.time()`` seconds) no task is started after it (it yields
``skipped="deadline"``). Each task runs with ``threads`` torch threads (None: unchanged
in this process, the CPUs per worker on Ray); a task's result depends only on its
argument and its thread count, so both paths give identical results at the same count.
"""

from __future__ import annotations

import math
import os
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fl.errors import UsageError

#: ``address`` values that mean "no Ray: in this process"
SEQUENTIAL = ("none", "")


@dataclass
class Outcome:
    """One task's end: ``value`` (fn's return), or ``error`` (its last attempt's, as
    ``Type: message``), or ``skipped`` (why it never started)."""

    index: int
    value: object = None
    error: str | None = None
    skipped: str | None = None
    attempts: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.skipped is None


def usable_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def resolve_workers(workers: int, n_tasks: int) -> int:
    """Tasks in flight: ``workers`` (0: one per usable CPU), at most one per task."""
    if workers < 0:
        raise UsageError(f"workers must be >= 0 (0: one per CPU), got {workers}")
    w = workers or usable_cpus()
    return max(1, min(w, n_tasks))


def is_sequential(address: str | None, workers: int, n_tasks: int) -> bool:
    return (address or "").lower() in SEQUENTIAL or resolve_workers(workers, n_tasks) == 1


#: the driver's scheduling priority, handed to the local Ray workers
NICENESS_ENV = "FEDLORA_DRIVER_NICENESS"


def match_driver_priority() -> bool:
    """Give this Ray worker the driver's scheduling priority.

    Ray starts its workers at niceness 15, so on a shared machine a grid's or a
    shadow's tasks on Ray would get a fraction of the CPU the same work gets in the
    driver's own process. Lowering a niceness needs the privilege to do so; without it
    the worker keeps Ray's (the result does not change, only the share of CPU).
    Returns whether the priority now matches."""
    want = os.environ.get(NICENESS_ENV)
    if want is None or not hasattr(os, "getpriority"):
        return False
    cur = os.getpriority(os.PRIO_PROCESS, 0)
    if cur == int(want):
        return True
    try:
        os.setpriority(os.PRIO_PROCESS, 0, int(want))
    except (PermissionError, OSError):
        return False
    return True


def _with_threads(fn: Callable, arg, threads: int | None):
    """fn(arg) with ``threads`` torch intra-op threads (restored afterwards)."""
    match_driver_priority()
    if threads is None:
        return fn(arg)
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(int(threads))
    try:
        return fn(arg)
    finally:
        torch.set_num_threads(old)


def _error_text(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError wraps the task's own exception
    e = cause if isinstance(cause, BaseException) else exc
    return f"{type(e).__name__}: {e}"


def ensure_ray(address: str = "local", num_cpus: int | None = None) -> None:
    """Start (``local``) or join (an address) Ray once per process; later calls reuse it."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network at start
    import ray

    if ray.is_initialized():
        return
    with warnings.catch_warnings():  # Ray's notice about a future change of its GPU env vars
        warnings.filterwarnings("ignore", message=".*accelerator visible devices.*")
        _init(ray, address, num_cpus)


def _init(ray, address: str, num_cpus: int | None) -> None:
    kw = dict(
        include_dashboard=False,
        log_to_driver=False,
        logging_level="ERROR",
        configure_logging=True,
        namespace="fedlora",
    )
    if address == "local":
        # the workers import this checkout (not another one on sys.path)
        root = str(Path(__file__).resolve().parents[1])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        if hasattr(os, "getpriority"):
            env[NICENESS_ENV] = str(os.getpriority(os.PRIO_PROCESS, 0))
        ray.init(
            address="local",
            num_cpus=max(usable_cpus(), num_cpus or 0),
            runtime_env={"env_vars": env},
            # no niceness increment for the workers (Ray's default is +15): they keep
            # the driver's priority without the privilege match_driver_priority needs
            _system_config={"worker_niceness": 0},
            **kw,
        )
    else:
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        ray.init(address=address, runtime_env={"env_vars": env}, **kw)


def run_tasks(
    fn: Callable,
    args: list,
    *,
    workers: int = 0,
    address: str | None = "local",
    retries: int = 1,
    threads: int | None = None,
    gpus_per_task: float = 0.0,
    deadline: float = math.inf,
    report: Callable[[str], None] | None = None,
) -> Iterator[Outcome]:
    """Run ``fn(arg)`` for every arg (see the module doc); yields outcomes as tasks end.

    ``fn`` must be importable by the workers (a module-level function) on Ray; its
    argument and result must pickle. ``retries`` >= 0 extra attempts per task.
    """
    if retries < 0:
        raise UsageError(f"retries must be >= 0, got {retries}")
    n = len(args)
    if n == 0:
        return
    w = resolve_workers(workers, n)
    say = report or (lambda _msg: None)
    if is_sequential(address, workers, n):
        yield from _sequential(fn, args, retries, threads, deadline, say)
    else:
        if threads is None:
            threads = max(1, usable_cpus() // w)
        yield from _on_ray(fn, args, w, address, retries, threads, gpus_per_task, deadline, say)


def _sequential(fn, args, retries, threads, deadline, say) -> Iterator[Outcome]:
    for i, arg in enumerate(args):
        if time.time() > deadline:
            yield Outcome(i, skipped="deadline")
            continue
        for attempt in range(1, retries + 2):
            try:
                value = _with_threads(fn, arg, threads)
            except Exception as exc:  # noqa: BLE001 - reported; retried or yielded
                err = _error_text(exc)
                say(f"task {i} failed (attempt {attempt}/{retries + 1}): {err}")
                say(traceback.format_exc(limit=-3).rstrip())
                if attempt == retries + 1:
                    yield Outcome(i, error=err, attempts=attempt)
                continue
            yield Outcome(i, value=value, attempts=attempt)
            break


def _on_ray(fn, args, workers, address, retries, threads, gpus, deadline, say):
    import ray

    ensure_ray(address or "local", workers)
    remote = ray.remote(_with_threads).options(
        num_cpus=1, num_gpus=gpus, max_retries=0, retry_exceptions=False
    )
    fn_ref = ray.put(fn)
    todo = deque(range(len(args)))
    attempts = [0] * len(args)
    pending: dict = {}
    try:
        while todo or pending:
            while todo and len(pending) < workers:
                i = todo.popleft()
                if attempts[i] == 0 and time.time() > deadline:
                    yield Outcome(i, skipped="deadline")
                    continue
                attempts[i] += 1
                pending[remote.remote(fn_ref, args[i], threads)] = i
            if not pending:
                continue
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            i = pending.pop(ref)
            try:
                value = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the task raised, or its worker died
                err = _error_text(exc)
                say(f"task {i} failed (attempt {attempts[i]}/{retries + 1}): {err}")
                if attempts[i] <= retries:
                    todo.appendleft(i)
                else:
                    yield Outcome(i, error=err, attempts=attempts[i])
                continue
            yield Outcome(i, value=value, attempts=attempts[i])
    finally:
        for ref in pending:  # the caller stopped early (an error, Ctrl-C)
            ray.cancel(ref, force=True)


__all__ = ["Outcome", "run_tasks", "ensure_ray", "resolve_workers", "usable_cpus"]

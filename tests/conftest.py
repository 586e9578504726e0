import os

import pytest
import torch

from fl.allocator import tune_malloc

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Shadows train in this process unless a test asks for Ray (tests/benchmarks/test_ray.py
# starts it once): the default of `fedlora attack --ray-address`.
os.environ.setdefault("FEDLORA_RAY_ADDRESS", "none")
# Tests run two workers on two cores: one torch thread each (more threads on busy
# cores made tiny-model training 10-25x slower).
torch.set_num_threads(1)
# glibc keeps freed tensor memory for the next step instead of mapping it anew (as
# `fedlora` does: fl/allocator.py); subprocesses and Ray workers inherit the environment.
tune_malloc()


@pytest.fixture
def tiny_cfg():
    """A factory for tiny, fast training configs (tiny-bert on synthetic text):
    ``fl.testing.tiny_config``, which module-scoped fixtures call directly."""
    from fl.testing import tiny_config

    return tiny_config


def _load_suite_budget():
    """tests/suite_budget.py (issue 49), loaded by path: with --import-mode=importlib the
    tests folder is not on sys.path."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "fedlora_tests_suite_budget"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("suite_budget.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


suite_budget = _load_suite_budget()
_TIMER = suite_budget.Timer()


def pytest_collection_modifyitems(session, config, items):
    # longest file first (tests/suite_budget.py): the workers end together
    items[:] = suite_budget.longest_first(items, suite_budget.load_durations())


def pytest_runtest_logreport(report):
    _TIMER.add(report)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller sums
        return
    path = os.environ.get("FEDLORA_SUITE_DURATIONS")
    if path:
        import json

        with open(path, "w", encoding="utf-8") as fh:
            json.dump(_TIMER.doc(), fh, indent=1)
    if os.environ.get("FEDLORA_SUITE_BUDGET") == "1" and _TIMER.seconds:
        budget, reason = suite_budget.read_budget()
        over = suite_budget.over_budget(_TIMER.seconds, budget)
        if over:
            tr = session.config.pluginmanager.get_plugin("terminalreporter")
            msg = (
                f"test budget exceeded: {', '.join(f'{f} {s:.0f} s' for f, s in over)} > "
                f"{budget:g} s per file (pyproject.toml [tool.fedlora.test-budget]: {reason})"
            )
            if tr is not None:
                tr.write_line(msg, red=True)
            else:
                print(msg)
            if session.exitstatus == 0:
                session.exitstatus = 1

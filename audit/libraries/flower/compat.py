"""What the Flower audit (:mod:`audit.libraries.flower`) needs from flwr, in one place: the
supported releases, the modules each release has, the two Flower internals an in-process run
needs (the task identity a ``Message`` reads, the grid client proxy of the legacy API) and
the classification of a strategy and its mods.

**Supported releases** (:data:`SUPPORTED`): flwr 1.20 (mid-2025) … 1.42, read from their
sources. What differs between them and is handled here:

* the legacy API (``flwr.server.strategy``'s four DP wrappers, ``flwr.client.mod``'s
  ``fixedclipping_mod``, ``adaptiveclipping_mod``, ``LocalDpMod``) runs over an in-process
  Grid from 1.20 on (``flwr.server.Grid`` and ``GridClientProxy`` appear in 1.20; before,
  a ``Driver`` and ``DriverClientProxy`` of another signature: not supported);
* the Message API (``flwr.serverapp.strategy``'s DP wrappers, ``flwr.clientapp.mod``'s
  mods) exists from 1.21 on with fixed clipping (:func:`message_strategies` is None before:
  a Message API strategy cannot be built there); its adaptive wrappers and its own
  ``LocalDpMod`` by 1.23 (a wrapper a release lacks is simply not there to classify);
  1.21 samples evaluation nodes even at ``fraction_evaluate`` = 0, so the run configures
  no evaluation round at all;
* ``Grid`` is ``flwr.serverapp.Grid`` from 1.21, ``flwr.server.Grid`` in 1.20; ``ClientApp``
  ``flwr.clientapp.ClientApp`` or ``flwr.client.ClientApp``; ``recorddict_compat`` moved to
  ``flwr.compat.common`` in 1.35; the records and ``Message`` are read from ``flwr.common``,
  which has them in every supported release;
* ``TaskIdentity`` (read by ``Message(...)``) exists from 1.40 on (:func:`task_identity`
  sets it only where it exists); Flower's accountant (``accountant=``) from 1.35.

A release below the range is one ``RuntimeError`` line naming it and the range; one above
it is a ``RuntimeWarning`` line (not yet tried).

flwr is imported only inside functions (this module imports on a machine without it).
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager, nullcontext

__all__ = [
    "BEYOND",
    "OLDEST",
    "OLDEST_MESSAGE_API",
    "SUPPORTED",
    "check_version",
    "classify",
    "client_app_class",
    "grid_class",
    "grid_proxy",
    "installed_version",
    "local_dp_classes",
    "message_strategies",
    "recorddict_compat",
    "task_identity",
]

#: the oldest release supported (the legacy API over an in-process Grid)
OLDEST = (1, 20, 0)
#: the oldest release with the Message API's DP wrappers
OLDEST_MESSAGE_API = (1, 21, 0)
#: the first release not yet tried
BEYOND = (1, 43, 0)
#: the range in words
SUPPORTED = "flwr >= 1.20, < 1.43 (1.20 … 1.42; the Message API from 1.21)"


def _parse(v: str) -> tuple[int, ...]:
    nums = re.findall(r"\d+", v.split("+")[0])[:3]
    return tuple(int(x) for x in nums) + (0,) * (3 - len(nums))


def installed_version() -> str:
    """The installed flwr's version string."""
    import flwr

    return str(getattr(flwr, "__version__", "unknown"))


def check_version(version: str | None = None) -> str:
    """The installed flwr version (or ``version``); a release below :data:`OLDEST` is a
    ``RuntimeError`` in one line naming it and :data:`SUPPORTED`; one from :data:`BEYOND`
    on a ``RuntimeWarning`` line."""
    v = installed_version() if version is None else version
    t = _parse(v)
    if len(t) != 3 or t < OLDEST:
        raise RuntimeError(
            f"audit.libraries.flower supports {SUPPORTED}; the installed flwr is {v}"
        )
    if t >= BEYOND:
        warnings.warn(
            f"audit.libraries.flower supports {SUPPORTED}; the installed flwr {v} is newer "
            "and not yet tried",
            RuntimeWarning,
            stacklevel=3,
        )
    return v


def message_strategies():
    """``flwr.serverapp.strategy`` (the Message API's strategies), or None on a release
    without it (< 1.21)."""
    try:
        import flwr.serverapp.strategy as ms
    except ImportError:
        return None
    return ms if hasattr(ms, "DifferentialPrivacyServerSideFixedClipping") else None


def local_dp_classes() -> tuple:
    """(legacy ``LocalDpMod``, Message API ``LocalDpMod`` or None): ``flwr.client.mod``'s
    and, from 1.21, ``flwr.clientapp.mod``'s."""
    import flwr.client.mod as lmod

    try:
        import flwr.clientapp.mod as mmod
    except ImportError:
        return lmod.LocalDpMod, None
    m = getattr(mmod, "LocalDpMod", None)
    return lmod.LocalDpMod, (m if m is not lmod.LocalDpMod else None)


def grid_class():
    """Flower's ``Grid`` base class (``flwr.serverapp`` from 1.21, ``flwr.server`` in 1.20)."""
    try:
        from flwr.serverapp import Grid
    except ImportError:
        from flwr.server import Grid
    return Grid


def client_app_class():
    """Flower's ``ClientApp`` (``flwr.clientapp`` or, on older releases, ``flwr.client``)."""
    try:
        from flwr.clientapp import ClientApp
    except ImportError:
        from flwr.client import ClientApp
    return ClientApp


def recorddict_compat():
    """Flower's ``recorddict_compat`` (``flwr.compat.common`` from 1.35, ``flwr.common``
    before)."""
    try:
        from flwr.compat.common import recorddict_compat as compat
    except ImportError:
        from flwr.common import recorddict_compat as compat
    return compat


def task_identity():
    """Flower's ``Message(...)`` reads the process's task identity (set by the SuperLink or
    ``start_grid`` in a deployment, from flwr 1.40); an in-process run sets it as
    ``flwr.server.compat.start_grid`` does, and restores it after (a no-op on a release
    without it). Internal API (flwr 1.42: flwr/supercore/task_identity.py)."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:
        return nullcontext()
    return _set_task_identity(TaskIdentity)


@contextmanager
def _set_task_identity(TaskIdentity):
    from flwr.common.constant import SUPERLINK_NODE_ID

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id = 1
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    try:
        yield
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


def grid_proxy(node_id: int, grid):
    """The legacy ClientProxy that sends FitIns over a Grid (what ``start_grid`` registers).
    Internal API (flwr 1.20 … 1.42: flwr/server/compat/grid_client_proxy.py)."""
    from flwr.server.compat.grid_client_proxy import GridClientProxy

    return GridClientProxy(node_id, grid, 1)


def classify(strategy, mods) -> tuple[str, str]:
    """(api, mode) of a strategy and the client mods; a clear error for anything else."""
    import flwr.server.strategy as ls

    version = check_version()
    ms = message_strategies()
    legacy_ldp, message_ldp = local_dp_classes()
    kinds_ldp = tuple(k for k in (legacy_ldp, message_ldp) if k is not None)
    local = [m for m in mods if isinstance(m, kinds_ldp)]
    if ms is not None and isinstance(strategy, ms.Strategy):
        api, lib = "message", ms
    elif isinstance(strategy, ls.Strategy):
        api, lib = "legacy", ls
    else:
        raise ValueError(
            f"audit_flower needs a Flower strategy (flwr.server.strategy or "
            f"flwr.serverapp.strategy), got {type(strategy).__name__}"
            + ("" if ms is not None else f" (flwr {version} has no Message API strategies)")
        )
    kinds = {
        "DifferentialPrivacyServerSideFixedClipping": "server_fixed",
        "DifferentialPrivacyClientSideFixedClipping": "client_fixed",
        "DifferentialPrivacyServerSideAdaptiveClipping": "server_adaptive",
        "DifferentialPrivacyClientSideAdaptiveClipping": "client_adaptive",
    }
    # a release may lack some wrappers (the Message API's adaptive ones came after 1.21)
    mode = next((k for n, k in kinds.items() if isinstance(strategy, getattr(lib, n, ()))), None)
    if local:
        if mode is not None:
            raise ValueError(
                "LocalDpMod together with a central DP wrapper: audit one mechanism at a time"
            )
        if len(local) > 1:
            raise ValueError("more than one LocalDpMod among the mods")
        ok = legacy_ldp if api == "legacy" else message_ldp
        if not isinstance(local[0], ok):
            raise ValueError(
                f"a {type(local[0]).__module__}.LocalDpMod with a {api} strategy: use "
                f"{ok.__module__}.LocalDpMod"
            )
        return api, "local_dp"
    if mode is None:
        raise ValueError(
            f"{type(strategy).__name__} is not a Flower DP wrapper "
            f"({', '.join(kinds)} of {lib.__name__}) and no LocalDpMod is among the mods: "
            "nothing to audit"
        )
    return api, mode

"""What the Flower audit (:mod:`audit.libraries.flower`) needs from flwr, in one place: the
two Flower internals an in-process run needs (the task identity a ``Message`` reads, the grid
client proxy of the legacy API) and the classification of a strategy and its mods.

flwr is imported only inside functions (this module imports on a machine without it).
"""

from __future__ import annotations

from contextlib import contextmanager

__all__ = ["classify", "grid_proxy", "task_identity"]


@contextmanager
def task_identity():
    """Flower's ``Message(...)`` reads the process's task identity (set by the SuperLink or
    ``start_grid`` in a deployment); an in-process run sets it as ``flwr.server.compat.
    start_grid`` does, and restores it after. Internal API (flwr 1.42:
    flwr/supercore/task_identity.py)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

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
    Internal API (flwr 1.42: flwr/server/compat/grid_client_proxy.py)."""
    from flwr.server.compat.grid_client_proxy import GridClientProxy

    return GridClientProxy(node_id, grid, 1)


def classify(strategy, mods) -> tuple[str, str]:
    """(api, mode) of a strategy and the client mods; a clear error for anything else."""
    import flwr.client.mod as lmod
    import flwr.clientapp.mod as mmod
    import flwr.server.strategy as ls
    import flwr.serverapp.strategy as ms

    local = [m for m in mods if isinstance(m, (lmod.LocalDpMod, mmod.LocalDpMod))]
    if isinstance(strategy, ms.Strategy):
        api, lib = "message", ms
    elif isinstance(strategy, ls.Strategy):
        api, lib = "legacy", ls
    else:
        raise ValueError(
            f"audit_flower needs a Flower strategy (flwr.server.strategy or "
            f"flwr.serverapp.strategy), got {type(strategy).__name__}"
        )
    kinds = {
        "DifferentialPrivacyServerSideFixedClipping": "server_fixed",
        "DifferentialPrivacyClientSideFixedClipping": "client_fixed",
        "DifferentialPrivacyServerSideAdaptiveClipping": "server_adaptive",
        "DifferentialPrivacyClientSideAdaptiveClipping": "client_adaptive",
    }
    mode = next((k for n, k in kinds.items() if isinstance(strategy, getattr(lib, n))), None)
    if local:
        if mode is not None:
            raise ValueError(
                "LocalDpMod together with a central DP wrapper: audit one mechanism at a time"
            )
        if len(local) > 1:
            raise ValueError("more than one LocalDpMod among the mods")
        ok = lmod.LocalDpMod if api == "legacy" else mmod.LocalDpMod
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

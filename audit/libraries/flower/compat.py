"""What the Flower audit (:mod:`audit.libraries.flower`) needs from flwr, in one place: the
supported releases, the modules each release has, the two Flower internals an in-process run
needs (the task identity a ``Message`` reads, the grid client proxy of the legacy API) and
the classification of a strategy and its mods.

**Supported releases** (:data:`SUPPORTED`): flwr 1.8 (2024-04) … 1.42, read from their
sources and tried in throwaway venvs (1.8, 1.9, 1.10, 1.12, 1.13, 1.14, 1.16, 1.19, 1.20,
1.21, 1.30, 1.42). What differs between them and is handled here:

* the legacy API (``flwr.server.strategy``'s four DP wrappers, ``flwr.client.mod``'s
  ``fixedclipping_mod``, ``adaptiveclipping_mod``, ``LocalDpMod``) exists in all of them;
  its in-process loop sends each FitIns through Flower's own client proxy over the local
  grid: ``GridClientProxy(node, grid, run)`` from 1.18, ``DriverClientProxy(node, driver,
  run)`` in 1.15 … 1.17, with an ``anonymous`` flag in 1.9 … 1.14 (1.9 … 1.11 push and
  poll: the grid answers ``push_messages``/``pull_messages`` too); 1.8's proxy speaks gRPC
  to a SuperLink, so a local proxy does what the later ones do (:func:`local_proxy`);
* the client side: ``client_fn(context)`` and ``Context(run_id?, node_id, node_config,
  state, run_config)`` from 1.10 (``run_id`` from 1.13); 1.8 and 1.9 call
  ``client_fn(cid)`` with the message's ``partition_id`` and build ``Context(state)``
  (the user's ``client_fn`` then takes the partition index as a string);
* the records: ``RecordDict`` and ``recorddict_compat`` from 1.18, ``RecordSet`` and
  ``recordset_compat`` before; ``Message`` takes keywords (``content``, ``dst_node_id``, …)
  and ``Message(Error, reply_to=…)`` from 1.18, a ``Metadata`` and ``create_error_reply``
  before;
* flwr 1.8 … 1.12 need numpy < 2 (their metadata pins it; ``np.float_``), which the
  project's own pins exclude: they run in an environment with numpy 1.26;
* the Message API (``flwr.serverapp.strategy``'s DP wrappers, ``flwr.clientapp.mod``'s
  mods) exists from 1.21 on with fixed clipping (:func:`message_strategies` is None before:
  a Message API strategy cannot be built there); its adaptive wrappers and its own
  ``LocalDpMod`` by 1.23 (a wrapper a release lacks is simply not there to classify);
  1.21 samples evaluation nodes even at ``fraction_evaluate`` = 0, so the run configures
  no evaluation round at all;
* ``Grid`` is ``flwr.serverapp.Grid`` from 1.21, ``flwr.server.Grid`` in 1.18 … 1.20,
  ``flwr.server.Driver`` before; ``ClientApp`` ``flwr.clientapp.ClientApp`` or
  ``flwr.client.ClientApp``; ``recorddict_compat`` moved to ``flwr.compat.common`` in 1.35;
* ``TaskIdentity`` (read by ``Message(...)``) exists from 1.40 on (:func:`task_identity`
  sets it only where it exists); Flower's accountant (``accountant=``) from 1.35.

Found on the way: ``LocalDpMod`` of flwr 1.8 … 1.13 drops its noise (it calls
``add_localdp_gaussian_noise_to_params`` and discards the result; fixed in 1.14): the audit
says ``noise_absent``, ε = ∞.

A release below the range is one ``RuntimeError`` line naming it and the range; one above
it is a ``RuntimeWarning`` line (not yet tried).

flwr is imported only inside functions (this module imports on a machine without it).
"""

from __future__ import annotations

import inspect
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
    "error_message",
    "fitres_of",
    "grid_class",
    "grid_proxy",
    "installed_version",
    "local_proxy",
    "local_dp_classes",
    "message_strategies",
    "new_context",
    "new_message",
    "recorddict_compat",
    "records_class",
    "task_identity",
]

#: the oldest release supported (the legacy API over an in-process Grid)
OLDEST = (1, 8, 0)
#: the oldest release with the Message API's DP wrappers
OLDEST_MESSAGE_API = (1, 21, 0)
#: the first release not yet tried
BEYOND = (1, 43, 0)
#: the range in words
SUPPORTED = "flwr >= 1.8, < 1.43 (1.8 … 1.42; the Message API from 1.21)"


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
    """Flower's ``Grid`` base class (``flwr.serverapp`` from 1.21, ``flwr.server`` in 1.18 …
    1.20, ``flwr.server.Driver`` before: the same methods under its old name)."""
    try:
        from flwr.serverapp import Grid
    except ImportError:
        try:
            from flwr.server import Grid
        except ImportError:
            from flwr.server import Driver as Grid
    return Grid


def client_app_class():
    """Flower's ``ClientApp`` (``flwr.clientapp`` or, on older releases, ``flwr.client``)."""
    try:
        from flwr.clientapp import ClientApp
    except ImportError:
        from flwr.client import ClientApp
    return ClientApp


def new_context(node_id: int, node_config: dict):
    """A node's ``Context`` (``run_id`` first from 1.13; 1.10 … 1.12 have none)."""
    from flwr.common import Context

    params = inspect.signature(Context.__init__).parameters
    if "node_id" not in params:  # 1.8, 1.9: the state only (client_fn takes a cid)
        return Context(state=records_class()())
    kw = {"node_id": node_id, "node_config": node_config, "state": records_class()()}
    if "run_id" in params:
        kw["run_id"] = 1
    return Context(**kw, run_config={})


def records_class():
    """Flower's record container: ``RecordDict`` (1.18 on) or ``RecordSet`` (before)."""
    import flwr.common as common

    return getattr(common, "RecordDict", None) or common.RecordSet


def recorddict_compat():
    """Flower's ``recorddict_compat`` (``flwr.compat.common`` from 1.35, ``flwr.common``
    before; ``recordset_compat`` before 1.18)."""
    try:
        from flwr.compat.common import recorddict_compat as compat
    except ImportError:
        try:
            from flwr.common import recorddict_compat as compat
        except ImportError:
            from flwr.common import recordset_compat as compat
    return compat


def fitres_of(content):
    """The legacy ``FitRes`` a reply's content holds (``recorddict_to_fitres``, or
    ``recordset_to_fitres`` before 1.18)."""
    compat = recorddict_compat()
    to_fitres = getattr(compat, "recorddict_to_fitres", None) or compat.recordset_to_fitres
    return to_fitres(content, keep_input=True)


def new_message(content, message_type: str, dst_node_id: int, group_id, ttl):
    """A message to ``dst_node_id`` as ``Grid.create_message`` makes it: the keyword
    constructor (1.18 on), else a ``Metadata`` built by hand (before)."""
    from flwr.common import Message

    try:
        return Message(
            content=content,
            dst_node_id=dst_node_id,
            message_type=message_type,
            group_id=group_id,
            ttl=ttl,
        )
    except TypeError:
        from flwr.common import DEFAULT_TTL, Metadata

        kw = {}
        if "partition_id" in inspect.signature(Metadata.__init__).parameters:
            kw["partition_id"] = dst_node_id  # 1.8, 1.9: the ClientApp's client_fn(cid)
        meta = Metadata(
            run_id=1,
            message_id="",
            src_node_id=0,
            dst_node_id=dst_node_id,
            reply_to_message="",
            group_id=group_id or "",
            ttl=DEFAULT_TTL if ttl is None else ttl,
            message_type=message_type,
            **kw,
        )
        return Message(metadata=meta, content=content)


def error_message(msg, code: int, reason: str):
    """The error reply to ``msg`` (``Message(Error, reply_to=…)`` from 1.18 on,
    ``msg.create_error_reply(Error)`` before)."""
    from flwr.common import Error, Message

    try:
        return Message(Error(code=code, reason=reason), reply_to=msg)
    except TypeError:
        return msg.create_error_reply(Error(code=code, reason=reason))


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


def local_proxy(node_id: int, grid):
    """A legacy ClientProxy that sends FitIns over ``grid`` as ``GridClientProxy`` does, for
    flwr 1.8, whose ``DriverClientProxy`` speaks gRPC to a SuperLink: the FitIns as
    a record set, the grid's ``send_and_receive``, a missing reply (timed out) or an error
    reply raised, the FitRes read back (flwr 1.10 server/compat/driver_client_proxy.py)."""
    from flwr.common import MessageType
    from flwr.server.client_proxy import ClientProxy

    compat = recorddict_compat()
    to_records = getattr(compat, "fitins_to_recorddict", None) or compat.fitins_to_recordset
    to_fitres = getattr(compat, "recorddict_to_fitres", None) or compat.recordset_to_fitres

    class LocalProxy(ClientProxy):
        def __init__(self):
            super().__init__(str(node_id))
            self.node_id = node_id

        def fit(self, ins, timeout, group_id):
            content = to_records(ins, keep_input=True)
            msg = new_message(content, MessageType.TRAIN, node_id, str(group_id or ""), timeout)
            out = list(grid.send_and_receive([msg]))
            if not out:
                raise TimeoutError("the reply did not arrive before the timeout")
            if out[0].has_error():
                raise ValueError(f"Message contains an Error (reason: {out[0].error.reason})")
            return to_fitres(out[0].content, keep_input=False)

        def get_properties(self, ins, timeout, group_id=None):
            raise NotImplementedError("the audit runs training rounds only")

        get_parameters = evaluate = get_properties

        def reconnect(self, ins, timeout, group_id=None):
            raise NotImplementedError("the audit runs training rounds only")

    return LocalProxy()


def grid_proxy(node_id: int, grid):
    """The legacy ClientProxy that sends FitIns over a Grid (what ``start_grid`` registers).
    Internal API (flwr 1.18 … 1.42: flwr/server/compat/grid_client_proxy.py; before,
    ``DriverClientProxy``, with an ``anonymous`` flag up to 1.14)."""
    try:
        from flwr.server.compat.grid_client_proxy import GridClientProxy
    except ImportError:
        from flwr.server.compat.driver_client_proxy import DriverClientProxy

        params = inspect.signature(DriverClientProxy.__init__).parameters
        if "driver" in params and "Grpc" in str(params["driver"].annotation):
            return local_proxy(node_id, grid)  # 1.8: gRPC to a SuperLink
        if "anonymous" in params:
            return DriverClientProxy(node_id, grid, False, 1)
        return DriverClientProxy(node_id, grid, 1)
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

"""The in-process grid of the Flower audit (:mod:`audit.libraries.flower`): a
:class:`flwr.serverapp.Grid` that calls each node's ClientApp directly.
"""

from __future__ import annotations

from audit.libraries.flower.compat import error_message, grid_class, new_message

__all__ = ["LocalGrid", "error_reply", "make_grid"]


class LocalGrid:
    """An in-process :class:`flwr.serverapp.Grid`: ``send_and_receive`` calls each
    destination's ClientApp directly (real clients first, then canaries) and lets
    ``on_reply`` see every reply as the server receives it. A ClientApp that raises gets
    the error reply a SuperNode sends for it (``Error(CLIENT_APP_RAISED_EXCEPTION)``, flwr
    1.42 supernode/runtime/run_clientapp.py); a node whose reply times out (``timed_out``)
    is left out of the replies, as ``send_and_receive`` leaves out what has not arrived
    when its timeout passes. Built by :func:`make_grid` (the class derives from flwr's Grid
    there, so that this module imports without flwr)."""


def error_reply(msg, ex: BaseException):
    """The reply Flower's SuperNode sends for a ClientApp that raised ``ex``."""
    from flwr.common.constant import ErrorCode

    reason = str(type(ex)) + ":<'" + str(ex) + "'>"
    return error_message(msg, ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason)


def make_grid(apps: dict, on_reply, timed_out=lambda msg: False):
    Grid = grid_class()

    class _Grid(Grid, LocalGrid):
        def __init__(self):
            self.apps, self._run = apps, None
            self._pending, self._pushed = {}, 0

        def set_run(self, run) -> None:
            self._run = run

        @property
        def run(self):
            return self._run

        def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
            return new_message(content, message_type, dst_node_id, group_id, ttl)

        def get_node_ids(self):
            return list(self.apps)

        # flwr 1.10 and 1.11's DriverClientProxy pushes a message and polls for its reply
        def push_messages(self, messages):
            ids = []
            for msg in messages:
                self._pushed += 1
                ids.append(f"local-{self._pushed}")
                self._pending[ids[-1]] = msg
            return ids

        def pull_messages(self, message_ids):
            msgs = [self._pending.pop(i) for i in message_ids if i in self._pending]
            out = list(self.send_and_receive(msgs))
            if len(out) < len(msgs):  # a reply that times out: the proxy's wait ends
                raise TimeoutError("the reply did not arrive before the timeout")
            return out

        def send_and_receive(self, messages, *, timeout=None):
            msgs = sorted(messages, key=lambda m: apps[m.metadata.dst_node_id][2])
            out = []
            for msg in msgs:
                app, ctx, is_canary = apps[msg.metadata.dst_node_id]
                if timed_out(msg):
                    on_reply(msg, None, is_canary)
                    continue
                try:
                    reply = app(msg, ctx)
                except Exception as ex:  # the SuperNode's handling: an error reply
                    reply = error_reply(msg, ex)
                on_reply(msg, reply, is_canary)
                out.append(reply)
            return out

    return _Grid()

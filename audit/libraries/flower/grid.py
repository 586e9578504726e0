"""The in-process grid of the Flower audit (:mod:`audit.libraries.flower`): a
:class:`flwr.serverapp.Grid` that calls each node's ClientApp directly.
"""

from __future__ import annotations

__all__ = ["LocalGrid", "make_grid"]


class LocalGrid:
    """An in-process :class:`flwr.serverapp.Grid`: ``send_and_receive`` calls each
    destination's ClientApp directly (real clients first, then canaries) and lets
    ``on_reply`` see every reply as the server receives it. Built by :func:`make_grid`
    (the class derives from flwr's Grid there, so that this module imports without flwr)."""


def make_grid(apps: dict, on_reply):
    from flwr.serverapp import Grid

    class _Grid(Grid, LocalGrid):
        def __init__(self):
            self.apps, self._run = apps, None

        def set_run(self, run) -> None:
            self._run = run

        @property
        def run(self):
            return self._run

        def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
            from flwr.app import Message

            return Message(
                content=content,
                dst_node_id=dst_node_id,
                message_type=message_type,
                group_id=group_id,
                ttl=ttl,
            )

        def get_node_ids(self):
            return list(self.apps)

        def push_messages(self, messages):
            raise NotImplementedError("LocalGrid answers through send_and_receive only")

        def pull_messages(self, message_ids):
            raise NotImplementedError("LocalGrid answers through send_and_receive only")

        def send_and_receive(self, messages, *, timeout=None):
            msgs = sorted(messages, key=lambda m: apps[m.metadata.dst_node_id][2])
            out = []
            for msg in msgs:
                app, ctx, is_canary = apps[msg.metadata.dst_node_id]
                reply = app(msg, ctx)
                on_reply(msg, reply, is_canary)
                out.append(reply)
            return out

    return _Grid()

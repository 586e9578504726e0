"""The Flower ``ClientApp``: one handler per method stage, running the method's own
``on_<stage>`` code where the client's data lives.

Message types: ``train.<stage>`` (e.g. ``train.train_sketch``, ``train.project``) for
the method stages, ``query.partition`` for the server's node → client-id mapping.

Each message carries, besides the payload (``fl.flower.records``, prefix
``payload``), a ``fedlora.meta`` record: the run's TrainConfig (``cfg``), the server's
noise multiplier σ (``sigma``), the round (``index``, ``seed``, ``clients``), the
client id the server addressed (``cid``), an optional injected fault (tests), and
where to find the run's secret noise key with its public id (``noise_key_file``,
``noise_key_id``; a SuperNode's node config ``noise-key-file`` takes precedence). The
key itself never travels in a message.

The client rebuilds what it needs from the TrainConfig: the data split, its partition
and the model init are deterministic functions of it (``Engine.setup()``), so a
client-side :class:`fl.run.engine.Engine` is built once per process and cached. The
client's persistent ``client.state`` (FedASK between its two stages, SCAFFOLD's c_i,
FedSA's local B, optimizer moments) lives in Flower's ``context.state`` between
messages, under a key derived from the run's configuration. The DP events the
handler recorded (``ctx.events``) go back in the reply; the server moves them into its
ledger.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
import traceback

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fl.flower import records as R

META = "fedlora.meta"
STATE = "fedlora.state"

_ENGINE: dict = {}  # {"key": str, "engine": Engine}: one cached client-side engine


def config_key(cfg_dict: dict) -> str:
    """A short fingerprint of a TrainConfig dict (ignoring the fields that do not change
    what a client computes: ``fl.run.config.runtime_fields("client")``)."""
    from fl.run.config import runtime_fields

    skip = set(runtime_fields("client"))
    d = {k: v for k, v in cfg_dict.items() if k not in skip}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def node_noise_key(context: Context | None, meta: dict):
    """The run's noise key on this node: the node config's ``noise-key-file`` (a
    deployment: the operator puts the key on each SuperNode), else the file the server
    named (simulation on one machine). The key's public id must match the server's."""
    from fl.errors import UsageError
    from fl.privacy.rng import NoiseKey

    cfg = meta["cfg"]
    if cfg.get("insecure_deterministic_noise") or cfg.get("dp_level", "none") == "none":
        return None  # seeded (not private) or no DP: every draw is from the public seed
    path = None
    if context is not None:
        path = context.node_config.get("noise-key-file")
    path = path or meta.get("noise_key_file")
    if not path:
        raise UsageError(
            "this SuperNode has no noise key: set its node config noise-key-file=PATH "
            "(a copy of the run's private/noise.key)"
        )
    key = NoiseKey.read(path)
    if meta.get("noise_key_id") and key.key_id != meta["noise_key_id"]:
        raise UsageError(f"the noise key at {path} is not this run's (key id differs)")
    return key


def client_engine(cfg_dict: dict, sigma: float, noise_key=None, mechanism_sigmas=None):
    """The cached client-side Engine for this configuration (built with setup() on
    first use: dataset, split, partition, tokenized data, model + LoRA init)."""
    from fl.run.config import TrainConfig
    from fl.run.engine import Engine

    key = config_key(cfg_dict) + (noise_key.key_id if noise_key is not None else "")
    if _ENGINE.get("key") != key:
        d = dict(cfg_dict, progress=False, transport="inprocess")
        eng = Engine(
            TrainConfig.from_dict(d),
            tempfile.mkdtemp(prefix="fedlora-client-"),
            quiet=True,
            noise_key=noise_key,
        )
        eng.setup()
        # this engine serves every run of this configuration and key that reaches the
        # node (a replay re-issues the same streams); each message names its streams by
        # (round, client, stage, attempt)
        eng.rand.refuse_reuse = False
        _ENGINE.clear()
        _ENGINE.update(key=key, engine=eng)
    eng = _ENGINE["engine"]
    # The server's σ is authoritative (e.g. a resumed run's checkpointed σ); the client
    # noises its DP-SGD with exactly it and records events with it.
    eng.sigma = float(sigma)
    if mechanism_sigmas:
        eng.mechanism_sigmas = {(float(q), int(s)): float(v) for q, s, v in mechanism_sigmas}
    return eng


def partition_id(context: Context) -> int | None:
    v = context.node_config.get("partition-id")
    return None if v is None else int(v)


def handle_stage(message: Message, context: Context) -> Message:
    """Run ``method.on_<stage>`` for the client this node holds."""
    from fl.errors import ClientFailure
    from fl.methods.base import RoundInfo
    from fl.run.engine import ClientContext

    stage = message.metadata.message_type.split(".", 1)[1]
    meta = R.decode(message.content, META)
    cid = str(meta["cid"])
    pid = partition_id(context)
    if pid is not None and str(pid) != cid:
        raise RuntimeError(f"message for client {cid} reached the node holding partition {pid}")
    eng = client_engine(
        meta["cfg"],
        meta["sigma"],
        node_noise_key(context, meta),
        meta.get("mechanism_sigmas"),
    )
    if cid not in eng.client_positions:
        raise RuntimeError(
            f"client {cid} is not in this run's partition {sorted(eng.client_positions)}"
        )
    skey = f"{STATE}.{config_key(meta['cfg'])}"
    eng.client_states[cid] = R.decode(context.state, skey) if R.has(context.state, skey) else {}
    rnd = RoundInfo(index=int(meta["index"]), seed=int(meta["seed"]), clients=list(meta["clients"]))
    eng.rand.attempts[rnd.index] = int(meta.get("attempt", 0))
    ctx = ClientContext(eng, cid, rnd)
    handler = getattr(eng.method, f"on_{stage}", None)
    out: dict = {"cid": cid}
    reply: dict = {}
    try:
        if handler is None:
            raise RuntimeError(f"method {eng.method.name!r} has no handler for stage {stage!r}")
        if meta.get("fault"):
            raise ClientFailure(str(meta["fault"]))
        reply = dict(handler(ctx, R.decode(message.content, "payload")))
        reply.setdefault("n", ctx.n)
    except ClientFailure as exc:
        out["failed"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a bug: the server re-raises it with this text
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    # DP steps already taken count even when the stage failed: the data was touched.
    out["events"] = [ev.to_dict() for ev in ctx.events]
    if "failed" not in out and "error" not in out:
        # Only a stage that succeeded keeps its state; a failed one is rolled back, so
        # nothing trained in it (and not used by the server) is built on later.
        R.remove(context.state, skey)
        R.encode(ctx.state, context.state, skey)
    content = R.encode(reply, RecordDict(), "payload")
    R.encode(out, content, META)
    return Message(content=content, reply_to=message)


def handle_partition(message: Message, context: Context) -> Message:
    """Answer the server's node → client mapping query with this node's partition id."""
    content = R.encode({"partition_id": partition_id(context)}, RecordDict(), META)
    return Message(content=content, reply_to=message)


def stage_names() -> list[str]:
    """Every stage of every registered method (``on_<stage>`` handlers)."""
    from fl.methods import registry

    stages = set()
    for name in registry.names():
        cls = registry.get(name)
        stages.update(a[3:] for a in dir(cls) if a.startswith("on_") and callable(getattr(cls, a)))
    return sorted(s for s in stages if s.isidentifier())


def make_client_app() -> ClientApp:
    """A Flower ClientApp that handles every stage of the engine's rounds."""
    ca = ClientApp()
    for stage in stage_names():
        ca.train(stage)(handle_stage)
    ca.query("partition")(handle_partition)
    return ca


app = make_client_app()

__all__ = ["app", "make_client_app", "handle_stage", "client_engine", "config_key", "stage_names"]
